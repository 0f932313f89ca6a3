"""An adapter records the base model it was trained on (base_model.json), and a job refuses it
on another base (same shapes, other weights) before any weights load."""
import json
import shutil

import pytest

from conftest import run_cli
from hpc.models.base_model import RECORD, check_base
from hpc.runtime.errors import UserError


def folder(path):
    return path  # model.path is the folder itself (no built-in model here)


@pytest.fixture(scope="module")
def two_bases(tmp_path_factory):
    """Two tiny models of the same shapes and other weights, and an adapter saved on the first
    as the jobs save one (loaded from its folder)."""
    from hpc.models.loading import attach_lora, load_model, save_adapter
    from hpc.toys.toy import tiny_model

    root = tmp_path_factory.mktemp("bases")
    for seed in (0, 1):
        tiny_model(seed=seed, save_dir=str(root / f"base-{seed}"))
    model, _ = load_model(str(root / "base-0"))
    save_adapter(attach_lora(model, 4, 8.0, ["q_proj", "v_proj"]), str(root / "adapter"))
    return root


def test_the_saved_adapter_records_its_base(two_bases):
    record = json.loads((two_bases / "adapter" / RECORD).read_text())
    assert record["folder"] == str(two_bases / "base-0")
    assert len(record["config_sha256"]) == len(record["weights_sha256"]) == 64


def test_the_same_base_passes_where_it_lies(two_bases, tmp_path):
    adapter = str(two_bases / "adapter")
    check_base(adapter, str(two_bases / "base-0"), folder, False)
    copy = tmp_path / "copied-base"  # the same model on another file system
    shutil.copytree(two_bases / "base-0", copy)
    check_base(adapter, str(copy), folder, False)
    check_base("", str(two_bases / "base-1"), folder, False)  # a fresh LoRA: nothing to check


def test_another_base_of_the_same_shapes_is_one_line(two_bases):
    adapter, other = str(two_bases / "adapter"), str(two_bases / "base-1")
    with pytest.raises(UserError) as err:
        check_base(adapter, other, folder, False)
    text = str(err.value)
    assert str(two_bases / "base-0") in text and f"model.path={other}" in text, text
    assert "other weights" in text and "lora.allow_other_base=true" in text, text
    check_base(adapter, other, folder, True)  # deliberately


def test_a_record_that_is_not_ours_is_one_line(two_bases, tmp_path):
    adapter = tmp_path / "adapter"
    shutil.copytree(two_bases / "adapter", adapter)
    (adapter / RECORD).write_text('{"folder": 3}')
    with pytest.raises(UserError, match="not a base-model record this program wrote"):
        check_base(str(adapter), str(two_bases / "base-0"), folder, False)


@pytest.mark.parametrize("method", ["essa", "fgrpo", "hpc.evaluate"])
@pytest.mark.subprocess
def test_a_job_refuses_an_adapter_of_another_base_before_loading(two_bases, tmp_path, method):
    proc = run_cli(["-m", method, f"model.path={two_bases / 'base-1'}",
                    f"lora.adapter={two_bases / 'adapter'}", "run.progress=false",
                    f"run.out={tmp_path / 'run'}"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "was trained on the model in" in lines[0], lines
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("overrides, words", [
    (["lora.adapter=no/such/adapter"], ["adapter folder not found: no/such/adapter"]),
    (["model.path=/no/such/model", "lora.adapter=x"], ["model folder not found: /no/such/model"]),
    (["lora.adapter=ADAPTER_WITHOUT_WEIGHTS"], ["has no adapter weights"]),
    (["task.name=gsm8k", "task.eval_path=/no/such.jsonl", "lora.adapter=x"],
     ["task data file not found"]),
], ids=["adapter", "model", "adapter-files", "data"])
@pytest.mark.subprocess
def test_inputs_are_checked_before_torch_is_imported(tmp_path, overrides, words):
    """A typo in lora.adapter built the toy, loaded the task and the model (minutes on a
    cluster model), then said so: the job's inputs are checked first, torch-free."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    half = tmp_path / "half"
    half.mkdir()
    (half / "adapter_config.json").write_text("{}")
    argv = [o.replace("ADAPTER_WITHOUT_WEIGHTS", str(half)) for o in overrides]
    probe = ("import sys\nfrom essa.__main__ import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit as stop:\n"
             "    print('TORCH', 'torch' in sys.modules, stop.code)\n")
    proc = subprocess.run([sys.executable, "-c", probe, *argv, f"run.out={tmp_path / 'run'}"],
                          cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO))
    assert proc.stdout.strip() == "TORCH False 2", (proc.stdout, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), lines
    assert not (tmp_path / "run").exists()

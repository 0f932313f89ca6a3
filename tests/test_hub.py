"""Hugging Face Hub ids as model.path, lora.adapter and hpc-data prepare sources, found in a
local cache laid out as huggingface_hub lays it out, never downloaded; the done-when run: SFT,
ESSA and F-GRPO on ``model.path=org/name`` with data that ``hpc-data prepare`` made from a
parquet file in the datasets cache."""
import json
import os
import subprocess
import sys

import h5py
import pytest

from conftest import REPO, hf_cached as cached, run_cli
from hpc.job.inputs import check_inputs, recorded_sources, resolve_sources
from hpc.models.base_model import check_base, record_base
from hpc.models.hub import hub_id, local_or_cached
from hpc.job.config import JobConfig
from hpc.runtime.config import load_config
from hpc.runtime.errors import UserError
from hpc.runtime.runstore import RunStore

MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def placeholder_model(cache, repo, revision="a" * 40, config=b'{"model_type": "qwen2"}'):
    return cached(cache, repo, {"config.json": config, "model.safetensors": b"weights",
                                "tokenizer.json": b"{}"}, revision=revision)


def test_what_is_spelt_as_an_id():
    assert hub_id("Qwen/Qwen2.5-7B-Instruct") == ("Qwen/Qwen2.5-7B-Instruct", None)
    assert hub_id("org/name@v1.0") == ("org/name", "v1.0")
    for path in ("/models/x", "./x/y", "../x", "a/b/c", "toy", "runs/sft-1/adapter", "x/.."):
        assert hub_id(path) is None, path


def test_an_id_is_its_cached_snapshot_and_revision(tmp_path):
    old = placeholder_model(tmp_path, "org/name", revision="1" * 40)
    new = placeholder_model(tmp_path, "org/name", revision="2" * 40)
    source = local_or_cached("org/name", "model.path", cache_dir=str(tmp_path))
    assert (source.given, source.path, source.revision) == ("org/name", new, "2" * 40)
    pinned = local_or_cached(f"org/name@{'1' * 40}", "model.path", cache_dir=str(tmp_path))
    assert (pinned.path, pinned.revision) == (old, "1" * 40)
    cached(tmp_path, "org/name", {}, revision="1" * 40, ref="v1")  # a tag naming the old one
    assert local_or_cached("org/name@v1", "x", cache_dir=str(tmp_path)).path == old


def test_a_local_folder_keeps_priority_over_an_id(tmp_path, monkeypatch):
    placeholder_model(tmp_path / "cache", "org/name")
    (tmp_path / "work" / "org" / "name").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "work")
    source = local_or_cached("org/name", "model.path", cache_dir=str(tmp_path / "cache"))
    assert (source.path, source.revision) == ("org/name", "")


@pytest.mark.parametrize("given, words", [
    ("org/missing", ["org/missing", "holds no snapshot of the model org/missing",
                     "`hf download org/missing`", "HF_HUB_CACHE"]),
    ("org/name@v9", ["at revision v9", "`hf download org/name --revision v9`"]),
])
def test_an_id_the_cache_lacks_is_one_line_naming_the_download(tmp_path, given, words):
    placeholder_model(tmp_path, "org/name")
    with pytest.raises(UserError) as err:
        local_or_cached(given, "config key 'model.path'", cache_dir=str(tmp_path))
    text = str(err.value)
    assert "\n" not in text and text.startswith("config key 'model.path'") and str(tmp_path) in text
    assert all(w in text for w in words), text


def test_the_input_check_resolves_model_and_adapter_ids(tmp_path, monkeypatch):
    """The torch-free check reads the cache huggingface_hub reads (its HF_HUB_CACHE, set from
    the environment when it is imported), and the resolved folders and revisions are what the
    run file records."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    model = placeholder_model(tmp_path, "org/base", revision="b" * 40)
    adapter = cached(tmp_path, "org/lora", {"adapter_config.json": b"{}",
                                            "adapter_model.safetensors": b"w"}, revision="c" * 40)
    cfg = load_config(JobConfig, None, ["model.path=org/base", "lora.adapter=org/lora"])
    check_inputs(cfg)
    sources = resolve_sources(cfg)
    assert sources.attrs() == {"model_folder": model, "model_revision": "b" * 40,
                               "adapter_folder": adapter, "adapter_revision": "c" * 40}
    sources.apply(cfg)
    assert (cfg.model.path, cfg.lora.adapter) == (model, adapter)
    builtin = resolve_sources(load_config(JobConfig, None, ["model.path=toy"]))
    assert builtin.attrs() == {"model_folder": "toy", "model_revision": ""}
    with pytest.raises(UserError, match="config key 'lora.adapter': org/nolora is no local"):
        check_inputs(load_config(JobConfig, None, ["model.path=org/base",
                                                   "lora.adapter=org/nolora"]))


def test_a_resumed_run_keeps_the_snapshot_it_began_with(tmp_path, monkeypatch):
    """A download since the run began moved refs/main: the resumed run stays on the recorded
    snapshot (its checkpoint's LoRA was trained on it) and says so; an id with @revision, or
    another id, resolves as given."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    old = placeholder_model(tmp_path, "org/name", revision="1" * 40)
    new = placeholder_model(tmp_path, "org/name", revision="2" * 40)
    adapter = cached(tmp_path, "org/lora", {"adapter_config.json": b"{}"}, revision="3" * 40)
    cfg = load_config(JobConfig, None, ["model.path=org/name", "lora.adapter=org/lora"])
    recorded = {"model.path": ("org/name", "1" * 40), "lora.adapter": ("org/lora", "3" * 40)}
    sources = resolve_sources(cfg, recorded)
    assert (sources.model.path, sources.model.revision, sources.model.given) == (
        old, "1" * 40, "org/name")
    assert sources.adapter.path == adapter
    (note,) = sources.notes
    assert f"model.path=org/name stays at revision {'1' * 40}" in note and "2" * 40 in note
    pinned = load_config(JobConfig, None, [f"model.path=org/name@{'2' * 40}"])
    assert resolve_sources(pinned, recorded).model.path == new
    assert resolve_sources(cfg, {"model.path": ("org/other", "1" * 40)}).model.path == new
    with pytest.raises(UserError) as err:
        resolve_sources(cfg, {"model.path": ("org/name", "9" * 40)})
    assert str(err.value).startswith("--resume: config key 'model.path' (the snapshot the run "
                                     "began with") and f"--revision {'9' * 40}`" in str(err.value)


def test_a_reward_model_id_is_recorded_and_kept_at_its_snapshot_on_resume(tmp_path, monkeypatch):
    """reward.model as model.path: its snapshot folder and revision go into the run file, and a
    resumed run scores with the snapshot it began with although refs/main moved since."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    placeholder_model(tmp_path, "org/base")
    old = placeholder_model(tmp_path, "org/rm", revision="4" * 40)
    new = placeholder_model(tmp_path, "org/rm", revision="5" * 40)
    cfg = load_config(JobConfig, None, ["model.path=org/base", "reward.model=org/rm"])
    sources = resolve_sources(cfg)
    assert (sources.attrs()["reward_model_folder"], sources.attrs()["reward_model_revision"]) \
        == (new, "5" * 40)
    run_file = str(tmp_path / "fgrpo.h5")
    RunStore(run_file, True, dict(sources.attrs(), config="reward:\n  model: org/rm\n")).close()
    kept = resolve_sources(load_config(JobConfig, None, ["model.path=org/base",
                                                         "reward.model=org/rm"]),
                           {"reward.model": ("org/rm", "4" * 40)})
    assert recorded_sources(run_file)["reward.model"] == ("org/rm", "5" * 40)
    assert kept.reward.path == old and "reward.model=org/rm stays at revision" in kept.notes[0]
    kept.apply(cfg)
    assert cfg.reward.model == old


def test_the_run_file_records_what_a_resumed_run_keeps(tmp_path):
    config = "model:\n  path: org/name\nlora:\n  adapter: ''\n"
    RunStore(str(tmp_path / "sft.h5"), True, {"config": config, "model_revision": "1" * 40,
                                              "model_folder": "x"}).close()
    assert recorded_sources(str(tmp_path / "sft.h5")) == {
        "model.path": ("org/name", "1" * 40), "lora.adapter": ("", ""), "reward.model": ("", "")}
    assert recorded_sources(str(tmp_path / "none.h5")) == {}


@pytest.mark.subprocess
def test_a_resumed_run_whose_snapshot_is_gone_is_one_line(tmp_path):
    """The job reads the revision from the run file it resumes, before any weights load."""
    placeholder_model(tmp_path / "hub", "org/name", revision="2" * 40)
    out = tmp_path / "run"
    out.mkdir()
    RunStore(str(out / "sft.h5"), True, {"config": "model:\n  path: org/name\n",
                                         "model_revision": "1" * 40}).close()
    proc = run_cli(["-m", "sft", "model.path=org/name", f"run.out={out}", "--resume"],
                   env={"HF_HUB_CACHE": str(tmp_path / "hub")}, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "--resume: config key 'model.path' (the snapshot the run began with" in lines[0]
    assert f"`hf download org/name --revision {'1' * 40}`" in lines[0], lines[0]


def test_the_base_model_check_names_the_id(tmp_path):
    """An adapter records its base by content; given by id, the other base is named by it."""
    base = placeholder_model(tmp_path, "org/base")
    other = placeholder_model(tmp_path, "org/other", config=b'{"model_type": "llama"}')
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    record_base(str(adapter), base)
    check_base(str(adapter), "org/base", lambda _: base, False)
    with pytest.raises(UserError) as err:
        check_base(str(adapter), "org/other", lambda _: other, False)
    assert f"model.path=org/other ({other}) has other config.json and weights" in str(err.value)


@pytest.mark.subprocess
def test_a_missing_id_ends_a_job_before_torch(tmp_path):
    probe = ("import sys\nfrom essa.__main__ import main\n"
             "try:\n    main(sys.argv[1:])\nexcept SystemExit as stop:\n"
             "    print('TORCH', 'torch' in sys.modules, stop.code)\n")
    proc = subprocess.run([sys.executable, "-c", probe, "model.path=Qwen/Qwen2.5-7B-Instruct",
                           "lora.adapter=x", f"run.out={tmp_path / 'run'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=REPO, HF_HUB_CACHE=str(tmp_path)))
    assert proc.stdout.strip() == "TORCH False 2", (proc.stdout, proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    for words in ("Qwen/Qwen2.5-7B-Instruct", str(tmp_path),
                  "`hf download Qwen/Qwen2.5-7B-Instruct`"):
        assert words in lines[0], lines[0]
    assert not (tmp_path / "run").exists()


def gsm8k_rows(n: int, seed: int) -> list:
    """GSM8K-style rows short enough for the toy's 64 positions."""
    import random

    draw = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = draw.randint(1, 20), draw.randint(1, 20)
        rows.append({"question": f"{a}+{b}?",
                     "answer": f"{a}+{b}=<<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"})
    return rows


def tree(folder) -> list:
    return sorted(os.path.join(d, f) for d, _, files in os.walk(folder) for f in files)


@pytest.mark.toy
@pytest.mark.subprocess
@pytest.mark.slow
def test_model_ids_run_sft_essa_and_fgrpo_on_prepared_data(tmp_path):
    """Done when: a cache holding the toy model as org/toy and GSM8K-style parquet files as the
    dataset org/gsm8k-mini (subsets main and socratic, as GSM8K's); hpc-data prepare makes the
    task files; SFT, then ESSA from the SFT adapter given as a Hub id too, and F-GRPO run on
    model.path=org/toy; the run files record the snapshot and its revision; the cache is
    unchanged (nothing downloaded)."""
    import pandas

    from hpc.toys.toy import toy_model_path

    cache = tmp_path / "hub"
    toy = toy_model_path()
    revision = "0123456789abcdef0123456789abcdef01234567"
    snapshot = cached(cache, "org/toy", {f: os.path.join(toy, f) for f in os.listdir(toy)},
                      revision=revision)
    parquet = tmp_path / "parquet"
    parquet.mkdir()
    files = {}
    for subset in ("main", "socratic"):
        for split, rows in (("train", gsm8k_rows(32, 0)), ("test", gsm8k_rows(8, 1))):
            path = parquet / f"{subset}-{split}.parquet"
            pandas.DataFrame(rows).to_parquet(path)
            files[f"{subset}/{split}-00000-of-00001.parquet"] = str(path)
    cached(cache, "org/gsm8k-mini", files, kind="datasets", revision="d" * 40)
    before = tree(cache)
    env = {"HF_HUB_CACHE": str(cache)}  # conftest.MPI_ENV sets HF_HUB_OFFLINE=1
    data = tmp_path / "data" / "gsm8k"
    proc = run_cli(["-m", "hpc.data.check", "prepare", "org/gsm8k-mini", str(data),
                    "task.name=gsm8k", "model.path=org/toy", "--subset", "main"], env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (data / "train.jsonl").read_text().count("\n") == 32, proc.stdout
    assert "rows the loader rejects: 0" in proc.stdout
    common = ["model.path=org/toy", "task.name=gsm8k", f"task.train_path={data / 'train.jsonl'}",
              f"task.eval_path={data / 'test.jsonl'}", "task.n_eval=8", "eval.n_samples=2",
              "eval.every=0", "run.progress=false"]
    runs = tmp_path / "runs"
    proc = run_cli(["-m", "sft", *common, "sft.steps=2", "sft.batch_size=8",
                    f"run.out={runs / 'sft'}"], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    adapter = cached(cache, "org/toy-sft", {f: str(runs / "sft" / "adapter" / f)
                                            for f in os.listdir(runs / "sft" / "adapter")},
                     revision="e" * 40)
    before += tree(os.path.dirname(os.path.dirname(adapter)))
    for method, extra in (("essa", ["essa.population=4", "essa.minibatch=8",
                                    "essa.generations=1"]),
                          ("fgrpo", ["fgrpo.steps=1", "fgrpo.batch_prompts=4",
                                     "fgrpo.sampling.num_generations=2"])):
        proc = run_cli(["-m", method, *common, "lora.adapter=org/toy-sft", *extra,
                        f"run.out={runs / method}"], env=env)
        assert proc.returncode == 0, (method, proc.stderr[-3000:])
    for method in ("sft", "essa", "fgrpo"):
        with h5py.File(runs / method / f"{method}.h5", "r") as f:
            assert f.attrs["status"] == "complete"
            assert (f.attrs["model_folder"], f.attrs["model_revision"]) == (snapshot, revision)
            assert "path: org/toy\n" in f.attrs["config"]
            if method != "sft":
                assert (f.attrs["adapter_folder"], f.attrs["adapter_revision"]) == (adapter,
                                                                                    "e" * 40)
    assert json.loads((runs / "sft" / "adapter" / "base_model.json").read_text())["folder"] \
        == snapshot
    assert tree(cache) == sorted(before)  # nothing downloaded, nothing written to the cache


def test_the_readme_plan_reads_the_configs_model_by_its_id(tmp_path, monkeypatch, capsys):
    """`hpc-plan configs/cluster/math.yaml --ranks 8` (README): the config names its model by
    Hub id; hpc-plan reads the snapshot's config.json."""
    from hpc.commands import plan
    from hpc.engine.shape import QWEN25

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    config = dict(QWEN25["7B"], model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    snapshot = cached(tmp_path, "Qwen/Qwen2.5-7B-Instruct",
                      {"config.json": json.dumps(config).encode()})
    plan([os.path.join(REPO, "configs", "cluster", "math.yaml"), "--ranks", "8"])
    out = capsys.readouterr().out
    assert f"model {snapshot}: 7,615,616,512 parameters" in out and "fits" in out

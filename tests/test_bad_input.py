"""Bad input ends with one line and exit code 2, before any model work, leaving no run file.

By hand (each job's real command line) and fuzzed (hypothesis) over config overrides.
"""
import dataclasses
import os
import signal

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import our_lines, placeholder_adapter, require, run_cli, run_mpi
from essa.config import ESSAJobConfig
from fgrpo.config import FGRPOJobConfig
from hpc.runtime.config import load_config
from hpc.runtime.errors import UserError
from hpc.job.run_folder import run_folder
from sft.config import SFTJobConfig


def one_line_exit_2(proc, *words):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    lines = our_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("error"), lines
    assert "Traceback" not in proc.stderr
    for word in words:
        assert word in lines[0], lines[0]


def sft(tmp_path, *overrides):
    return run_cli(["-m", "sft", "run.progress=false", f"run.out={tmp_path / 'run'}",
                    *overrides], timeout=120)


@pytest.mark.subprocess
def test_unknown_key(tmp_path):
    one_line_exit_2(sft(tmp_path, "sft.stpes=3"), "sft.stpes", "does not exist")
    assert not (tmp_path / "run").exists()


@pytest.mark.subprocess
def test_bad_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sft: {steps: [1, 2\n")
    proc = run_cli(["-m", "essa", str(bad)], timeout=120)
    one_line_exit_2(proc, "not valid YAML")


@pytest.mark.subprocess
def test_missing_model_path(tmp_path):
    one_line_exit_2(sft(tmp_path, f"model.path={tmp_path / 'no-model'}"), "no-model")
    assert not (tmp_path / "run" / "sft.h5").exists()


@pytest.mark.subprocess
def test_model_folder_with_missing_files(tmp_path):
    folder = tmp_path / "half-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    one_line_exit_2(sft(tmp_path, f"model.path={folder}"), str(folder))


@pytest.mark.parametrize("content, words", [
    ("", ["has no rows"]),
    ('{"question": "1+1?", "answer": "#### 2"}\nnot json\n', ["line 2"]),
    ('{"question": "1+1?", "answer": "1+1=2\\n####"}\n', ["line 1", "gold answer is empty"]),
    ('{"question": {"text": "1+1?"}, "answer": "#### 2"}\n', ["line 1", "'question' must be"]),
    ('{"question": "1+1?", "answer": "#### 1e400"}\n', ["line 1", "not a finite number"]),
])
@pytest.mark.subprocess
def test_bad_data_files(tmp_path, content, words):
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    proc = sft(tmp_path, "task.name=gsm8k", f"task.train_path={data}",
               f"task.eval_path={data}")
    one_line_exit_2(proc, str(data), *words)
    assert not (tmp_path / "run" / "sft.h5").exists()


@pytest.mark.subprocess
def test_missing_data_file(tmp_path):
    missing = tmp_path / "nowhere.jsonl"
    proc = sft(tmp_path, "task.name=math", f"task.eval_path={missing}",
               f"task.train_path={missing}")
    one_line_exit_2(proc, str(missing))


@pytest.mark.subprocess
def test_output_folder_not_writable(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    proc = run_cli(["-m", "fgrpo", "run.progress=false", f"run.out={blocker}/run"],
                   timeout=120)
    one_line_exit_2(proc, "not writable")


@pytest.mark.subprocess
def test_disk_too_full(tmp_path):
    proc = run_cli(["-m", "essa", "run.progress=false", "run.min_free_mb=1e12",
                    f"lora.adapter={placeholder_adapter(tmp_path / 'adapter')}",
                    f"run.out={tmp_path / 'run'}"], timeout=120)
    one_line_exit_2(proc, "MiB free", "run.min_free_mb")
    assert not (tmp_path / "run" / "essa.h5").exists()


@pytest.mark.subprocess
def test_adapter_for_another_model(tiny_models, tmp_path):
    small_model, _, _ = tiny_models["small"]
    _, large_adapter, _ = tiny_models["large"]
    proc = run_cli(["-m", "essa", f"model.path={small_model}", f"lora.adapter={large_adapter}",
                    "run.progress=false", f"run.out={tmp_path / 'run'}"], timeout=120)
    one_line_exit_2(proc, "another shape")
    assert not (tmp_path / "run" / "essa.h5").exists()


KEYS = [f"{s}.{k}" for s, ks in {
    "model": ["path", "dtype", "device"], "lora": ["rank", "alpha", "targets"],
    "task": ["name", "n_train", "digits", "ops"], "eval": ["every", "top_p", "n_samples"],
    "run": ["seed", "max_time_s", "progress"],
    "essa": ["population", "sigma0", "optimizer", "members_per_pass"],
    "fgrpo": ["gamma", "loss_type", "num_generations"], "sft": ["steps", "lr"]}.items()
    for k in ks] + ["model.nope", "nope.path", "rank", ""]
VALUES = st.one_of(st.integers(-5, 10 ** 6).map(str), st.floats(allow_nan=True).map(str),
                   st.integers(10 ** 6, 10 ** 12).map(str), st.sampled_from(["0", "0.0"]),
                   st.sampled_from(["true", "no", "[]", "{}", "[a, b]", "''", "~", "nan",
                                    "float16", "cma", "token-mean", "gsm8k", "x" * 300]),
                   st.text(max_size=20))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(KEYS), VALUES), max_size=4),
       st.sampled_from([SFTJobConfig, ESSAJobConfig, FGRPOJobConfig]))
def test_fuzzed_overrides_load_or_raise_user_error(pairs, job):
    overrides = [f"{k}={v}" for k, v in pairs] + ["lora.adapter=some/adapter"]
    try:
        cfg = load_config(job, None, overrides)
    except UserError as err:
        assert "\n" not in str(err) and str(err)
        return
    assert_in_declared_ranges(cfg)


def assert_in_declared_ranges(cfg):
    """Every number of a loaded config lies in its declared range, and has one."""
    for section_field in dataclasses.fields(cfg):
        section = getattr(cfg, section_field.name)
        for f in dataclasses.fields(section):
            value, m = getattr(section, f.name), f.metadata
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            key = f"{section_field.name}.{f.name}"
            assert m["max"] is not None, f"{key} has no upper bound"
            assert value <= m["max"], key
            assert m["min"] is None or value >= m["min"], key
            assert m["above"] is None or value > m["above"], key


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(max_size=200).map(str.encode), st.binary(max_size=200)))
def test_fuzzed_yaml_files_load_or_raise_user_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("fuzz") / "c.yaml"
    path.write_bytes(data)
    try:
        load_config(SFTJobConfig, str(path))
    except UserError as err:
        assert "\n" not in str(err)
    finally:
        os.remove(path)


@pytest.mark.subprocess
def test_bad_run_out_template(tmp_path):
    proc = run_cli(["-m", "fgrpo", "run.progress=false", f"run.out={tmp_path}/{{name}}"],
                   timeout=120)
    one_line_exit_2(proc, "run.out", "{method}")


@pytest.mark.mpi
def test_fewer_prompts_than_ranks(tmp_path):
    from conftest import run_mpi

    proc = run_mpi(2, ["-m", "fgrpo", "run.progress=false", "task.n_train=1",
                       "fgrpo.batch_prompts=4", f"run.out={tmp_path / 'run'}"])
    one_line_exit_2(proc, "without a prompt")
    assert not (tmp_path / "run" / "fgrpo.h5").exists()


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.text(max_size=40), st.sampled_from(
    ["{method:>99999999999}", "{jobid!r}", "{0}", "{}", "{method.__class__}", "{jobid[0]}",
     "runs/{method}-{jobid}", "{{literal}}/{method}", "{", "}"])))
@example("{\n}")  # a field named by a new line: the line shows it escaped (found by hypothesis)
def test_fuzzed_run_out_templates_fill_in_or_raise_user_error(template):
    try:
        out = run_folder(template, "essa", "123")
    except UserError as err:
        assert "\n" not in str(err) and "run.out" in str(err)
        return
    assert len(out) <= len(template) + 8


# The probe's tracebacks (issue 17), each now one line and exit 2 on every rank under mpirun,
# before any run file exists.
PROBE_OVERRIDES = [
    (["essa.population=1000000000"], "essa.population"),
    (["eval.n_samples=1000000000"], "eval.n_samples"),
    (["fgrpo.sampling.num_generations=1000000000"], "fgrpo.sampling.num_generations"),
    (["essa.sigma0=0"], "essa.sigma0"),
    (["essa.members_per_pass=100000000"], "essa.members_per_pass"),
    (["task.max_new_tokens=100000000"], "task.max_new_tokens"),
    (["eval.batch_size=100000000"], "eval.batch_size"),
    (["run.out={method:>99999999999}"], "run.out"),
]


@pytest.mark.parametrize("overrides, key", PROBE_OVERRIDES, ids=[k for _, k in PROBE_OVERRIDES])
@pytest.mark.mpi
def test_probe_values_are_one_line_under_mpirun(tmp_path, overrides, key):
    method = key.split(".")[0] if key.startswith(("essa", "fgrpo")) else "essa"
    proc = run_mpi(2, ["-m", method, "run.progress=false", "lora.adapter=unused",
                       f"run.out={tmp_path / 'run'}", *overrides], timeout=120)
    one_line_exit_2(proc, key)
    assert not (tmp_path / "run").exists()


@pytest.mark.mpi
def test_non_utf8_config_file_under_mpirun(tmp_path):
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("essa:\n  population: 8  # popula\xe7\xe3o\n".encode("latin-1"))
    proc = run_mpi(2, ["-m", "essa", str(bad), f"run.out={tmp_path / 'run'}"], timeout=120)
    one_line_exit_2(proc, "not UTF-8", str(bad))


@pytest.mark.mpi
def test_override_after_resume_is_parsed(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("run:\n  progress: false\n")
    proc = run_mpi(2, ["-m", "essa", str(config), "--resume",
                       f"lora.adapter={placeholder_adapter(tmp_path / 'adapter')}",
                       f"run.out={tmp_path / 'none'}"], timeout=120)
    one_line_exit_2(proc, "--resume", "no run folder")  # the overrides were read


@pytest.mark.mpi
@pytest.mark.toy
def test_truncated_adapter_weights(toy_adapter, tmp_path):
    import shutil

    adapter = tmp_path / "adapter"
    shutil.copytree(toy_adapter, adapter)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:len(weights.read_bytes()) // 2])
    proc = run_mpi(2, ["-m", "essa", "model.path=toy", f"lora.adapter={adapter}",
                       "run.progress=false", f"run.out={tmp_path / 'run'}"], timeout=300)
    one_line_exit_2(proc, str(adapter))
    assert not (tmp_path / "run" / "essa.h5").exists()


# The bad-input sweep's silent cases and tracebacks (issue 29): each one line and exit 2, no run
# file, and no rank left behind.
def ranks_left(marker) -> list:
    """Pids of processes whose command line contains ``marker`` (a test's own tmp_path)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read().decode(errors="replace")
            with open(f"/proc/{pid}/stat") as fh:
                state = fh.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(marker) in cmdline and state != "Z" and int(pid) != os.getpid():
            found.append(int(pid))
    return found


def refused(proc, tmp_path, *words, run_file=None):
    """One line (exit 2, no traceback) naming ``words``, no rank still running, and no run
    folder (a config mistake: found before the folder is claimed), or no ``run_file`` in it."""
    one_line_exit_2(proc, *words)
    assert not (tmp_path / "run" / run_file if run_file else tmp_path / "run").exists()
    assert ranks_left(tmp_path) == []


def job(tmp_path, method, *items, ranks=1):
    args = ["-m", method, *items, "run.progress=false", f"run.out={tmp_path / 'run'}"]
    return run_mpi(ranks, args, timeout=120) if ranks > 1 else run_cli(args, timeout=120)


@pytest.mark.mpi
def test_duplicate_yaml_key_names_key_file_and_line(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("essa:\n  population: 8\n  sigma0: 0.1\n  population: 16\n")
    refused(job(tmp_path, "essa", str(config), "lora.adapter=unused", ranks=2), tmp_path,
            str(config), "line 4", "'population' is given twice", "lines 2 and 4")


@pytest.mark.parametrize("method, items, words", [
    ("fgrpo", ["essa.population=8"], ["'essa.population' is not read by this job"]),
    ("sft", ["essa.members_per_pass=2"], ["'essa.members_per_pass' is not read"]),
    ("essa", ["lora.adapter=unused", "FILE:fgrpo:\n  gama: 1.0\n"], ["'fgrpo.gama' does not exist"]),
    ("sft", ["FILE:lora:\n  targets: []\n"], ["lora.targets", "0 items"]),
    ("fgrpo", ["lora.targets=[]"], ["lora.targets", "0 items"]),
], ids=["essa-key-to-fgrpo", "essa-key-to-sft", "misspelt-in-other-section", "empty-list-file",
        "empty-list-override"])
@pytest.mark.subprocess
def test_keys_no_section_of_the_job_reads(tmp_path, method, items, words):
    config = tmp_path / "c.yaml"
    args = []
    for item in items:
        if item.startswith("FILE:"):
            config.write_text(item[5:])
            args.append(str(config))
        else:
            args.append(item)
    refused(job(tmp_path, method, *args), tmp_path, *words)


@pytest.mark.mpi
def test_huge_yaml_value_under_mpirun(tmp_path):
    """A 100 MB value got the job killed by the kernel, 2 ranks left running: the file's size is
    bounded before it is read."""
    config = tmp_path / "c.yaml"
    with open(config, "w") as fh:
        fh.write("run:\n  out: ")
        fh.write("x" * 100_000_000)
        fh.write("\n")
    proc = run_mpi(2, ["-m", "essa", str(config), "lora.adapter=unused",
                       f"run.out={tmp_path / 'run'}"], timeout=120)
    refused(proc, tmp_path, str(config), "larger than 1048576 bytes")


@pytest.mark.parametrize("override", [f"run.out={'x' * 70_000}", f"task.system_prompt={'y' * 70_000}"])
@pytest.mark.subprocess
def test_huge_override_value(tmp_path, override):
    refused(job(tmp_path, "fgrpo", override), tmp_path, override.split("=")[0], "70000 characters")


@pytest.mark.mpi
def test_deeply_nested_data_row_under_mpirun(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"question": "1+1?", "answer": "#### 2"}\n'
                    '{"question": ' + "[" * 100_000 + "]" * 100_000 + ', "answer": "#### 2"}\n')
    proc = job(tmp_path, "fgrpo", "task.name=gsm8k", f"task.train_path={data}",
               f"task.eval_path={data}", ranks=2)
    refused(proc, tmp_path, str(data), "line 2", "nested 100001 levels deep",
            run_file="fgrpo.h5")


def test_byte_order_mark_data_file_is_read_as_utf8(tmp_path):
    from hpc.data.mathdata import load_file_task
    from hpc.data.config import TaskConfig

    data = tmp_path / "bom.jsonl"
    data.write_bytes(b"\xef\xbb\xbf" + b'{"question": "1+1?", "answer": "1+1=2\\n#### 2"}\n')
    task = load_file_task(TaskConfig(name="gsm8k", eval_path=str(data), train_path=str(data)))
    assert task.eval.answers == ["2"] and len(task.train.prompts) == 1


@pytest.mark.subprocess
def test_adapter_of_nan_weights(tiny_models, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    model, adapter, _ = tiny_models["small"]
    nan_adapter = tmp_path / "nan-adapter"
    shutil.copytree(adapter, nan_adapter)
    weights = nan_adapter / "adapter_model.safetensors"
    save_file({k: v.fill_(float("nan")) for k, v in load_file(weights).items()}, weights)
    proc = job(tmp_path, "essa", f"model.path={model}", f"lora.adapter={nan_adapter}")
    refused(proc, tmp_path, str(weights), "tensor base_model.model.", "NaN or infinite",
            run_file="essa.h5")


def _started_job(tmp_path, ranks):
    """A toy F-GRPO job under mpirun, returned (Popen) once its run folder exists, i.e. once
    every rank is past the job's first line; its ranks then sleep at the first start-up safe
    point (STARTUP_DELAY_ENV), silent and outside MPI, as in a long load or parse (a rank that
    writes to its dead launcher's pipe, or calls MPI, may die of that by chance)."""
    from hpc.runtime.preempt import STARTUP_DELAY_ENV

    import subprocess
    import sys
    import time

    from conftest import MPI_ENV, REPO, mpirun_path

    mpirun = mpirun_path()
    require(mpirun is not None, "mpirun")
    proc = subprocess.Popen(
        [mpirun, "-n", str(ranks), "--oversubscribe", sys.executable, "-m", "fgrpo",
         "run.progress=false", "fgrpo.steps=100000", "eval.every=0", "task.n_eval=4",
         "eval.n_samples=1", f"run.out={tmp_path / 'run'}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "stderr.txt", "w"), cwd=REPO,
        env=dict(os.environ, **MPI_ENV, **{STARTUP_DELAY_ENV: "3600"}))
    for _ in range(600):
        if (tmp_path / "run").exists() or proc.poll() is not None:
            break
        time.sleep(0.5)
    assert proc.poll() is None and (tmp_path / "run").exists(), \
        (proc.returncode, (tmp_path / "stderr.txt").read_text()[-3000:])
    return proc


def _wait_gone(tmp_path, polls=240):
    """The pids still running after ``polls`` half-second polls (no rank should be)."""
    import time

    for _ in range(polls):
        left = ranks_left(tmp_path)
        if not left:
            return []
        time.sleep(0.5)
    for pid in left:  # ours: this test started them
        os.kill(pid, signal.SIGKILL)
    return left


@pytest.mark.mpi
def test_no_rank_outlives_a_killed_launcher(tmp_path):
    """mpirun killed with SIGKILL (the kernel's OOM killer, a timeout) cannot end its ranks; they
    ran on, orphaned. Each rank now dies with its parent (PR_SET_PDEATHSIG)."""
    proc = _started_job(tmp_path, 2)
    ranks = [pid for pid in ranks_left(tmp_path) if pid != proc.pid]
    assert len(ranks) == 2, ranks
    proc.kill()
    proc.wait()
    assert _wait_gone(tmp_path) == []


@pytest.mark.mpi
def test_no_rank_outlives_a_killed_rank(tmp_path):
    """One of 3 ranks killed with SIGKILL: mpirun ends the other two and fails."""
    proc = _started_job(tmp_path, 3)
    ranks = [pid for pid in ranks_left(tmp_path) if pid != proc.pid]
    assert len(ranks) == 3, ranks
    os.kill(ranks[1], signal.SIGKILL)
    assert proc.wait(timeout=120) != 0
    assert _wait_gone(tmp_path) == []


def alias_bomb(levels: int) -> str:
    """A "billion laughs" YAML flow list: level i holds nine aliases of level i - 1, so
    ``levels`` = 9 expands to 9^9 strings in under 300 characters."""
    items = ["&a0 [" + ", ".join(["lol"] * 9) + "]"]
    items += [f"&a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels)]
    return "[" + ", ".join(items) + f", [*a{levels - 1}]]"


BOMB_CASES = [  # (config file text or None, overrides)
    ("essa:\n  population: BOMB\n", []),  # an int key
    ("lora:\n  targets: BOMB\n", []),
    ("fgrpo:\n  num_generations: BOMB\n", []),  # another method's section, checked and skipped
    (None, ["essa.population=BOMB"]),
    (None, ["lora.targets=BOMB"]),
]


@pytest.mark.parametrize("text, overrides", BOMB_CASES,
                         ids=["int-key", "lora.targets", "other-method", "override-int",
                              "override-list"])
@pytest.mark.parametrize("levels", [6, 9])
def test_alias_bombs_are_refused_while_loading_with_a_short_line(tmp_path, text, overrides,
                                                                 levels):
    """A YAML alias bomb took 2 minutes and a MemoryError (the error line formatted its full
    repr before cutting it); 9^6 was refused with a 3,138,878-character line. Its expanded size
    is counted while it loads, without expanding it."""
    bomb = alias_bomb(levels)
    path = None
    if text is not None:
        path = tmp_path / "bomb.yaml"
        path.write_text(text.replace("BOMB", bomb))
    with pytest.raises(UserError) as err:
        load_config(ESSAJobConfig, str(path) if path else None,
                    [o.replace("BOMB", bomb) for o in overrides])
    message = str(err.value)
    assert "more than 65536 values once its aliases" in message, message
    assert len(message) < 300, len(message)


@pytest.mark.parametrize("text, words", [
    ("essa:\n  population: &a [*a]\n", ["alias refers to the value that holds it"]),
    ("essa:\n  population: " + "9" * 5000 + "\n", ["an integer of 5000 digits"]),
    ("task:\n  system_prompt: \"be brief \\ud800\"\n", ["task.system_prompt", "character 10",
                                                        "U+D800", "lone surrogate"]),
    ("lora:\n  targets: [q_proj, \"\\udfff\"]\n", ["lora.targets", "U+DFFF"]),
    ("essa:\n  population: [" + ", ".join(["x" * 60] * 1000) + "]\n",
     ["essa.population", "expected an integer"]),
])
def test_values_an_error_line_cannot_show_in_full_are_cut_first(tmp_path, text, words):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        load_config(ESSAJobConfig, str(path))
    message = str(err.value)
    assert all(w in message for w in words) and len(message) < 300, message


def test_an_override_that_is_not_utf8_is_one_line():
    """A command-line byte that is not UTF-8 reaches Python as a lone surrogate
    (surrogateescape)."""
    with pytest.raises(UserError, match=r"task.system_prompt.*character 3 .*U\+DCE7"):
        load_config(ESSAJobConfig, None, [b"task.system_prompt=ol\xe7".decode(
            "utf-8", "surrogateescape")])


@pytest.mark.parametrize("where", ["file", "override"])
@pytest.mark.mpi
def test_alias_bomb_under_mpirun(tmp_path, where):
    """On 2 ranks whose address space is limited to 3 GB, as a shared login node limits it."""
    import resource
    import subprocess
    import sys

    from conftest import MPI_ENV, REPO, mpirun_path

    bomb = alias_bomb(9)
    args = ["lora.adapter=unused", "run.progress=false", f"run.out={tmp_path / 'run'}"]
    if where == "file":
        config = tmp_path / "c.yaml"
        config.write_text(f"essa:\n  population: {bomb}\n")
        args.append(str(config))
    else:
        args.append(f"lora.targets={bomb}")
    require(mpirun_path() is not None, "mpirun")
    proc = subprocess.run(
        [mpirun_path(), "-n", "2", "--oversubscribe", sys.executable, "-m", "essa", *args],
        capture_output=True, text=True, timeout=120, cwd=REPO, env=dict(os.environ, **MPI_ENV),
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_AS, (3 * 10 ** 9,) * 2))
    refused(proc, tmp_path, "once its aliases")


SURROGATE_ROW = '{"question": "What is 1+1? \\ud800", "answer": "1+1=2\\n#### 2"}\n'
GOOD_ROW = '{"question": "What is 2+2?", "answer": "2+2=4\\n#### 4"}\n'


@pytest.mark.parametrize("method", ["essa", "fgrpo"])
@pytest.mark.parametrize("bad", ["train", "eval"])
@pytest.mark.mpi
def test_a_lone_surrogate_in_a_question_is_one_line_before_the_run_file(tmp_path, method, bad):
    """A ``\\ud800`` escape reached the tokenizer (TypeError, exit 1) after the run file was
    created, which stayed ``running`` with no rows."""
    files = {}
    for part in ("train", "eval"):
        files[part] = tmp_path / f"{part}.jsonl"
        files[part].write_text(GOOD_ROW * 3 + (SURROGATE_ROW if part == bad else GOOD_ROW))
    proc = job(tmp_path, method, "task.name=gsm8k", f"task.train_path={files['train']}",
               f"task.eval_path={files['eval']}", "lora.adapter=unused", ranks=2)
    refused(proc, tmp_path, f"{files[bad]} line 4, column 28", "\\ud800", "lone surrogate",
            run_file=f"{method}.h5")


def test_data_check_reports_a_lone_surrogate(tmp_path, capsys):
    from hpc.data.check import main

    data = tmp_path / "d.jsonl"
    data.write_text(GOOD_ROW + SURROGATE_ROW)
    with pytest.raises(SystemExit) as stop:
        main(["check", str(data), "task.name=gsm8k"])
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1, err
    assert f"{data} line 2, column 28: \\ud800 is a lone surrogate" in err[0]

"""Fault injection under real mpirun: preemption signals, damaged checkpoints."""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import MPI_ENV, REPO, mpirun_path, require, run_mpi
from hpc.runtime.checkpoint import list_checkpoints, load_latest, save_checkpoint
from hpc.runtime.errors import UserError
from hpc.runtime.runstore import RunFile

P = 6


def essa_args(adapter, out, generations, *extra, every=1):
    return ["-m", "essa", "model.path=toy", f"lora.adapter={adapter}", "task.n_train=200",
            "task.n_eval=16", f"essa.population={P}", "essa.minibatch=16",
            f"essa.generations={generations}", "eval.every=0", "eval.n_samples=2",
            "eval.batch_size=16", "run.progress=false", f"run.checkpoint_every={every}",
            f"run.out={out}", *extra]


def fgrpo_args(adapter, out, steps, *extra, every=1):
    return ["-m", "fgrpo", "model.path=toy", f"lora.adapter={adapter}", "task.n_train=200",
            "task.n_eval=16", "fgrpo.batch_prompts=8", "fgrpo.sampling.num_generations=4",
            f"fgrpo.steps={steps}", "eval.every=0", "eval.n_samples=2", "run.progress=false",
            f"run.checkpoint_every={every}", f"run.out={out}", *extra]


def sft_args(out, steps, *extra):
    return ["-m", "sft", "model.path=toy", "task.n_train=200", "task.n_eval=16",
            "sft.batch_size=8", f"sft.steps={steps}", "lora.dropout=0.1", "eval.every=0",
            "eval.n_samples=2", "run.progress=false", "run.checkpoint_every=1",
            f"run.out={out}", *extra]


def _rows(path, group):
    """Rows of ``group`` in a run file another process is writing (0 while it cannot be read:
    without SWMR a read in the middle of a flush can fail in several ways)."""
    try:
        return len(RunFile(path).group(group).get("step", []))
    except (OSError, KeyError, RuntimeError, ValueError):
        return 0


def rank_pids(marker: str) -> list:
    """Process ids of the Python ranks whose command line contains ``marker``."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if cmd and "python" in os.path.basename(cmd[0]) and any(marker in c for c in cmd):
            pids.append(int(pid))
    return pids


def rank_of(pid: int) -> int:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        env = dict(kv.split("=", 1) for kv in fh.read().decode(errors="replace").split("\0")
                   if "=" in kv)
    return int(env["OMPI_COMM_WORLD_RANK"])


def run_and_signal(args, h5, group, after_rows, sig, to_ranks=False, only_rank=None):
    """Start ``args`` on 2 ranks; once ``after_rows`` rows exist send ``sig`` to mpirun (which
    forwards SIGUSR1 to its ranks, as srun does) or, with ``to_ranks``, to every rank directly
    (as Slurm does with SIGTERM at preemption; mpirun itself would kill its ranks on SIGTERM)."""
    mpirun = mpirun_path()
    require(mpirun is not None, "mpirun")
    proc = subprocess.Popen([mpirun, "-n", "2", "--oversubscribe", sys.executable] + args,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **MPI_ENV), cwd=REPO)
    deadline = time.time() + 300
    while _rows(h5, group) < after_rows and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    if to_ranks:
        marker = next(a for a in args if a.startswith("run.out="))
        for pid in rank_pids(marker):
            if only_rank is None or rank_of(pid) == only_rank:
                os.kill(pid, sig)
    else:
        proc.send_signal(sig)
    try:
        out, err = proc.communicate(timeout=120)  # the bound: a hang fails the test here
    finally:
        if to_ranks:
            for pid in rank_pids(next(a for a in args if a.startswith("run.out="))):
                os.kill(pid, signal.SIGKILL)
    return proc.returncode, out, err


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
@pytest.mark.xdist_group("essa_20")  # one worker runs the reference once
def test_essa_preemption_then_resume_is_bitwise(essa_20, toy_adapter, tmp_path, sig):
    """SIGUSR1 to mpirun (which forwards it, as srun does) or SIGTERM to every rank (as Slurm
    at preemption) after generation 2: exit 3 with the step's checkpoint, and the resumed run
    ends as the uninterrupted 20-generation one (``essa_20``), bit for bit."""
    part = tmp_path / "part"
    h5 = str(part / "essa.h5")
    args = essa_args(toy_adapter, part, 20, "essa.keep_checkpoints=100")
    code, out, err = run_and_signal(args, h5, "essa", 2, sig, to_ranks=sig == signal.SIGTERM)
    assert code == 3, err[-3000:]
    assert "preempted after step" in out
    stopped = RunFile(h5)
    assert stopped.attrs["status"] == "preempted"
    g = stopped.group("essa")["step"][-1]
    assert 2 <= g < 20
    assert os.path.basename(list_checkpoints(str(part / "checkpoints"))[-1]) == \
        f"step-{g:08d}.safetensors"
    resumed = run_mpi(2, args + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_end(essa_20, part)


@pytest.fixture(scope="module")
def fgrpo_6(toy_adapter, tmp_path_factory):
    """An uninterrupted 6-step F-GRPO run on 2 ranks, checkpointed every 3 steps."""
    full = tmp_path_factory.mktemp("fgrpo-6") / "full"
    proc = run_mpi(2, fgrpo_args(toy_adapter, full, 6, every=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return full


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
@pytest.mark.xdist_group("fgrpo_6")  # one worker runs the reference once
def test_fgrpo_preemption_then_resume_is_bitwise(fgrpo_6, toy_adapter, tmp_path):
    """The interrupted run checkpoints every step and moves its AdamW moments to host memory
    around every rollout (fgrpo.parallel.offload=optimizer, restored state included after the
    resume); the reference (``fgrpo_6``) checkpoints every 3 steps and keeps them in place:
    the results depend on neither. Metrics and the exported adapter, bit for bit."""
    part = tmp_path / "part"
    h5 = str(part / "fgrpo.h5")
    moved = fgrpo_args(toy_adapter, part, 6, "fgrpo.parallel.offload=optimizer")
    code, _, err = run_and_signal(moved, h5, "metrics", 2, signal.SIGUSR1)
    assert code == 3, err[-3000:]
    assert RunFile(h5).attrs["status"] == "preempted"
    assert RunFile(h5).group("metrics")["step"][-1] < 6
    resumed = run_mpi(2, moved + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = RunFile(str(fgrpo_6 / "fgrpo.h5")), RunFile(h5)
    assert b.group("metrics")["step"].tolist() == list(range(1, 7))
    for key in ("reward_mean", "loss", "entropy", "generated_tokens"):
        assert np.array_equal(a.group("metrics")[key], b.group("metrics")[key]), key
    assert_same_adapters(fgrpo_6, part)


def assert_same_adapters(full, part) -> None:
    """Every adapter the two runs exported (F-GRPO adapter/, ESSA adapter-best/ and
    adapter-mean/), the same bytes."""
    names = sorted(p.parent.name for p in full.glob("adapter*/adapter_model.safetensors"))
    assert names and names == sorted(p.parent.name for p in
                                     part.glob("adapter*/adapter_model.safetensors"))
    for name in names:
        weights = f"{name}/adapter_model.safetensors"
        assert (full / weights).read_bytes() == (part / weights).read_bytes(), name


def run_and_kill_at_step(args, step, rank, paused):
    """Start ``args`` on 2 ranks with the test hook PAUSE_AFTER_STEP_ENV: once step ``step``'s
    row is written every rank waits; then SIGKILL to rank ``rank`` (a kill no process can
    handle: mpirun ends the other rank). (returncode, stdout, stderr)."""
    from hpc.runtime.preempt import PAUSE_AFTER_STEP_ENV

    mpirun = mpirun_path()
    require(mpirun is not None, "mpirun")
    paused.mkdir()
    proc = subprocess.Popen([mpirun, "-n", "2", "--oversubscribe", sys.executable] + args,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env=dict(os.environ, **MPI_ENV,
                                     **{PAUSE_AFTER_STEP_ENV: f"{step}:{paused}"}))
    try:
        deadline = time.monotonic() + 300
        while len(os.listdir(paused)) < 2 and proc.poll() is None and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert sorted(os.listdir(paused)) == ["paused-0", "paused-1"], \
            (proc.poll(), proc.stderr.read()[-3000:] if proc.poll() is not None else "")
        marker = next(a for a in args if a.startswith("run.out="))
        pids = [pid for pid in rank_pids(marker) if rank_of(pid) == rank]
        assert len(pids) == 1, pids
        os.kill(pids[0], signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # a failed test: mpirun's ranks end with it
            proc.kill()
            proc.wait()
    return proc.returncode, out, err


# What two runs of one config may differ in: clock readings (attributes start_time, end_time,
# wall_seconds; the datasets of measured durations, *_s and *seconds, and the per-rank phase
# seconds of group timings) and the run folder's path (run.out in the config attribute).
# The group segments (a row per start or resume) is compared on its own.
CLOCK_ATTRS = ("start_time", "end_time", "wall_seconds")
DURATIONS = ("_s", "seconds")


def _config_without_out(text: str) -> dict:
    import yaml

    config = yaml.safe_load(text)
    config["run"].pop("out")
    return config


def assert_same_run_file(full, part, method) -> None:
    """The run file of ``part`` equals that of ``full`` bitwise but for what CLOCK_ATTRS and
    DURATIONS name: every other attribute, every other dataset of every group (metrics,
    evaluations, payload bytes, the method's own groups)."""
    import h5py

    with h5py.File(full / f"{method}.h5", "r") as fa, h5py.File(part / f"{method}.h5", "r") as fb:
        assert fa.attrs["status"] == fb.attrs["status"] == "complete"
        names = sorted(set(fa.attrs) - set(CLOCK_ATTRS))
        assert names == sorted(set(fb.attrs) - set(CLOCK_ATTRS))
        for name in names:
            x, y = fa.attrs[name], fb.attrs[name]
            if name == "config":
                assert _config_without_out(x) == _config_without_out(y)
            else:
                assert np.array_equal(np.asarray(x), np.asarray(y)), name
        kept = _compared_datasets(fa)
        assert len(kept) > 10 and kept == _compared_datasets(fb)
        for name in kept:
            assert np.array_equal(fa[name][()], fb[name][()], equal_nan=True), name
        for group in sorted({name.split("/")[0] for name in kept}):
            assert np.array_equal(np.asarray(fa[group].attrs.get("rows")),
                                  np.asarray(fb[group].attrs.get("rows"))), group


def _compared_datasets(f) -> list:
    """The names of the datasets of run file ``f`` that assert_same_run_file compares."""
    import h5py

    names = []

    def visit(name, obj):  # returns None: visititems goes on
        if isinstance(obj, h5py.Dataset) and not name.startswith(("timings/", "segments/")) \
                and not name.endswith(DURATIONS):
            names.append(name)

    f.visititems(visit)
    return sorted(names)


def _same_state(x, y, where="state") -> None:
    """Two checkpoint states (nested dicts, lists, tensors, arrays, scalars) equal bitwise."""
    assert type(x) is type(y), where
    if isinstance(x, dict):
        assert list(x) == list(y), where
        for key in x:  # pycma's timers (es.timer, its logger's timer_*) read the clock
            if not (isinstance(key, str) and
                    any(part.startswith("timer") for part in key.split("."))):
                _same_state(x[key], y[key], f"{where}.{key}")
    elif isinstance(x, (list, tuple)):
        assert len(x) == len(y), where
        for i, (a, b) in enumerate(zip(x, y)):
            _same_state(a, b, f"{where}[{i}]")
    elif isinstance(x, torch.Tensor):
        assert x.dtype == y.dtype and torch.equal(x, y), where
    elif isinstance(x, np.ndarray):
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True), where
    else:
        assert x == y or (x != x and y != y), where  # NaN equals NaN here


def assert_same_final_checkpoint(full, part) -> None:
    """The last checkpoint of both runs holds the same step, token count and method state
    (F-GRPO: weights, AdamW moments, RNG; ESSA: the whole CMA-ES state with its covariance,
    the search space, the RNG keys), bit for bit, but for pycma's wall-clock timers: a run
    resumed from either goes on alike."""
    a, b = (load_latest(str(run / "checkpoints")) for run in (full, part))
    assert a["step"] == b["step"] and a["generated_tokens"] == b["generated_tokens"]
    _same_state(a["method"], b["method"])


@pytest.mark.parametrize("method", [
    pytest.param("fgrpo", marks=pytest.mark.xdist_group("fgrpo_6")),  # with the test above
    "essa"])
@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_sigkill_at_step_5_then_resume_from_step_3_is_bitwise(method, request, toy_adapter,
                                                              tmp_path):
    """run.checkpoint_every=3 (configs/cluster/math.yaml checkpoints every 5): the run is held
    after step 5's row (the test hook PAUSE_AFTER_STEP_ENV) and a rank gets SIGKILL, which no
    process can handle (F-GRPO: rank 0, the writer of the run file and the checkpoints;
    ESSA: rank 1). The run file keeps rows 4 and 5, past the last checkpoint (step 3). The
    same command with --resume on the same 2 ranks drops them, runs steps 4 to 6 again and
    ends with the run file, the exported adapter(s) and the last checkpoint's state of an
    uninterrupted run of the same config, bit for bit (see assert_same_run_file for what a
    run file may differ in)."""
    full = request.getfixturevalue(f"{method}_6")
    part = tmp_path / "part"
    make_args = {"fgrpo": fgrpo_args, "essa": essa_args}[method]
    args = make_args(toy_adapter, part, 6, every=3)
    rank = {"fgrpo": 0, "essa": 1}[method]
    code, _, err = run_and_kill_at_step(args, 5, rank, tmp_path / "paused")
    assert code not in (0, 2, 3), err[-3000:]
    assert f"rank {rank} with PID" in err and "signal 9" in err, err[-3000:]
    killed = RunFile(str(part / f"{method}.h5"))
    assert killed.attrs["status"] == "running"
    assert killed.group("metrics")["step"].tolist() == [1, 2, 3, 4, 5]
    assert [os.path.basename(p) for p in list_checkpoints(str(part / "checkpoints"))] == \
        ["step-00000003.safetensors"]
    resumed = run_mpi(2, args + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = RunFile(str(part / f"{method}.h5"))
    assert run.group("metrics")["step"].tolist() == [1, 2, 3, 4, 5, 6]
    assert run.group("segments")["step"].tolist() == [0, 3]  # started, resumed from step 3
    assert run.group("segments")["world_size"].tolist() == [2, 2]
    assert RunFile(str(full / f"{method}.h5")).group("segments")["step"].tolist() == [0]
    assert_same_run_file(full, part, method)
    assert_same_adapters(full, part)
    assert_same_final_checkpoint(full, part)


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_preemption_during_a_refill_resumes_bitwise(toy_adapter, tmp_path):
    """DAPO's dynamic sampling at temperature 0.1: most groups are uniform, so every step
    spends most of its time in refill rounds (asserted on the uninterrupted run) and SIGUSR1
    lands in one. The step in flight finishes, is checkpointed, the run exits 3; the resumed
    run draws the following steps' rounds from the shared seed, as the uninterrupted one."""
    full, part = tmp_path / "full", tmp_path / "part"
    extra = ("fgrpo.algorithm=dapo", "fgrpo.sampling.max_refills=3",
             "fgrpo.sampling.temperature=0.1")
    assert run_mpi(2, fgrpo_args(toy_adapter, full, 5, *extra)).returncode == 0
    h5 = str(part / "fgrpo.h5")
    code, _, err = run_and_signal(fgrpo_args(toy_adapter, part, 5, *extra), h5, "metrics", 1,
                                  signal.SIGUSR1)
    assert code == 3, err[-3000:]
    assert RunFile(h5).attrs["status"] == "preempted"
    assert RunFile(h5).group("metrics")["step"][-1] < 5
    resumed = run_mpi(2, fgrpo_args(toy_adapter, part, 5, *extra) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = RunFile(str(full / "fgrpo.h5")).group("metrics"), RunFile(h5).group("metrics")
    assert a["sampling_rounds"].min() >= 2
    assert b["step"].tolist() == list(range(1, 6))
    for key in ("reward_mean", "loss", "entropy", "generated_tokens", "sampling_rounds",
                "filtered_groups", "extra_rollouts", "shortfall_groups", "focal_weight_mean"):
        assert np.array_equal(a[key], b[key]), key


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_fsdp2_preemption_then_resume_is_bitwise(toy_adapter, tmp_path):
    """fgrpo.parallel.strategy=fsdp2, full fine-tuning: every rank writes its shard of the fp32
    masters and AdamW moments (torch.distributed.checkpoint); SIGTERM to every rank (as Slurm at preemption), then --resume
    on the same 2 ranks ends with the metrics and the exported model of an uninterrupted run,
    bit for bit."""
    full, part = tmp_path / "full", tmp_path / "part"
    extra = ("fgrpo.parallel.strategy=fsdp2", "fgrpo.full_finetune=true",
             "fgrpo.optim.learning_rate=1e-4", "fgrpo.parallel.offload=state")
    assert run_mpi(2, fgrpo_args(toy_adapter, full, 5, *extra)).returncode == 0
    h5 = str(part / "fgrpo.h5")
    code, _, err = run_and_signal(fgrpo_args(toy_adapter, part, 5, *extra), h5, "metrics", 2,
                                  signal.SIGTERM, to_ranks=True)
    assert code == 3, err[-3000:]
    assert RunFile(h5).attrs["status"] == "preempted"
    g = RunFile(h5).group("metrics")["step"][-1]
    # the step's checkpoint and its sharded part (every rank's DCP files) for the same step
    assert os.path.basename(list_checkpoints(str(part / "checkpoints"))[-1]) == \
        f"step-{g:08d}.safetensors"
    assert (part / "checkpoints" / "sharded" / f"step-{g:08d}" / ".metadata").is_file()
    resumed = run_mpi(2, fgrpo_args(toy_adapter, part, 5, *extra) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    a, b = RunFile(str(full / "fgrpo.h5")), RunFile(h5)
    assert b.group("metrics")["step"].tolist() == list(range(1, 6))
    for key in ("reward_mean", "loss", "entropy", "generated_tokens"):
        assert np.array_equal(a.group("metrics")[key], b.group("metrics")[key]), key
    x = load_file(str(full / "model" / "model.safetensors"))
    y = load_file(str(part / "model" / "model.safetensors"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_sft_preemption_then_resume_is_bitwise(tmp_path):
    """SFT with LoRA dropout (so torch's RNG is part of the state) stopped by SIGUSR1, then
    resumed: the losses and the adapter equal an uninterrupted run's. The resume names no
    folder, only the default run.out's kind ({method}-{jobid}): it takes the newest unfinished
    run, not the complete one beside it."""
    from safetensors.torch import load_file

    full, part = tmp_path / "sft-20261201-090000", tmp_path / "sft-20261201-080000"
    done = run_mpi(2, sft_args(full, 30))
    assert done.returncode == 0, done.stderr[-3000:]
    h5 = str(part / "sft.h5")
    code, out, err = run_and_signal(sft_args(part, 30), h5, "metrics", 2, signal.SIGUSR1)
    assert code == 3, err[-3000:]
    assert "preempted after step" in out
    stopped = RunFile(h5)
    assert stopped.attrs["status"] == "preempted"
    assert 2 <= stopped.group("metrics")["step"][-1] < 30
    assert not (part / "adapter").exists()
    resumed = run_mpi(2, sft_args(tmp_path / "{method}-{jobid}", 30) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"--resume: the newest unfinished sft run is {part}\n" in resumed.stdout
    a, b = RunFile(str(full / "sft.h5")), RunFile(h5)
    assert b.attrs["status"] == "complete"
    assert b.group("metrics")["step"].tolist() == list(range(1, 31))
    assert np.array_equal(a.group("metrics")["loss"], b.group("metrics")["loss"])
    wa, wb = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (full, part))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.xdist_group("essa_20")  # one worker runs the reference once
def test_sigterm_to_mpirun_loses_only_the_step_in_flight(essa_20, toy_adapter, tmp_path):
    """Open MPI 5's mpirun (PRRTE) passes SIGTERM to the ranks and SIGKILLs them 0.25 s later
    (fixed in PRRTE): the step in flight is lost unless it ends within that time. What is kept:
    a readable run file (status ``running``, or ``preempted`` when a step did end) and the
    last checkpoint, from which the resumed run equals the uninterrupted one (``essa_20``: the
    signal after generation 2 lands with 18 to go). The job scripts therefore pass SIGTERM on
    as SIGUSR1 (tests/test_slurm.py)."""
    part = tmp_path / "part"
    h5 = str(part / "essa.h5")
    args = essa_args(toy_adapter, part, 20, "essa.keep_checkpoints=100")
    code, _, err = run_and_signal(args, h5, "essa", 2, signal.SIGTERM)
    assert code not in (0, 3), err[-3000:]
    stopped = RunFile(h5)  # readable; "preempted" only if a rank finished its step in 0.25 s
    assert stopped.attrs["status"] in ("running", "preempted")
    assert stopped.group("essa")["step"][-1] < 20
    assert list_checkpoints(str(part / "checkpoints"))
    resumed = run_mpi(2, args + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_end(essa_20, part)


def test_damaged_checkpoint_falls_back_to_previous(tmp_path, capsys):
    for step in (1, 2, 3):
        save_checkpoint(str(tmp_path), step, {"step": step, "x": torch.arange(4) * step},
                        keep=2)
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == \
        ["step-00000002.safetensors", "step-00000003.safetensors"]
    newest = tmp_path / "step-00000003.safetensors"
    newest.write_bytes(newest.read_bytes()[:-20])  # truncated
    assert load_latest(str(tmp_path))["step"] == 2
    assert "truncated or corrupted" in capsys.readouterr().err
    older = tmp_path / "step-00000002.safetensors"
    data = bytearray(older.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    older.write_bytes(bytes(data))
    with pytest.raises(UserError, match="every checkpoint"):
        load_latest(str(tmp_path))


def test_no_checkpoint_folder_means_fresh_start(tmp_path):
    assert load_latest(str(tmp_path / "none")) is None


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
@pytest.mark.xdist_group("fgrpo_6")  # one worker runs the reference once
def test_damaged_run_file_is_restored_from_the_checkpoint_on_resume(fgrpo_6, toy_adapter,
                                                                    tmp_path):
    """A run file that a failed write left unreadable (here: cut in half) comes back from the
    copy in the last checkpoint; the resumed run completes with every step. The run is a copy
    of ``fgrpo_6`` (complete, its last checkpoint that of step 6), resumed to step 8: the job
    of its own that this test ran before (2 steps, resumed to 4) is saved."""
    from conftest import our_lines

    out = tmp_path / "run"
    shutil.copytree(fgrpo_6, out)
    h5 = str(out / "fgrpo.h5")
    before = RunFile(h5).group("metrics")["reward_mean"]
    assert len(before) == 6
    with open(h5, "r+b") as fh:
        fh.truncate(os.path.getsize(h5) // 2)
    resumed = run_mpi(2, fgrpo_args(toy_adapter, out, 8, every=3) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [ln for ln in our_lines(resumed.stderr) if ln.startswith("warning: the run file")] \
        == [f"warning: the run file {h5} was damaged; restored from the checkpoint"]
    run = RunFile(h5)
    assert run.attrs["status"] == "complete"
    assert run.group("metrics")["step"].tolist() == list(range(1, 9))
    assert np.array_equal(run.group("metrics")["reward_mean"][:6], before)


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.xdist_group("fgrpo_6")  # one worker runs the reference once
def test_damaged_run_file_without_a_copy_ends_every_rank(fgrpo_6, toy_adapter, tmp_path):
    """No checkpoint to restore from: rank 0 alone finds the damage, so it must end the job
    (exit 2, one line), not leave rank 1 waiting in the next collective. The run is a copy of
    ``fgrpo_6`` (saves this test a job of its own), its checkpoints removed."""
    from conftest import our_lines

    out = tmp_path / "run"
    shutil.copytree(fgrpo_6, out)
    h5 = str(out / "fgrpo.h5")
    shutil.rmtree(out / "checkpoints")
    with open(h5, "r+b") as fh:
        fh.truncate(100)
    proc = run_mpi(2, fgrpo_args(toy_adapter, out, 8, every=3) + ["--resume"], timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [ln for ln in our_lines(proc.stderr) if ln.startswith("error")]
    assert lines == [f"error (rank 0): --resume: the run file {h5} is damaged and there is no "
                     f"copy of it in a checkpoint; move it away to start a new one"]


@pytest.mark.mpi
@pytest.mark.toy
def test_killed_rank_ends_the_job_and_resume_works(toy_adapter, tmp_path):
    out = tmp_path / "run"
    h5 = str(out / "essa.h5")
    code, _, err = run_and_signal(essa_args(toy_adapter, out, 6), h5, "essa", 2,
                                  signal.SIGKILL, to_ranks=True, only_rank=1)
    assert code != 0
    assert "exited on signal 9" in err or "rank 1" in err or ",1]" in err, err[-2000:]
    assert RunFile(h5).attrs["status"] == "running"  # readable; marked as not finished
    g = len(list_checkpoints(str(out / "checkpoints")))
    assert g >= 1
    resumed = run_mpi(2, essa_args(toy_adapter, out, 6) + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = RunFile(h5)
    assert run.attrs["status"] == "complete"
    assert run.group("essa")["step"].tolist() == list(range(1, 7))


@pytest.mark.mpi
@pytest.mark.toy
def test_hung_rank_is_named_and_the_job_aborted(toy_adapter, tmp_path):
    out = tmp_path / "run"
    h5 = str(out / "essa.h5")
    code, _, err = run_and_signal(essa_args(toy_adapter, out, 50, "run.collective_timeout_s=5"),
                                  h5, "essa", 2, signal.SIGSTOP, to_ranks=True, only_rank=1)
    assert code != 0
    # Every collective waits for named arrival first, so rank 0 names rank 1 whichever one it
    # misses (almost always the fitness exchange, as it is stopped while generating).
    assert "rank(s) [1] did not " in err and "within 5 s" in err, err[-2000:]
    # ... and marks the run file before the abort, so that the job script requeues it
    run = RunFile(h5)
    assert run.attrs["status"] == "lost", err[-2000:]
    assert run.attrs["lost_ranks"].tolist() == [1]
    assert list(run.attrs["lost_hosts"]) == [socket.gethostname()]


@pytest.mark.mpi
@pytest.mark.toy
def test_hung_rank_is_named_in_fgrpo(toy_adapter, tmp_path):
    """F-GRPO's token-count all-gather ran before its arrival check: the probe saw the anonymous
    "collective 'metrics' did not complete" in 2 of 3 runs."""
    out = tmp_path / "run"
    h5 = str(out / "fgrpo.h5")
    code, _, err = run_and_signal(fgrpo_args(toy_adapter, out, 50, "run.collective_timeout_s=5"),
                                  h5, "metrics", 2, signal.SIGSTOP, to_ranks=True, only_rank=1)
    assert code != 0
    assert "rank(s) [1] did not " in err and "within 5 s" in err, err[-2000:]


def test_nan_fitness_is_worst_and_counted():
    from essa.optimizers import sanitize

    fitness, bad = sanitize(np.array([0.5, np.nan, 0.25, np.inf, -np.inf]))
    assert bad == 3
    assert fitness.tolist() == [0.5, -0.75, 0.25, -0.75, -0.75]
    clean, none_bad = sanitize(np.array([0.1, 0.2]))
    assert none_bad == 0 and clean.tolist() == [0.1, 0.2]


def test_nan_gradient_step_is_skipped():
    from hpc.models.parallelize import TrainedWeights

    w = torch.nn.Parameter(torch.ones(3))
    weights = TrainedWeights([w], lr=0.1, weight_decay=0.0)
    w.grad = torch.tensor([1.0, float("nan"), 0.0])
    assert weights.step(1.0) is False
    assert torch.equal(w.detach(), torch.ones(3)) and not weights.opt.state
    w.grad = torch.tensor([1.0, 1.0, 0.0])
    assert weights.step(1.0) is True
    assert not torch.equal(w.detach(), torch.ones(3))


@pytest.mark.mpi
@pytest.mark.toy
def test_disk_full_mid_run(toy_adapter, tmp_path):
    """The output folder is a 1 MiB tmpfs: the run starts (min_free_mb=0), its first
    checkpoint does not fit; the job ends with one line naming it, exit 2, and the run file
    stays readable."""
    from conftest import our_lines

    disk = tmp_path / "small-disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)],
                             capture_output=True).returncode == 0
    require(mounted, "mounting a tmpfs (root)")
    try:
        out = disk / "run"
        proc = run_mpi(2, essa_args(toy_adapter, out, 3, "run.min_free_mb=0"))
        assert proc.returncode == 2, proc.stderr[-3000:]
        lines = [ln for ln in our_lines(proc.stderr) if ln.startswith("error")]
        assert len(lines) == 1 and "cannot write checkpoint" in lines[0], proc.stderr[-2000:]
        assert "No space left" in lines[0]
        assert RunFile(str(out / "essa.h5")).group("metrics")["step"].tolist() == [1]
        assert not list((out / "checkpoints").glob("*.tmp"))
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


@pytest.mark.parametrize("kind,dim,popsize", [("cma", 30, 4), ("cma", 12, 5), ("cma", 8, 6),
                                              ("sep-cma", 30, 4), ("cma", 64, 8)])
def test_cma_resume_from_every_checkpoint_of_20_generations_is_bitwise(tmp_path, kind, dim,
                                                                       popsize):
    """The optimizer alone, through real checkpoint files: resumed from each of the 19
    checkpoints of a 20-generation run, CMA-ES ends with the uninterrupted run's mean, step
    size and covariance, bit for bit (pycma's ``dC`` is a view into ``sm.C`` and ``sm.B`` is
    Fortran-ordered: restored as a copy or in C order, each drifted by ~1e-10 a generation)."""
    from essa.optimizers import Tracked, make_optimizer

    def fitness(x, g):
        return -np.sum((x - 0.3) ** 2, axis=1) + 0.01 * g

    def run(opt, first):
        for g in range(first, 20):
            x = opt.ask()
            opt.tell(x, fitness(x, g))
            save_checkpoint(str(tmp_path / "ckpt"), g + 1, {"method": opt.state_dict()},
                            keep=100)
        return opt

    def fresh():
        return Tracked(make_optimizer(kind, dim, popsize, 0.5, seed=7))

    full = run(fresh(), 0)
    for step in range(1, 20):
        one = tmp_path / f"from-{step}"
        one.mkdir()
        for suffix in (".safetensors", ".sha256"):
            shutil.copy(tmp_path / "ckpt" / f"step-{step:08d}{suffix}", one)
        resumed = fresh()
        resumed.load_state_dict(load_latest(str(one))["method"])
        for g in range(step, 20):
            x = resumed.ask()
            resumed.tell(x, fitness(x, g))
        es, ref = resumed.optimizer._es, full.optimizer._es
        assert np.array_equal(resumed.mean, full.mean), step
        assert resumed.optimizer.sigma == full.optimizer.sigma, step
        # the covariance: CMA-ES's full matrix (es.C is es.sm.C, es.dC a view of its diagonal);
        # sep-CMA's diagonal lives in sigma_vec.scaling
        assert np.array_equal(es.C, ref.C) and np.array_equal(es.dC, ref.dC), step
        assert np.array_equal(es.sigma_vec.scaling, ref.sigma_vec.scaling), step
        assert np.array_equal(es.pc, ref.pc), step
        assert np.array_equal(es.adapt_sigma.ps, ref.adapt_sigma.ps), step
        assert (es.countiter, es.countevals) == (ref.countiter, ref.countevals)
        assert (ref.countiter, ref.countevals) == (20, 20 * popsize)
        # and the whole state the checkpoint holds: every pycma array and counter, the RNG
        got, want = resumed.state_dict(), full.state_dict()
        compared = same_state(got, want, step)
        named = {"mean", "sigma", "pc", "adapt_sigma.ps", "countiter", "countevals",
                 "sigma_vec.scaling", *(["C"] if kind == "sep-cma" else ["sm.C", "sm.B", "sm.D"])}
        assert {f"optimizer.es.values.{p}" for p in named} | {
            "optimizer.rng_keys", "optimizer.rng_pos", "optimizer.rng_has_gauss", "best_x",
            "best_fitness"} <= set(compared), step
    print(f"{kind} dim {dim} popsize {popsize}: {len(compared)} state entries equal bitwise "
          f"after resuming from each of 19 checkpoints (pycma's wall-clock timers left out)")


WALL_CLOCK = ("timer.", "logger.timer_all.", "logger.timer_plot.")


def same_state(got, want, step, path="") -> list:
    """Assert two optimizer state dicts are equal bitwise (arrays: dtype, shape, bytes; ints
    and floats by value; nested dicts and lists by their keys and items), pycma's wall-clock
    timers aside; returns the paths compared."""
    compared = []
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), (step, path)
        for key in want:
            name = key if not path else f"{path}.{key}"
            if any(key.startswith(w) for w in WALL_CLOCK):
                continue
            compared += same_state(got[key], want[key], step, name)
        return compared
    if isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), (step, path)
        for i, (a, b) in enumerate(zip(got, want)):
            same_state(a, b, step, f"{path}[{i}]")
        return [path]
    if isinstance(want, (np.ndarray, np.generic)):
        a, b = np.asarray(got), np.asarray(want)
        assert a.dtype == b.dtype and a.shape == b.shape, (step, path)
        assert a.tobytes() == b.tobytes(), (step, path)  # bitwise, NaN included
        return [path]
    if isinstance(want, float) and np.isnan(want):
        assert isinstance(got, float) and np.isnan(got), (step, path)
        return [path]
    assert type(got) is type(want) and got == want, (step, path, got, want)
    return [path]


@pytest.fixture(scope="module")
def essa_20(toy_adapter, tmp_path_factory):
    """An uninterrupted 20-generation ESSA run on 2 ranks that keeps every checkpoint."""
    full = tmp_path_factory.mktemp("essa-20") / "full"
    proc = run_mpi(2, essa_args(toy_adapter, full, 20, "essa.keep_checkpoints=100"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return full


@pytest.fixture(scope="module")
def essa_6(toy_adapter, tmp_path_factory):
    """An uninterrupted 6-generation ESSA run on 2 ranks, checkpointed every 3 generations."""
    full = tmp_path_factory.mktemp("essa-6") / "full"
    proc = run_mpi(2, essa_args(toy_adapter, full, 6, every=3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return full


def _same_end(full, part):
    a, b = RunFile(str(full / "essa.h5")), RunFile(str(part / "essa.h5"))
    assert b.attrs["status"] == "complete"
    assert b.group("essa")["step"].tolist() == list(range(1, 21))
    assert np.array_equal(a.group("essa")["fitness"], b.group("essa")["fitness"])
    assert np.array_equal(a.group("final")["mean"], b.group("final")["mean"])
    for adapter in ("adapter-mean", "adapter-best"):
        weights = f"{adapter}/adapter_model.safetensors"
        for name, tensor in load_file(str(full / weights)).items():
            assert torch.equal(tensor, load_file(str(part / weights))[name]), name


@pytest.mark.parametrize("step", [2, 7, 8, 10, 14, 16, 18])
@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
@pytest.mark.xdist_group("essa_20")  # one worker runs the reference once
def test_essa_resumed_from_a_checkpoint_of_20_generations_is_bitwise(essa_20, toy_adapter,
                                                                     tmp_path, step):
    """The job resumed from checkpoint ``step`` (the later ones deleted, as if it had been
    preempted there): the same fitness rows, final mean and adapter as the uninterrupted run
    (steps 8, 10, 14 and 16 once ended ~6e-10 apart)."""
    part = tmp_path / "part"
    shutil.copytree(essa_20, part)
    for path in list_checkpoints(str(part / "checkpoints")):
        if int(os.path.basename(path)[5:13]) > step:
            os.remove(path)
            os.remove(path[:-len(".safetensors")] + ".sha256")
    resumed = run_mpi(2, essa_args(toy_adapter, part, 20, "essa.keep_checkpoints=100") +
                      ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_end(essa_20, part)


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
@pytest.mark.xdist_group("essa_20")  # one worker runs the reference once
def test_essa_sigusr1_after_generation_7_then_resume_is_bitwise(essa_20, toy_adapter,
                                                                tmp_path):
    part = tmp_path / "part"
    args = essa_args(toy_adapter, part, 20, "essa.keep_checkpoints=100")
    code, out, err = run_and_signal(args, str(part / "essa.h5"), "essa", 7, signal.SIGUSR1)
    assert code == 3, err[-3000:]
    assert 7 <= RunFile(str(part / "essa.h5")).group("essa")["step"][-1] < 20
    resumed = run_mpi(2, args + ["--resume"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_end(essa_20, part)


COMPLETES = """
import sys
from hpc.runtime.errors import user_errors_exit
from hpc.runtime.preempt import stop_signals

@user_errors_exit
def main():
    stop_signals()
    import torch, h5py  # what a job has loaded: a shutdown that takes a while
    print("run: done", flush=True)
    sys.stdin.readline()  # the test starts signalling now

main()
"""


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM], ids=["SIGUSR1", "SIGTERM"])
@pytest.mark.subprocess
def test_a_stop_signal_after_the_final_line_leaves_exit_0(sig):
    """Signals sent again and again from the final ``run:`` line until the process is gone
    (a preemption that comes as the job ends): exit 0, not 138 or 143."""
    env = dict(os.environ, **MPI_ENV, OMPI_COMM_WORLD_RANK="0")
    proc = subprocess.Popen([sys.executable, "-c", COMPLETES], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    assert proc.stdout.readline().startswith("run: ")
    proc.stdin.write("\n")
    proc.stdin.flush()
    sent = 0
    while proc.poll() is None:
        try:
            os.kill(proc.pid, sig)
            sent += 1
        except ProcessLookupError:
            break
        time.sleep(0.0005)
    assert proc.wait(timeout=60) == 0
    assert sent > 0

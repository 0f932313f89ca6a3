"""Preemption during start-up, under the real mpirun: SIGUSR1 to the ranks 1, 3, 6 and 10 s
after the start ends every job with exit 3 and a run file marked preempted before its first
step; ``--resume`` then starts again, and the finished run equals an uninterrupted one bitwise.

One chain per method keeps it short: the run is started and preempted at 1 s, resumed and
preempted at 3 s, at 6 s, at 10 s (so a resumed start-up is preempted too, also after its start
evaluation wrote rows), then resumed to the end; an uninterrupted run runs alongside, and the
two methods' chains run at the same time. The
test-only HPC_TEST_STARTUP_DELAY_S makes each start-up safe point wait, so even the 10 s signal
lands before the first step however fast the toy loads.
"""
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from safetensors.numpy import load_file

from conftest import MPI_ENV, REPO, mpirun_path, require
from hpc.runtime.checkpoint import list_checkpoints
from hpc.runtime.preempt import STARTUP_DELAY_ENV
from hpc.runtime.runstore import RunFile, RunStore
from test_faults import rank_pids

SIGNAL_AFTER_S = (1, 3, 6, 10)
DELAY_S = 3  # per start-up safe point (4 or more of them before the first step): > 10 s
SIGUSR1_BIT = 1 << (signal.SIGUSR1 - 1)  # in /proc/PID/status SigCgt


def tiny_args(method, adapter, out):
    common = ["model.path=toy", f"lora.adapter={adapter}", "task.n_train=64", "task.n_eval=8",
              "eval.every=0", "eval.n_samples=2", "eval.batch_size=8", "run.progress=false",
              "run.checkpoint_every=1", f"run.out={out}"]
    if method == "essa":
        return ["-m", "essa", *common, "essa.population=4", "essa.minibatch=8",
                "essa.generations=2"]
    return ["-m", "fgrpo", *common, "fgrpo.batch_prompts=4", "fgrpo.sampling.num_generations=2",
            "fgrpo.steps=2"]


def start(args, delay_s=0):
    mpirun = mpirun_path()
    require(mpirun is not None, "mpirun")
    env = dict(os.environ, **MPI_ENV, **{STARTUP_DELAY_ENV: str(delay_s)})
    return subprocess.Popen([mpirun, "-n", "2", "--oversubscribe", sys.executable] + args,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=REPO)


def catches_sigusr1(pid: int) -> bool:
    """Whether process ``pid`` has a handler for SIGUSR1 (so the signal cannot kill it)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            caught = next(line for line in fh if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) & SIGUSR1_BIT)


def signal_ranks_after(proc, marker: str, after_s: float) -> None:
    """SIGUSR1 to both ranks ``after_s`` seconds after ``proc`` started. Not before each rank
    has installed its handler: the interpreter's first fraction of a second, before the entry
    point runs, is the one moment a signal still ends a rank (README, "Faults")."""
    started = time.monotonic()
    deadline = started + 120
    while time.monotonic() < deadline and proc.poll() is None:
        pids = rank_pids(marker)
        if len(pids) == 2 and all(map(catches_sigusr1, pids)):
            break
        time.sleep(0.05)
    time.sleep(max(0.0, started + after_s - time.monotonic()))
    for pid in rank_pids(marker):
        os.kill(pid, signal.SIGUSR1)


def preempt_four_times_then_finish(method, adapter, part):
    """The chain of the module docstring in ``part``; returns the finished run's output."""
    h5 = part / f"{method}.h5"
    for i, after_s in enumerate(SIGNAL_AFTER_S):
        args = tiny_args(method, adapter, part) + (["--resume"] if i else [])
        proc = start(args, delay_s=DELAY_S)
        signal_ranks_after(proc, f"run.out={part}", after_s)
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 3, f"{method}, signal at {after_s} s: {err[-3000:]}"
        assert "preempted during start-up" in out, out
        stopped = RunFile(str(h5))
        assert stopped.attrs["status"] == "preempted"
        assert stopped.attrs["preempted_before_first_step"]
        assert not list_checkpoints(str(part / "checkpoints"))
    return finish(start(tiny_args(method, adapter, part) + ["--resume"]))


def finish(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return out


def assert_same_run(method, full, part):
    """Bitwise: the run file's metrics and evaluations, and the exported adapters."""
    a, b = RunFile(str(full / f"{method}.h5")), RunFile(str(part / f"{method}.h5"))
    assert b.attrs["status"] == "complete" and not b.attrs["preempted_before_first_step"]
    assert b.group("metrics")["step"].tolist() == [1, 2]
    assert b.group("eval")["step"].tolist() == [-1, 2]  # the start evaluation once
    keys = {"essa": ("fitness_mean", "fitness_max", "fitness_min"),
            "fgrpo": ("reward_mean", "loss", "entropy", "generated_tokens")}[method]
    for key in keys:
        assert np.array_equal(a.group("metrics")[key], b.group("metrics")[key]), key
    for key in ("accuracy", "pass_at_k", "avg_at_n"):
        assert np.array_equal(a.group("eval")[key], b.group("eval")[key], equal_nan=True), key
    adapters = {"essa": ("adapter-mean", "adapter-best"), "fgrpo": ("adapter",)}[method]
    for name in adapters:
        x = load_file(str(full / name / "adapter_model.safetensors"))
        y = load_file(str(part / name / "adapter_model.safetensors"))
        assert x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x), name


@pytest.mark.mpi
@pytest.mark.toy
@pytest.mark.slow
def test_signal_during_startup_requeues_and_resume_is_bitwise(toy_adapter, tmp_path):
    """ESSA and F-GRPO, each chain beside an uninterrupted run, all at once: the chains wait
    for their signals most of the time."""
    methods = ("essa", "fgrpo")
    references = {m: start(tiny_args(m, toy_adapter, tmp_path / f"{m}-full")) for m in methods}
    with ThreadPoolExecutor(len(methods)) as pool:
        chains = {m: pool.submit(preempt_four_times_then_finish, m, toy_adapter,
                                 tmp_path / f"{m}-part") for m in methods}
        for method in methods:
            chains[method].result()
            finish(references[method])
            assert_same_run(method, tmp_path / f"{method}-full", tmp_path / f"{method}-part")


def test_a_run_restarting_from_step_0_keeps_no_row(tmp_path):
    """A run preempted after its start evaluation but before its first step holds that
    evaluation's row (step -1); resumed from step 0 it evaluates again, so every row goes
    (truncate_after(None)); from a checkpoint, the rows up to it stay."""
    path = str(tmp_path / "run.h5")
    store = RunStore(path, True)
    store.write_row("eval", -1, accuracy=0.5)
    store.close("preempted")
    store = RunStore(path, True, resume=True)
    store.truncate_after(None)
    store.write_row("eval", -1, accuracy=0.5)
    store.write_row("metrics", 1, loss=1.0)
    store.write_row("metrics", 2, loss=0.5)
    store.truncate_after(1)
    store.close()
    run = RunFile(path)
    assert run.group("eval")["step"].tolist() == [-1]
    assert run.group("metrics")["step"].tolist() == [1]

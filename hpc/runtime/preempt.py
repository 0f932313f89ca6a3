"""Preemption: SIGUSR1 (Slurm's warning before the time limit) or SIGTERM makes every rank
stop at the next safe point, write what it must and exit with code 3, which the job scripts
turn into a requeue; the requeued job resumes with ``--resume``.

The handler is installed first thing in a job's entry point (:func:`hpc.runtime.cli.job_command`,
before the slow imports of torch and transformers), so a signal during start-up is recorded,
never fatal. Safe points:

* during start-up (:func:`hpc.job.lifecycle.stop_if_preempted`): after the job's world and run
  folder are ready, after model loading, after adapter loading and after the start evaluation,
  before the first step. A stop there writes no checkpoint (no step ran since the last one);
  rank 0 marks the run file ``preempted`` with ``preempted_before_first_step`` true;
* at the end of every step (:func:`should_stop`): the step finishes, is checkpointed, then
  :func:`preempted_exit`.

A signal may reach the ranks at different moments, so each decision is taken collectively:
one Allgather of one or two bytes per rank (tag ``control``).
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from hpc.runtime.errors import end_with_launcher

EXIT_PREEMPTED = 3
# Test-only: seconds each start-up safe point sleeps first, so that a test's signal lands in
# start-up even where loading the toy model takes no time. Never set it in a real job.
STARTUP_DELAY_ENV = "HPC_TEST_STARTUP_DELAY_S"
# Test-only: "STEP:FOLDER". Once step STEP's row is written (before its checkpoint, if one is
# due), every rank creates FOLDER/paused-RANK and waits there (at most PAUSE_S), so that a test
# can SIGKILL a rank at a step it knows. Never set it in a real job.
PAUSE_AFTER_STEP_ENV = "HPC_TEST_PAUSE_AFTER_STEP"
PAUSE_S = 300.0


class StopSignals:
    """Records SIGUSR1/SIGTERM instead of dying, so the work in flight can reach a safe point."""

    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)):
        self.received = None
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.received = signal.Signals(signum).name


_installed: StopSignals | None = None


def stop_signals() -> StopSignals:
    """This process's :class:`StopSignals`, installed by the first call (the entry point's);
    later calls return the same one, so a signal received in between is not forgotten. The
    first call also ties a launched rank's life to its launcher's
    (:func:`hpc.runtime.errors.end_with_launcher`)."""
    global _installed
    if _installed is None:
        end_with_launcher()
        _installed = StopSignals()
    return _installed


def any_rank_signalled(world, signals: StopSignals) -> bool:
    """True on every rank if a stop signal reached any rank (1 byte per rank, tag control)."""
    return bool(world.allgather(np.array([signals.received is not None], dtype=np.int8),
                                tag="control").any())


def startup_delay() -> None:
    """Sleep ``$HPC_TEST_STARTUP_DELAY_S`` seconds (tests only; see STARTUP_DELAY_ENV)."""
    seconds = float(os.environ.get(STARTUP_DELAY_ENV) or 0)
    if seconds > 0:
        time.sleep(seconds)


def pause_after_step(step: int, rank: int) -> None:
    """Wait as ``$HPC_TEST_PAUSE_AFTER_STEP`` asks, after step ``step`` (tests only; see
    PAUSE_AFTER_STEP_ENV)."""
    value = os.environ.get(PAUSE_AFTER_STEP_ENV)
    if not value:
        return
    at, folder = value.split(":", 1)
    if step != int(at):
        return
    open(os.path.join(folder, f"paused-{rank}"), "w").close()
    until = time.monotonic() + PAUSE_S
    while time.monotonic() < until:  # a stop signal is recorded, not obeyed, here
        time.sleep(0.1)


def should_stop(world, signals: StopSignals, out_of_time: bool) -> tuple:
    """(stop, preempted), identical on every rank: preempted if any rank got a signal; out of
    time if rank 0's clock says so (rank 0's clock decides for everyone)."""
    flags = world.allgather(np.array([signals.received is not None, out_of_time],
                                     dtype=np.int8), tag="control")
    preempted = bool(flags[:, 0].any())
    return preempted or bool(flags[0, 1]), preempted


def preempted_exit(world, store, step: int, wall_s: float) -> dict:
    """Close the run file as ``preempted`` (the checkpoint is already written) and wait until
    every rank is here, since a launcher kills the rest as soon as one rank exits non-zero."""
    store.set_attrs(wall_seconds=wall_s, preempted_before_first_step=False)
    store.close("preempted")
    world.barrier()
    if world.is_root:
        print(f"preempted after step {step}: checkpoint written; exiting with code "
              f"{EXIT_PREEMPTED} so the job is requeued and resumes", flush=True)
    return {"preempted": True, "step": step}

"""Preemption: SIGUSR1 (Slurm's warning before the time limit) or SIGTERM makes every rank
finish the current step, checkpoint, flush the run file and exit with code 3, which the job
scripts turn into a requeue; the requeued job resumes with ``--resume``.

A signal may reach the ranks at different moments, so the decision is taken collectively at
the end of each step: one Allgather of two bytes per rank (tag ``control``).
"""
from __future__ import annotations

import signal

import numpy as np

EXIT_PREEMPTED = 3


class StopSignals:
    """Records SIGUSR1/SIGTERM instead of dying, so the step in flight can finish."""

    def __init__(self, signals=(signal.SIGUSR1, signal.SIGTERM)):
        self.received = None
        for sig in signals:
            signal.signal(sig, self._handle)

    def _handle(self, signum, _frame):
        self.received = signal.Signals(signum).name


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
    store.set_attrs(wall_seconds=wall_s)
    store.close("preempted")
    world.barrier()
    if world.is_root:
        print(f"preempted after step {step}: checkpoint written; exiting with code "
              f"{EXIT_PREEMPTED} so the job is requeued and resumes", flush=True)
    return {"preempted": True, "step": step}

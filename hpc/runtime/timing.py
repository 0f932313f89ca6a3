"""Per-phase wall-clock timers, gathered per rank so stragglers are visible."""
from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np


class PhaseTimer:
    """Accumulates seconds per named phase between calls to :meth:`take`.

    ``sync`` (e.g. ``torch.cuda.synchronize``) is called at phase boundaries so GPU work is
    charged to the phase that queued it; on CPU leave it None.
    """

    def __init__(self, phases: list[str], sync=None):
        self.phases = list(phases)
        self.sync = sync
        self.seconds = dict.fromkeys(self.phases, 0.0)

    @contextmanager
    def phase(self, name: str):
        if name not in self.seconds:
            raise KeyError(f"unknown phase {name!r}; declared: {self.phases}")
        if self.sync:
            self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                self.sync()
            self.seconds[name] += time.perf_counter() - start

    def take(self) -> np.ndarray:
        """Seconds per phase (float64, (n_phases,)) since the last take; resets them."""
        out = np.array([self.seconds[p] for p in self.phases], dtype=np.float64)
        self.seconds = dict.fromkeys(self.phases, 0.0)
        return out


def gather_timings(world, timer: PhaseTimer) -> dict:
    """All ranks' phase seconds: {phase: float64 (world_size,)} (one Allgather, tag 'timings')."""
    table = world.allgather(timer.take(), tag="timings")  # (size, n_phases)
    return {phase: table[:, i] for i, phase in enumerate(timer.phases)}

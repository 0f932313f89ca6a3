"""What the doctor's checks report, and how the ranks share it.

A check returns, on each rank, a list of :class:`Finding` (empty: it holds there). The ranks
exchange their facts and findings as JSON over the world's deadline-checked gathers
(:func:`share`), so every rank knows the verdict and exits with the same code; rank 0 folds
the same finding on several ranks into one line naming their hosts (:func:`failure_lines`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Finding:
    """A check that fails on this rank: what was checked, what was found, what fixes it
    (``''`` where the problem's text names it). ``job_wide``: found by rank 0 for the whole
    job (the rendezvous, the memory plan), so its line names no host."""

    check: str
    problem: str
    fix: str
    job_wide: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def share(world, obj) -> list:
    """Collective: every rank's JSON-able ``obj``, in rank order, on every rank. Two gathers
    (the lengths, then the bytes), each behind the world's named arrival (tag ``doctor``), so
    a rank that never arrives is named rather than waited for."""
    raw = np.frombuffer(json.dumps(obj).encode(), dtype=np.uint8)
    counts = [int(c) for c in world.allgather(np.array([raw.size], dtype=np.int64),
                                              tag="doctor").ravel()]
    joined = world.allgatherv(raw, counts, tag="doctor")
    bounds = np.concatenate([[0], np.cumsum(counts)])
    return [json.loads(bytes(joined[a:b]).decode()) for a, b in zip(bounds[:-1], bounds[1:])]


def ranks_text(ranks: list) -> str:
    """'rank 3', 'ranks 0-3, 6'."""
    spans, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            spans.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(spans)


def where(ranks: list, hosts: list) -> str:
    """'node2 (ranks 2, 3)', the hosts of ``ranks`` in rank order, each with its ranks."""
    by_host: dict = {}
    for r in ranks:
        by_host.setdefault(hosts[r], []).append(r)
    return ", ".join(f"{host} ({ranks_text(rs)})" for host, rs in by_host.items())


def failure_lines(per_rank: list, hosts: list) -> list:
    """One line per distinct finding of ``per_rank`` (each rank's list of Finding dicts), in
    the order first seen: ``error: CHECK on HOST (ranks): PROBLEM; FIX``."""
    groups: dict = {}
    for rank, findings in enumerate(per_rank):
        for f in findings:
            key = (f["check"], f["problem"], f["fix"], f["job_wide"])
            groups.setdefault(key, []).append(rank)
    lines = []
    for (check, problem, fix, job_wide), ranks in groups.items():
        place = "" if job_wide else f" on {where(ranks, hosts)}"
        lines.append(f"error: {check}{place}: {problem}" + (f"; {fix}" if fix else ""))
    return lines

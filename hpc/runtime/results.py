"""What an evaluation returns, how it is logged to the run file and printed as a table.

Kept apart from :mod:`hpc.evaluate` (which generates, so needs the models) so that the job
runtime and the offline report can log and print results without importing a model stack.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class EvalResult:
    accuracy: float  # greedy, fraction of problems
    pass_at_k: np.ndarray  # (n_samples,), k = 1..n_samples
    avg_at_n: float  # mean reward of all samples
    n_problems: int
    seconds: float
    greedy_correct: np.ndarray = field(repr=False)  # (n_problems,) int8


def log_eval(store, step: int, result: EvalResult) -> None:
    """Write one full evaluation (start: step -1, or final) to group ``eval`` of the store."""
    store.write_row("eval", step, accuracy=result.accuracy, pass_at_k=result.pass_at_k,
                    avg_at_n=result.avg_at_n, seconds=result.seconds)


def format_table(rows: list, ks=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> str:
    """Text table of (label, EvalResult, extra dict) rows: accuracy, pass@k, extra columns."""
    n = max(len(r[1].pass_at_k) for r in rows)
    shown = [k for k in ks if k <= n]
    extra_keys = list(dict.fromkeys(key for r in rows for key in r[2]))
    head = ["model", "greedy acc"] + [f"pass@{k}" for k in shown] + extra_keys
    lines = [head]
    for label, res, extra in rows:
        cells = [label, f"{100 * res.accuracy:.1f}%"]
        cells += [f"{100 * res.pass_at_k[k - 1]:.1f}%" if k <= len(res.pass_at_k) else ""
                  for k in shown]
        cells += [str(extra.get(key, "")) for key in extra_keys]
        lines.append(cells)
    return aligned(lines[0], lines[1:])


def aligned(head: list, rows: list, left: int = 0) -> str:
    """Text table of ``head`` and ``rows`` (lists of strings), columns two spaces apart, the
    first ``left`` columns aligned left, the others right."""
    lines = [head] + rows
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths))).rstrip()
                     for line in lines)

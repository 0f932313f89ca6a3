"""The run files of the papers' reproduction experiment (:mod:`compare.reproduce`) as the
summary reads them: :class:`Run` (method, seed, F-GRPO's gamma and algorithm, the final
evaluation, the held-out curve, provenance), :func:`find_runs` (the run files of each group
under the experiment's folder), and the F-GRPO paper's checkpoint choice per seed pair
(:func:`choose_paper`, ``hpc-report reproduce --checkpoint paper``: :data:`PAPER_RULE`).
"""
from __future__ import annotations

import copy
import glob
import os
from dataclasses import dataclass

import numpy as np

from hpc.runtime.config import stored_config
from hpc.runtime.errors import UserError
from hpc.runtime.runstore import RunFile

GROUPS = ("gamma", "wall", "tokens", "family")
PAPER_RULE = ("checkpoint: the F-GRPO paper's choice per seed pair (plain: gamma = 0; focal: the "
              "same algorithm and seed at gamma > 0): the plain run's evaluation with the highest "
              "pass@1, then the focal run's with the highest pass@1 at no more compute than that "
              "one (generated tokens; steps where a run file lacks them); ties: the earliest")


@dataclass(frozen=True, eq=False)
class Evaluation:
    """One full evaluation of a run (pass@k over samples): what the paper's rule picks from."""
    step: int
    tokens: int | None  # generated completion tokens at that step; None: not in the run file
    passk: np.ndarray   # k = 1..n
    accuracy: float     # greedy
    final: bool


def evaluations(f: RunFile) -> tuple:
    """([Evaluation] in step order, note): a run's full evaluations, the final one and any
    periodic ones that hold pass@k (one a step: the ``eval`` row where two share it), and why
    it has no periodic one ('' where it has)."""
    m = f.group("metrics")
    tokens_at = dict(zip(m["step"].tolist(), np.asarray(m["generated_tokens"], float).tolist())) \
        if "generated_tokens" in m else {}

    def tokens(step, value=None):
        value = tokens_at.get(step) if value is None else float(value)
        return int(round(value)) if value is not None and np.isfinite(value) else None

    found = {}
    h = f.group("heldout")
    if "pass_at_k" in h:
        n = len(h["step"])
        acc = h.get(f.attrs.get("heldout_accuracy", "accuracy"), np.full(n, np.nan))
        for i, step in enumerate(h["step"].tolist()):
            passk = np.atleast_1d(np.asarray(h["pass_at_k"][i], dtype=np.float64))
            if passk.size and np.isfinite(passk[0]):  # NaN: a row written without pass@k
                own = h["generated_tokens"][i] if "generated_tokens" in h else None
                found[step] = Evaluation(step, tokens(step, own), passk, float(acc[i]), False)
    ev = f.group("eval")
    rows = np.flatnonzero(ev["step"] >= 0)
    for i in rows:
        step = int(ev["step"][i])
        found[step] = Evaluation(step, tokens(step), np.asarray(ev["pass_at_k"][i], np.float64),
                                 float(ev["accuracy"][i]), bool(i == rows[-1]))
    evals = [found[s] for s in sorted(found)]
    # the loop evaluates held-out at the last step at any eval.every: that row is no periodic one
    greedy = bool(evals) and bool(np.any(h.get("step", np.zeros(0)) < evals[-1].step))
    note = "" if len(evals) > 1 else "no periodic evaluations" if not greedy \
        else "periodic evaluations without pass@k (greedy accuracy alone)"
    return evals, note


class Run:
    """What the summary needs of one run file: method, seed, gamma, evaluations, curve."""

    def __init__(self, path: str):
        f = RunFile(path)
        if f.attrs.get("status") != "complete":
            raise UserError(f"{path} is not a complete run (status "
                            f"{f.attrs.get('status')!r}): rerun the experiment")
        cfg = stored_config(f.attrs.get("config", ""))
        self.path, self.method = path, f.attrs["method"]
        self.seed = int(cfg["run"]["seed"])
        grpo = cfg["fgrpo"] if self.method == "fgrpo" else None
        self.gamma = float(grpo["advantage"]["gamma"]) if grpo else None
        self.algorithm = grpo.get("algorithm", "grpo") if grpo else None
        self.num_iterations = int(grpo.get("optim", {}).get("num_iterations", 1)) if grpo \
            else None
        # optimizer updates a batch: PPO epochs x mini-batches (earlier run files: one a pass)
        batch = int(grpo.get("batch_prompts", 1)) if grpo else 1
        mini = int(grpo.get("optim", {}).get("mini_batch_prompts", 0)) if grpo else 0
        self.updates = self.num_iterations * (batch // (mini or batch)) if grpo else None
        # what the results file's provenance names (hpc.runtime.runstore's attributes)
        self.commit = f.attrs.get("git_commit", "") or "unrecorded"
        self.toy_build = f.attrs.get("model_build", "unrecorded") or None  # '': not a toy
        self.machine = (f"{f.attrs.get('world_size')} rank(s) on {f.attrs.get('device_model')}"
                        f", cpu kernels {f.attrs.get('cpu_kernels')}, torch "
                        f"{f.attrs.get('torch_version')}")
        ev = f.group("eval")
        start, end = np.flatnonzero(ev["step"] == -1), np.flatnonzero(ev["step"] >= 0)
        self.start_passk = ev["pass_at_k"][start[0]] if start.size else None
        self.start_accuracy = float(ev["accuracy"][start[0]]) if start.size else float("nan")
        self.passk, self.accuracy = ev["pass_at_k"][end[-1]], float(ev["accuracy"][end[-1]])
        self.evaluations, self.no_periodic = evaluations(f)  # what --checkpoint paper picks from
        self.checkpoint = None  # how --checkpoint paper chose the reported one (choose_paper)
        m = f.group("metrics")
        self.steps = int(m["step"][-1])
        self.train_s, self.tokens = float(m["train_s"][-1]), int(m["generated_tokens"][-1])
        h = f.group("heldout")  # none in a run without evaluations along the way
        acc = h.get(f.attrs["heldout_accuracy"], np.zeros(0))
        # the curve starts at the start evaluation (x = 0) and ends at the final one
        self.curve = {x: np.concatenate([[0.0], h.get(x, np.zeros(0)), [getattr(self, a)]])
                      for x, a in (("train_s", "train_s"), ("generated_tokens", "tokens"))}
        self.curve["accuracy"] = np.concatenate([[self.start_accuracy], acc, [self.accuracy]])


def find_runs(root: str) -> dict:
    """{group: [Run]} of the run files under ``root``, one group a folder (what each holds:
    :mod:`compare.reproduce`)."""
    if not os.path.isdir(root):
        raise UserError(f"no experiment folder {root}: run jobscripts/reproduce.sh first")
    runs = {g: [Run(p) for p in sorted(glob.glob(f"{root}/{g}/*/*.h5"))] for g in GROUPS}
    if not any(runs.values()):
        raise UserError(f"{root} holds no run files under {', '.join(GROUPS)}/*/")
    return runs


def _best(evals: list) -> Evaluation:
    """The evaluation with the highest pass@1; of equal ones the earliest (``evals`` are in
    step order, and ``max`` keeps the first of equal keys)."""
    return max(evals, key=lambda e: e.passk[0])


def _compute(e: Evaluation, measure: str) -> float:
    return e.tokens if measure == "tokens" else e.step


def _measure(*runs) -> str:
    """What compute is compared in: generated tokens where every evaluation of ``runs`` has
    them in its run file, else steps."""
    return "tokens" if all(e.tokens is not None for r in runs for e in r.evaluations) \
        else "steps"


def _at(run: Run, e: Evaluation, how: str, measure: str) -> Run:
    """A copy of ``run`` reported at evaluation ``e``; ``checkpoint`` says which and why."""
    chosen = copy.copy(run)
    chosen.passk, chosen.accuracy, chosen.steps = e.passk, e.accuracy, e.step
    chosen.tokens = e.tokens if e.tokens is not None else float("nan")
    chosen.checkpoint = {"step": e.step, "tokens": e.tokens, "pass@1": float(e.passk[0]),
                         "final": e.final, "measure": measure, "how": how}
    return chosen


def choose_paper(runs: list) -> list:
    """``runs`` as ``--checkpoint paper`` reports them (:data:`PAPER_RULE`), in their order:
    each plain run (gamma = 0) at its evaluation with the highest pass@1, each focal run at its
    highest pass@1 among the evaluations at no more compute than the chosen one of the plain
    run of its algorithm and seed. Runs with no periodic evaluation stay at their final one;
    a focal run with no evaluation within that compute at its first; one without a plain run
    at its final one; ``checkpoint['how']`` says which of these it was."""
    plain = {(r.algorithm, r.seed): (r, _best(r.evaluations)) for r in runs if r.gamma == 0.0}
    out = []
    for r in runs:
        final = r.evaluations[-1]
        if r.gamma == 0.0:
            e = plain[(r.algorithm, r.seed)][1]
            out.append(_at(r, e, f"final: {r.no_periodic}" if r.no_periodic else
                           "highest pass@1", _measure(r)))
            continue
        if (r.algorithm, r.seed) not in plain:
            out.append(_at(r, final, "final: no plain run of its seed", _measure(r)))
            continue
        p, pe = plain[(r.algorithm, r.seed)]
        measure = _measure(p, r)
        limit = _compute(pe, measure)
        within = [e for e in r.evaluations if _compute(e, measure) <= limit]
        if r.no_periodic:
            above = "" if within else f", above the plain one's {measure}"
            out.append(_at(r, final, f"final: {r.no_periodic}{above}", measure))
        elif within:
            out.append(_at(r, _best(within), f"highest pass@1 at <= the plain one's {measure}",
                           measure))
        else:
            out.append(_at(r, r.evaluations[0], f"first: none at <= the plain one's {measure}",
                           measure))
    return out



"""Summary of the papers' reproduction experiment (``jobscripts/reproduce.sh``).

``hpc-report reproduce ROOT [--plots DIR] [--json OUT.json]`` reads the run files under ROOT,
grouped by the folder they sit in:

* ``gamma/*/fgrpo.h5``: F-GRPO from one SFT start at several focal exponents gamma and seeds,
  equal steps; the final evaluation's pass@k (k = 1..n, unbiased estimator). Table: mean and
  spread over seeds per gamma, and a paired t-test of each gamma against gamma = 0 over seeds
  (the same seed draws the same batches and sampling keys at every gamma);
* ``wall/*/{essa,fgrpo}.h5``: ESSA and F-GRPO from the same start with the same training-time
  budget (``run.max_train_s``: wall time less evaluations and checkpoints);
* ``tokens/*/{essa,fgrpo}.h5``: the same with the same budget of generated completion tokens
  (``run.max_generated_tokens``). Both: final greedy accuracy and pass@k, mean and spread over
  seeds, and Welch's t-test of ESSA against F-GRPO (independent runs, unequal variances);
* ``family/*/fgrpo.h5``: the F-GRPO paper's three pairs, ``fgrpo.algorithm`` = grpo, dapo,
  cispo at gamma = 0 (the plain algorithm) and gamma > 0 (its focal variant), every run
  stopped by the same generated-token budget. Table: pass@k per arm, mean and 95% confidence
  interval over seeds (Student t); a paired t-test of each focal arm against its plain one
  over seeds at every shown k.

Plots: ``passk_vs_gamma.png`` (pass@k against k on a log axis, one line per gamma: the mean
over seeds, the band from the lowest to the highest seed; the SFT start dashed),
``passk_family.png`` (one panel per algorithm: pass@k of the plain and focal arm, mean and
95% confidence band over seeds),
``accuracy_vs_train_time.png`` and ``accuracy_vs_tokens.png`` (held-out greedy accuracy of
each method against training seconds and generated tokens, interpolated onto one grid; mean
and min-max band over seeds). Spreads are sample standard deviations (ddof = 1).

``--checkpoint`` picks the evaluation each run of the gamma and family groups is reported at:
``final`` (the default) its final evaluation; ``paper`` the F-GRPO paper's choice, per seed
pair (the plain run at gamma = 0 and the focal run of the same algorithm and seed at
gamma > 0): the plain run's evaluation with the highest pass@1, then the focal run's with the
highest pass@1 among those at no more compute than that one (generated tokens; steps where a
run file lacks them); ties go to the earliest. A run's evaluations are its full ones, those
with pass@k: the final one (group ``eval``) and any periodic ones that hold it (a row of
group ``eval`` before the last, or a ``pass_at_k`` column of group ``heldout``). A run whose
periodic evaluations hold greedy accuracy alone (the held-out rows ``eval.every`` writes),
or that has none, is reported at its final evaluation, and the summary says so: the rule in
one line, and per arm the chosen step and tokens (mean over seeds) and how each seed's was
chosen.

The JSON (``--json``) holds every table's values per seed (each family arm with its
``fgrpo.optim.num_iterations``) and ``provenance``: the command, and the commits, toy builds
(``model_build``) and machines its run files record, so that a page quoting it
(:mod:`hpc.analysis.pages`) can name them.
"""
from __future__ import annotations

import collections
import copy
import glob
import json
import os
import shlex
import sys
import warnings
from dataclasses import dataclass

import numpy as np

from hpc.runtime.config import stored_config
from hpc.runtime.errors import UserError
from hpc.runtime.runstore import RunFile

GROUPS = ("gamma", "wall", "tokens", "family")
PLOTS = ("passk_vs_gamma.png", "accuracy_vs_train_time.png", "accuracy_vs_tokens.png",
         "passk_family.png")
ALGORITHMS = {"grpo": "GRPO", "dapo": "DAPO", "cispo": "CISPO"}
SHOWN_K = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # pass@k columns of the tables, where k <= n
# per budget group: (x column of the held-out rows, axis label, plot file)
CURVES = {"wall": ("train_s", "training seconds (wall less evaluations)",
                   "accuracy_vs_train_time.png"),
          "tokens": ("generated_tokens", "generated completion tokens (all ranks)",
                     "accuracy_vs_tokens.png")}
CHECKPOINTS = ("final", "paper")  # --checkpoint: which evaluation of each run is reported
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
    """{group: [Run]} of the run files under ``root`` (see the module docstring)."""
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


def checkpoint_summary(arms: list) -> tuple:
    """(text, {key: record}) of the checkpoints ``--checkpoint paper`` chose, ``arms`` a list
    of (name, key, runs chosen by :func:`choose_paper`): per arm the mean step and tokens over
    seeds and how many seeds were chosen how; per seed in the record."""
    rows, record = [], {}
    for name, key, rs in arms:
        hows = collections.Counter(r.checkpoint["how"] for r in rs)
        rows.append([name, len(rs), f"{np.mean([r.steps for r in rs]):.1f}",
                     f"{np.mean([r.tokens for r in rs]) / 1e3:.1f}k",
                     "; ".join(f"{n} {how}" for how, n in hows.items())])
        record[key] = {"seeds": [r.seed for r in rs]} | {
            field: [r.checkpoint[field] for r in rs]
            for field in ("step", "tokens", "pass@1", "final", "measure", "how")}
    return ("chosen checkpoints (mean over seeds; how each seed's was chosen)\n" +
            _table(["arm", "seeds", "step", "tokens", "chosen"], rows)), record


def start_evaluations(runs: list) -> list:
    """One run per seed, for its start evaluation (every gamma starts from the same model and
    samples with the seed's keys, so runs of one seed share it)."""
    return list({r.seed: r for r in runs if r.start_passk is not None}.values())


def mean_spread(values) -> str:
    v = 100 * np.asarray(values, dtype=np.float64)
    spread = f" ± {v.std(ddof=1):.1f}" if len(v) > 1 else ""
    return f"{v.mean():.1f}{spread}"


def p_value(test: str, b, a, **kw) -> float:
    """``scipy.stats.<test>(b, a).pvalue``; NaN where the seeds leave no variance to test
    against (3 seeds with equal values are common for greedy accuracy on a few hundred
    problems). scipy is imported here, not with the module: it takes a second, and every
    ``hpc-report --help`` would wait for it."""
    from scipy import stats

    with warnings.catch_warnings():  # scipy warns, then answers, when values nearly agree
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(getattr(stats, test)(b, a, **kw).pvalue)


def _p(p: float) -> str:
    return "n/a" if not np.isfinite(p) else f"{p:.3f}"


def _table(head: list, rows: list) -> str:
    widths = [max(len(str(r[i])) for r in [head] + rows) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in [head] + rows)


def gamma_summary(runs: list, at: str = "final evaluation") -> tuple:
    """(text, record) of the gamma sweep: pass@k per gamma over seeds, paired tests; ``at``
    names the evaluation the runs are reported at."""
    gammas = sorted({r.gamma for r in runs})
    n = min(len(r.passk) for r in runs)
    ks = [k for k in SHOWN_K if k <= n]
    by = {g: sorted((r for r in runs if r.gamma == g), key=lambda r: r.seed) for g in gammas}
    starts = start_evaluations(runs)
    head = ["gamma", "seeds", "greedy"] + [f"pass@{k}" for k in ks]
    rows, record = [], {"n_samples": n, "k": ks, "gammas": {}}
    if starts:
        rows.append(["start", len(starts), mean_spread([r.start_accuracy for r in starts])] +
                    [mean_spread([r.start_passk[k - 1] for r in starts]) for k in ks])
    base = {r.seed: r for r in by.get(0.0, [])}
    tests = []
    for g in gammas:
        rs = by[g]
        rows.append([f"{g:g}", len(rs), mean_spread([r.accuracy for r in rs])] +
                    [mean_spread([r.passk[k - 1] for r in rs]) for k in ks])
        record["gammas"][f"{g:g}"] = {
            "seeds": [r.seed for r in rs], "greedy": [r.accuracy for r in rs],
            "pass_at_k": {str(k): [float(r.passk[k - 1]) for r in rs] for k in ks}}
        paired = [(base[r.seed], r) for r in rs if r.seed in base]
        if g != 0.0 and len(paired) >= 2:
            for k in (1, ks[-1]):
                a = np.array([b.passk[k - 1] for b, _ in paired])
                b = np.array([r.passk[k - 1] for _, r in paired])
                diff = b - a
                p = p_value("ttest_rel", b, a)
                tests.append([f"{g:g} vs 0", f"pass@{k}", len(paired),
                              f"{100 * diff.mean():+.1f}", _p(p)])
                record["gammas"][f"{g:g}"][f"paired_pass@{k}"] = {
                    "mean_difference": float(diff.mean()), "p_value": float(p)}
    text = (f"F-GRPO against gamma ({at}, pass@k from "
            f"{n} samples a problem; mean ± std over seeds, %)\n" + _table(head, rows))
    if tests:
        text += ("\n\npaired t-test over seeds (same seed: same batches and sampling keys)\n" +
                 _table(["gammas", "metric", "pairs", "diff (points)", "p"], tests))
    return text, record


def method_summary(runs: list, group: str) -> tuple:
    """(text, record) of ESSA against F-GRPO under one budget: final accuracy over seeds."""
    by = {m: [r for r in runs if r.method == m] for m in ("essa", "fgrpo")}
    n = min(len(r.passk) for r in runs)
    ks = [k for k in SHOWN_K if k <= n]
    head = ["method", "seeds", "steps", "train s", "tokens", "greedy"] + \
        [f"pass@{k}" for k in ks]
    rows, record = [], {}
    starts = [r for r in runs if r.start_passk is not None]  # both methods' start evaluations
    if starts:  # of their one SFT start
        rows.append(["start", len(starts), "0", "0", "0k",
                     mean_spread([r.start_accuracy for r in starts])] +
                    [mean_spread([r.start_passk[k - 1] for r in starts]) for k in ks])
        record["start"] = {"runs": len(starts), "greedy": [r.start_accuracy for r in starts]}
    for m, rs in by.items():
        if not rs:
            continue
        rows.append([m, len(rs), f"{np.mean([r.steps for r in rs]):.0f}",
                     f"{np.mean([r.train_s for r in rs]):.0f}",
                     f"{np.mean([r.tokens for r in rs]) / 1e3:.0f}k",
                     mean_spread([r.accuracy for r in rs])] +
                    [mean_spread([r.passk[k - 1] for r in rs]) for k in ks])
        record[m] = {"seeds": [r.seed for r in rs], "steps": [r.steps for r in rs],
                     "train_s": [r.train_s for r in rs], "tokens": [r.tokens for r in rs],
                     "greedy": [r.accuracy for r in rs]}
    budget = "training time" if group == "wall" else "generated tokens"
    text = f"ESSA against F-GRPO at equal {budget} (mean ± std over seeds, %)\n" + \
        _table(head, rows)
    if all(len(by[m]) >= 2 for m in by):
        a, b = (np.array([r.accuracy for r in by[m]]) for m in ("essa", "fgrpo"))
        p = p_value("ttest_ind", b, a, equal_var=False)
        record["welch_greedy"] = {"fgrpo_minus_essa": float(b.mean() - a.mean()),
                                  "p_value": float(p)}
        text += (f"\nWelch t-test, greedy accuracy F-GRPO - ESSA: "
                 f"{100 * (b.mean() - a.mean()):+.1f} points, p = {_p(p)}")
    return text, record


def ci95(values) -> tuple:
    """(mean, half-width of the 95% Student-t confidence interval; NaN for one value)."""
    from scipy import stats  # here: see p_value

    v = np.asarray(values, dtype=np.float64)
    if len(v) < 2:
        return float(v.mean()), float("nan")
    return float(v.mean()), float(stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) /
                                  np.sqrt(len(v)))


def _ci_text(values) -> str:
    mean, half = ci95(100 * np.asarray(values, dtype=np.float64))
    return f"{mean:.1f}" + (f" ± {half:.1f}" if np.isfinite(half) else "")


def family_arms(runs: list) -> list:
    """[(algorithm, gamma, runs sorted by seed)] in the order grpo, dapo, cispo; plain first."""
    keys = sorted({(r.algorithm, r.gamma) for r in runs},
                  key=lambda a: (list(ALGORITHMS).index(a[0]), a[1]))
    return [(a, g, sorted((r for r in runs if (r.algorithm, r.gamma) == (a, g)),
                          key=lambda r: r.seed)) for a, g in keys]


def arm_name(algorithm: str, gamma: float) -> str:
    """A family arm's name in the tables: GRPO, F-GRPO (γ=1), ..."""
    return ("" if gamma == 0.0 else "F-") + ALGORITHMS[algorithm] + \
        ("" if gamma == 0.0 else f" (γ={gamma:g})")


def family_summary(runs: list, at: str = "final evaluation") -> tuple:
    """(text, record) of the paper's pairs: pass@k per arm with 95% CIs, paired tests; ``at``
    names the evaluation the runs are reported at."""
    n = min(len(r.passk) for r in runs)
    ks = [k for k in SHOWN_K if k <= n]
    head = ["arm", "seeds", "steps", "tokens", "greedy"] + [f"pass@{k}" for k in ks]
    rows, tests, record = [], [], {"n_samples": n, "k": ks, "arms": {}}
    arms = family_arms(runs)
    plain = {a: {r.seed: r for r in rs} for a, g, rs in arms if g == 0.0}
    starts = start_evaluations(runs)
    if starts:
        rows.append(["SFT start", len(starts), "0", "0", _ci_text([r.start_accuracy
                                                                   for r in starts])] +
                    [_ci_text([r.start_passk[k - 1] for r in starts]) for k in ks])
        record["start"] = {"seeds": [r.seed for r in starts],
                           "greedy": [r.start_accuracy for r in starts],
                           "pass_at_k": {str(k): [float(r.start_passk[k - 1]) for r in starts]
                                         for k in ks}}
    start = {r.seed: r for r in starts}
    gains = []
    for a, g, rs in arms:
        name = arm_name(a, g)
        rows.append([name, len(rs), f"{np.mean([r.steps for r in rs]):.0f}",
                     f"{np.mean([r.tokens for r in rs]) / 1e3:.1f}k",
                     _ci_text([r.accuracy for r in rs])] +
                    [_ci_text([r.passk[k - 1] for r in rs]) for k in ks])
        arm = record["arms"][f"{a}-g{g:g}"] = {
            "algorithm": a, "gamma": g, "seeds": [r.seed for r in rs],
            "num_iterations": [r.num_iterations for r in rs],
            "updates": [r.updates for r in rs],
            "steps": [r.steps for r in rs], "tokens": [r.tokens for r in rs],
            "greedy": [r.accuracy for r in rs],
            "pass_at_k": {str(k): [float(r.passk[k - 1]) for r in rs] for k in ks}}
        from_start = [(start[r.seed], r) for r in rs if r.seed in start]
        if len(from_start) >= 2:
            metrics = {"greedy": [r.accuracy - s.start_accuracy for s, r in from_start]} | {
                f"pass@{k}": [r.passk[k - 1] - s.start_passk[k - 1] for s, r in from_start]
                for k in ks}
            arm["over_start"] = {}
            for metric, diffs in metrics.items():
                mean, half = ci95(100 * np.asarray(diffs))
                arm["over_start"][metric] = {"mean_difference": mean / 100, "ci95": half / 100}
            gains.append([name, len(from_start)] + [
                f"{d['mean_difference'] * 100:+.1f} ± {d['ci95'] * 100:.1f}"
                for d in arm["over_start"].values()])
        paired = [(plain[a][r.seed], r) for r in rs if g != 0.0 and r.seed in plain.get(a, {})]
        if len(paired) < 2:
            continue
        for k in ks:
            base = np.array([b.passk[k - 1] for b, _ in paired])
            focal = np.array([r.passk[k - 1] for _, r in paired])
            mean, half = ci95(100 * (focal - base))
            p = p_value("ttest_rel", focal, base)
            tests.append([f"{name} - {ALGORITHMS[a]}", f"pass@{k}", len(paired),
                          f"{mean:+.1f} ± {half:.1f}", _p(p)])
            arm[f"paired_pass@{k}"] = {"mean_difference": float(mean / 100),
                                       "ci95": float(half / 100), "p_value": float(p)}
    text = (f"The F-GRPO paper's pairs at equal generated tokens ({at}, pass@k "
            f"from {n} samples a problem; mean ± 95% CI over seeds, %)\n" + _table(head, rows))
    if gains:
        text += ("\n\neach arm minus its SFT start (the same seed's start evaluation; ± 95% CI, "
                 "points)\n" + _table(["arm", "seeds", "greedy"] + [f"pass@{k}" for k in ks],
                                      gains))
    if tests:
        text += ("\n\npaired t-test over seeds, focal minus plain (same seed: same first "
                 "batches and sampling keys; ± 95% CI, points)\n" +
                 _table(["pair", "metric", "pairs", "diff", "p"], tests))
    return text, record


def summarize(root: str, checkpoint: str = "final") -> tuple:
    """(text, record, runs) of every group present under ``root``; ``checkpoint`` (one of
    :data:`CHECKPOINTS`) picks the evaluation the gamma and family groups' runs are reported
    at, and ``runs`` holds them at it."""
    if checkpoint not in CHECKPOINTS:
        raise UserError(f"--checkpoint is one of {', '.join(CHECKPOINTS)} (got {checkpoint!r})")
    runs = find_runs(root)
    parts, record = [], {}
    paper = checkpoint == "paper"
    at = "the paper's checkpoints" if paper else "final evaluation"
    if paper:
        parts.append(PAPER_RULE)
        record["checkpoint"] = {"rule": "paper", "text": PAPER_RULE}
        runs = dict(runs, **{g: choose_paper(runs[g]) for g in ("gamma", "family")})
    if runs["gamma"]:
        text, record["gamma"] = gamma_summary(runs["gamma"], at)
        if paper:
            gammas = sorted({r.gamma for r in runs["gamma"]})
            chosen, by = checkpoint_summary([
                (f"gamma {g:g}", f"{g:g}", sorted((r for r in runs["gamma"] if r.gamma == g),
                                                  key=lambda r: r.seed)) for g in gammas])
            text += "\n\n" + chosen
            for key, value in by.items():
                record["gamma"]["gammas"][key]["checkpoint"] = value
        parts.append(text)
    for group in ("wall", "tokens"):
        if runs[group]:
            text, record[group] = method_summary(runs[group], group)
            parts.append(text)
    if runs["family"]:
        text, record["family"] = family_summary(runs["family"], at)
        if paper:
            chosen, by = checkpoint_summary([(arm_name(a, g), f"{a}-g{g:g}", rs)
                                             for a, g, rs in family_arms(runs["family"])])
            text += "\n\n" + chosen
            for key, value in by.items():
                record["family"]["arms"][key]["checkpoint"] = value
        parts.append(text)
    return "\n\n".join(parts), record, runs


def provenance(runs: dict) -> dict:
    """What made the summary: this command, and the runs' commits, toy builds and machines
    (each a sorted list of the distinct values its run files record)."""
    files = [r for group in runs.values() for r in group]

    def distinct(name):
        return sorted({getattr(r, name) for r in files if getattr(r, name) is not None})

    return {"command": shlex.join(["hpc-report"] + sys.argv[1:]), "commit": distinct("commit"),
            "toy_build": distinct("toy_build") or None, "machine": distinct("machine")}


def _band(ax, x, ys, label, style="-"):
    ys = np.asarray(ys)
    line, = ax.plot(x, ys.mean(axis=0), style, label=f"{label} (n={len(ys)})")
    if len(ys) > 1:
        ax.fill_between(x, ys.min(axis=0), ys.max(axis=0), color=line.get_color(), alpha=0.2)


def draw(runs: dict, out_dir: str) -> list:
    """Write the plots of the groups present; returns their paths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    if runs["gamma"]:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        n = min(len(r.passk) for r in runs["gamma"])
        k = np.arange(1, n + 1)
        starts = [r.start_passk[:n] for r in start_evaluations(runs["gamma"])]
        if starts:
            _band(ax, k, starts, "SFT start", "--")
        for g in sorted({r.gamma for r in runs["gamma"]}):
            _band(ax, k, [r.passk[:n] for r in runs["gamma"] if r.gamma == g], f"gamma {g:g}")
        ax.set_xscale("log", base=2)
        ax.set(xlabel="k (samples a problem)", ylabel="pass@k (held-out)",
               title="F-GRPO: pass@k against gamma (band: min-max over seeds)")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(_save(fig, plt, out_dir, "passk_vs_gamma.png"))
    for group, (x_key, label, name) in CURVES.items():
        if not runs[group]:
            continue
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m in ("essa", "fgrpo"):
            rs = [r for r in runs[group] if r.method == m]
            if not rs:
                continue
            grid = np.linspace(0, min(r.curve[x_key][-1] for r in rs), 50)
            _band(ax, grid, [np.interp(grid, r.curve[x_key], r.curve["accuracy"])
                             for r in rs], m)
        ax.set(xlabel=label, ylabel="held-out greedy accuracy",
               title=f"ESSA vs F-GRPO, equal {'training time' if group == 'wall' else 'tokens'}"
               " (band: min-max over seeds)")
        ax.grid(alpha=0.3)
        ax.legend()
        paths.append(_save(fig, plt, out_dir, name))
    if runs["family"]:
        paths.append(draw_family(runs["family"], plt, out_dir))
    return paths


def draw_family(runs: list, plt, out_dir: str) -> str:
    """``passk_family.png``: a panel per algorithm, pass@k of each arm with its 95% CI band,
    and the SFT start's mean (dashed) where the runs evaluated it."""
    n = min(len(r.passk) for r in runs)
    k = np.arange(1, n + 1)
    arms = family_arms(runs)
    algos = list(dict.fromkeys(a for a, _, _ in arms))
    starts = start_evaluations(runs)
    fig, axes = plt.subplots(1, len(algos), figsize=(4.5 * len(algos), 4), squeeze=False,
                             sharey=True)
    for ax, algo in zip(axes[0], algos):
        if starts:
            ax.plot(k, np.mean([r.start_passk[:n] for r in starts], axis=0), "--", color="grey",
                    label=f"SFT start (n={len(starts)})")
        for a, g, rs in arms:
            if a != algo:
                continue
            curves = np.array([r.passk[:n] for r in rs])
            mean, half = zip(*(ci95(curves[:, j]) for j in range(n)))
            label = (ALGORITHMS[a] if g == 0.0 else f"F-{ALGORITHMS[a]} (γ={g:g})") + \
                f" (n={len(rs)})"
            line, = ax.plot(k, mean, label=label)
            if len(rs) > 1:
                ax.fill_between(k, np.subtract(mean, half), np.add(mean, half),
                                color=line.get_color(), alpha=0.2)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="k (samples a problem)", title=ALGORITHMS[algo])
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("pass@k (held-out), 95% CI over seeds")
    return _save(fig, plt, out_dir, "passk_family.png")


def _save(fig, plt, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_arguments(parser) -> None:
    """The options of ``hpc-report reproduce`` that this module defines."""
    parser.add_argument("--checkpoint", choices=CHECKPOINTS, default="final",
                        help="the evaluation each run of the gamma and family groups is "
                        "reported at: final (default), or paper: per seed pair the plain "
                        "run's best pass@1, then the focal run's best at no more compute "
                        "(generated tokens) than that one")


def main(args) -> None:
    """``hpc-report reproduce``: print the summary, write its JSON and plots if asked."""
    text, record, runs = summarize(args.root, getattr(args, "checkpoint", "final"))
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(record, provenance=provenance(runs)), f, indent=1)
        print(f"json: {args.json}")
    if args.plots:
        for path in draw(runs, args.plots):
            print(f"plot: {path}")

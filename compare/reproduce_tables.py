"""The tables and tests of the papers' reproduction experiment (:mod:`compare.reproduce`):
pass@k against gamma with paired t-tests (:func:`gamma_summary`), ESSA against F-GRPO at one
budget with Welch's t-test (:func:`method_summary`), the F-GRPO paper's plain and focal pairs
with 95% confidence intervals and paired t-tests (:func:`family_summary`), and the
checkpoints ``--checkpoint paper`` chose (:func:`checkpoint_summary`). Each returns (text,
record): the table as printed and its values per seed for the JSON.
"""
from __future__ import annotations

import collections
import warnings

import numpy as np

ALGORITHMS = {"grpo": "GRPO", "dapo": "DAPO", "cispo": "CISPO"}
SHOWN_K = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # pass@k columns of the tables, where k <= n


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

"""The plots of the papers' reproduction experiment (:mod:`compare.reproduce`,
``hpc-report reproduce --plots DIR``): :data:`PLOTS`, each drawn where its group has runs.
"""
from __future__ import annotations

import os

import numpy as np

from compare.reproduce_tables import ALGORITHMS, ci95, family_arms, start_evaluations

PLOTS = ("passk_vs_gamma.png", "accuracy_vs_train_time.png", "accuracy_vs_tokens.png",
         "passk_family.png")
# per budget group: (x column of the held-out rows, axis label, plot file)
CURVES = {"wall": ("train_s", "training seconds (wall less evaluations)",
                   "accuracy_vs_train_time.png"),
          "tokens": ("generated_tokens", "generated completion tokens (all ranks)",
                     "accuracy_vs_tokens.png")}


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

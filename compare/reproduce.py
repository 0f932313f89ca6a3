"""Summary of the papers' reproduction experiment (``jobscripts/reproduce.sh``): the
``reproduce`` subcommand of ``hpc-report`` (:mod:`compare.report`). Its run files are read by
:mod:`compare.reproduce_runs`, tabled and tested by :mod:`compare.reproduce_tables`, drawn by
:mod:`compare.reproduce_plots`.

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
(:mod:`tools.docs.pages`) can name them.
"""
from __future__ import annotations

import json
import shlex
import sys

from compare.reproduce_plots import PLOTS, draw
from compare.reproduce_runs import PAPER_RULE, choose_paper, find_runs
from compare.reproduce_tables import (arm_name, checkpoint_summary, family_arms, family_summary,
                                      gamma_summary, method_summary)
from hpc.runtime.errors import UserError

CHECKPOINTS = ("final", "paper")  # --checkpoint: which evaluation of each run is reported


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


def add_command(sub) -> None:
    """The ``reproduce`` subcommand, its arguments and options, on ``hpc-report``'s
    subparsers ``sub``."""
    parser = sub.add_parser("reproduce", help="the papers' reproduction experiment "
                            "(jobscripts/reproduce.sh): pass@k against gamma, ESSA against "
                            "F-GRPO at equal time and tokens; tests and plots")
    parser.add_argument("root", help="the experiment's folder (OUT of reproduce.sh)")
    parser.add_argument("--plots", metavar="DIR", help="write " + ", ".join(PLOTS))
    parser.add_argument("--json", metavar="OUT.json", help="write every figure as JSON")
    parser.add_argument("--checkpoint", choices=CHECKPOINTS, default="final",
                        help="the evaluation each run of the gamma and family groups is "
                        "reported at: final (default), or paper: per seed pair the plain "
                        "run's best pass@1, then the focal run's best at no more compute "
                        "(generated tokens) than that one")


def main(args) -> None:
    """``hpc-report reproduce``: print the summary, write its JSON and plots if asked."""
    text, record, runs = summarize(args.root, args.checkpoint)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(record, provenance=provenance(runs)), f, indent=1)
        print(f"json: {args.json}")
    if args.plots:
        for path in draw(runs, args.plots):
            print(f"plot: {path}")

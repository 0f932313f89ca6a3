"""The papers' reproduction experiment: a miniature of jobscripts/reproduce.sh end to end (real
mpirun on one rank: what is tested here is the experiment's wiring, rank invariance is
tests/test_essa.py's and tests/test_fgrpo.py's; one seed, few steps, k up to 8), and the
summary's statistics on known numbers."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from conftest import REPO
from compare.reproduce_plots import PLOTS
from compare.reproduce_tables import gamma_summary, method_summary
from hpc.runtime.runstore import RunFile
from hpc.toys import TOY_VERSION

TOKENS = 3000
MINI = {"SEEDS": "0", "GAMMAS": "0 1", "STEPS": "2", "SAMPLES": "8", "N_EVAL": "8",
        "METHOD_EVAL": "8", "TRAIN_S": "1", "TOKENS": str(TOKENS), "ESSA_EVERY": "1",
        "FGRPO_EVERY": "2", "ESSA_EVERY_T": "1", "FGRPO_EVERY_T": "2",
        "FAMILY_TOKENS": "300", "FAMILY_EVAL": "8", "FAMILY_SAMPLES": "8", "RANKS": "1",
        # every algorithm runs the same lines of the script; the family table's pairing of
        # every algorithm is test_family_table_has_cis_and_pairs_each_focal_arm_with_its_plain_one's
        "FAMILY_ALGORITHMS": "grpo"}


@pytest.mark.mpi  # reproduce.sh starts its jobs under mpirun
@pytest.mark.toy
@pytest.mark.slow
def test_miniature_experiment_writes_runs_summary_and_plots(tmp_path):
    out = tmp_path / "rep"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable, **MINI)
    proc = subprocess.run(["bash", "jobscripts/reproduce.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for gamma in ("0", "1"):
        run = RunFile(str(out / "gamma" / f"g{gamma}-s0" / "fgrpo.h5"))
        assert run.attrs["status"] == "complete"
        assert run.group("metrics")["step"].tolist() == [1, 2]
        assert run.group("eval")["pass_at_k"].shape == (2, 8)  # start and end, k = 1..8
    for method in ("essa", "fgrpo"):
        timed = RunFile(str(out / "wall" / f"{method}-s0" / f"{method}.h5")).group("metrics")
        assert timed["train_s"][-1] >= 1.0 and (len(timed["step"]) == 1 or timed["train_s"][-2] < 1.0)
        tokens = RunFile(str(out / "tokens" / f"{method}-s0" / f"{method}.h5")) \
            .group("metrics")["generated_tokens"]
        assert tokens[-1] >= TOKENS and (len(tokens) == 1 or tokens[-2] < TOKENS)
    summary = json.loads((out / "summary.json").read_text())
    assert sorted(summary) == ["family", "gamma", "provenance", "tokens", "wall"]
    made = summary["provenance"]  # what tools.docs.pages names beside a quoted table
    assert made["command"].startswith("hpc-report reproduce ")
    assert [build.split()[0] for build in made["toy_build"]] == [TOY_VERSION]
    assert made["commit"] and made["machine"]
    # FAMILY_ITERATIONS and FAMILY_MINI_BATCH: every arm the same epochs and updates a batch;
    # the focal arm at the preset's gamma (the paper's 0.5 for GRPO) and clip 0.2 / 0.2, over
    # the demo config's gamma 1 and clip-higher
    assert {arm["num_iterations"][0] for arm in summary["family"]["arms"].values()} == {1}
    assert {arm["updates"][0] for arm in summary["family"]["arms"].values()} == {4}
    assert sorted(summary["family"]["arms"]) == ["grpo-g0", "grpo-g0.5"]
    run = RunFile(str(out / "family" / "grpo-g0.5-s0" / "fgrpo.h5"))
    for line in ("algorithm: grpo", "num_iterations: 1", "mini_batch_prompts: 8",
                 "epsilon_high: 0.2\n", "gamma: 0.5"):
        assert line in run.attrs["config"], line
    assert run.group("metrics")["updates"].tolist()[0] == 4
    assert run.group("metrics")["generated_tokens"][-1] >= 300
    assert summary["gamma"]["k"] == [1, 2, 4, 8]
    assert sorted(summary["gamma"]["gammas"]) == ["0", "1"]
    assert all(len(v) == 1 for v in summary["gamma"]["gammas"]["1"]["pass_at_k"].values())
    for group in ("wall", "tokens"):
        assert summary[group]["essa"]["seeds"] == summary[group]["fgrpo"]["seeds"] == [0]
    text = (out / "summary.txt").read_text()
    assert "F-GRPO against gamma" in text and "equal generated tokens" in text
    assert all((out / "plots" / name).stat().st_size > 0 for name in PLOTS)
    assert "GRPO/ESSA" in (out / "scaling.txt").read_text()


def _run(seed, accuracy, passk, method="fgrpo", gamma=0.0):
    return SimpleNamespace(seed=seed, gamma=gamma, method=method, accuracy=accuracy,
                           passk=np.asarray(passk), start_passk=None, start_accuracy=0.5,
                           steps=10, train_s=5.0, tokens=1000, num_iterations=1, updates=1)


def test_gamma_table_pairs_seeds_and_tests_each_gamma_against_zero():
    base = [_run(s, 0.6, [p, 0.9]) for s, p in ((0, 0.50), (1, 0.55), (2, 0.52))]
    focal = [_run(s, 0.6, [p, 0.95], gamma=1.0) for s, p in ((2, 0.56), (0, 0.51), (1, 0.58))]
    text, record = gamma_summary(base + focal)
    paired = record["gammas"]["1"]["paired_pass@1"]
    want = stats.ttest_rel([0.51, 0.58, 0.56], [0.50, 0.55, 0.52])  # paired by seed, not order
    assert paired["p_value"] == pytest.approx(want.pvalue)
    assert paired["mean_difference"] == pytest.approx(np.mean([0.01, 0.03, 0.04]))
    assert record["gammas"]["1"]["paired_pass@2"]["mean_difference"] == pytest.approx(0.05)
    assert "1 vs 0" in text and "52.3 ± 2.5" in text


def test_method_table_uses_welch_t_test():
    essa = [_run(s, a, [0.5], "essa") for s, a in ((0, 0.70), (1, 0.72), (2, 0.69))]
    fgrpo = [_run(s, a, [0.6]) for s, a in ((0, 0.80), (1, 0.85), (2, 0.90))]
    for r in essa + fgrpo:
        r.start_passk = np.asarray([0.4])  # the SFT start's evaluation, in every run
    text, record = method_summary(essa + fgrpo, "tokens")
    want = stats.ttest_ind([0.80, 0.85, 0.90], [0.70, 0.72, 0.69], equal_var=False)
    assert record["welch_greedy"]["p_value"] == pytest.approx(want.pvalue)
    assert "equal generated tokens" in text and "Welch" in text
    assert record["start"]["greedy"] == [0.5] * 6  # _run's start evaluation, every run's
    assert text.splitlines()[2].split()[:2] == ["start", "6"]


def test_family_table_has_cis_and_pairs_each_focal_arm_with_its_plain_one():
    """Three seeds per arm: pass@k mean ± the Student-t 95% half-width, and a paired t-test
    of F-X against X by seed (scipy's ttest_rel), for each algorithm present."""
    from compare.reproduce_tables import family_summary
    runs = []
    for algo, shift in (("grpo", 0.0), ("dapo", 0.1)):
        for gamma, gain in ((0.0, 0.0), (1.0, 0.05)):
            for seed, noise in ((0, 0.00), (1, 0.02), (2, -0.01)):
                r = _run(seed, 0.5, [0.3 + shift + noise + gain, 0.6 + shift + gain + noise / 2])
                r.algorithm, r.gamma = algo, gamma
                runs.append(r)
    text, record = family_summary(runs)
    assert "F-DAPO (γ=1)" in text and "F-GRPO (γ=1) - GRPO" in text
    plain = [0.30, 0.32, 0.29]
    half = stats.t.ppf(0.975, 2) * np.std(plain, ddof=1) / np.sqrt(3)
    assert f"{100 * np.mean(plain):.1f} ± {100 * half:.1f}" in text
    pair = record["arms"]["dapo-g1"]["paired_pass@1"]
    assert pair["mean_difference"] == pytest.approx(0.05)
    assert np.isnan(pair["p_value"]) or pair["p_value"] < 1e-6  # a constant gain
    assert record["arms"]["grpo-g0"]["seeds"] == [0, 1, 2]
    assert record["arms"]["grpo-g0"]["num_iterations"] == [1, 1, 1]  # passes a batch, by seed


def test_family_states_each_arms_change_over_its_own_seeds_sft_start():
    """Each arm minus the start evaluation of the same seed (not the mean start): the mean
    and the Student-t 95% half-width of those differences, in the text and the record."""
    from compare.reproduce_tables import family_summary
    runs = []
    for seed, start, end in ((0, 0.40, 0.50), (1, 0.30, 0.36), (2, 0.35, 0.47)):
        r = _run(seed, 0.6, [end, 0.9])
        r.algorithm, r.start_passk, r.start_accuracy = "grpo", np.array([start, 0.8]), 0.55
        runs.append(r)
    text, record = family_summary(runs)
    gains = 100 * np.array([0.10, 0.06, 0.12])
    half = stats.t.ppf(0.975, 2) * np.std(gains, ddof=1) / np.sqrt(3)
    over = record["arms"]["grpo-g0"]["over_start"]
    assert over["pass@1"]["mean_difference"] == pytest.approx(gains.mean() / 100)
    assert over["pass@1"]["ci95"] == pytest.approx(half / 100)
    assert over["pass@2"]["mean_difference"] == pytest.approx(0.1)
    assert over["greedy"]["mean_difference"] == pytest.approx(0.05)
    assert "each arm minus its SFT start" in text and f"+{gains.mean():.1f} ± {half:.1f}" in text

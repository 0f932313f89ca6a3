"""``hpc-report reproduce --checkpoint paper``: the F-GRPO paper's checkpoint choice per seed
pair (the plain run's best pass@1, then the focal run's best at no more generated tokens),
on small run files written with known pass@1 curves; no training job."""
import json

import numpy as np
import pytest

from compare import reproduce
from compare.report import main as report_main
from compare.reproduce_runs import PAPER_RULE, Evaluation, Run, choose_paper
from hpc.runtime.runstore import RunStore

CONFIG = "run:\n  seed: {seed}\nfgrpo:\n  algorithm: {algorithm}\n  advantage:\n" \
         "    gamma: {gamma}\n"


def write_run(path, seed=0, gamma=0.0, algorithm="grpo", steps=8, every=2, curve=None,
              final=0.5, tokens_a_step=100, periodic="pass@k", full_at=()):
    """A complete F-GRPO run file as the job loop writes it: ``steps`` steps of
    ``tokens_a_step`` generated tokens each; a held-out row every ``every`` steps whose pass@1
    is ``curve[step]`` (``periodic``: 'pass@k' stores pass_at_k in it, 'greedy' greedy
    accuracy alone, None none but the last step's, which the loop writes at any eval.every);
    a full evaluation (group eval) at the start, at each step of ``full_at`` (pass@1
    ``curve[step]``) and at the last step (pass@1 ``final``).
    pass@2 is pass@1 + 0.1 throughout, greedy accuracy pass@1 + 0.2."""
    path.parent.mkdir(parents=True, exist_ok=True)
    store = RunStore(str(path), active=True, attrs={
        "method": "fgrpo", "world_size": 1, "heldout_accuracy": "accuracy",
        "config": CONFIG.format(seed=seed, gamma=gamma, algorithm=algorithm)})

    def full(step, p):
        store.write_row("eval", step, accuracy=p + 0.2, pass_at_k=[p, p + 0.1], avg_at_n=p,
                        seconds=1.0)

    full(-1, 0.1)
    for step in range(1, steps + 1):
        tokens = tokens_a_step * step
        if periodic and step % every == 0 or step == steps:
            p = curve[step] if step < steps else final
            extra = {"pass_at_k": [p, p + 0.1]} if periodic == "pass@k" else {}
            store.write_row("heldout", step, flush=False, accuracy=p + 0.2, train_s=float(step),
                            wall_s=float(step), generated_tokens=tokens, **extra)
        store.log_step(step, metrics={"loss": 0.0, "train_s": float(step),
                                      "generated_tokens": tokens})
        if step in full_at:
            full(step, curve[step])
    full(steps, final)
    store.close()
    return Run(str(path))


def by_gamma(runs):
    return {r.gamma: r for r in choose_paper(runs)}


def test_plain_run_at_its_best_pass1_focal_at_its_best_within_the_plain_ones_tokens(tmp_path):
    """The plain run peaks at step 4 (400 tokens). The focal run generates 60 tokens a step,
    so its step 6 (360 tokens) is within the plain run's compute and is chosen although it is a
    later step; its step 8 (480 tokens, the final, the higher pass@1) is not."""
    plain = write_run(tmp_path / "p.h5", curve={2: 0.3, 4: 0.5, 6: 0.4}, final=0.45)
    focal = write_run(tmp_path / "f.h5", gamma=1.0, tokens_a_step=60,
                      curve={2: 0.35, 4: 0.4, 6: 0.6}, final=0.7)
    chosen = by_gamma([plain, focal])
    p, f = chosen[0.0], chosen[1.0]
    assert (p.steps, p.tokens, p.passk[0], p.accuracy) == (4, 400, 0.5, pytest.approx(0.7))
    assert p.checkpoint["how"] == "highest pass@1" and p.checkpoint["measure"] == "tokens"
    assert (f.steps, f.tokens, f.passk[0]) == (6, 360, 0.6)
    assert f.passk[1] == pytest.approx(0.7)  # the whole pass@k curve of that evaluation
    assert f.checkpoint["how"] == "highest pass@1 at <= the plain one's tokens"
    # the runs themselves still hold their final evaluation (what --checkpoint final reports)
    assert (plain.steps, plain.passk[0], focal.steps, focal.passk[0]) == (8, 0.45, 8, 0.7)


def test_equal_pass1_goes_to_the_earliest_and_equal_tokens_are_within(tmp_path):
    plain = write_run(tmp_path / "p.h5", curve={2: 0.5, 4: 0.5, 6: 0.2}, final=0.5)
    # the focal run's step 2 has exactly the plain one's 200 tokens; 4 (400) is above them
    focal = write_run(tmp_path / "f.h5", gamma=1.0, curve={2: 0.4, 4: 0.9, 6: 0.9}, final=0.9)
    chosen = by_gamma([plain, focal])
    assert (chosen[0.0].steps, chosen[0.0].tokens) == (2, 200)  # 0.5 at 2, 4 and 8: the first
    assert (chosen[1.0].steps, chosen[1.0].passk[0]) == (2, 0.4)
    ties = write_run(tmp_path / "t.h5", gamma=2.0, tokens_a_step=50,  # 4: 200 tokens, 0.4 too
                     curve={2: 0.4, 4: 0.4, 6: 0.9}, final=0.9)
    assert by_gamma([plain, ties])[2.0].steps == 2


def test_full_evaluations_before_the_last_step_are_candidates_too(tmp_path):
    """Group eval rows at steps before the last (full evaluations along the way) count as
    periodic evaluations, with the tokens group metrics logged at their step."""
    plain = write_run(tmp_path / "p.h5", periodic=None, full_at=(3, 5), curve={3: 0.6, 5: 0.4},
                      final=0.5)
    assert [e.step for e in plain.evaluations] == [3, 5, 8] and plain.no_periodic == ""
    p = by_gamma([plain])[0.0]
    assert (p.steps, p.tokens, p.passk[0]) == (3, 300, 0.6)


@pytest.mark.parametrize("periodic, note", [
    (None, "no periodic evaluations"),
    ("greedy", "periodic evaluations without pass@k (greedy accuracy alone)")])
def test_runs_without_periodic_pass_at_k_stay_at_their_final_evaluation(tmp_path, periodic, note):
    """Greedy held-out rows (what eval.every writes today) are not evaluations the rule can
    report: a run with only those, or none, is reported at its final evaluation, and says so."""
    plain = write_run(tmp_path / "p.h5", periodic=periodic, curve={2: 0.9, 4: 0.9, 6: 0.9},
                      final=0.5)
    focal = write_run(tmp_path / "f.h5", gamma=1.0, tokens_a_step=110, periodic=periodic,
                      curve={2: 0.9, 4: 0.9, 6: 0.9}, final=0.4)
    chosen = by_gamma([plain, focal])
    assert (chosen[0.0].steps, chosen[0.0].passk[0]) == (8, 0.5)
    assert chosen[0.0].checkpoint["how"] == f"final: {note}"
    # 880 tokens against the plain run's 800: said, not hidden
    assert (chosen[1.0].steps, chosen[1.0].passk[0], chosen[1.0].tokens) == (8, 0.4, 880)
    assert chosen[1.0].checkpoint["how"] == f"final: {note}, above the plain one's tokens"


def _bare(seed, gamma, points, algorithm="grpo", tokens=True):
    """A Run-like object with evaluations (step, pass@1) and tokens 100 a step (or none)."""
    evals = [Evaluation(s, 100.0 * s if tokens else None, np.array([p, p]), p, i == len(points) - 1)
             for i, (s, p) in enumerate(points)]
    run = Run.__new__(Run)
    run.seed, run.gamma, run.algorithm, run.evaluations = seed, gamma, algorithm, evals
    run.no_periodic = "" if len(evals) > 1 else "no periodic evaluations"
    run.passk, run.accuracy, run.steps, run.tokens = evals[-1].passk, 0.0, evals[-1].step, 0
    return run


def test_pairs_are_by_algorithm_and_seed_and_steps_stand_in_for_missing_tokens():
    runs = [_bare(0, 0.0, [(2, 0.5), (4, 0.2)]), _bare(1, 0.0, [(2, 0.1), (4, 0.6)]),
            _bare(0, 0.0, [(2, 0.1), (4, 0.6)], "dapo"),
            _bare(0, 1.0, [(2, 0.3), (4, 0.9)]), _bare(1, 1.0, [(2, 0.3), (4, 0.9)]),
            _bare(0, 1.0, [(2, 0.3), (4, 0.9)], "dapo"),
            _bare(2, 1.0, [(2, 0.3), (4, 0.9)]),  # no plain run of seed 2
            _bare(1, 2.0, [(2, 0.3), (3, 0.8), (5, 0.9)], tokens=False)]
    chosen = [r.checkpoint for r in choose_paper(runs)]
    assert [c["step"] for c in chosen] == [2, 4, 4, 2, 4, 4, 4, 3]
    assert chosen[6]["how"] == "final: no plain run of its seed"
    assert chosen[7]["measure"] == "steps" and chosen[4]["measure"] == "tokens"


def test_a_focal_run_with_nothing_within_the_plain_compute_is_at_its_first_evaluation():
    runs = [_bare(0, 0.0, [(2, 0.5), (4, 0.2)]), _bare(0, 1.0, [(3, 0.3), (4, 0.9)])]
    focal = choose_paper(runs)[1].checkpoint
    assert (focal["step"], focal["how"]) == (3, "first: none at <= the plain one's tokens")


def test_command_states_the_rule_and_the_chosen_checkpoints_and_final_stays_as_it_was(
        tmp_path, capsys):
    root = tmp_path / "rep"
    for seed, (peak, rate) in enumerate(((4, 60), (6, 70))):  # plain peak, focal tokens a step
        write_run(root / "family" / f"grpo-g0-s{seed}" / "fgrpo.h5", seed=seed,
                  curve={2: 0.3, 4: 0.5 if peak == 4 else 0.3, 6: 0.5 if peak == 6 else 0.4},
                  final=0.45)
        write_run(root / "family" / f"grpo-g1-s{seed}" / "fgrpo.h5", seed=seed, gamma=1.0,
                  tokens_a_step=rate, curve={2: 0.35, 4: 0.4, 6: 0.6}, final=0.7)
    out = tmp_path / "paper.json"
    report_main(["reproduce", str(root), "--checkpoint", "paper", "--json", str(out)])
    text = capsys.readouterr().out
    assert text.splitlines()[0] == PAPER_RULE
    assert "pairs at equal generated tokens (the paper's checkpoints," in text
    assert "chosen checkpoints (mean over seeds" in text
    record = json.loads(out.read_text())
    assert record["checkpoint"] == {"rule": "paper", "text": PAPER_RULE}
    # plain: step 4 (400 tokens) and step 6 (600); focal at 60 and 70 tokens a step: its
    # step 6 (360 <= 400), and its final, step 8 (560 <= 600)
    plain, focal = (record["family"]["arms"][k] for k in ("grpo-g0", "grpo-g1"))
    assert plain["checkpoint"]["step"] == [4, 6] and plain["checkpoint"]["tokens"] == [400, 600]
    assert focal["checkpoint"]["step"] == [6, 8] and focal["checkpoint"]["tokens"] == [360, 560]
    assert focal["pass_at_k"]["1"] == [0.6, 0.7] and plain["steps"] == [4, 6]
    row = next(line for line in text.splitlines() if line.strip().startswith("F-GRPO (γ=1)")
               and "highest pass@1" in line)
    assert "7.0" in row and "0.5k" in row  # mean step (6 + 8) / 2, tokens (360 + 560) / 2
    report_main(["reproduce", str(root), "--json", str(tmp_path / "final.json")])
    text = capsys.readouterr().out
    final = json.loads((tmp_path / "final.json").read_text())
    assert "checkpoint" not in final and "checkpoint" not in final["family"]["arms"]["grpo-g0"]
    assert final["family"]["arms"]["grpo-g1"]["steps"] == [8, 8]
    assert final["family"]["arms"]["grpo-g1"]["pass_at_k"]["1"] == [0.7, 0.7]
    assert PAPER_RULE not in text and "chosen checkpoints" not in text
    assert "(final evaluation, pass@k" in text


def test_an_unknown_rule_is_one_line(tmp_path):
    with pytest.raises(reproduce.UserError, match="--checkpoint is one of final, paper"):
        reproduce.summarize(str(tmp_path), "best")


"""CISPO's loss -sg(clip(rho, 1 - eps_low, 1 + eps_high)) * A * log pi against the formula in
Python floats: values and gradients for every aggregation, with and without the KL term."""
import math

import pytest
import torch

from fgrpo.loss import LOSS_TYPES, policy_loss
from fgrpo.surrogates.cispo import CISPO
from fgrpo.surrogates.clip import Clip
from test_fgrpo_loss import DELTA, MASK, REF_GAP, tensors

ADV = [0.7, -0.7, 0.3, -0.3]
SURROGATES = {"clip": Clip, "cispo": CISPO}
EPS_LOW, EPS_HIGH = 0.2, 0.28  # delta = +-0.5 and +0.4, -0.4 leave [0.8, 1.28]: clipped


def hand_cispo(logp, loss_type, beta, max_len=3):
    """(loss, d loss / d logp as nested lists): per token -w A logp + beta k3, w the clipped
    ratio as a constant; aggregated by ``loss_type`` (the weight of each token in the mean)."""
    rows = [[t for t in range(3) if MASK[b][t]] for b in range(4)]
    n_tokens = sum(len(r) for r in rows)
    loss, grad = 0.0, [[0.0] * 3 for _ in range(4)]
    for b, valid in enumerate(rows):
        for t in valid:
            w = min(max(math.exp(DELTA[b][t]), 1.0 - EPS_LOW), 1.0 + EPS_HIGH)
            gap = REF_GAP[b][t]
            term = -w * ADV[b] * logp[b][t] + beta * (math.exp(gap) - gap - 1.0)
            d_term = -w * ADV[b] + beta * (1.0 - math.exp(gap))  # d k3 / d logp = 1 - e^gap
            scale = {"token-mean": 1.0 / n_tokens,
                     "seq-mean-token-mean": 1.0 / (4 * len(valid)),
                     "seq-mean-token-sum": 1.0 / 4,
                     "seq-mean-token-sum-norm": 1.0 / (4 * max_len)}[loss_type]
            loss += scale * term
            grad[b][t] = scale * d_term
    return loss, grad


@pytest.mark.parametrize("beta", [0.0, 0.1])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_cispo_loss_and_gradient_equal_the_formula(loss_type, beta):
    logp, old, ref, mask = tensors()
    loss, stats = policy_loss(logp, old, torch.tensor(ADV), mask, loss_type,
                              CISPO(EPS_LOW, EPS_HIGH), beta, ref if beta else None,
                              max_completion_length=3)
    loss.backward()
    want_loss, want_grad = hand_cispo(logp.detach().tolist(), loss_type, beta)
    assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-6, abs=1e-6)
    torch.testing.assert_close(logp.grad, torch.tensor(want_grad), rtol=1e-6, atol=1e-6)
    clipped = [(b, t) for b in range(4) for t in range(3) if MASK[b][t]
               and not 1 - EPS_LOW <= math.exp(DELTA[b][t]) <= 1 + EPS_HIGH]
    assert stats["clip_fraction"] == pytest.approx(len(clipped) / 10)


def test_clipped_and_unclipped_tokens_both_carry_gradient():
    """The clip surrogate drops the gradient of a token its clip acts on; CISPO keeps it,
    scaled by the clipped weight: tokens (0, 0) (ratio e^0.5 > 1.28, A > 0), (1, 1) (e^-0.3 =
    0.74 < 0.8, A < 0) and (3, 0) (e^-0.4, A < 0) are clipped, (0, 2) and (2, 1) are not."""
    grads = {}
    for surrogate in ("clip", "cispo"):
        logp, old, _, mask = tensors()
        loss, _ = policy_loss(logp, old, torch.tensor(ADV), mask, "token-mean",
                              SURROGATES[surrogate](EPS_LOW, EPS_HIGH))
        loss.backward()
        grads[surrogate] = logp.grad
    for b, t in ((0, 0), (1, 1), (3, 0)):  # clipped
        assert grads["clip"][b, t] == 0.0
        assert grads["cispo"][b, t] == pytest.approx(-(1 + EPS_HIGH if DELTA[b][t] > 0 else
                                                       1 - EPS_LOW) * ADV[b] / 10, rel=1e-6)
    for b, t in ((0, 2), (2, 1)):  # inside the clip: both have -rho * A / N (cispo: -w A / N)
        assert grads["cispo"][b, t] != 0.0 and grads["clip"][b, t] != 0.0
        assert grads["cispo"][b, t] == pytest.approx(float(grads["clip"][b, t]), rel=1e-6)
    assert grads["cispo"][2, 2] == 0.0  # padding


def test_at_ratio_one_cispo_has_the_clip_surrogates_gradient():
    """mu = 1: old = logp, rho = 1, both gradients are -A / N per token."""
    logp, _, _, mask = tensors()
    grads = []
    for surrogate in ("clip", "cispo"):
        x = logp.detach().clone().requires_grad_()
        policy_loss(x, x.detach(), torch.tensor(ADV), mask, "seq-mean-token-mean",
                    SURROGATES[surrogate](EPS_LOW, EPS_HIGH))[0].backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-7)


def test_cispo_has_no_dual_clip():
    """CISPO has no dual-clip key: fgrpo.loss.clip.ratio_c is the clip surrogate's own, and
    under cispo the loss reads only fgrpo.loss.cispo."""
    import dataclasses

    from fgrpo.config import FGRPOJobConfig
    from fgrpo.surrogates import from_config
    from hpc.runtime.config import load_config

    assert [f.name for f in dataclasses.fields(CISPO)] == ["epsilon_low", "epsilon_high"]
    loss = load_config(FGRPOJobConfig, None, ["fgrpo.loss.surrogate=cispo",
                                              "fgrpo.loss.clip.ratio_c=3"]).fgrpo.loss
    assert from_config(loss) == CISPO()


# ---------------------------------------------------------------- fgrpo.algorithm presets

def test_presets_resolve_and_given_keys_win():
    from fgrpo.config import FGRPOJobConfig
    from hpc.runtime.config import config_to_yaml, load_config
    f = load_config(FGRPOJobConfig, None, ["fgrpo.algorithm=dapo",
                                           "task.max_new_tokens=20"]).fgrpo
    assert (f.loss.surrogate, f.loss.aggregation, f.loss.clip.epsilon, f.loss.clip.epsilon_high,
            f.sampling.dynamic_sampling, f.sampling.max_refills, f.reward.overlong_buffer) == \
        ("clip", "token-mean", 0.2, 0.28, True, 9, 4)
    f = load_config(FGRPOJobConfig, None, ["fgrpo.algorithm=cispo"]).fgrpo
    assert (f.loss.surrogate, f.loss.cispo.epsilon_low, f.loss.cispo.epsilon_high,
            f.sampling.dynamic_sampling) == ("cispo", 1.0, 5.0, False)
    cfg = load_config(FGRPOJobConfig, None, ["fgrpo.algorithm=dapo",
                                             "fgrpo.sampling.max_refills=2",
                                             "fgrpo.reward.overlong_buffer=0",
                                             "fgrpo.sampling.dynamic_sampling=false"])
    f = cfg.fgrpo
    assert (f.sampling.max_refills, f.reward.overlong_buffer, f.sampling.dynamic_sampling) == \
        (2, 0, False)
    # the run file's config holds the resolved values; loading it back gives the same config
    text = config_to_yaml(cfg)
    assert "dynamic_sampling: false" in text and "algorithm: dapo" in text
    default = load_config(FGRPOJobConfig, None, []).fgrpo
    assert (default.algorithm, default.loss.surrogate, default.sampling.dynamic_sampling) == \
        ("grpo", "clip", False)


def test_presets_hold_the_f_grpo_papers_values():
    """Tables 5 and 7 of the F-GRPO paper: GRPO clip 0.2 / 0.2, DAPO 0.2 / 0.28, CISPO's
    weight bound (1.0, 5.0) in MiniMax-M1's convention ([0, 6]); gamma 0.5, 0.5, 1.0."""
    from fgrpo.config import FGRPOJobConfig, PRESET_TABLE
    from fgrpo.surrogates import from_config
    from hpc.runtime.config import load_config
    resolved = {a: load_config(FGRPOJobConfig, None, [f"fgrpo.algorithm={a}"]).fgrpo
                for a in ("grpo", "dapo", "cispo")}
    clip = {a: (f.loss.clip.epsilon, f.loss.clip.epsilon_high) for a, f in resolved.items()}
    assert clip["grpo"] == (0.2, 0.2) and clip["dapo"] == (0.2, 0.28)
    assert {a: f.advantage.gamma for a, f in resolved.items()} == \
        {"grpo": 0.5, "dapo": 0.5, "cispo": 1.0}
    cispo = from_config(resolved["cispo"].loss)
    weight = cispo(torch.ones(3, 1), torch.tensor([[0.0], [3.0], [9.0]]), torch.ones(3, 1))[0]
    assert weight.flatten().tolist() == [-0.0, -3.0, -6.0]  # -sg(w) * A * logp: w in [0, 6]
    for name, rows in PRESET_TABLE.items():  # every value names its source
        assert all(source for _, _, source in rows), name
        gamma_source = dict((k, s) for k, _, s in rows)["advantage.gamma"]
        assert "F-GRPO paper" in gamma_source


def test_a_config_file_leaving_a_changed_preset_key_gets_one_note_line(tmp_path):
    from fgrpo.config import FGRPOJobConfig
    from hpc.runtime.config import load_config
    old = tmp_path / "old.yaml"  # written when grpo meant clip-higher and gamma 1
    old.write_text("fgrpo:\n  advantage:\n    gamma: 1.0\n")
    notes = []
    load_config(FGRPOJobConfig, str(old), [], notes=notes)
    assert len(notes) == 1 and "\n" not in notes[0]
    assert "fgrpo.loss.clip.epsilon_high=0.2" in notes[0] and "0.28" in notes[0]
    assert "gamma" not in notes[0]  # given: not the preset's
    notes = []
    load_config(FGRPOJobConfig, str(old), ["fgrpo.algorithm=dapo"], notes=notes)
    assert notes == []  # dapo's clip did not change, its gamma is given
    load_config(FGRPOJobConfig, None, [], notes=notes)
    assert notes == []  # no file: nothing written for an earlier version


@pytest.mark.parametrize("overrides, words", [
    (["fgrpo.algorithm=cispo", "fgrpo.loss.clip.ratio_c=0.5"],
     ["fgrpo.loss.clip.ratio_c", "0.5", "> 1"]),
    (["fgrpo.reward.overlong_buffer=9", "task.max_new_tokens=8"],
     ["fgrpo.reward.overlong_buffer", "8"]),
])
def test_bad_algorithm_combinations(overrides, words):
    from fgrpo.config import FGRPOJobConfig
    from hpc.runtime.config import load_config
    from hpc.runtime.errors import UserError
    with pytest.raises(UserError) as err:
        load_config(FGRPOJobConfig, None, overrides)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words)


@pytest.mark.subprocess
def test_help_lists_the_new_keys_with_ranges():
    import subprocess
    import sys
    text = subprocess.run([sys.executable, "-m", "fgrpo", "--help"], capture_output=True,
                          text=True, timeout=120).stdout
    for line in ("fgrpo.algorithm = 'grpo'  (one of grpo, dapo, cispo)",
                 "fgrpo.loss.surrogate = 'clip'  (one of cispo, clip)",
                 "fgrpo.loss.cispo.epsilon_low = 1.0  (>= 0.0 <= 1.0)",
                 "fgrpo.loss.cispo.epsilon_high = 5.0  (>= 0.0 <= 1000.0)",
                 "fgrpo.advantage.gamma = 0.5  (>= 0.0 <= 100.0)",
                 "fgrpo.optim.mini_batch_prompts = 0", "fgrpo.optim.warmup_steps = 0",
                 "fgrpo.sampling.max_refills = 9  (>= 0 <= 1000)",
                 "fgrpo.reward.overlong_buffer = 0  (>= 0 <= 32768)",
                 "fgrpo.reward.overlong_penalty = 1.0  (>= 0.0 <= 1000.0)",
                 "fgrpo.sampling.dynamic_sampling = False", "fgrpo.loss.overlong_filter = False"):
        assert line in text, line
    flat = " ".join(text.split())  # the presets' values with their sources
    for words in ("loss.clip.epsilon_high=0.2, advantage.gamma=0.5",
                  "[F-GRPO paper, Tables 5 and 7]", "loss.cispo.epsilon_high=5.0",
                  "the F-GRPO paper is silent"):
        assert words in flat, words

"""F-GRPO advantages and the clipped policy loss against hand-computed Python-float values."""
import math

import pytest
import torch

from fgrpo.advantages import batch_moments, group_advantages, std_from_moments
from fgrpo.config import FGRPOJobConfig
from fgrpo.loss import LOSS_TYPES, policy_loss
from fgrpo.surrogates.clip import Clip
from hpc.models.logprobs import masked_mean, token_entropy, token_logprobs
from hpc.runtime.config import load_config
from hpc.runtime.errors import UserError

EPS_STD = 1e-4
PAD = 100.0  # garbage log-prob at padding: exp(PAD - old) overflows float32 unless masked first

# 2 groups x G=2 completions, 3 tokens each; rows 2 and 3 have 2 valid tokens.
REWARDS = [[1.0, 0.0], [1.0, 0.5]]
OLD = [[-1.0, -1.2, -0.7], [-0.9, -1.1, -1.3], [-0.8, -0.6, -2.0], [-1.5, -1.0, -2.0]]
# logp - old: tokens (0,0), (1,1), (2,0), (3,0) leave [1 - 0.2, 1 + 0.28] on the side the clip acts.
DELTA = [[0.5, -0.5, 0.1], [0.3, -0.3, 0.0], [0.4, 0.0, None], [-0.4, 0.2, None]]
REF_GAP = [[0.1, -0.2, 0.05], [0.0, 0.3, -0.1], [0.2, -0.1, None], [-0.3, 0.1, None]]  # ref - logp
MASK = [[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 0]]


def hand_advantages(rewards, mode, gamma, eps=EPS_STD, threshold=1.0):
    """Flat list of advantages, plain Python arithmetic; p = share of rewards >= threshold."""
    flat = [r for group in rewards for r in group]
    n = len(flat)
    batch_mean = sum(flat) / n
    batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in flat) / (n - 1))
    out = []
    for group in rewards:
        g_len = len(group)
        mean = sum(group) / g_len
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (g_len - 1))
        p = sum(r >= threshold for r in group) / g_len
        weight = (1.0 - p) ** gamma
        for r in group:
            centred = r - mean
            if mode == "group":
                centred = centred / (std + eps)
            elif mode == "batch":
                centred = centred / (batch_std + eps)
            out.append(weight * centred)
    return out


def hand_loss(adv, loss_type, eps, eps_high, beta, with_ref, max_len=3, clip_ratio_c=0.0):
    """(loss, clip_fraction, kl mean, ratio mean, per-token loss mean, dual-clip fraction) on
    the module data."""
    seq_terms, all_tok, kls, ratios, clipped_count, dual_count = [], [], [], [], 0, 0
    for b in range(4):
        tok = []
        for t in range(3):
            if not MASK[b][t]:
                continue
            ratio = math.exp(DELTA[b][t])
            unclipped = ratio * adv[b]
            clipped = min(max(ratio, 1.0 - eps), 1.0 + eps_high) * adv[b]
            clipped_count += clipped < unclipped
            value = -min(unclipped, clipped)
            if clip_ratio_c and adv[b] < 0 and value > -clip_ratio_c * adv[b]:
                value = -clip_ratio_c * adv[b]  # dual clip: negative advantages only
                dual_count += 1
            if with_ref and beta != 0.0:
                gap = REF_GAP[b][t]
                kl = math.exp(gap) - gap - 1.0
                kls.append(kl)
                value += beta * kl
            tok.append(value)
            ratios.append(ratio)
        all_tok.extend(tok)
        if loss_type == "seq-mean-token-mean":
            seq_terms.append(sum(tok) / len(tok))
        elif loss_type == "seq-mean-token-sum":
            seq_terms.append(sum(tok))
        else:
            seq_terms.append(sum(tok) / max_len)
    n = len(all_tok)
    loss = sum(all_tok) / n if loss_type == "token-mean" else sum(seq_terms) / len(seq_terms)
    kl_mean = sum(kls) / n if kls else 0.0
    return loss, clipped_count / n, kl_mean, sum(ratios) / n, sum(all_tok) / n, dual_count / n


def tensors():
    old = torch.tensor(OLD)
    logp = torch.tensor([[o + (d if d is not None else PAD) for o, d in zip(orow, drow)]
                         for orow, drow in zip(OLD, DELTA)])
    ref = torch.tensor([[lp + (g if g is not None else -PAD) for lp, g in zip(lrow, grow)]
                        for lrow, grow in zip(logp.tolist(), REF_GAP)])
    return logp.requires_grad_(), old, ref, torch.tensor(MASK, dtype=torch.bool)


def approx(x):
    return pytest.approx(x, rel=1e-5, abs=1e-6)


# ---------------------------------------------------------------- advantages


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
@pytest.mark.parametrize("gamma", [0.0, 1.0, 2.0, 0.5])
def test_advantages_match_hand_values(mode, gamma):
    out = group_advantages(torch.tensor(REWARDS), mode, gamma)
    assert out.advantages.dtype == torch.float32 and out.advantages.shape == (2, 2)
    assert out.advantages.reshape(-1).tolist() == approx(hand_advantages(REWARDS, mode, gamma))
    assert out.success_rate.tolist() == approx([0.5, 0.5])  # one reward >= 1 in each group
    assert out.focal_weight.tolist() == approx([0.5 ** gamma, 0.5 ** gamma])
    assert out.zero_spread.tolist() == [False, False]


def test_advantage_literals():
    # group [1, 0]: mean 0.5, unbiased std sqrt(0.5); gamma 2 -> weight (1 - 0.5)^2 = 0.25.
    out = group_advantages(torch.tensor(REWARDS), "group", 2.0)
    a = 0.25 * 0.5 / (0.7071067811865476 + 1e-4)
    b = 0.25 * 0.25 / (0.3535533905932738 + 1e-4)  # group [1, 0.5]: p 0.5, std sqrt(0.125)
    assert out.advantages.tolist() == [approx([a, -a]), approx([b, -b])]


@pytest.mark.parametrize("mode", ["group", "batch", "none"])
def test_gamma_zero_is_plain_grpo_bitwise(mode):
    gen = torch.Generator().manual_seed(0)
    binary = (torch.rand(16, 8, generator=gen) > 0.5).float()
    binary[0], binary[1] = 1.0, 0.0  # zero-spread groups, p = 1 and p = 0
    for r in (binary, torch.randn(16, 8, generator=gen) * 3.0):
        centred = r - r.mean(dim=1, keepdim=True)
        if mode == "group":
            plain = centred / (r.std(dim=1, keepdim=True) + 1e-4)
        elif mode == "batch":
            plain = centred / (r.std().item() + 1e-4)
        else:
            plain = centred
        out = group_advantages(r, mode, 0.0, batch_std=r.std().item())
        assert torch.equal(out.advantages, plain)
        assert torch.equal(out.focal_weight, torch.ones(16))


def test_zero_spread_groups_get_zero_advantage_and_are_counted():
    # float32 mean(0.9, 0.9, 0.9) - 0.9 = 6e-8, which TRL's formula would turn into 6e-4
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 1.0], [0.9, 0.9, 0.9]])
    for mode in ("group", "batch", "none"):
        for gamma in (0.0, 1.0):
            out = group_advantages(r, mode, gamma)
            assert out.zero_spread.tolist() == [True, True, False, True]
            assert int(out.zero_spread.sum()) == 3
            assert torch.equal(out.advantages[out.zero_spread], torch.zeros(3, 3))
            assert bool((out.advantages[2] != 0).all())


def test_always_solved_groups_get_weight_zero_unless_gamma_zero():
    # means 1.0, 1.25 (clipped to p = 1), 0.0, -0.25 (clipped to p = 0)
    r = torch.tensor([[1.0, 1.0], [1.5, 1.0], [0.0, 0.0], [-1.0, 0.5]])
    for gamma in (1.0, 2.0):
        out = group_advantages(r, "group", gamma)
        assert out.success_rate.tolist() == [1.0, 1.0, 0.0, 0.0]
        assert out.focal_weight.tolist() == [0.0, 0.0, 1.0, 1.0]
        assert out.advantages[:2].abs().sum().item() == 0.0
        a = 0.75 / (1.0606601717798212 + 1e-4)  # [-1, 0.5]: centred -+0.75, std 1.5 / sqrt(2)
        assert out.advantages[3].tolist() == approx([-a, a])
    out = group_advantages(r, "group", 0.0)
    assert out.focal_weight.tolist() == [1.0, 1.0, 1.0, 1.0]
    a = 0.25 / (0.3535533905932738 + 1e-4)
    assert out.advantages[1].tolist() == approx([a, -a])


def test_batch_std_from_moments_over_two_ranks_matches_full_batch():
    gen = torch.Generator().manual_seed(1)
    r = torch.rand(6, 4, generator=gen)
    full = group_advantages(r, "batch", 1.0)
    per_rank = torch.stack([batch_moments(r[:2]), batch_moments(r[2:])])  # an allgather, (2, 3)
    summed = per_rank.sum(0)  # an all-reduce SUM, (3,)
    assert std_from_moments(per_rank) == pytest.approx(r.double().std().item(), rel=1e-12)
    assert std_from_moments(summed) == std_from_moments(per_rank)
    std = std_from_moments(summed)
    parts = [group_advantages(r[:2], "batch", 1.0, batch_std=std).advantages,
             group_advantages(r[2:], "batch", 1.0, batch_std=std).advantages]
    assert torch.allclose(torch.cat(parts), full.advantages, rtol=0, atol=1e-7)
    assert full.advantages.reshape(-1).tolist() == approx(
        hand_advantages(r.tolist(), "batch", 1.0))


def test_focal_p_is_the_success_rate_for_non_binary_rewards():
    """Issue 13 fault 8: rewards in {-1, 1}, 6 of 8 correct. p = 6/8 (as the logged success
    rate counts it), weight (1 - 0.75)^1 = 0.25; a clamped mean reward (0.5) gave 0.5."""
    r = torch.tensor([[1.0] * 6 + [-1.0] * 2])
    out = group_advantages(r, "group", 1.0)
    assert out.success_rate.tolist() == [0.75] and out.focal_weight.tolist() == [0.25]
    std = math.sqrt((6 * 0.5 ** 2 + 2 * 1.5 ** 2) / 7)  # mean 0.5
    assert out.advantages[0].tolist() == approx([0.25 * 0.5 / (std + 1e-4)] * 6 +
                                                [0.25 * -1.5 / (std + 1e-4)] * 2)
    assert out.advantages.reshape(-1).tolist() == approx(hand_advantages(r.tolist(), "group", 1.0))


@pytest.mark.parametrize("threshold, p", [(1.0, 0.25), (0.5, 0.5), (0.0, 1.0), (1.5, 0.0)])
def test_success_threshold_sets_p(threshold, p):
    r = torch.tensor([[0.6, 0.4, 1.0, 0.0]])
    out = group_advantages(r, "none", 2.0, success_threshold=threshold)
    assert out.success_rate.tolist() == [p] and out.focal_weight.tolist() == approx([(1 - p) ** 2])
    assert out.advantages.reshape(-1).tolist() == approx(
        hand_advantages(r.tolist(), "none", 2.0, threshold=threshold))
    assert out.advantages[0].tolist() == approx([(1 - p) ** 2 * (x - 0.5) for x in r[0].tolist()])


@pytest.mark.parametrize("eps", [1e-6, 0.0, 0.5])
@pytest.mark.parametrize("mode", ["group", "batch"])
def test_advantage_epsilon_by_hand(eps, mode):
    # verl's GRPO adds 1e-6; group [1, 0]: A = 0.5 * (+-0.5) / (sqrt(0.5) + eps) at gamma 1
    out = group_advantages(torch.tensor(REWARDS), mode, 1.0, eps=eps)
    assert out.advantages.reshape(-1).tolist() == approx(
        hand_advantages(REWARDS, mode, 1.0, eps=eps))
    if mode == "group":
        assert out.advantages[0, 0].item() == approx(0.25 / (0.7071067811865476 + eps))


@pytest.mark.parametrize("kwargs", [dict(gamma=-0.5), dict(rewards=torch.ones(3, 1)),
                                    dict(rewards=torch.ones(4)), dict(scale_rewards="std"),
                                    dict(eps=-1e-6)])
def test_advantage_errors(kwargs):
    args = dict(rewards=torch.ones(3, 2), scale_rewards="group", gamma=1.0) | kwargs
    with pytest.raises(ValueError):
        group_advantages(**args)


# ---------------------------------------------------------------- loss


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("gamma", [0.0, 1.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.05])
@pytest.mark.parametrize("clip", [(0.2, 0.28), (0.9, 10.0)], ids=["clip-active", "no-clip"])
@pytest.mark.parametrize("clip_ratio_c", [0.0, 1.1], ids=["no-dual", "dual-1.1"])
def test_loss_matches_hand_computation(loss_type, gamma, beta, clip, clip_ratio_c):
    eps, eps_high = clip
    adv_hand = hand_advantages(REWARDS, "group", gamma)
    adv = group_advantages(torch.tensor(REWARDS), "group", gamma).advantages.reshape(-1)
    logp, old, ref, mask = tensors()
    loss, stats = policy_loss(logp, old, adv, mask, loss_type, Clip(eps, eps_high, clip_ratio_c),
                              beta=beta, ref_logp=ref)
    want, clip_frac, kl, ratio, tok_mean, dual = hand_loss(adv_hand, loss_type, eps, eps_high,
                                                           beta, True, clip_ratio_c=clip_ratio_c)
    assert loss.item() == approx(want)
    assert stats["clip_fraction"] == approx(clip_frac)
    assert stats["clip_fraction"] == approx(0.4 if clip == (0.2, 0.28) else 0.0)  # 4 of 10 tokens
    # dual clip at 1.1 acts on the negative-advantage tokens (1, 0) and (3, 1): ratios e^0.3, e^0.2
    assert stats["dual_clip_fraction"] == approx(dual)
    assert dual == approx(0.2 if clip_ratio_c else 0.0)
    assert stats["kl"] == approx(kl) and (stats["kl"] > 0) == (beta > 0)
    assert stats["ratio_mean"] == approx(ratio)
    assert stats["loss_mean"] == approx(tok_mean)
    assert stats["valid_tokens"] == 10.0
    loss.backward()
    assert torch.isfinite(logp.grad).all()
    assert logp.grad[~mask].abs().sum().item() == 0.0


def test_loss_literal_single_token():
    # ratio e^0.5 = 1.6487 > 1 + 0.28 with A = 2: objective 1.28 * 2; k3 at gap 0.1, beta 0.5.
    logp = torch.tensor([[0.5]])
    args = (torch.zeros(1, 1), torch.tensor([2.0]), torch.ones(1, 1), "token-mean", Clip(0.2, 0.28))
    loss, stats = policy_loss(logp, *args, beta=0.5, ref_logp=torch.tensor([[0.6]]))
    k3 = math.exp(0.1) - 0.1 - 1.0
    assert loss.item() == approx(-2.56 + 0.5 * k3)
    assert stats["clip_fraction"] == 1.0 and stats["kl"] == approx(k3)
    loss_sum, _ = policy_loss(logp, *args[:3], "seq-mean-token-sum-norm", Clip(0.2, 0.28),
                              max_completion_length=4)
    assert loss_sum.item() == approx(-2.56 / 4)


def test_dual_clip_literals():
    # A = -2: ratio e^1.5 = 4.48 -> PPO loss 2 * 4.48 = 8.96, dual clip c = 3 caps it at 6 (no
    # gradient); ratio e^0.5 = 1.65 -> 3.30 < 6, unchanged. A = +2 is never dual-clipped.
    logp = torch.tensor([[1.5, 0.5], [1.5, -1.5]], requires_grad=True)
    adv, mask = torch.tensor([-2.0, 2.0]), torch.ones(2, 2)
    loss, stats = policy_loss(logp, torch.zeros(2, 2), adv, mask, "token-mean",
                              Clip(0.2, 0.28, 3.0))
    rows = [[6.0, 2 * math.exp(0.5)], [-2 * 1.28, -2 * math.exp(-1.5)]]
    assert loss.item() == approx(sum(rows[0] + rows[1]) / 4)
    assert stats["dual_clip_fraction"] == 0.25
    loss.backward()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() == approx(
        2 * math.exp(0.5) / 4)
    off, off_stats = policy_loss(logp, torch.zeros(2, 2), adv, mask, "token-mean", Clip(0.2, 0.28))
    assert off.item() == approx((2 * math.exp(1.5) + sum(rows[0][1:] + rows[1])) / 4)
    assert off_stats["dual_clip_fraction"] == 0.0


def verl_vanilla_loss(logp, old, adv, mask, eps, eps_high, c, agg):
    """verl's ``compute_policy_loss_vanilla`` + ``agg_loss`` (core_algos.py), written out:
    the PPO max of the two losses, then min with -A * c where A < 0."""
    ratio = torch.exp(torch.clamp(logp - old, -20.0, 20.0))
    a = adv[:, None].expand_as(logp)
    clip1 = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - eps, 1 + eps_high))
    losses = torch.where(a < 0, torch.min(-a * c, clip1), clip1)
    m = mask.float()
    if agg == "token-mean":
        return (losses * m).sum() / m.sum()
    return (losses * m).sum(-1).mean()  # seq-mean-token-sum


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("c", [1.5, 3.0])
def test_dual_clip_and_token_sum_match_verl(agg, c):
    logp, old, _, adv, mask = _split_batch()
    logp = old + 5.0 * (logp - old)  # spread log-ratios (std 2 nats), so the dual clip acts
    mine, stats = policy_loss(logp, old, adv, mask, agg, Clip(0.2, 0.28, c))
    assert stats["dual_clip_fraction"] > 0
    assert mine.item() == approx(verl_vanilla_loss(logp, old, adv, mask, 0.2, 0.28, c, agg).item())
    plain, _ = policy_loss(logp, old, adv, mask, agg, Clip(0.2, 0.28))
    assert plain.item() > mine.item()  # the dual clip only ever lowers the loss


def test_seq_mean_token_sum_literal():
    # rows of 3 and 1 valid tokens, ratio 1, A = [1, -2]: per-token losses -1 and +2
    loss, _ = policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1.0, -2.0]),
                          torch.tensor([[1, 1, 1], [1, 0, 0]]), "seq-mean-token-sum",
                          Clip(0.2, 0.28))
    assert loss.item() == approx((-3.0 + 2.0) / 2)


@pytest.mark.parametrize("c", [0.5, 1.0, -3.0])
def test_dual_clip_bound_must_exceed_one(c):
    logp, old, _, mask = tensors()
    with pytest.raises(UserError, match=r"ratio_c': -?[\d.]+ must be 0 .dual clip off. or > 1"):
        policy_loss(logp, old, torch.zeros(4), mask, "token-mean", Clip(0.2, 0.28, c))


def test_kl_needs_both_beta_and_reference():
    logp, old, ref, mask = tensors()
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    plain, _ = policy_loss(logp, old, adv, mask, "token-mean", Clip(0.2, 0.28))
    no_ref, stats = policy_loss(logp, old, adv, mask, "token-mean", Clip(0.2, 0.28), beta=0.1)
    zero_beta, _ = policy_loss(logp, old, adv, mask, "token-mean", Clip(0.2, 0.28), beta=0.0,
                               ref_logp=ref)
    assert torch.equal(plain, no_ref) and torch.equal(plain, zero_beta) and stats["kl"] == 0.0


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_padding_gives_zero_loss_and_finite_grad(loss_type):
    logp = torch.full((2, 3), PAD, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for normalizer in (None, 0.0):
        loss, stats = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), mask, loss_type,
                                  Clip(0.2, 0.28), beta=0.1, ref_logp=torch.zeros(2, 3),
                                  normalizer=normalizer)
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))
        assert stats == {"clip_fraction": 0.0, "dual_clip_fraction": 0.0, "kl": 0.0,
                         "ratio_mean": 0.0, "loss_mean": 0.0, "valid_tokens": 0.0}


def test_bad_loss_type_lists_allowed():
    logp, old, _, mask = tensors()
    allowed = "token-mean.*seq-mean-token-mean.*seq-mean-token-sum-norm"
    with pytest.raises(ValueError, match=allowed):
        policy_loss(logp, old, torch.zeros(4), mask, "dapo", Clip(0.2, 0.28))


def _split_batch():
    gen = torch.Generator().manual_seed(3)
    b, t = 8, 5
    old = torch.randn(b, t, generator=gen) - 1.0
    logp = old + 0.4 * torch.randn(b, t, generator=gen)
    ref = logp + 0.2 * torch.randn(b, t, generator=gen)
    adv = torch.randn(b, generator=gen)
    lengths = torch.tensor([5, 3, 1, 4, 2, 3, 0, 2])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return logp, old, ref, adv, mask


def _chunk_grad(rows, loss_type, normalizer, logp, old, ref, adv, mask):
    """Backward of one micro-batch padded only to its own longest sequence; returns its loss."""
    width = max(int(mask[rows].sum(1).max()), 1)
    cols = slice(0, width)
    loss, _ = policy_loss(logp[rows, cols], old[rows, cols], adv[rows], mask[rows, cols], loss_type,
                          Clip(0.2, 0.28), beta=0.05, ref_logp=ref[rows, cols],
                          max_completion_length=mask.shape[1], normalizer=normalizer)
    loss.backward()
    return loss.item()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_normalizer_makes_microbatches_and_ranks_match_full_batch(loss_type):
    logp0, old, ref, adv, mask = _split_batch()
    data = (old, ref, adv, mask)
    full_logp = logp0.clone().requires_grad_()
    full, _ = policy_loss(full_logp, old, adv, mask, loss_type, Clip(0.2, 0.28), beta=0.05,
                          ref_logp=ref)
    full.backward()
    denom = float(mask.sum()) if loss_type == "token-mean" else float(mask.shape[0])

    # one rank, 2 micro-batches of 4 sequences: gradients accumulate by plain backward
    acc = logp0.clone().requires_grad_()
    total = sum(_chunk_grad(slice(i, i + 4), loss_type, denom, acc, *data) for i in (0, 4))
    assert total == approx(full.item())
    assert torch.allclose(acc.grad, full_logp.grad, rtol=0, atol=1e-6)

    # 2 ranks x 2 micro-batches of 2: all-reduce MEAN times world size, or normalizer D / world
    for normalizer, scale in ((denom, 2.0), (denom / 2, 1.0)):
        grads = []
        for rank in range(2):
            own = logp0.clone().requires_grad_()  # each rank holds its own replica
            for mb in range(2):
                start = 4 * rank + 2 * mb
                _chunk_grad(slice(start, start + 2), loss_type, normalizer, own, *data)
            grads.append(own.grad)
        reduced = torch.stack(grads).mean(0) * scale
        assert torch.allclose(reduced, full_logp.grad, rtol=0, atol=1e-6)


def test_without_normalizer_token_mean_microbatches_are_biased():
    logp0, old, ref, adv, mask = _split_batch()
    full_logp = logp0.clone().requires_grad_()
    full, _ = policy_loss(full_logp, old, adv, mask, "token-mean", Clip(0.2, 0.28))
    full.backward()
    naive = logp0.clone().requires_grad_()
    for i in (0, 4):  # mean of the two micro-batch token-means (18 vs 7 valid tokens)
        part, _ = policy_loss(naive[i:i + 4], old[i:i + 4], adv[i:i + 4], mask[i:i + 4],
                              "token-mean", Clip(0.2, 0.28))
        (part / 2).backward()
    assert not torch.allclose(naive.grad, full_logp.grad, rtol=0, atol=1e-3)


# ---------------------------------------------------------------- helpers


def test_token_logprobs_by_hand():
    logits = torch.tensor([[[1.0, 2.0, 0.5], [0.0, 0.0, 3.0]]])
    tokens = torch.tensor([[1, 0]])
    out = token_logprobs(logits.to(torch.bfloat16), tokens)
    assert out.dtype == torch.float32 and out.shape == (1, 2)
    lse0 = math.log(math.exp(1.0) + math.exp(2.0) + math.exp(0.5))
    lse1 = math.log(2.0 + math.exp(3.0))
    assert out[0].tolist() == approx([2.0 - lse0, 0.0 - lse1])


def test_token_entropy_by_hand():
    neg_inf = float("-inf")
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [1.0, 1.0, neg_inf, neg_inf]],
                           [[5.0, neg_inf, neg_inf, neg_inf], [float("nan")] * 4]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # uniform over 4: ln 4; uniform over 2 (two -inf): ln 2; one-hot: 0; nan row is padding
    assert masked_mean(token_entropy(logits), mask) == approx((math.log(4) + math.log(2)) / 3)


# ---------------------------------------------------------------- config keys


def test_config_keys_for_the_new_options():
    cfg = load_config(FGRPOJobConfig, None, [])
    assert (cfg.fgrpo.reward.success_threshold, cfg.fgrpo.advantage.epsilon,
            cfg.fgrpo.loss.clip.ratio_c) \
        == (1.0, 1e-4, 0.0)  # TRL's epsilon; dual clip off as in TRL
    cfg = load_config(FGRPOJobConfig, None, ["fgrpo.loss.clip.ratio_c=3",
                                             "fgrpo.advantage.epsilon=1e-6",
                                             "fgrpo.reward.success_threshold=0.5",
                                             "fgrpo.loss.aggregation=seq-mean-token-sum"])
    assert (cfg.fgrpo.loss.clip.ratio_c, cfg.fgrpo.advantage.epsilon) == (3.0, 1e-6)
    for bad, message in (("fgrpo.loss.clip.ratio_c=1", "must be 0 .dual clip off. or > 1"),
                         ("fgrpo.loss.clip.ratio_c=-2", "below the minimum"),
                         ("fgrpo.advantage.epsilon=-1e-6", "below the minimum")):
        with pytest.raises(UserError, match=message):
            load_config(FGRPOJobConfig, None, [bad])

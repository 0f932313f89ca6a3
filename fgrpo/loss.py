"""The policy losses of GRPO/DAPO (clipped PPO surrogate) and CISPO, side by side, + k3 KL,
their aggregations, and helpers.

Per valid token (b, t), with ratio rho = exp(logp - old_logp) and advantage A_b, the
``surrogate`` is one of

    clip  (GRPO, DAPO):  pg_bt = -min(rho * A_b, clip(rho, 1 - epsilon, 1 + epsilon_high) * A_b)
    cispo (MiniMax-M1):  pg_bt = -sg(clip(rho, 1 - epsilon, 1 + epsilon_high)) * A_b * logp_bt

    loss_bt = pg_bt + beta * k3_bt
    k3_bt   = exp(ref - logp) - (ref - logp) - 1         (Schulman's k3 estimator, as in TRL)

CISPO (arXiv 2506.13585, eq. 4-5) clips the importance weight itself under a stop-gradient
``sg``, so every token keeps the gradient -w_bt * A_b of log pi (the clip surrogate's gradient
is 0 on a token its clip acts on). TRL's ``loss_type="cispo"`` is
``-clamp(rho, max=epsilon_high).detach() * A * logp`` (no lower bound; its docs suggest
``epsilon_high=5.0``): the same as ``epsilon=1`` (lower bound 0) and ``epsilon_high=4`` here,
the package's CISPO defaults (``fgrpo.cispo_epsilon_low``, ``fgrpo.cispo_epsilon_high``).
With mu = 1 pass rho = 1, so both surrogates have the REINFORCE gradient -A * grad logp.

Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729; verl's ``clip_ratio_c``, 3.0 there), off by
default as in TRL: with ``clip_ratio_c = c > 1``, tokens with A_b < 0 use
``min(pg_bt, -c * A_b)``, so a large ratio on a negative-advantage token cannot make its loss
(and gradient) unbounded; tokens with A_b >= 0 are unchanged. The KL term is added after.

Aggregations (``loss_type``), with m the (B, T) mask and L = ``max_completion_length``:

* ``token-mean`` (DAPO):             sum_bt m*loss / sum_bt m
* ``seq-mean-token-mean`` (GRPO):    (1/B) sum_b [sum_t m*loss / max(sum_t m, 1)]
* ``seq-mean-token-sum`` (verl):     (1/B) sum_b [sum_t m*loss]
* ``seq-mean-token-sum-norm`` (Dr. GRPO): (1/B) sum_b [sum_t m*loss / L]

Data parallel + gradient accumulation (the ``normalizer`` contract). Every aggregation is
``numerator / D``: a sum over this call's tokens or sequences divided by a denominator D that
is the batch's valid-token count (token-mean) or sequence count (the seq modes). When one
optimizer step's batch is split over micro-batches and ranks, the trainer must

1. compute D over the WHOLE step: the valid tokens (token-mean) or sequences (seq modes) of
   every micro-batch on every rank (a SUM all-reduce of the local counts: :func:`step_counts`
   on each rank, gathered, then :func:`step_normalizer`), and pass it as ``normalizer`` to
   every call; for ``seq-mean-token-sum-norm`` also pass the same
   ``max_completion_length`` everywhere (the default, this call's T, varies with padding);
2. call ``loss.backward()`` on each micro-batch's loss unscaled (gradients add up);
3. SUM the gradients over ranks. With a MEAN all-reduce (``hpc.runtime.dist.all_reduce_mean_``),
   multiply the result by the world size, or equivalently pass ``normalizer = D / world_size``.

The summed losses and gradients then equal one ``normalizer=None`` call on the full batch.
``old_logp``, ``ref_logp`` and ``advantages`` are treated as constants (detached).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from fgrpo.config import LOSS_TYPES, SURROGATES


def clip_surrogate(ratio: Tensor, adv: Tensor, epsilon: float, epsilon_high: float,
                   clip_ratio_c: float) -> tuple[Tensor, Tensor, Tensor]:
    """GRPO/DAPO: per-token -min(rho A, clip(rho) A), with dual clip where ``clip_ratio_c``;
    ratio (B, T), adv (B, 1). Returns (per-token loss, clip-acted mask, dual-clip mask)."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    dual = torch.zeros_like(per_token, dtype=torch.bool)
    if clip_ratio_c:
        bound = -clip_ratio_c * adv  # > 0 where A < 0
        dual = (adv < 0) & (per_token > bound)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
    return per_token, clipped < unclipped, dual


def cispo_surrogate(logp: Tensor, ratio: Tensor, adv: Tensor, epsilon: float,
                    epsilon_high: float) -> tuple[Tensor, Tensor]:
    """CISPO: per-token -sg(clip(rho, 1 - epsilon, 1 + epsilon_high)) * A * logp; logp, ratio
    (B, T), adv (B, 1). Returns (per-token loss, mask of tokens whose weight was clipped)."""
    weight = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon_high).detach()
    return -weight * adv * logp, weight != ratio


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss_type: str,
                epsilon: float, epsilon_high: float, beta: float = 0.0,
                ref_logp: Tensor | None = None, max_completion_length: int | None = None,
                normalizer: float | None = None, clip_ratio_c: float = 0.0,
                surrogate: str = "clip") -> tuple[Tensor, dict[str, float]]:
    """The ``surrogate``'s loss (``clip`` or ``cispo``) aggregated by ``loss_type``, see the
    module docstring; ``epsilon`` / ``epsilon_high`` are the clip's bounds in both.

    logp, old_logp, ref_logp, mask: (B, T), log-probabilities in nats of the sampled tokens
    under the current / sampling / reference policy; mask is bool or 0/1 float (1 = valid).
    advantages: (B,). ``normalizer`` overrides the denominator D (see the module docstring).
    ``clip_ratio_c``: dual-clip bound (clip surrogate only), 0 = off, else > 1. Returns
    (scalar loss with grad through ``logp``, stats) where stats are floats over this call's
    valid tokens: ``clip_fraction`` (tokens where the clip changed the objective: the PPO
    clip's min, or CISPO's weight clip), ``dual_clip_fraction`` (tokens where the
    dual clip lowered the loss, verl's ``pg_clipfrac_lower``), ``kl`` (mean k3, 0.0 without
    KL), ``ratio_mean``, ``loss_mean`` (mean per-token loss) and ``valid_tokens`` (their count,
    to weight stats across micro-batches).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    if surrogate not in SURROGATES:
        raise ValueError(f"surrogate must be one of {SURROGATES}, got {surrogate!r}")
    if surrogate == "cispo" and clip_ratio_c:
        raise ValueError("dual clip (clip_ratio_c) bounds the clip surrogate; CISPO has none")
    if clip_ratio_c != 0.0 and not clip_ratio_c > 1.0:
        raise ValueError(f"clip_ratio_c must be 0 (off) or > 1, got {clip_ratio_c}")
    valid = mask.bool()
    m = valid.to(logp.dtype)
    # Zero the log-ratios at padding so garbage there cannot turn into inf/nan (forward or grad).
    log_ratio = torch.where(valid, logp - old_logp.detach(), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(logp.dtype)[:, None]
    if surrogate == "cispo":
        per_token, clip_acted = cispo_surrogate(torch.where(valid, logp, torch.zeros_like(logp)),
                                                ratio, adv, epsilon, epsilon_high)
        dual = torch.zeros_like(valid)
    else:
        per_token, clip_acted, dual = clip_surrogate(ratio, adv, epsilon, epsilon_high,
                                                     clip_ratio_c)
    use_kl = beta != 0.0 and ref_logp is not None
    if use_kl:
        ref_gap = torch.where(valid, ref_logp.detach() - logp, torch.zeros_like(logp))
        kl = torch.exp(ref_gap) - ref_gap - 1.0
        per_token = per_token + beta * kl
    masked = per_token * m
    if loss_type == "token-mean":
        denom = float(m.sum()) if normalizer is None else float(normalizer)
        loss = masked.sum() / (denom if denom > 0 else 1.0)  # no valid tokens: numerator is 0
    else:
        if loss_type == "seq-mean-token-mean":
            per_seq = masked.sum(dim=1) / m.sum(dim=1).clamp(min=1.0)
        elif loss_type == "seq-mean-token-sum":
            per_seq = masked.sum(dim=1)
        else:
            per_seq = masked.sum(dim=1) / float(max_completion_length or logp.shape[1])
        denom = float(logp.shape[0] if normalizer is None else normalizer)
        loss = per_seq.sum() / (denom if denom > 0 else 1.0)
    with torch.no_grad():
        n = m.sum()
        n_safe = n.clamp(min=1.0)
        stats = {
            "clip_fraction": (clip_acted.to(m.dtype) * m).sum() / n_safe,
            "dual_clip_fraction": (dual.to(m.dtype) * m).sum() / n_safe,
            "kl": (kl * m).sum() / n_safe if use_kl else n.new_zeros(()),
            "ratio_mean": (ratio * m).sum() / n_safe,
            "loss_mean": (masked.sum() / n_safe),
            "valid_tokens": n,
        }
    return loss, dict(zip(stats, torch.stack(list(stats.values())).tolist()))  # one device sync


def step_counts(completion_mask: Tensor) -> np.ndarray:
    """This rank's [valid tokens, sequences] of one step (float64 (2,)); ``completion_mask``
    (rows, T) marks the loss's tokens. A row without a valid token (overlong filtering masks
    a truncated completion) is no sequence of the seq modes' mean."""
    return np.array([float(completion_mask.sum()), float((completion_mask.sum(1) > 0).sum())])


def step_normalizer(loss_type: str, counts: np.ndarray, world_size: int) -> float:
    """``normalizer`` of every :func:`policy_loss` call of one step (rule 1 and 3 of the module
    docstring): D over every rank's :func:`step_counts` (``counts``: (ranks, 2)), divided by
    the world size for a MEAN gradient all-reduce."""
    total = np.asarray(counts).sum(axis=0)
    return (total[0] if loss_type == "token-mean" else total[1]) / world_size

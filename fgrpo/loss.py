"""The F-GRPO policy loss: a surrogate's per-token loss (:mod:`fgrpo.surrogates`: the clip
surrogate of GRPO and DAPO, CISPO, or any registered one) + k3 KL, aggregated, and helpers.

Per valid token (b, t), with ratio rho = exp(logp - old_logp) and advantage A_b:

    loss_bt = pg_bt + beta * k3_bt
    k3_bt   = exp(ref - logp) - (ref - logp) - 1         (Schulman's k3 estimator, as in TRL)

where pg_bt is the surrogate's (its own file gives its formula). The KL term is added after.

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

from fgrpo.config import LOSS_TYPES


def policy_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, loss_type: str,
                surrogate, beta: float = 0.0, ref_logp: Tensor | None = None,
                max_completion_length: int | None = None,
                normalizer: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """``surrogate``'s per-token loss (a :mod:`fgrpo.surrogates` object, e.g.
    ``fgrpo.surrogates.from_config(cfg.fgrpo)``) aggregated by ``loss_type``, see the module
    docstring.

    logp, old_logp, ref_logp, mask: (B, T), log-probabilities in nats of the sampled tokens
    under the current / sampling / reference policy; mask is bool or 0/1 float (1 = valid).
    advantages: (B,). ``normalizer`` overrides the denominator D (see the module docstring).
    Returns
    (scalar loss with grad through ``logp``, stats) where stats are floats over this call's
    valid tokens: ``clip_fraction`` (tokens where the clip changed the objective: the PPO
    clip's min, or CISPO's weight clip), ``dual_clip_fraction`` (tokens where the
    dual clip lowered the loss, verl's ``pg_clipfrac_lower``), ``kl`` (mean k3, 0.0 without
    KL), ``ratio_mean``, ``loss_mean`` (mean per-token loss) and ``valid_tokens`` (their count,
    to weight stats across micro-batches).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    valid = mask.bool()
    m = valid.to(logp.dtype)
    # Zero the log-ratios at padding so garbage there cannot turn into inf/nan (forward or grad).
    log_ratio = torch.where(valid, logp - old_logp.detach(), torch.zeros_like(logp))
    ratio = torch.exp(log_ratio)
    adv = advantages.detach().to(logp.dtype)[:, None]
    per_token, clip_acted, dual = surrogate(torch.where(valid, logp, torch.zeros_like(logp)),
                                            ratio, adv)
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

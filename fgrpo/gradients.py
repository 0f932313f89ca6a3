"""Gradients of the F-GRPO loss over one step's rollouts.

:func:`accumulate_gradients` runs forward/backward in micro-batches with the step's global
normaliser (:func:`fgrpo.loss.step_normalizer`), so after a MEAN all-reduce every rank holds the
gradient of the whole step's batch (the step that applies it:
:meth:`hpc.models.parallelize.TrainedWeights.step`).
"""
from __future__ import annotations

import numpy as np
import torch

from fgrpo.loss import policy_loss, step_counts, step_normalizer
from fgrpo.surrogates import from_config
from hpc.models.logprobs import masked_mean, sequence_logprobs

# Per-step sums accumulate_gradients returns (token-weighted stats are sums over tokens).
GRADIENT_SUMS = ("loss", "tokens", "kl", "clip_fraction", "ratio", "entropy")


def accumulate_gradients(model, rollouts, advantages: torch.Tensor, cfg, world,
                         max_new_tokens: int, old_logp=None, ref_logp=None,
                         lockstep: bool = False) -> dict:
    """Forward/backward over ``rollouts`` in micro-batches; gradients are left ready for a MEAN
    all-reduce (see :func:`fgrpo.loss.step_normalizer`). ``advantages``: (n*G,). ``lockstep``
    (FSDP2, whose every forward and backward is collective): a rank with fewer micro-batches
    than another runs :func:`idle_backward` for each one it lacks (a rank may hold fewer rows
    of an update: dynamic sampling's kept groups, PPO mini-batches).

    Returns {name: float} of :data:`GRADIENT_SUMS`: the loss summed over micro-batches, the
    valid tokens, and kl, clip_fraction, ratio (mean importance ratio) and entropy summed over
    valid tokens.
    """
    f = cfg.fgrpo
    rows = rollouts.input_ids.shape[0]
    counts = world.allgather(step_counts(rollouts.completion_mask[:, 1:]), tag="metrics")
    normalizer = step_normalizer(f.loss.aggregation, counts, world.size)
    sums = dict.fromkeys(GRADIENT_SUMS, 0.0)
    starts = range(0, rows, f.optim.micro_batch)
    for _ in range(most_micro_batches(world, len(starts)) - len(starts) if lockstep else 0):
        idle_backward(model, cfg)
    for start in starts:
        stop = min(start + f.optim.micro_batch, rows)
        old = None if old_logp is None else old_logp[start:stop]
        ref = None if ref_logp is None else ref_logp[start:stop]
        stats = micro_batch_backward(model, rollouts.rows(start, stop), advantages[start:stop],
                                     old, ref, cfg, max_new_tokens, normalizer)
        n = stats["valid_tokens"]
        sums["tokens"] += n
        sums["kl"] += stats["kl"] * n
        sums["clip_fraction"] += stats["clip_fraction"] * n
        sums["ratio"] += stats["ratio_mean"] * n
        sums["entropy"] += stats["entropy"] * n
        sums["loss"] += stats["loss"]
    return sums


def micro_batch_backward(model, rows, advantages, old_logp, ref_logp, cfg, max_new_tokens: int,
                         normalizer: float) -> dict:
    """Loss and backward of one micro-batch: ``rows`` = (input_ids, attention_mask,
    completion_mask), each (b, T); ``old_logp`` / ``ref_logp`` (b, T-1) or None. The
    surrogate is the one ``fgrpo.loss.surrogate`` names, with its own keys
    (:func:`fgrpo.surrogates.from_config`). Returns
    :func:`fgrpo.loss.policy_loss`'s stats plus ``loss`` and ``entropy`` (mean over valid
    tokens) as floats only, so no tensor of this micro-batch outlives the call into the next
    one's forward. Log-probs go through ``model.logprob_chunk`` (:mod:`hpc.models.logprobs`)."""
    f = cfg.fgrpo
    ids, attn, cm = rows
    logp, entropy = sequence_logprobs(model, ids, attn, cfg.model.logprob_chunk,
                                      with_entropy=True)
    old = logp.detach() if old_logp is None else old_logp
    loss, stats = policy_loss(logp, old, advantages, cm[:, 1:], f.loss.aggregation,
                              from_config(f.loss), f.loss.beta, ref_logp,
                              max_completion_length=max_new_tokens, normalizer=normalizer)
    loss.backward()
    return dict(stats, loss=float(loss.detach()), entropy=masked_mean(entropy, cm[:, 1:]))



def most_micro_batches(world, mine: int) -> int:
    """The most micro-batches any rank runs (an Allgather, tag ``metrics``)."""
    return int(world.allgather(np.array([mine]), tag="metrics").max())


def idle_backward(model, cfg) -> None:
    """A forward and backward of one two-token row that no loss term counts (completion mask 0,
    attention 1): under FSDP2 it joins the other ranks' all-gathers and reduce-scatters of a
    micro-batch this rank has no rows for, adding zero to every gradient."""
    device = next(model.parameters()).device
    ids = torch.zeros((1, 2), dtype=torch.long, device=device)
    logp, _ = sequence_logprobs(model, ids, torch.ones_like(ids), cfg.model.logprob_chunk)
    (logp.sum() * 0.0).backward()

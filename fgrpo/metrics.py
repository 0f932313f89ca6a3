"""The named metrics of one F-GRPO step, reduced over ranks with one Allgather.

Every rank fills the sums of :data:`SUMMED` (and its focal-weight extremes) from its rollouts,
advantages and gradient pass; one Allgather of those values, in that fixed order, gives every
rank the whole step's :data:`METRICS`. Reward, success, length and truncation metrics are over
the step's first sampling round (every group of its ``fgrpo.batch_prompts`` prompts, filtered
or not: what the policy scores on fresh prompts); focal weights, loss and token statistics
over the groups it trained on; the sampling statistics are
:data:`fgrpo.sampling.SAMPLING_STATS`.
"""
from __future__ import annotations

import numpy as np

from fgrpo.sampling import SAMPLING_STATS

SUMMED = ("reward", "successes", "completions", "truncated", "penalty", "focal_weight",
          "groups", "zero_spread_groups", "completion_tokens", "loss", "tokens", "kl",
          "clip_fraction", "ratio", "entropy")
METRICS = ("reward_mean", "success_rate", "focal_weight_mean", "focal_weight_min",
           "focal_weight_max", "zero_spread_groups", "kl", "clip_fraction", "ratio_mean",
           "entropy", "completion_length", "truncated_share", "overlong_penalty", "loss",
           "skipped_steps", "trained_groups", "updates", "clipped_tokens") + SAMPLING_STATS


def local_sums(batch, adv, gradient_sums: dict, success_threshold: float = 1.0) -> dict:
    """This rank's {name: float} of :data:`SUMMED`: its rollouts (a
    :class:`fgrpo.rollout.StepRollouts`), the trained groups' advantages
    (:class:`fgrpo.advantages.Advantages`) and the sums of
    :func:`fgrpo.step.train_on_rollouts` (over its last epoch). A success is a reward
    >= ``success_threshold`` (the p of the focal weight counts the same)."""
    first = batch.first
    return dict(gradient_sums, reward=first.rewards.sum().item(),
                successes=(first.rewards >= success_threshold).sum().item(),
                completions=first.rewards.numel(), truncated=first.truncated.sum().item(),
                penalty=first.penalty.sum().item(), focal_weight=adv.focal_weight.sum().item(),
                groups=adv.zero_spread.numel(), zero_spread_groups=adv.zero_spread.sum().item(),
                completion_tokens=first.completion_lengths.float().sum().item())


def step_metrics(world, sums: dict, focal_weight, skipped: int, sampling: dict,
                 updates: int = 1) -> dict:
    """{name: float} of :data:`METRICS` over every rank (one Allgather, tag ``metrics``).
    ``focal_weight``: this rank's (n,) group weights (n may be 0 under dynamic sampling);
    ``skipped``: steps skipped so far; ``sampling``: the step's sampling statistics;
    ``updates``: the optimizer updates the step took (PPO epochs x mini-batches).
    ``clipped_tokens`` counts the tokens where the clip acted in the last epoch (all ranks),
    ``clip_fraction`` their share; ``loss`` is the mean over the last epoch's updates."""
    w = focal_weight.tolist()
    extremes = [min(w, default=np.inf), max(w, default=-np.inf)]
    table = world.allgather(np.array([sums[k] for k in SUMMED] + extremes), tag="metrics")
    total = dict(zip(SUMMED, table[:, :len(SUMMED)].sum(axis=0)))
    tokens, groups = max(total["tokens"], 1.0), total["groups"]
    return {"reward_mean": total["reward"] / total["completions"],
            "success_rate": total["successes"] / total["completions"],
            "focal_weight_mean": total["focal_weight"] / max(groups, 1.0),
            "focal_weight_min": table[:, -2].min() if groups else 0.0,
            "focal_weight_max": table[:, -1].max() if groups else 0.0,
            "zero_spread_groups": total["zero_spread_groups"],
            "kl": total["kl"] / tokens, "clip_fraction": total["clip_fraction"] / tokens,
            "ratio_mean": total["ratio"] / tokens, "entropy": total["entropy"] / tokens,
            "completion_length": total["completion_tokens"] / total["completions"],
            "truncated_share": total["truncated"] / total["completions"],
            "overlong_penalty": total["penalty"] / total["completions"],
            "loss": total["loss"] / world.size, "skipped_steps": skipped,
            "trained_groups": groups, "updates": updates,
            "clipped_tokens": round(total["clip_fraction"]), **sampling}

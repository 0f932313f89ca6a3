"""The named metrics of one F-GRPO step, reduced over ranks with one Allgather.

Every rank fills the sums of :data:`SUMMED` (and its focal-weight extremes) from its rollouts,
advantages and gradient pass; one Allgather of those values, in that fixed order, gives every
rank the whole step's :data:`METRICS`.
"""
from __future__ import annotations

import numpy as np

SUMMED = ("reward", "successes", "completions", "focal_weight", "groups", "zero_spread_groups",
          "completion_tokens", "loss", "tokens", "kl", "clip_fraction", "ratio", "entropy")
METRICS = ("reward_mean", "success_rate", "focal_weight_mean", "focal_weight_min",
           "focal_weight_max", "zero_spread_groups", "kl", "clip_fraction", "ratio_mean",
           "entropy", "completion_length", "loss", "skipped_steps")


def local_sums(rollouts, adv, gradient_sums: dict, success_threshold: float = 1.0) -> dict:
    """This rank's {name: float} of :data:`SUMMED`: its rollouts (rewards (n, G)), their
    advantages (:class:`fgrpo.advantages.Advantages`) and the sums of
    :func:`fgrpo.gradients.accumulate_gradients` (over its last pass). A success is a reward
    >= ``success_threshold`` (the p of the focal weight counts the same)."""
    return dict(gradient_sums, reward=rollouts.rewards.sum().item(),
                successes=(rollouts.rewards >= success_threshold).sum().item(),
                completions=rollouts.rewards.numel(), focal_weight=adv.focal_weight.sum().item(),
                groups=adv.zero_spread.numel(), zero_spread_groups=adv.zero_spread.sum().item(),
                completion_tokens=rollouts.completion_lengths.float().sum().item())


def step_metrics(world, sums: dict, focal_weight, skipped: int) -> dict:
    """{name: float} of :data:`METRICS` over every rank (one Allgather, tag ``metrics``).
    ``focal_weight``: this rank's (n,) group weights; ``skipped``: steps skipped so far."""
    extremes = [float(focal_weight.min()), float(focal_weight.max())]
    table = world.allgather(np.array([sums[k] for k in SUMMED] + extremes), tag="metrics")
    total = dict(zip(SUMMED, table[:, :len(SUMMED)].sum(axis=0)))
    tokens = max(total["tokens"], 1.0)
    return {"reward_mean": total["reward"] / total["completions"],
            "success_rate": total["successes"] / total["completions"],
            "focal_weight_mean": total["focal_weight"] / total["groups"],
            "focal_weight_min": table[:, -2].min(), "focal_weight_max": table[:, -1].max(),
            "zero_spread_groups": total["zero_spread_groups"],
            "kl": total["kl"] / tokens, "clip_fraction": total["clip_fraction"] / tokens,
            "ratio_mean": total["ratio"] / tokens, "entropy": total["entropy"] / tokens,
            "completion_length": total["completion_tokens"] / total["completions"],
            "loss": total["loss"] / world.size, "skipped_steps": skipped}

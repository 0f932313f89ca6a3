"""Group-relative advantages with the F-GRPO focal weight.

Rewards are laid out as ``(n_groups, G)``: row i holds the G = ``num_generations`` completions of
prompt i. The advantage of completion j of group i is

    A_ij = g_i * (r_ij - mean_i) / (s + eps),   g_i = (1 - p_i)^gamma,
    p_i  = (1/G) * #{j : r_ij >= success_threshold}      (the group's success rate)

where s is chosen by ``scale_rewards`` (TRL's convention, unbiased std, ``torch.std``):

* ``"group"``: s = unbiased std of row i (divisor G - 1);
* ``"batch"``: s = unbiased std of every reward in the *global* batch (divisor N - 1);
* ``"none"``:  no division at all (Dr. GRPO), A_ij = g_i * (r_ij - mean_i).

Groups whose rewards are all equal (``zero_spread``) get advantage exactly 0.0 (TRL leaves the
rounding noise of ``r - mean`` there). p_i is the share of the group's rewards at or above
``success_threshold`` (default 1.0), the same count the trainer logs as ``success_rate``; for
0/1 rewards it equals the group mean. With rewards in {-1, 1}, 6 of 8 correct gives p = 0.75
and g = 0.25 at gamma = 1 (a clamped mean would give p = 0.5). Groups the policy always solves
(p = 1) get weight 0 when gamma > 0. gamma = 0 gives g = 1.0 exactly, and multiplying by 1.0 is
exact, so the result is bitwise plain GRPO.

``eps`` is TRL's 1e-4 by default (``fgrpo.advantage.epsilon``); verl's GRPO uses 1e-6.

Distributed use: each rank holds whole groups, so group statistics are local. For ``"batch"``
the std must be global: every rank calls :func:`batch_moments` on its rewards, the trainer sums
the (3,) float64 moments over ranks (all-reduce SUM, or allgather to ``(n_ranks, 3)``),
:func:`std_from_moments` turns them into s, and each rank passes it as ``batch_std``. With
``batch_std=None`` the same moment path runs on the local rewards, so one rank and N ranks agree.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

SCALE_REWARDS = ("group", "batch", "none")


@dataclass(frozen=True)
class Advantages:
    """Result of :func:`group_advantages` (all tensors on the rewards' device).

    advantages:   (n_groups, G) float32, focal-weighted, scaled, group-centred rewards.
    focal_weight: (n_groups,) float32, g = (1 - p)^gamma, in [0, 1].
    success_rate: (n_groups,) float32, p = share of the group's rewards >= the threshold.
    zero_spread:  (n_groups,) bool, True where every reward of the group is equal.
    """

    advantages: Tensor
    focal_weight: Tensor
    success_rate: Tensor
    zero_spread: Tensor


def batch_moments(rewards: Tensor) -> Tensor:
    """(3,) float64 ``[count, sum, sum of squares]`` of all rewards; sum these over ranks."""
    r = rewards.detach().to(torch.float64).reshape(-1)
    return torch.stack([r.new_tensor(float(r.numel())), r.sum(), (r * r).sum()])


def std_from_moments(moments) -> float:
    """Unbiased std (divisor count - 1) from summed moments, shape (3,) or (n_ranks, 3)."""
    summed = torch.as_tensor(moments, dtype=torch.float64).reshape(-1, 3).sum(0)
    count, total, squares = summed.tolist()
    if count < 2:
        raise ValueError(f"the batch std needs at least 2 rewards, got {int(count)}")
    return max(squares - total * total / count, 0.0) ** 0.5 / (count - 1) ** 0.5


def group_advantages(rewards: Tensor, scale_rewards: str, gamma: float, eps: float = 1e-4,
                     batch_std: float | None = None, success_threshold: float = 1.0,
                     task_rewards: Tensor | None = None) -> Advantages:
    """F-GRPO advantages of ``rewards`` (n_groups, G), see the module docstring.

    ``eps`` is added to the std (TRL's 1e-4; verl's 1e-6). ``batch_std`` is the global unbiased
    std for ``scale_rewards="batch"`` (from :func:`std_from_moments`); ignored by the other
    modes. A reward >= ``success_threshold`` counts as a success in p; ``task_rewards``
    (n_groups, G), if given, decide success instead of ``rewards`` (the overlong-shaped
    rewards give the advantages, the task's rewards the success rate). Raises ValueError for
    gamma < 0, eps < 0, G < 2, a non-2-D ``rewards`` or an unknown ``scale_rewards``.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if gamma < 0:
        raise ValueError(f"focal gamma must be >= 0, got {gamma}")
    if eps < 0:
        raise ValueError(f"the advantage epsilon must be >= 0, got {eps}")
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(f"rewards must be (n_groups, G) with G >= 2, got {tuple(rewards.shape)}")
    r = rewards.detach().to(torch.float32)
    mean = r.mean(dim=1, keepdim=True)
    adv = r - mean
    if scale_rewards == "group":
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    elif scale_rewards == "batch":
        std = std_from_moments(batch_moments(r)) if batch_std is None else batch_std
        adv = adv / (std + eps)
    zero_spread = r.amax(dim=1) == r.amin(dim=1)
    adv = torch.where(zero_spread[:, None], torch.zeros_like(adv), adv)
    scored = r if task_rewards is None else task_rewards.detach().to(torch.float32)
    p = (scored >= success_threshold).to(torch.float32).mean(dim=1)
    weight = torch.pow(1.0 - p, float(gamma))  # pow(x, 0) == 1 exactly, even for x = 0
    return Advantages(adv * weight[:, None], weight, p, zero_spread)

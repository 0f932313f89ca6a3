"""GRPO's and DAPO's surrogate: PPO's clipped importance ratio, with the dual clip.

    pg_bt = -min(rho * A_b, clip(rho, 1 - epsilon, 1 + epsilon_high) * A_b)

Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729; verl's ``clip_ratio_c``, 3.0 there), off by
default as in TRL: with ``clip_ratio_c = c > 1``, tokens with A_b < 0 use ``min(pg_bt, -c *
A_b)``, so a large ratio on a negative-advantage token cannot make its loss (and gradient)
unbounded; tokens with A_b >= 0 are unchanged. The gradient is 0 on a token its clip acts on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Clip:
    """``fgrpo.surrogate=clip``: its parameters are ``fgrpo.epsilon``, ``fgrpo.epsilon_high``
    and ``fgrpo.clip_ratio_c``."""

    epsilon: float = 0.2
    epsilon_high: float = 0.28
    clip_ratio_c: float = 0.0
    KEYS = {"epsilon": "epsilon", "epsilon_high": "epsilon_high",
            "clip_ratio_c": "clip_ratio_c"}

    def __post_init__(self):
        if self.clip_ratio_c != 0.0 and not self.clip_ratio_c > 1.0:
            raise ValueError(f"clip_ratio_c must be 0 (off) or > 1, got {self.clip_ratio_c}")

    def __call__(self, logp: Tensor, ratio: Tensor, adv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1.0 - self.epsilon, 1.0 + self.epsilon_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        dual = torch.zeros_like(per_token, dtype=torch.bool)
        if self.clip_ratio_c:
            bound = -self.clip_ratio_c * adv  # > 0 where A < 0
            dual = (adv < 0) & (per_token > bound)
            per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
        return per_token, clipped < unclipped, dual

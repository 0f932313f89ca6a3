"""GRPO's and DAPO's surrogate: PPO's clipped importance ratio, with the dual clip.

    pg_bt = -min(rho * A_b, clip(rho, 1 - epsilon, 1 + epsilon_high) * A_b)

Dual-clip PPO (Ye et al. 2020, arXiv 1912.09729; verl's ``clip_ratio_c``, 3.0 there), off by
default as in TRL: with ``ratio_c = c > 1``, tokens with A_b < 0 use ``min(pg_bt, -c * A_b)``,
so a large ratio on a negative-advantage token cannot make its loss (and gradient) unbounded;
tokens with A_b >= 0 are unchanged. The gradient is 0 on a token its clip acts on.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpc.runtime.config import param
from hpc.runtime.errors import UserError


@dataclass
class Clip:
    """``fgrpo.loss.surrogate=clip``; its keys are ``fgrpo.loss.clip.*``."""

    epsilon: float = param(0.2, "lower clip of the importance ratio: 1 - this", min=0.0,
                           max=10.0)
    epsilon_high: float = param(0.2, "upper clip: 1 + this (0.2: GRPO in the F-GRPO paper; "
                                "fgrpo.algorithm=dapo sets DAPO's clip-higher 0.28)",
                                min=0.0, max=10.0)
    ratio_c: float = param(0.0, "dual-clip PPO (verl clip_ratio_c, 3 there): the loss of a "
                           "negative-advantage token A < 0 is capped at -ratio_c * A; 0 = off "
                           "(as TRL), else > 1", min=0.0, max=1000.0)

    def __post_init__(self):
        self.check("fgrpo.loss.clip")

    def check(self, key: str) -> None:
        if self.ratio_c != 0.0 and not self.ratio_c > 1.0:
            raise UserError(f"config key '{key}.ratio_c': {self.ratio_c} must be 0 (dual clip "
                            f"off) or > 1")

    def __call__(self, logp, ratio, adv):
        import torch

        unclipped = ratio * adv
        clipped = torch.clamp(ratio, 1.0 - self.epsilon, 1.0 + self.epsilon_high) * adv
        per_token = -torch.minimum(unclipped, clipped)
        dual = torch.zeros_like(per_token, dtype=torch.bool)
        if self.ratio_c:
            bound = -self.ratio_c * adv  # > 0 where A < 0
            dual = (adv < 0) & (per_token > bound)
            per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
        return per_token, clipped < unclipped, dual

"""MiniMax-M1's CISPO (arXiv 2506.13585, eq. 4-5): the importance weight itself is clipped under
a stop-gradient ``sg``, so every token keeps the gradient -w_bt * A_b of log pi.

    pg_bt = -sg(clip(rho, 1 - epsilon_low, 1 + epsilon_high)) * A_b * logp_bt

TRL's ``loss_type="cispo"`` is ``-clamp(rho, max=epsilon_high).detach() * A * logp`` (no lower
bound; its docs suggest ``epsilon_high=5.0``): the same as ``epsilon_low=1`` (lower bound 0)
and ``epsilon_high=4`` here, the package's defaults. With mu = 1 pass rho = 1, so CISPO and the
clip surrogate have the same REINFORCE gradient -A * grad logp.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CISPO:
    """``fgrpo.surrogate=cispo``: its parameters are ``fgrpo.cispo_epsilon_low`` and
    ``fgrpo.cispo_epsilon_high``; it has no dual clip."""

    epsilon_low: float = 1.0
    epsilon_high: float = 4.0
    KEYS = {"epsilon_low": "cispo_epsilon_low", "epsilon_high": "cispo_epsilon_high"}

    def __call__(self, logp: Tensor, ratio: Tensor, adv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        weight = torch.clamp(ratio, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high).detach()
        return -weight * adv * logp, weight != ratio, torch.zeros_like(ratio, dtype=torch.bool)

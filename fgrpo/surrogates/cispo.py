"""MiniMax-M1's CISPO (arXiv 2506.13585, eq. 4-5): the importance weight itself is clipped under
a stop-gradient ``sg``, so every token keeps the gradient -w_bt * A_b of log pi.

    pg_bt = -sg(clip(rho, 1 - epsilon_low, 1 + epsilon_high)) * A_b * logp_bt

The bounds follow MiniMax-M1's convention: (epsilon_low, epsilon_high) = (1.0, 5.0), the
F-GRPO paper's pair and the defaults, clip the weight to [0, 6]. TRL's ``loss_type="cispo"``
is ``-clamp(rho, max=epsilon_high).detach() * A * logp`` (no lower bound; its docs suggest
``epsilon_high=5.0``): the same as ``epsilon_low=1`` and ``epsilon_high=4`` here
(:data:`fgrpo.config.PRESET_TABLE` says why the paper's pair is read in the first convention). With mu = 1 pass rho = 1, so CISPO and the
clip surrogate have the same REINFORCE gradient -A * grad logp.
"""
from __future__ import annotations

from dataclasses import dataclass

from hpc.runtime.config import param


@dataclass
class CISPO:
    """``fgrpo.loss.surrogate=cispo``; its keys are ``fgrpo.loss.cispo.*``. It has no dual
    clip."""

    epsilon_low: float = param(1.0, "the importance weight's lower bound is 1 - this (1 = "
                               "none)", min=0.0, max=1.0)
    epsilon_high: float = param(5.0, "its upper bound is 1 + this (MiniMax-M1's convention; "
                                "5: the F-GRPO paper's, weight in [0, 6]; TRL's "
                                "epsilon_high=5.0 is 4 here)", min=0.0, max=1000.0)

    def __call__(self, logp, ratio, adv):
        import torch

        weight = torch.clamp(ratio, 1.0 - self.epsilon_low, 1.0 + self.epsilon_high).detach()
        return -weight * adv * logp, weight != ratio, torch.zeros_like(ratio, dtype=torch.bool)

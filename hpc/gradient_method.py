"""What the methods that train weights by gradient (SFT, F-GRPO) share as job-loop methods:
evaluating their model, exporting its adapter, and checkpointing the trained weights with the
optimizer state."""
from __future__ import annotations

import numpy as np
import torch

from hpc.evaluate import evaluate
from hpc.models.loading import enable_activation_checkpointing, save_adapter
from hpc.job.loop import Method


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of one rank's random draws at one step: a function of (seed, step, rank) alone,
    so a resumed run draws what an uninterrupted one drew, whatever each rank drew before."""
    return int(np.random.default_rng([seed, step, rank]).integers(2 ** 31))


def shared_step_seed(seed: int, step: int, round_: int = 0) -> int:
    """The seed of one step's draws that every rank shares (the keyed sampling of the step's
    rollouts, :mod:`hpc.models.sampling`; ``round_``: dynamic sampling's refill round): a
    function of (seed, step, round) alone, not of the rank or the rank count (a key no rank's
    :func:`step_seed` uses)."""
    return int(np.random.default_rng([seed, step, 2 ** 32 + round_]).integers(2 ** 31))


class GradientMethod(Method):
    """A :class:`hpc.job.loop.Method` whose subclass sets ``model`` (peft or plain), ``tok``,
    ``task`` and ``weights`` (:class:`hpc.models.parallelize.TrainedWeights`: the trained
    tensors, their fp32 masters, AdamW and the gradient all-reduce), which it checkpoints."""

    def checkpoint_activations(self) -> bool:
        """Turn on activation checkpointing of ``model`` where ``model.activation_checkpointing``
        resolves to on (the job's plan, :class:`hpc.plan.registry.JobPlan`); returns whether
        it did."""
        on = self.job.plan.activation_checkpointing
        if on:
            enable_activation_checkpointing(self.model)
        return on

    def train_mode(self, i: int) -> None:
        """Put the model in training mode for step ``i`` and seed torch's RNG (LoRA dropout
        draws from it) from (run.seed, i, rank). Ranks draw different amounts (their shares of
        a batch differ in length), so a carried-over RNG state would be per rank; a keyed one
        needs no checkpoint and survives a resume on a different number of ranks."""
        self.model.train()
        torch.manual_seed(step_seed(self.job.cfg.run.seed, i, self.job.world.rank))

    def evaluate(self, sampled: bool):
        cfg = self.job.cfg
        self.model.eval()
        return evaluate(self.model, self.tok, self.task, self.task.eval, cfg.eval,
                        cfg.task.max_new_tokens, self.job.world, self.job.decoder,
                        seed=cfg.run.seed, sampled=sampled, next_decode=self.next_decode())

    def heldout(self) -> dict:
        return {"accuracy": self.evaluate(sampled=False).accuracy}

    def export(self, out_dir: str, step: int) -> None:
        save_adapter(self.model, f"{out_dir}/adapter")

    def state_dict(self) -> dict:
        """The trained weights (fp32 masters) and their AdamW state."""
        return self.weights.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Checked first (:meth:`hpc.models.parallelize.TrainedWeights.load_state_dict`): one
        tensor per trained parameter, of its shape and dtype, and an optimizer state AdamW
        accepts; a mismatch is one line."""
        self.weights.load_state_dict(state)

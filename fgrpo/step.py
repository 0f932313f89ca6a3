"""The F-GRPO update of one step, as a plain function of (policy, optimizer, rollouts, config):
what :class:`fgrpo.trainer.FGRPO` runs after its rollouts and ``benchmarks/gpu_check.py`` times.

:func:`train_on_rollouts`, top to bottom:

1. focal-weighted group advantages of the shaped rewards (:mod:`fgrpo.advantages`), p from the
   task's rewards;
2. the frozen log-probs: the sampling policy's where any update is off-policy (a second PPO
   epoch, or a mini-batch after the first), the reference's for the KL term;
3. ``fgrpo.optim.num_iterations`` PPO epochs, each of U = batch_prompts / mini_batch_prompts
   optimizer updates: loss and backward over the update's groups in micro-batches, the gradient
   all-reduce, AdamW. Group i of the step's kept groups (``StepRollouts.order``, the same on
   any number of ranks) goes to update i mod U, so an update's groups do not depend on the rank
   count; under FSDP2 a rank with fewer rows of an update (or of dynamic sampling's kept
   groups) runs idle forwards to keep the collectives in step. The loss of
   an update is normalised over that update's groups on all ranks (:mod:`fgrpo.loss`). With
   U = 1 (``mini_batch_prompts`` 0 or ``batch_prompts``) and one epoch the ratio is 1 and the
   step is the single update of earlier versions, bit for bit.

A NaN/inf gradient skips the update and the rest of the step (weights and optimizer state
untouched). The learning rate of step i is :func:`learning_rate` (linear warm-up).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import numpy as np
import torch

from fgrpo.advantages import Advantages, batch_moments, group_advantages, std_from_moments
from fgrpo.gradients import GRADIENT_SUMS, accumulate_gradients, most_micro_batches
from hpc.models.logprobs import sequence_logprobs


class _Untimed:
    """A timer that times nothing (the :class:`hpc.runtime.timing.PhaseTimer` interface)."""

    def phase(self, name: str):
        return contextlib.nullcontext()


class OneProcess:
    """The :class:`hpc.runtime.world.World` of a caller without MPI (a benchmark, a test): one
    rank, so every all-gather is its own row and no all-reduce runs."""

    size, rank, timeout_s = 1, 0, None

    def allgather(self, send, tag: str = "") -> np.ndarray:
        return np.asarray(send)[None]

    def arrive(self, label: str, timeout_s) -> None:
        pass


@dataclass
class Update:
    """What :func:`train_on_rollouts` did on this rank: the trained groups' ``advantages``,
    ``sums`` of :data:`fgrpo.gradients.GRADIENT_SUMS` over the last epoch's updates (``loss``
    their mean), ``finite`` (False: a NaN/inf gradient stopped the step), ``updates`` (AdamW
    steps taken) and ``per_update``: this rank's ``{"ratio_mean", "clip_fraction",
    "tokens"}`` of each update, in order (token-weighted over its rows; 0 tokens: no rows)."""

    advantages: Advantages
    sums: dict
    finite: bool = True
    updates: int = 0
    per_update: list = field(default_factory=list)


@torch.no_grad()
def frozen_logprobs(model, rollouts, micro_batch: int, chunk: int,
                    most: int | None = None) -> torch.Tensor:
    """Log-probs of all rollouts without gradient: (rows, T-1) float32; ``chunk``: positions
    per LM-head chunk (model.logprob_chunk, 0 = full logits). ``most`` (FSDP2: every forward
    is collective): the most micro-batches any rank runs; this rank runs a two-token forward
    for each it lacks."""
    ids = rollouts.input_ids
    starts = range(0, ids.shape[0], micro_batch)
    for _ in range((most or 0) - len(starts)):
        idle = torch.zeros((1, 2), dtype=torch.long, device=ids.device)
        sequence_logprobs(model, idle, torch.ones_like(idle), chunk)
    parts = [sequence_logprobs(model, *rollouts.rows(s, s + micro_batch)[:2], chunk)[0]
             for s in starts]
    return torch.cat(parts) if parts else ids.new_zeros((0, ids.shape[1] - 1), dtype=torch.float32)


@contextlib.contextmanager
def reference_model(model, ref_model):
    """The model that computes reference log-probs: ``ref_model`` (full fine-tuning) or, under
    LoRA, ``model`` itself with its adapter disabled for the duration."""
    if ref_model is not None:
        yield ref_model
        return
    with model.disable_adapter():
        yield model


def updates_per_epoch(f) -> int:
    """U: optimizer updates per PPO epoch of the ``fgrpo`` section ``f``."""
    return f.batch_prompts // (f.optim.mini_batch_prompts or f.batch_prompts)


def learning_rate(optim, step: int) -> float:
    """The learning rate of step ``step`` (from 0): ``optim.learning_rate * min(1, step /
    optim.warmup_steps)``, the constant rate without warm-up."""
    if optim.warmup_steps == 0:
        return optim.learning_rate
    return optim.learning_rate * min(1.0, step / optim.warmup_steps)


def mini_batches(order: torch.Tensor | None, groups: int, updates: int) -> list:
    """(groups,) bool masks of this rank's groups, one per update: the groups whose place in
    the step (``order``; None: 0, 1, ... here) is j mod ``updates``; [None] for one update
    (all groups)."""
    if updates == 1:
        return [None]
    place = torch.arange(groups) if order is None else order
    return [place % updates == j for j in range(updates)]


def train_on_rollouts(model, weights, batch, cfg, world=None, step: int = 0, seed: int = 0, *,
                      timer=None, ref_model=None) -> Update:
    """Train ``model`` (its tensors in ``weights``, a
    :class:`hpc.models.parallelize.TrainedWeights`) on this rank's ``batch`` (a
    :class:`fgrpo.rollout.StepRollouts`) under ``cfg`` (an ``FGRPOJobConfig``), ``world`` the
    job's ranks (every rank calls this together; None: one process, :class:`OneProcess`).
    ``step``: the step's number (the warm-up); ``seed``: torch's seed for the training
    forward (LoRA dropout); ``timer``: phases
    forward_backward, waiting, allreduce, optimizer; ``ref_model``: the full fine-tuning
    reference (LoRA: the adapter disabled). See the module docstring."""
    f, timer, world = cfg.fgrpo, timer or _Untimed(), world or OneProcess()
    rollouts = batch.train
    # 1. focal-weighted advantages of the shaped rewards, p from the task's rewards
    batch_std = None
    if f.advantage.scale_rewards == "batch":  # moments summed over ranks
        batch_std = std_from_moments(world.allgather(
            batch_moments(rollouts.shaped_rewards).numpy(), tag="metrics"))
    adv = group_advantages(rollouts.shaped_rewards, f.advantage.scale_rewards,
                           f.advantage.gamma, eps=f.advantage.epsilon, batch_std=batch_std,
                           success_threshold=f.reward.success_threshold,
                           task_rewards=rollouts.rewards)
    # 2. the frozen log-probs: the sampling policy's (off-policy updates), the reference's (KL)
    U = updates_per_epoch(f)
    lockstep = weights.sharded  # FSDP2: every rank runs as many forwards as the busiest
    with timer.phase("forward_backward"):
        def frozen(m):
            rows, mb = rollouts.input_ids.shape[0], f.optim.micro_batch
            most = most_micro_batches(world, -(-rows // mb)) if lockstep else None
            return frozen_logprobs(m, rollouts, mb, cfg.model.logprob_chunk, most)
        old_logp = frozen(model) if f.optim.num_iterations > 1 or U > 1 else None
        ref_logp = None
        if f.loss.beta > 0:
            with reference_model(model, ref_model) as ref:
                ref_logp = frozen(ref)
    # 3. PPO epochs x U updates: loss and backward, all-reduce, AdamW (NaN/inf: step stopped)
    model.train()
    torch.manual_seed(seed)
    weights.set_learning_rate(learning_rate(f.optim, step))
    row_adv = adv.advantages.reshape(-1).to(rollouts.input_ids.device)
    G = f.sampling.num_generations
    parts = mini_batches(batch.order, rollouts.rewards.shape[0], U)
    out = Update(adv, dict.fromkeys(GRADIENT_SUMS, 0.0))
    for epoch in range(f.optim.num_iterations):
        sums = dict.fromkeys(GRADIENT_SUMS, 0.0)
        for groups in parts:
            part, part_adv, old, ref = rollouts, row_adv, old_logp, ref_logp
            if groups is not None:
                rows = groups.repeat_interleave(G).to(row_adv.device)
                part, part_adv = rollouts.groups(groups), row_adv[rows]
                old = None if old is None else old[rows.to(old.device)]
                ref = None if ref is None else ref[rows.to(ref.device)]
            weights.zero_grad()
            with timer.phase("forward_backward"):
                got = accumulate_gradients(model, part, part_adv, cfg, world,
                                           cfg.task.max_new_tokens, old, ref, lockstep)
                weights.ensure_gradients()  # no rows here: zeros to all-reduce
            with timer.phase("waiting"):
                world.arrive("gradient all-reduce", cfg.run.collective_timeout_s)
            with timer.phase("allreduce"):  # FSDP2 reduce-scattered during the backward
                weights.reduce_gradients(world)
            with timer.phase("optimizer"):
                out.finite = weights.step(f.optim.max_grad_norm)
            tokens = max(got["tokens"], 1.0)
            out.per_update.append({"ratio_mean": got["ratio"] / tokens,
                                   "clip_fraction": got["clip_fraction"] / tokens,
                                   "tokens": got["tokens"]})
            for key in GRADIENT_SUMS:
                sums[key] += got[key]
            if not out.finite:
                break
            out.updates += 1
        sums["loss"] /= len(out.per_update) - epoch * len(parts)  # the mean over its updates
        out.sums = sums
        if not out.finite:
            break
    weights.free_gradients()
    return out

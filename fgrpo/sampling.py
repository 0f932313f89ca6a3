"""One step's rollouts: prompts drawn from the shared seed, and DAPO's dynamic sampling.

Round 0 draws ``fgrpo.batch_prompts`` prompts with the key (run.seed, step); every rank rolls
out its contiguous share. Completion j of the round's prompt i is sampled with the key
(:func:`hpc.gradient_method.shared_step_seed` (run.seed, step, round), i, j), so a rollout does not
depend on which rank, or how many ranks, sample it.

Dynamic sampling (DAPO, arXiv 2503.14476 sec. 3.2; verl's ``algorithm.filter_groups``,
``metric=acc``): a group whose task rewards are all equal has advantage 0 and no gradient.
After each round every rank learns every group's uniformity (one byte a group, Allgatherv, tag
``sampling``) and all ranks keep the same groups: the informative ones in (round, prompt)
order, until ``batch_prompts`` are kept. While fewer are kept and fewer than
``fgrpo.sampling.max_refills`` extra rounds ran, round r >= 1 draws ``batch_prompts`` new prompts
with the key (run.seed, step, r) (as verl draws whole generation batches). What a round draws is a
function of (seed, step, round) alone: the kept groups do not depend on the rank count, and a
step a preemption interrupts in the middle of a refill reruns from its round 0 on resume,
drawing the same. When the rounds run out the step trains on the groups it has and logs the
shortfall. A rank keeps the groups it sampled, so ranks may train on different numbers of
groups (the loss's global normaliser keeps the gradient the single-process one).

The focal weight (1 - p)^gamma is computed after the filtering, on the kept groups, from each
group's own sampled success rate p (its G completions; filtering removes whole groups, so it
never changes a kept group's p). Filtered groups are the p = 0 and p = 1 ones (binary
rewards): F-GRPO's weight would have been 1 and 0 there, on a zero advantage either way.
"""
from __future__ import annotations

import numpy as np
import torch

from fgrpo.rollout import RolloutRequest, StepRollouts, cat_rollouts, sample_rollouts
from hpc.gradient_method import shared_step_seed
from hpc.runtime.world import my_slice, split_evenly

# Per-step statistics of the sampling (the same on every rank), logged as metrics.
SAMPLING_STATS = ("sampling_rounds", "filtered_groups", "filtered_share", "extra_rollouts",
                  "shortfall_groups")


def round_prompts(seed: int, step: int, round_: int, n_train: int, n: int) -> np.ndarray:
    """Indices of the ``n`` (at most ``n_train``) training prompts of one sampling round."""
    key = [seed, step] if round_ == 0 else [seed, step, round_]
    return np.random.default_rng(key).choice(n_train, size=min(n, n_train), replace=False)


def keep_informative(uniform: np.ndarray, need: int) -> np.ndarray:
    """(n,) bool: the first ``need`` groups whose rewards are not all equal (``uniform``)."""
    informative = ~uniform.astype(bool)
    return informative & (np.cumsum(informative) <= need)


def sample_step(model, tok, task, cfg, world, step: int, timer, decoder) -> StepRollouts:
    """The step's rollouts (see the module docstring), decoded by ``decoder`` (the job's
    :class:`hpc.engine.engine_backend.EngineBackend`); collective when dynamic sampling is on."""
    f, seed = cfg.fgrpo, cfg.run.seed
    target = min(f.batch_prompts, len(task.train))
    kept, order, first, have, filtered, drawn, rounds = [], [], None, 0, 0, 0, 0
    for r in range(1 + (f.sampling.max_refills if f.sampling.dynamic_sampling else 0)):
        batch = round_prompts(seed, step, r, len(task.train), f.batch_prompts)
        share = my_slice(len(batch), world)
        mine = batch[share]
        request = RolloutRequest([task.train.prompts[j] for j in mine],
                                 [task.train.answers[j] for j in mine], cfg.task.max_new_tokens,
                                 cfg.model.decode_batch, shared_step_seed(seed, step, r),
                                 first_index=share.start)
        rollouts = sample_rollouts(model, tok, task, f, request, decoder=decoder, timer=timer)
        first = rollouts if first is None else first
        rounds, drawn = rounds + 1, drawn + len(batch)
        if not f.sampling.dynamic_sampling:
            kept.append(rollouts)
            order.append(np.arange(share.start, share.stop))
            have = target
            break
        r_ = rollouts.rewards
        uniform = world.allgatherv((r_.amax(1) == r_.amin(1)).numpy().astype(np.uint8),
                                   split_evenly(len(batch), world.size), tag="sampling")
        take = keep_informative(uniform, target - have)
        filtered += int(uniform.sum())
        order.append((have + np.cumsum(take) - 1)[share][take[share]])
        have += int(take.sum())
        kept.append(rollouts.groups(torch.from_numpy(take[share].copy())))
        if have >= target:
            break
    stats = {"sampling_rounds": rounds, "filtered_groups": filtered,
             "filtered_share": filtered / drawn,
             "extra_rollouts": (drawn - target) * f.sampling.num_generations,
             "shortfall_groups": target - have}
    return StepRollouts(cat_rollouts(kept, tok.pad_token_id), first, stats,
                        torch.from_numpy(np.concatenate(order).astype(np.int64)))

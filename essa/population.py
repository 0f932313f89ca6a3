"""Population evaluation: which rank scores which member, and the fitness of a member.

Members are split over ranks in contiguous blocks (:func:`hpc.runtime.world.split_evenly`, any
P >= N). A member's fitness is the mean reward of greedy completions on the generation's
minibatch, identical whichever rank computes it (same prompts, same decoding batches). k members
decode together in one call of the job's decoding backend (:mod:`hpc.engine.backend`), each
request tagged with its member: on the package's engine their factors are stacked and every row
applies its own; on ``hf`` k adapters share one ``generate`` call, member-major. Either way the
model's own adapter is untouched, and fitness equals one member at a time wherever greedy
tokens agree (:mod:`hpc.engine.hf_backend` says when that is bitwise).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import torch

from hpc.engine.generate import member_completions
from hpc.runtime.world import split_evenly


def owners(population: int, n_ranks: int) -> np.ndarray:
    """Rank that evaluates each member: int16 (population,)."""
    counts = split_evenly(population, n_ranks)
    return np.repeat(np.arange(n_ranks, dtype=np.int16), counts)


def minibatch_indices(n_train: int, size: int, seed: int, generation: int) -> np.ndarray:
    """The generation's minibatch of training prompts, the same on every rank: int64 (size,)."""
    rng = np.random.default_rng([seed, generation])
    return rng.choice(n_train, size=min(size, n_train), replace=False)


def mean_reward(task, completions: list, answers: list, cache: dict) -> float:
    """Mean of ``task.rewards`` over (completion, answer) pairs; only pairs missing from
    ``cache`` ({pair: reward}, filled in) are scored: members of one generation mostly write
    the same completions. Same value as ``np.mean(task.rewards(completions, answers))``."""
    pairs = list(zip(completions, answers))
    new = list(dict.fromkeys(p for p in pairs if p not in cache))
    if new:
        cache.update(zip(new, task.rewards([c for c, _ in new], [a for _, a in new])))
    return float(np.mean([cache[p] for p in pairs]))


def padded_group(factors: dict, start: int, k: int) -> dict:
    """Members start .. start+k-1 of ``factors``; a short last group is padded with copies of
    its first member (never decoded), so an engine keeps one shape for every group."""
    group = {}
    for name, (a, b) in factors.items():
        a, b = a[start:start + k], b[start:start + k]
        pad = k - a.shape[0]
        group[name] = (torch.cat([a] + [a[:1]] * pad), torch.cat([b] + [b[:1]] * pad))
    return group


@dataclass(frozen=True)
class ScoringRequest:
    """One generation's scoring on one rank: which members, on which prompts, decoded how.

    members: float64 (n, dim), the members' coordinates in the search space.
    prompts, answers: the generation's minibatch (m strings each, the same on every rank).
    max_new_tokens: tokens a completion may add (``task.max_new_tokens``).
    decode_batch: prompts per decoding batch (``model.decode_batch``).
    members_per_pass: k, members decoded together (``essa.members_per_pass``, capped by n):
    a call decodes up to ``decode_batch * k`` rows.
    """

    members: np.ndarray
    prompts: list
    answers: list
    max_new_tokens: int
    decode_batch: int
    members_per_pass: int = 1


def score_members(model, tokenizer, space, task, request: ScoringRequest, *, decoder,
                  timer) -> np.ndarray:
    """Fitness of each member of ``request``: mean reward in [0, 1], float64 (n,).

    ``decoder``: the job's backend. Phases of ``timer``: ``rebuild`` (A', B' of all n members
    in one vectorised call, then sliced per group), ``generate``, ``reward``.
    """
    members = request.members
    with timer.phase("rebuild"):
        k = max(1, min(request.members_per_pass, len(members)))
        factors = space.factors_batch(members)
    fitness = np.empty(len(members), dtype=np.float64)
    cache = {}
    for g in range(0, len(members), k):
        n_group = min(k, len(members) - g)
        with timer.phase("rebuild"):
            group = padded_group(factors, g, k)
        with timer.phase("generate"):
            texts = member_completions(model, tokenizer, group, request.prompts,
                                       request.max_new_tokens, request.decode_batch,
                                       decoder=decoder, n_members=n_group)
        with timer.phase("reward"):
            for m, completions in enumerate(texts):
                fitness[g + m] = mean_reward(task, completions, request.answers, cache)
    return fitness

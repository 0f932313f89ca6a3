"""Population evaluation: which rank scores which member, and the fitness of a member.

Members are split over ranks in contiguous blocks (:func:`hpc.runtime.world.split_evenly`, any
P >= N). A member's fitness is the mean reward of greedy completions on the generation's
minibatch, identical whichever rank computes it (same prompts, same generation batching).
"""
from __future__ import annotations

import numpy as np

from essa.batched import score_members_batched, score_members_engine
from hpc.engine.generate import generate
from hpc.runtime.world import split_evenly


def owners(population: int, n_ranks: int) -> np.ndarray:
    """Rank that evaluates each member: int16 (population,)."""
    counts = split_evenly(population, n_ranks)
    return np.repeat(np.arange(n_ranks, dtype=np.int16), counts)


def minibatch_indices(n_train: int, size: int, seed: int, generation: int) -> np.ndarray:
    """The generation's minibatch of training prompts, the same on every rank: int64 (size,)."""
    rng = np.random.default_rng([seed, generation])
    return rng.choice(n_train, size=min(size, n_train), replace=False)


def score_members(model, tokenizer, space, members: np.ndarray, task, prompts: list,
                  answers: list, max_new_tokens: int, batch_size: int, timer, decoder,
                  k: int = 1) -> np.ndarray:
    """Fitness of each row of ``members`` (n, dim): mean reward in [0, 1], float64 (n,).

    Decoded by ``decoder`` (the job's :class:`hpc.engine.decoder.Decoder`). On the decoding
    engine (``model.engine=engine``) k members decode together, each row
    tagged with its member (:func:`essa.batched.score_members_engine`, any k, the model's
    adapter untouched). On the reference path ``hf``, ``k`` > 1 scores k members per batched
    generation (:mod:`essa.batched`, same fitness), and with k = 1 the model's adapter is left
    holding the last member's weights; callers re-apply what they need next.
    """
    if decoder.path == "engine":
        return score_members_engine(model, tokenizer, space, members, task, prompts, answers,
                                    max_new_tokens, batch_size, timer, k, decoder)
    if k > 1:
        return score_members_batched(model, tokenizer, space, members, task, prompts, answers,
                                     max_new_tokens, batch_size, timer, k, decoder)
    fitness = np.empty(len(members), dtype=np.float64)
    for i, x in enumerate(members):
        with timer.phase("rebuild"):
            space.apply(model, x)
        with timer.phase("generate"):
            completions = generate(model, tokenizer, prompts, max_new_tokens,
                                   batch_size=batch_size, decoder=decoder, path="hf")
        with timer.phase("reward"):
            fitness[i] = float(np.mean(task.rewards(completions, answers)))
    return fitness

"""Run under mpirun: each rank scores its block of members one at a time and batched.

The case (:func:`build_case`) is a tiny random Qwen2 with a random-B LoRA, members drawn wide
enough that completions differ between members, prompts of different lengths (left padding),
and a reward that hashes the completion text. Rank 0 writes every rank's fitness of both paths,
and whether their completions agree, as JSON to argv[1].
"""
import json
import sys
import zlib

import numpy as np
import torch

from essa.population import ScoringRequest, owners, score_members
from hpc.engine.backend import make_backend
from hpc.engine.generate import generate, member_completions
from hpc.models.adapter_space import SingularValueSpace
from hpc.models.loading import attach_lora, randomize_lora_b
from hpc.toys.toy import tiny_model
from hpc.runtime.timing import PhaseTimer

N_MEMBERS = 5
N_PROMPTS = 28  # with BATCH = 16: generate chunks of 16 and 12 prompts
BATCH = 16
MAX_NEW = 6


class HashTask:
    """Reward = crc32 of completion and answer / 2^32, in [0, 1): any token changes it."""

    @staticmethod
    def rewards(completions: list, answers: list) -> list:
        return [zlib.crc32(f"{c}|{a}".encode()) / 2 ** 32 for c, a in zip(completions, answers)]


def build_case():
    """(peft model, tokenizer, space, members (N_MEMBERS, dim) float64, prompts, answers)."""
    model, tok = tiny_model(hidden=64, layers=2)
    peft_model = attach_lora(model, 4, 8.0, ["q_proj", "k_proj", "v_proj", "o_proj"])
    randomize_lora_b(peft_model, 0.5, torch.Generator().manual_seed(1))
    space = SingularValueSpace.from_peft(peft_model)
    members = np.random.default_rng(0).normal(0.0, 0.5, (N_MEMBERS, space.dim))
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 10 ** rng.integers(1, 4, (2, N_PROMPTS)))  # 1- to 3-digit operands
    prompts = [f"{x}+{y}=" for x, y in zip(a, b)]  # lengths 4..8: left padding in chunks
    return peft_model, tok, space, members, prompts, [str(x + y) for x, y in zip(a, b)]


def score(case, members, k: int) -> np.ndarray:
    """Fitness (n,) float64 of ``members``: k per generation through ESSA's score_members on
    the hf backend; k = 1: the mean reward of peft's own completions (:func:`completions`)."""
    model, tok, space, _, prompts, answers = case
    if k == 1:
        return np.array([np.mean(HashTask.rewards(texts, answers))
                         for texts in completions(case, members, 1)])
    timer = PhaseTimer(["rebuild", "generate", "reward"])
    return score_members(model, tok, space, HashTask(),
                         ScoringRequest(members, prompts, answers, MAX_NEW, BATCH, k),
                         decoder=make_backend("hf"), timer=timer)


def completions(case, members, k: int) -> list:
    """Greedy completions of each member (n lists of N_PROMPTS strings), k per generation;
    k = 1 is peft's own LoRA path, one member at a time."""
    model, tok, space, _, prompts, _ = case
    if k == 1:
        out = []
        for x in members:
            space.apply(model, x)
            out.append(generate(model, tok, prompts, MAX_NEW, batch_size=BATCH, backend="hf"))
        return out
    return [texts for g in range(0, len(members), k)
            for texts in member_completions(model, tok, space.factors_batch(members[g:g + k]),
                                            prompts, MAX_NEW, BATCH, backend="hf")]


def main(out_path: str, k: int = 2) -> None:
    from hpc.runtime.world import get_world

    world = get_world()
    case = build_case()
    mine = case[3][owners(N_MEMBERS, world.size) == world.rank]
    one_fit, batch_fit = score(case, mine, 1), score(case, mine, k)
    one_text, batch_text = completions(case, mine, 1), completions(case, mine, k)
    report = {"rank": world.rank, "k": k, "members": len(mine),
              "one_at_a_time": one_fit.tolist(), "batched": batch_fit.tolist(),
              "bitwise": bool(np.array_equal(one_fit, batch_fit)),
              "same_completions": one_text == batch_text,
              "distinct_completions": len({tuple(t) for t in one_text})}
    reports = world.comm.gather(report, root=0)
    if world.is_root:
        with open(out_path, "w") as fh:
            json.dump(reports, fh)


if __name__ == "__main__":
    main(sys.argv[1])

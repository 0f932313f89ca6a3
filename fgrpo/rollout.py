"""Rollouts: G sampled completions per prompt and their rewards.

Sequences are stored right-padded as ``prompt + completion`` so that position ids start at 0;
``completion_mask`` marks the completion tokens (the eos that ended a completion included, so
the policy also learns when to stop).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hpc.models.generation import generate_tokens


@dataclass
class Rollouts:
    """One rank's rollouts for one step (n prompts x G completions, prompt-major rows).

    input_ids, attention_mask, completion_mask: (n*G, T) int64 / int64 / float32.
    rewards: (n, G) float32. completion_lengths: (n*G,) int64 tokens.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    rewards: torch.Tensor
    completion_lengths: torch.Tensor

    def rows(self, start: int, stop: int):
        return (self.input_ids[start:stop], self.attention_mask[start:stop],
                self.completion_mask[start:stop])


def pack(tokenizer, prompt_ids: list, completion_ids: list, device) -> tuple:
    """Right-padded (input_ids, attention_mask, completion_mask) from token id lists."""
    rows = [p + c for p, c in zip(prompt_ids, completion_ids)]
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    cmask = torch.zeros((len(rows), width), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c, dtype=torch.long)
        attn[i, : len(p) + len(c)] = 1
        cmask[i, len(p): len(p) + len(c)] = 1.0
    return ids.to(device), attn.to(device), cmask.to(device)


def sample_rollouts(model, tokenizer, task, prompts: list, answers: list, cfg, max_new_tokens,
                    batch_size: int, seed: int, timer, first_index: int = 0) -> Rollouts:
    """Sample ``cfg.num_generations`` completions per prompt and score them; prompt ``i``'s
    draws are keyed by (``seed``, ``first_index + i``, sample index), its position in the
    step's global batch (the same on any rank count)."""
    G = cfg.num_generations
    device = next(model.parameters()).device
    with timer.phase("generate"):
        completions = generate_tokens(model, tokenizer, prompts, max_new_tokens, do_sample=True,
                                      temperature=cfg.temperature, top_p=cfg.top_p,
                                      num_return_sequences=G, batch_size=batch_size, seed=seed,
                                      first_index=first_index)
    with timer.phase("reward"):
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = task.rewards(texts, [a for a in answers for _ in range(G)])
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    ids, attn, cmask = pack(tokenizer, [p for p in prompt_ids for _ in range(G)], completions,
                            device)
    return Rollouts(ids, attn, cmask,
                    torch.tensor(rewards, dtype=torch.float32).reshape(len(prompts), G),
                    torch.tensor([len(c) for c in completions], dtype=torch.long))


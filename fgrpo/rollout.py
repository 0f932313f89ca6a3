"""Rollouts: G sampled completions per prompt, their rewards and DAPO's overlong shaping.

Sequences are stored right-padded as ``prompt + completion`` so that position ids start at 0;
``completion_mask`` marks the completion tokens (the eos that ended a completion included, so
the policy also learns when to stop). A completion without an eos was cut by the length limit
(``truncated``).

Overlong reward shaping (DAPO, arXiv 2503.14476 eq. 13; verl's ``overlong_buffer``): with
length limit L = ``task.max_new_tokens``, buffer B = ``fgrpo.reward.overlong_buffer`` and factor
c = ``fgrpo.reward.overlong_penalty``, a completion of |y| tokens gets

    penalty(|y|) = min(0, -c * (|y| - (L - B)) / B)

added to its reward: 0 up to L - B tokens, -c/B at L - B + 1, -c at L. The task reward alone
decides success (the focal weight's p, ``success_rate``) and whether a group is uniform
(dynamic sampling, as verl's ``filter_groups.metric=acc``); the shaped reward gives the
advantages. Overlong filtering (``fgrpo.loss.overlong_filter``) zeroes the ``completion_mask`` of
truncated completions: they stay in their group's statistics but carry no loss.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from hpc.engine.generate import eos_ids, generate_tokens


@dataclass
class Rollouts:
    """One rank's rollouts for one step (n prompts x G completions, prompt-major rows).

    input_ids, attention_mask, completion_mask: (n*G, T) int64 / int64 / float32.
    rewards, penalty: (n, G) float32, the task's reward and the overlong penalty (<= 0).
    completion_lengths: (n*G,) int64 tokens; truncated: (n*G,) bool, cut by the length limit.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    completion_mask: torch.Tensor
    rewards: torch.Tensor
    penalty: torch.Tensor
    completion_lengths: torch.Tensor
    truncated: torch.Tensor

    def rows(self, start: int, stop: int):
        return (self.input_ids[start:stop], self.attention_mask[start:stop],
                self.completion_mask[start:stop])

    @property
    def shaped_rewards(self) -> torch.Tensor:
        """(n, G) float32: the reward the advantages use, task reward + overlong penalty."""
        return self.rewards + self.penalty

    def groups(self, keep: torch.Tensor) -> "Rollouts":
        """The rollouts of the groups where ``keep`` ((n,) bool) is True, in order."""
        rows = keep.repeat_interleave(self.rewards.shape[1])
        dev = self.input_ids.device
        return Rollouts(self.input_ids[rows.to(dev)], self.attention_mask[rows.to(dev)],
                        self.completion_mask[rows.to(dev)], self.rewards[keep],
                        self.penalty[keep], self.completion_lengths[rows],
                        self.truncated[rows])

@dataclass
class StepRollouts:
    """What one step sampled on this rank: ``train`` (the kept groups), ``first`` (its round-0
    groups, all of them: the step's reward metrics) and ``stats`` ({name: float} of
    :data:`fgrpo.sampling.SAMPLING_STATS`, over all ranks)."""

    train: Rollouts
    first: Rollouts
    stats: dict
    order: torch.Tensor | None = None  # (groups of train,) int64: each kept group's place in
    # the step's kept groups over all ranks, in (round, prompt) order (the PPO mini-batches,
    # :func:`fgrpo.step.mini_batches`); None: this rank's groups from 0


def cat_rollouts(parts: list, pad_id: int) -> Rollouts:
    """One :class:`Rollouts` of ``parts`` (in order), the sequences right-padded to the widest
    (``pad_id`` tokens, mask 0)."""
    width = max(p.input_ids.shape[1] for p in parts)

    def padded(name, value):
        t = [getattr(p, name) for p in parts]
        if name not in ("input_ids", "attention_mask", "completion_mask"):
            return torch.cat(t)
        return torch.cat([torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)
                          for x in t])
    return Rollouts(**{f.name: padded(f.name, pad_id if f.name == "input_ids" else 0)
                       for f in fields(Rollouts)})


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int,
                     factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment of completion ``lengths`` (any shape, tokens), float32
    (see the module docstring); all zeros when ``buffer`` is 0."""
    if buffer == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    exceed = lengths.to(torch.float64) - (max_len - buffer)
    return torch.clamp(-factor * exceed / buffer, max=0.0).to(torch.float32)


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


@dataclass(frozen=True)
class RolloutRequest:
    """One rank's share of a sampling round: n prompts, each sampled G times.

    prompts, answers: n strings each, the round's prompts ``first_index`` .. ``first_index``
    + n - 1. max_new_tokens: the length limit L (tokens, ``task.max_new_tokens``).
    decode_batch: prompts per decoding batch (``model.decode_batch``), ``decode_batch * G``
    rows at once. seed: the round's sampling key
    (:func:`hpc.gradient_method.shared_step_seed`). first_index: the first prompt's place in
    the round, so that a completion's key does not depend on the rank that samples it.
    """

    prompts: list
    answers: list
    max_new_tokens: int
    decode_batch: int
    seed: int
    first_index: int = 0


def sample_rollouts(model, tokenizer, task, f, request: RolloutRequest, *, decoder,
                    timer) -> Rollouts:
    """Sample ``f.sampling.num_generations`` completions per prompt of ``request`` and score
    them. Completion j of prompt i draws with the key (``request.seed``,
    ``request.first_index`` + i, j) (:func:`hpc.engine.generate.generate_tokens`), decoded by
    ``decoder`` (:class:`hpc.engine.engine_backend.EngineBackend`). ``f``: the ``fgrpo``
    section (sampling, overlong shaping and filtering)."""
    prompts, answers, max_new_tokens = request.prompts, request.answers, request.max_new_tokens
    G = f.sampling.num_generations
    device = next(model.parameters()).device
    with timer.phase("generate"):
        completions = generate_tokens(model, tokenizer, prompts, max_new_tokens, do_sample=True,
                                      temperature=f.sampling.temperature,
                                      top_p=f.sampling.top_p,
                                      num_return_sequences=G,
                                      batch_size=request.decode_batch, seed=request.seed,
                                      first_index=request.first_index, decoder=decoder)
    with timer.phase("reward"):
        texts = tokenizer.batch_decode(completions, skip_special_tokens=True)
        rewards = task.rewards(texts, [a for a in answers for _ in range(G)])
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    ids, attn, cmask = pack(tokenizer, [p for p in prompt_ids for _ in range(G)], completions,
                            device)
    stops = set(eos_ids(model, tokenizer))
    truncated = torch.tensor([not c or c[-1] not in stops for c in completions], dtype=torch.bool)
    if f.loss.overlong_filter:
        cmask[truncated.to(device)] = 0.0
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.long)
    return Rollouts(ids, attn, cmask,
                    torch.tensor(rewards, dtype=torch.float32).reshape(len(prompts), G),
                    overlong_penalty(lengths, max_new_tokens, f.reward.overlong_buffer,
                                     f.reward.overlong_penalty).reshape(len(prompts), G),
                    lengths, truncated)

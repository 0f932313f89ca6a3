"""Keyed sampling: each drawn token depends only on (seed, prompt index, sample index, position).

Sampling is Gumbel-max: ``argmax(top_p(logits / temperature) + g)`` with ``g`` a Gumbel draw per
vocabulary entry, which picks token ``v`` with probability ``softmax(top_p(logits / T))[v]``.
The uniform behind ``g`` is a counter-based hash of the five integers (seed, prompt index,
sample index, completion position, token id), computed in int64 tensor ops on any device, so a
row's draws do not depend on which other rows share its batch, on the batch size or on the
number of ranks: a rank that answers prompts 40..59 draws for prompt 47 what a single rank
answering all prompts draws for it. Both decoding paths use it: the engine calls
:func:`pick_tokens`; Hugging Face ``generate`` runs greedy with :class:`KeyedGumbelProcessor`.

``temperature == 0`` means greedy. Top-p keeps the smallest set of most likely tokens whose
probability reaches ``top_p`` (the rule of transformers' ``TopPLogitsWarper``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import LogitsProcessor

_MASK32 = 0xFFFFFFFF


@dataclass(frozen=True)
class Sampling:
    """Temperature / top-p sampling keyed by ``seed`` (an int >= 0)."""

    temperature: float
    top_p: float
    seed: int


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wellons' lowbias32) of int64 values in [0, 2^32), elementwise.

    Products may pass 2^63 and wrap; the low 32 bits kept by the mask are still exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _MASK32
    return x ^ (x >> 16)


def keyed_gumbel(seed: int, prompt: torch.Tensor, sample: torch.Tensor, position: torch.Tensor,
                 vocab: int) -> torch.Tensor:
    """Gumbel noise (rows, vocab) float32 for rows keyed by int64 (rows,) tensors ``prompt``,
    ``sample`` and ``position`` (completion token index) under ``seed``."""
    h = _mix32(torch.full_like(prompt, seed & _MASK32))
    for key in (prompt, sample, position):
        h = _mix32(h ^ (key & _MASK32))
    token = torch.arange(vocab, device=prompt.device, dtype=torch.int64)
    bits = _mix32(h[:, None] ^ _mix32(token)[None, :])  # (rows, vocab) in [0, 2^32)
    u = ((bits >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), 24-bit grid
    return -torch.log(-torch.log(u))


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Logits (rows, vocab) with every token outside the top-p nucleus set to -inf."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= 1.0 - top_p
    drop[:, -1] = False  # the most likely token always stays
    return logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))


def keyed_scores(logits: torch.Tensor, sampling: Sampling, prompt: torch.Tensor,
                 sample: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Scores (rows, vocab) float32 whose argmax is the keyed sample of each row."""
    scores = top_p_filter(logits.float() / sampling.temperature, sampling.top_p)
    return scores + keyed_gumbel(sampling.seed, prompt, sample, position, logits.shape[-1])


def pick_tokens(logits: torch.Tensor, sampling: Sampling | None, prompt: torch.Tensor,
                sample: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """Next token of each row (rows,) int64: greedy when ``sampling`` is None or has
    temperature 0, else the keyed sample (keys as for :func:`keyed_gumbel`)."""
    if sampling is None or sampling.temperature == 0:
        return logits.argmax(dim=-1)
    return keyed_scores(logits, sampling, prompt, sample, position).argmax(dim=-1)


class KeyedGumbelProcessor(LogitsProcessor):
    """For HF ``generate`` in greedy mode: replaces the scores by :func:`keyed_scores`.

    ``prompt``/``sample`` (rows,) int64 key each row of the batch; ``prompt_width`` is the
    padded prompt length, so the completion position is ``input_ids.shape[1] - prompt_width``.
    """

    def __init__(self, sampling: Sampling, prompt: torch.Tensor, sample: torch.Tensor,
                 prompt_width: int):
        self.sampling, self.prompt, self.sample = sampling, prompt, sample
        self.prompt_width = prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        position = torch.full_like(self.prompt, input_ids.shape[1] - self.prompt_width)
        return keyed_scores(scores, self.sampling, self.prompt, self.sample, position)

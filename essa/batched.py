"""Batched population members: k LoRA adapters scored in one batched generation.

Two paths, as :mod:`hpc.engine.generate` (``model.engine``):

* ``engine`` (:func:`score_members_engine`): the decoding engine holds k members' factors
  stacked and tags each row with its member; rows of all k members decode together under
  continuous batching. Fitness equals the reference path's whenever greedy tokens agree (the
  arithmetic differs in the last bits, so a near-tied argmax may flip; none on the trained toy,
  tested).
* ``hf`` (the reference, :func:`score_members_batched`), described below.

Reference path: each ``generate`` call holds one chunk of prompts repeated for k members, member-major, under
:class:`essa.member_lora.MemberLora` (shared base weights, each member's factors on its rows).

Exactness (fp32, CPU, greedy, the exact arithmetic): the delta uses the same ops in the same
order and dtype as peft's vanilla LoRA path, and MKL's sgemm gives each row the same bits
whatever the number of rows once a matrix has 12 rows or more. So fitness and completions equal
one-at-a-time evaluation bit for bit whenever every generate chunk holds >= 12 prompts (checked
with MKL 2024.2 on AVX-512, 1 to 8 threads; tests/test_essa_batched.py, also under mpirun). A
chunk of fewer prompts (a small last chunk) goes through MKL's small-matrix kernels, whose
rounding depends on the row count: logits then differ by about 1e-7 relative (tested within
1e-5), which flips a greedy token only at a near tie. On CUDA the fused arithmetic computes the
delta in the model's dtype (bf16 factors, scaling folded into B') where peft keeps fp32 LoRA
weights, and cuBLAS picks kernels by shape: logits stay as close to the fp32 model's as peft's
own bf16 logits are (tested on CPU: within twice peft's bf16 error), and fitness agrees up to
greedy flips at near ties, not bitwise.
"""
from __future__ import annotations

import numpy as np
import torch

from essa.member_lora import MemberLora
from hpc.engine.generate import eos_ids, generate
from hpc.engine.memory import ENGINE_MEMORY_SHARE
from hpc.engine.scheduler import Request
from hpc.engine.shape import ModelShape


def choose_k(model, tokenizer, k: int, n_members: int, prompts: list, batch_size: int,
             max_new_tokens: int) -> int:
    """Members per batched generation: ``k`` capped by ``n_members`` and, on CUDA, by
    :func:`members_on_device` for generate chunks of ``batch_size`` of ``prompts`` (longest
    tokenised prompt + ``max_new_tokens`` tokens per row). Always >= 1; on CPU nothing is
    tokenised."""
    k = max(1, min(k, n_members))
    if next(model.parameters()).device.type != "cuda":
        return k
    seq_len = max(len(ids) for ids in tokenizer(prompts)["input_ids"]) + max_new_tokens
    return min(k, members_on_device(model, n_members, min(batch_size, len(prompts)), seq_len))


def members_on_device(model, n_members: int, rows_per_member: int, seq_len: int) -> int:
    """:func:`members_that_fit` in the free memory of the model's CUDA device now
    (``torch.cuda.mem_get_info``), with the model's dtype and LoRA size."""
    param = next(model.parameters())
    lora = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if "lora_" in n)
    free, _ = torch.cuda.mem_get_info(param.device)
    return members_that_fit(ModelShape.from_config(model.config), param.element_size(), lora,
                            free, n_members, rows_per_member, seq_len)


def members_that_fit(shape: ModelShape, elem_bytes: int, lora_bytes: int, free_bytes: int,
                     n_members: int, rows_per_member: int, seq_len: int) -> int:
    """How many members fit in ENGINE_MEMORY_SHARE of ``free_bytes`` (>= 1), the share the
    decoding engine takes of free memory.

    Deducted first: the stacked LoRA factors of all ``n_members`` (``lora_bytes`` each). Per
    member: ``rows_per_member`` rows of ``seq_len`` tokens (prompt + new), each token holding
    its KV cache and one layer's activations (:meth:`ModelShape.kv_token_bytes`,
    :meth:`ModelShape.activation_token_bytes`, ``elem_bytes`` a value), plus fp32 logits over
    the vocabulary per row.
    """
    per_token = shape.kv_token_bytes(elem_bytes) + shape.activation_token_bytes(elem_bytes)
    per_member = rows_per_member * (seq_len * per_token + 4 * shape.vocab)
    return max(1, (int(ENGINE_MEMORY_SHARE * free_bytes) - n_members * lora_bytes)
               // per_member)


def member_completions(model, tokenizer, factors: dict, prompts: list, max_new_tokens: int,
                       batch_size: int, decoder=None) -> list:
    """Greedy completions of k members on every prompt: k lists of len(prompts) strings.

    ``factors``: {module: (A' (k, r, in), B' (k, out, r))}. Each ``generate`` call holds one
    chunk of ``batch_size`` prompts repeated for every member (k * chunk rows, member-major),
    so every row is padded exactly as in one-at-a-time generation of that chunk.
    """
    k = next(iter(factors.values()))[0].shape[0]
    texts = [[] for _ in range(k)]
    with MemberLora(model, factors):
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            out = generate(model, tokenizer, chunk * k, max_new_tokens,
                           batch_size=len(chunk) * k, decoder=decoder, path="hf")
            for m in range(k):
                texts[m].extend(out[m * len(chunk):(m + 1) * len(chunk)])
    return texts


def mean_reward(task, completions: list, answers: list, cache: dict) -> float:
    """Mean of ``task.rewards`` over (completion, answer) pairs; only pairs missing from
    ``cache`` ({pair: reward}, filled in) are scored: members of one generation mostly write
    the same completions. Same value as ``np.mean(task.rewards(completions, answers))``."""
    pairs = list(zip(completions, answers))
    new = list(dict.fromkeys(p for p in pairs if p not in cache))
    if new:
        cache.update(zip(new, task.rewards([c for c, _ in new], [a for _, a in new])))
    return float(np.mean([cache[p] for p in pairs]))


def score_members_batched(model, tokenizer, space, members: np.ndarray, task, prompts: list,
                          answers: list, max_new_tokens: int, batch_size: int, timer,
                          k: int, decoder=None) -> np.ndarray:
    """Fitness of each row of ``members`` (n, dim), k members per batched generation.

    Same result as :func:`essa.population.score_members` (mean reward in [0, 1], float64
    (n,)); k is capped by :func:`choose_k` and the last group may be shorter. The model's own
    adapter weights are not touched. Phases: ``rebuild`` (A', B' of all n members in one
    vectorised call, then sliced per group; also :func:`choose_k`), ``generate``,
    ``reward``.
    """
    with timer.phase("rebuild"):
        k = choose_k(model, tokenizer, k, len(members), prompts, batch_size, max_new_tokens)
        factors = space.factors_batch(members)
    fitness = np.empty(len(members), dtype=np.float64)
    cache = {}
    for g in range(0, len(members), k):
        with timer.phase("rebuild"):
            group = {name: (a[g:g + k], b[g:g + k]) for name, (a, b) in factors.items()}
        with timer.phase("generate"):
            texts = member_completions(model, tokenizer, group, prompts, max_new_tokens,
                                       batch_size, decoder)
        with timer.phase("reward"):
            for m, completions in enumerate(texts):
                fitness[g + m] = mean_reward(task, completions, answers, cache)
    return fitness


def _padded_group(factors: dict, start: int, k: int) -> dict:
    """Members start .. start+k-1 of ``factors``; a short last group is padded with copies of
    its first member (never decoded), so the engine keeps one shape for every group."""
    group = {}
    for name, (a, b) in factors.items():
        a, b = a[start:start + k], b[start:start + k]
        pad = k - a.shape[0]
        group[name] = (torch.cat([a] + [a[:1]] * pad), torch.cat([b] + [b[:1]] * pad))
    return group


def score_members_engine(model, tokenizer, space, members: np.ndarray, task, prompts: list,
                         answers: list, max_new_tokens: int, batch_size: int, timer,
                         k: int, decoder) -> np.ndarray:
    """:func:`score_members_batched` on ``decoder``'s engine
    (:class:`hpc.engine.decoder.Decoder`): k members' factors stacked (k
    capped by the number of members only), up to ``batch_size * k`` rows decoding at once
    (fewer when the engine's memory budget holds fewer: the rest decode in waves), each row
    tagged with its member. Same phases and result; the model's own adapter weights are not
    touched."""
    with timer.phase("rebuild"):
        k = max(1, min(k, len(members)))
        factors = space.factors_batch(members)
        prompt_ids = [tokenizer(p)["input_ids"] for p in prompts]
        eos = eos_ids(model, tokenizer)
    fitness = np.empty(len(members), dtype=np.float64)
    cache = {}
    for g in range(0, len(members), k):
        n_group = min(k, len(members) - g)
        with timer.phase("rebuild"):
            group = _padded_group(factors, g, k)
        requests = [Request(ids, max_new_tokens, m, i, 0)
                    for m in range(n_group) for i, ids in enumerate(prompt_ids)]
        with timer.phase("generate"):
            was_training = model.training
            model.eval()
            try:
                rows = decoder.run_requests(model, requests, eos, None, batch_size * k,
                                            factors=group)
            finally:
                model.train(was_training)
            texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
        with timer.phase("reward"):
            for m in range(n_group):
                fitness[g + m] = mean_reward(task, texts[m * len(prompts):(m + 1) * len(prompts)],
                                             answers, cache)
    return fitness

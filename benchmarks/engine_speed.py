"""Decoding engine against HF eager ``generate``: useful tokens per second and the bound.

Used by ``gpu_check.py --engine`` (real shapes, random weights) and ``engine_cpu.py`` (toy).
Every row is forced to end at its own length (random weights never emit eos): the engine gets
each row's length as its ``max_new``; HF ``generate`` gets :class:`ForceLength`, which bans the
stop token before a row's length and forces it at that length, so a finished row stops and
pads while its batch runs on, as in a real ``generate`` call. Useful tokens are the tokens up to
each row's end; ``tokens_per_s`` is useful tokens / wall seconds.

Lengths are ``fixed`` (every row the same) or ``spread``: token counts of the worked solutions
of GSM8K (test) and MATH-500 in ``../shared/data``, estimated as characters / 3.5 (no Qwen
tokenizer travels with the package), drawn with replacement and clipped to [1, cap].

Bound of a call: ``max(steps * weight_bytes / bandwidth, 2 * params * tokens / peak_flops)``
with ``steps = max(longest row, total tokens / rows)``, the decode steps of an ideal continuous
batcher holding ``rows`` rows; the prompt prefill and attention are left out, so the bound is
optimistic.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time

import numpy as np
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from hpc.models.member_lora import MemberLora
from hpc.engine.scheduler import Request

STOP = 1  # the stop token id HF generate is forced to emit at each row's length
CHARS_PER_TOKEN = 3.5


class ForceLength(LogitsProcessor):
    """Row i of a ``generate`` batch emits exactly ``lengths[i]`` tokens, the last being STOP."""

    def __init__(self, lengths: torch.Tensor, prompt_width: int):
        self.lengths, self.width = lengths, prompt_width

    def __call__(self, input_ids, scores):
        done = input_ids.shape[1] - self.width  # tokens generated so far
        last = (self.lengths == done + 1)[:, None]
        scores = scores.clone()
        scores[:, STOP] = float("-inf")
        return torch.where(last, torch.where(
            torch.arange(scores.shape[1], device=scores.device) == STOP, 0.0, float("-inf")),
            scores)


def solution_lengths(data_dir: str) -> np.ndarray:
    """Estimated token counts (n,) int64 of the GSM8K test and MATH-500 worked solutions."""
    counts = []
    for rel in ("gsm8k/test.jsonl", "math500/test.jsonl"):
        with open(os.path.join(data_dir, rel)) as fh:
            for line in fh:
                counts.append(math.ceil(len(json.loads(line)["answer"]) / CHARS_PER_TOKEN))
    return np.array(counts, dtype=np.int64)


def row_lengths(kind: str, rows: int, cap: int, pool: np.ndarray, seed: int = 0) -> np.ndarray:
    """(rows,) lengths: ``cap`` each (``fixed``) or drawn from ``pool`` clipped to [1, cap]."""
    if kind == "fixed":
        return np.full(rows, cap, dtype=np.int64)
    return np.clip(np.random.default_rng(seed).choice(pool, rows), 1, cap)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_seconds(model, prompts: torch.Tensor, lengths: np.ndarray, device) -> float:
    """Seconds of one HF eager greedy ``generate`` over all rows of ``prompts`` (rows, T),
    row i forced to end after ``lengths[i]`` tokens."""
    cfg = GenerationConfig(max_new_tokens=int(lengths.max()), do_sample=False, pad_token_id=0,
                           eos_token_id=STOP)
    force = ForceLength(torch.as_tensor(lengths, device=device), prompts.shape[1])
    _sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                             generation_config=cfg, logits_processor=LogitsProcessorList([force]))
    _sync(device)
    seconds = time.perf_counter() - start
    if out.shape[1] - prompts.shape[1] != int(lengths.max()):
        raise RuntimeError("HF generate did not run to the longest forced length")
    return seconds


def engine_seconds(decoder, model, prompts: torch.Tensor, lengths: np.ndarray, device,
                   rows: int, members: np.ndarray | None = None,
                   factors: dict | None = None) -> float:
    """Seconds of one call of ``decoder``'s engine (:class:`hpc.engine.engine_backend.EngineBackend`)
    decoding every prompt row (``rows`` slots), row i ending after ``lengths[i]`` tokens;
    ``members`` (rows,) and ``factors`` give per-row members."""
    ids = prompts.tolist()
    member = members if members is not None else np.zeros(len(ids), dtype=np.int64)
    requests = [Request(p, int(n), int(m), i) for i, (p, n, m) in
                enumerate(zip(ids, lengths, member))]
    _sync(device)
    start = time.perf_counter()
    out = decoder.decode(model, requests, [], None, rows, members=factors)
    _sync(device)
    seconds = time.perf_counter() - start
    if [len(o) for o in out] != lengths.tolist():
        raise RuntimeError("the engine did not decode the forced lengths")
    return seconds


def bound_seconds(params: int, weight_bytes: int, lengths: np.ndarray, rows: int,
                  bandwidth: float, peak_flops: float) -> float:
    """The module docstring's bound of one call, in seconds."""
    steps = max(int(lengths.max()), math.ceil(lengths.sum() / rows))
    return max(steps * weight_bytes / bandwidth, 2 * params * lengths.sum() / peak_flops)


def stored_bytes(t: torch.Tensor) -> int:
    """Bytes a parameter holds: of its inner tensors for a torchao quantised tensor (values,
    scales, zero points), else numel x element size."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(stored_bytes(getattr(t, n)) for n in names if getattr(t, n) is not None)
    return t.numel() * t.element_size()


def compare(decoder, model, space, device, rows: int, k: int, kind: str, lengths: np.ndarray,
            prompts: torch.Tensor, hf: bool, hw: dict) -> dict:
    """One row of the report: ``decoder``'s engine (one warm-up call, then timed) and, if
    ``hf``, HF eager
    generate on the same rows; k members (k = 1: the peft adapter, as F-GRPO and evaluation
    run it; k > 1: ESSA members, interleaved on the engine, member-major under MemberLora on
    HF). ``hw``: ``bandwidth`` (bytes/s) and ``peak_flops`` (FLOP/s) of the bound."""
    params = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    weight_bytes = sum(stored_bytes(p) for n, p in model.named_parameters() if "lora_" not in n)
    tokens = int(lengths.sum())
    factors = members = None
    if k > 1:
        xs = np.random.default_rng(k).normal(0.0, 0.1, (k, space.dim))
        factors = space.factors_batch(xs)
        members = np.arange(rows) % k
    engine_seconds(decoder, model, prompts, lengths, device, rows, members, factors)  # warm-up
    seconds = engine_seconds(decoder, model, prompts, lengths, device, rows, members, factors)
    bound = bound_seconds(params, weight_bytes, lengths, rows, hw["bandwidth"], hw["peak_flops"])
    row = {"rows": rows, "k": k, "lengths": kind, "useful_tokens": tokens,
           "mean_length": float(lengths.mean()), "max_length": int(lengths.max()),
           "engine": {"s": seconds, "tokens_per_s": tokens / seconds,
                      "of_bound": bound / seconds},
           "bound": {"s": bound, "tokens_per_s": tokens / bound}}
    if hf:
        order = np.argsort(members, kind="stable") if k > 1 else np.arange(rows)
        with MemberLora(model, factors) if k > 1 else contextlib.nullcontext():
            hf_s = hf_seconds(model, prompts[order], lengths[order], device)
        row["hf_eager"] = {"s": hf_s, "tokens_per_s": tokens / hf_s, "of_bound": bound / hf_s}
        row["engine_vs_hf"] = hf_s / seconds
    return row

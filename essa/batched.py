"""Batched population members: k LoRA adapters scored in one batched generation.

The base weights are shared. While :class:`MemberLora` is active, every adapted Linear of the
peft model computes, for the rows of member m,

    out = base(x) + ((x @ A'_m^T) @ B'_m^T) * scaling

with A' (k, r, in) and B' (k, out, r) stacked over the k members and applied by one batched
matmul each (``torch.bmm``); the peft LoRA path (and its weights) is bypassed. The batch is laid
out member-major: a batch of k*n rows holds member m's rows at m*n .. m*n+n-1. HF ``generate``
keeps row order under left padding and the KV cache rows follow, so this layout holds at every
step; the member of a row is read off shapes only, nothing synchronises with the host. On CUDA
the delta is fused into two kernels per layer (:class:`MemberLora`, ``fused``).

Exactness (fp32, CPU, greedy): the delta uses the same ops in the same order and dtype as
peft's vanilla LoRA path (matmul by A, matmul by B, times scaling, added to the base output),
and MKL's sgemm gives each row the same bits whatever the number of rows once a matrix has 12
rows or more. So fitness and completions equal one-at-a-time evaluation bit for bit whenever
every generate chunk holds >= 12 prompts (checked with MKL 2024.2 on AVX-512, 1 to 8 threads;
tests/test_essa_batched.py, also under mpirun). A chunk of fewer prompts (a small last chunk)
goes through MKL's small-matrix kernels, whose rounding depends on the row count: logits then
differ by about 1e-7 relative (tested within 1e-5), which flips a greedy token only at a near
tie. On CUDA the fused path computes the delta in the model's dtype (bf16 factors, scaling
folded into B') where peft keeps fp32 LoRA weights, and cuBLAS picks kernels by shape: logits
stay as close to the fp32 model's as peft's own bf16 logits are (tested on CPU: within twice
peft's bf16 error), and fitness agrees up to greedy flips at near ties, not bitwise.
"""
from __future__ import annotations

import numpy as np
import torch

from essa.space import ADAPTER
from hpc.errors import UserError
from hpc.generation import generate

MEMORY_SHARE = 0.5  # of free CUDA memory that choose_k may plan to fill


class MemberLora:
    """Context manager: per-row LoRA factors of k members on ``peft_model``.

    ``factors``: {module name: (A' (k, r, in), B' (k, out, r))}, as from
    ``SingularValueSpace.factors_batch``, on the model's device. Every batch passed through the
    model while active must have a multiple of k rows, member-major.

    ``fused`` (default: on CUDA only) casts the factors once to the base layer's dtype, folds
    ``scaling`` into B' and adds the delta inside the second matmul (``torch.baddbmm``): two
    kernels per layer and step instead of up to six. Unfused, the delta is computed exactly as peft
    does (in the adapter's dtype, fp32 even on a bf16 model, then added and cast back).
    """

    def __init__(self, peft_model, factors: dict, fused: bool | None = None):
        self.model = peft_model
        self.factors = factors
        self.fused = (next(peft_model.parameters()).device.type == "cuda" if fused is None
                      else fused)

    def __enter__(self) -> "MemberLora":
        for name, (a, b) in self.factors.items():
            module = self.model.get_submodule(name)
            if module.merged or ADAPTER in getattr(module, "lora_variant", {}):
                raise UserError(f"{name}: batched members need an unmerged vanilla LoRA "
                                f"adapter (no DoRA or other variant)")
            base, scaling = module.base_layer, module.scaling[ADAPTER]
            if self.fused:
                dtype = base.weight.dtype
                module.forward = _fused_forward(base, a.transpose(1, 2).to(dtype),
                                                (b * scaling).transpose(1, 2).to(dtype))
            else:
                module.forward = _exact_forward(base, a.transpose(1, 2), b.transpose(1, 2),
                                                scaling)
        return self

    def __exit__(self, *exc) -> None:
        for name in self.factors:
            del self.model.get_submodule(name).forward  # back to the class's peft forward


def _member_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """(k*n, t, in) -> (k, n*t, in): member m's rows m*n .. m*n+n-1 become batch m."""
    if x.shape[0] % k:
        raise ValueError(f"batch of {x.shape[0]} rows is not a multiple of {k} members")
    return x.reshape(k, -1, x.shape[-1])


def _exact_forward(base, a_t: torch.Tensor, b_t: torch.Tensor, scaling: float):
    """Peft's LoRA arithmetic for k members: a_t (k, in, r), b_t (k, r, out), adapter dtype."""
    k = a_t.shape[0]

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # x (k*n, t, in)
        result = base(x, *args, **kwargs)  # (k*n, t, out), shared base weight
        rows = _member_rows(x.to(a_t.dtype), k)  # (k, n*t, in)
        delta = torch.bmm(torch.bmm(rows, a_t), b_t) * scaling  # (k, n*t, out)
        return (result + delta.reshape(result.shape)).to(result.dtype)

    return forward


def _fused_forward(base, a_t: torch.Tensor, sb_t: torch.Tensor):
    """Two-kernel LoRA for k members: a_t (k, in, r), sb_t = scaling * B'^T (k, r, out), both
    in the base weight's dtype."""
    k = a_t.shape[0]

    def forward(x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # x (k*n, t, in)
        result = base(x, *args, **kwargs)  # (k*n, t, out)
        out = torch.baddbmm(_member_rows(result, k), torch.bmm(_member_rows(x, k), a_t), sb_t)
        return out.reshape(result.shape)

    return forward


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
    return members_that_fit(model.config, param.element_size(), lora, free, n_members,
                            rows_per_member, seq_len)


def members_that_fit(config, elem_bytes: int, lora_bytes: int, free_bytes: int, n_members: int,
                     rows_per_member: int, seq_len: int) -> int:
    """How many members fit in MEMORY_SHARE of ``free_bytes`` (>= 1).

    Deducted first: the stacked LoRA factors of all ``n_members`` (``lora_bytes`` each). Per
    member: ``rows_per_member`` rows of ``seq_len`` tokens (prompt + new), each token holding
    KV cache (2 x layers x kv heads x head dim) and activations (4 x hidden + 3 x
    intermediate) of ``elem_bytes`` each, plus fp32 logits over the vocabulary per row.
    """
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = (2 * config.num_hidden_layers * kv_heads * head_dim + 4 * config.hidden_size
                 + 3 * config.intermediate_size) * elem_bytes
    per_member = rows_per_member * (seq_len * per_token + 4 * config.vocab_size)
    return max(1, (int(MEMORY_SHARE * free_bytes) - n_members * lora_bytes) // per_member)


def member_completions(model, tokenizer, factors: dict, prompts: list, max_new_tokens: int,
                       batch_size: int) -> list:
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
                           batch_size=len(chunk) * k)
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
                          k: int) -> np.ndarray:
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
                                       batch_size)
        with timer.phase("reward"):
            for m, completions in enumerate(texts):
                fitness[g + m] = mean_reward(task, completions, answers, cache)
    return fitness

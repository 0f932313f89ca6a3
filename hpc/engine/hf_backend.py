"""Hugging Face ``model.generate`` as a backend (``model.engine=hf``): the reference every other
backend is tested against, and the one that runs any causal LM transformers runs.

Prompts are left-padded with an attention mask, so position ids start at 0 on the first real
token of every row (``generate`` derives them from the mask); padded positions get no attention
weight, so the pad token's value changes nothing. Greedy decoding is deterministic; sampled rows
get their keyed Gumbel noise from :class:`hpc.models.sampling.KeyedGumbelProcessor`.

Batch invariance (fp32, CPU): a prompt gets the same greedy completion whatever the other
prompts of its batch when all prompts have the same length (no padding; tested). With prompts
of different lengths the padded rows see a different mask and matmul shape, which can change
logits in the last bits (about 1e-5 for the toy model) and so, rarely, flip a near-tied argmax
(none in 200 mixed-length toy prompts); in bf16/fp16 or on GPU flips are more likely.

Members (ESSA's k adapters at once): each ``generate`` call holds one chunk of prompts repeated
for every member, member-major, under :class:`hpc.models.member_lora.MemberLora` (shared base
weights, each member's factors on its rows). Exactness (fp32, CPU, greedy, the exact
arithmetic): the delta uses the same ops in the same order and dtype as peft's vanilla LoRA
path, and MKL's sgemm gives each row the same bits whatever the number of rows once a matrix
has 12 rows or more. So completions equal one-at-a-time decoding under peft bit for bit
whenever every chunk holds >= 12 prompts (checked with MKL 2024.2 on AVX-512, 1 to 8 threads;
tests/test_essa_batched.py, also under mpirun). A chunk of fewer prompts goes through MKL's
small-matrix kernels, whose rounding depends on the row count: logits then differ by about
1e-7 relative (tested within 1e-5), which flips a greedy token only at a near tie. On CUDA the
fused arithmetic computes the delta in the model's dtype and cuBLAS picks kernels by shape:
logits stay as close to the fp32 model's as peft's own bf16 logits are (tested on CPU: within
twice peft's bf16 error), not bitwise; and the members of one call are capped by the device's
free memory (:func:`members_on_device`).
"""
from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList

from hpc.engine.backend import DecodeBackend
from hpc.engine.memory import ENGINE_MEMORY_SHARE
from hpc.engine.shape import ModelShape
from hpc.models.member_lora import MemberLora
from hpc.models.sampling import KeyedGumbelProcessor


def _through_eos(ids: torch.Tensor, eos: list) -> list:
    """``ids`` (T,) up to and including the first eos token, as a list."""
    hits = torch.isin(ids, torch.tensor(eos, device=ids.device)).nonzero()
    return (ids[: int(hits[0]) + 1] if len(hits) else ids).tolist()


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
    """How many members fit in ENGINE_MEMORY_SHARE of ``free_bytes`` (>= 1), the share
    decoding takes of free memory.

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


class HFBackend(DecodeBackend):
    """Decoding by Hugging Face ``generate`` (module docstring); holds nothing between calls."""

    name = "hf"
    package = "transformers"

    def decode(self, model, requests: list, eos: list, sampling, rows: int,
               members: dict | None = None) -> list:
        if members is None:
            out = [row for start in range(0, len(requests), rows)
                   for row in self._generate(model, requests[start:start + rows], eos,
                                             sampling)]
        else:
            out = self._members(model, requests, eos, sampling, rows, members)
        self.count_tokens(out)
        return out

    def _members(self, model, requests, eos, sampling, rows, members) -> list:
        """:meth:`decode` with ``members``: the requests of each member (the same number for
        every member present, members 0 .. n-1 of the k in ``members``) in chunks of ``rows //
        k`` per member, all members of a chunk in one member-major ``generate`` call (on CUDA,
        as many members a call as :func:`members_on_device` holds)."""
        by_member: dict = {}
        for i, r in enumerate(requests):
            by_member.setdefault(r.member, []).append(i)
        k, per = len(by_member), len(requests) // len(by_member)
        if sorted(by_member) != list(range(k)) or any(len(v) != per
                                                      for v in by_member.values()):
            raise ValueError("hf members: every member 0..k-1 needs the same number of requests")
        chunk = max(1, rows // next(iter(members.values()))[0].shape[0])
        per_call = k
        if next(model.parameters()).device.type == "cuda":
            seq_len = max(len(r.prompt) + r.max_new for r in requests)
            per_call = min(k, members_on_device(model, k, min(chunk, per), seq_len))
        out: list = [None] * len(requests)
        for first in range(0, k, per_call):
            group = range(first, min(k, first + per_call))
            factors = {name: (a[group.start:group.stop], b[group.start:group.stop])
                       for name, (a, b) in members.items()}
            with MemberLora(model, factors):
                for start in range(0, per, chunk):
                    index = [by_member[m][i] for m in group
                             for i in range(start, min(per, start + chunk))]
                    for i, row in zip(index, self._generate(
                            model, [requests[i] for i in index], eos, sampling)):
                        out[i] = row
        return out

    @torch.inference_mode()
    def _generate(self, model, requests: list, eos: list, sampling) -> list:
        """One ``generate`` call on ``requests``, left-padded; new tokens through eos."""
        device = next(model.parameters()).device
        width = max(len(r.prompt) for r in requests)
        pad = getattr(model.generation_config, "pad_token_id", None)
        pad = eos[0] if pad is None else pad
        ids = torch.full((len(requests), width), pad, dtype=torch.int64)
        mask = torch.zeros((len(requests), width), dtype=torch.int64)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt):] = 1
        processors = LogitsProcessorList()
        if sampling is not None:
            key = torch.tensor([(r.prompt_index, r.sample_index) for r in requests],
                               dtype=torch.int64, device=device)
            processors.append(KeyedGumbelProcessor(sampling, key[:, 0], key[:, 1], width))
        config = GenerationConfig(max_new_tokens=max(r.max_new for r in requests),
                                  do_sample=False, repetition_penalty=1.0, pad_token_id=pad,
                                  eos_token_id=eos)
        new = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                             generation_config=config, logits_processor=processors)[:, width:]
        return [_through_eos(row[:r.max_new], eos) for row, r in zip(new, requests)]

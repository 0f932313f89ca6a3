"""Batched text generation with Hugging Face ``model.generate``: completions only, prompt-major.

Prompts are left-padded with an attention mask, so position ids start at 0 on the first real
token of every row (``generate`` derives them from the mask). Greedy decoding is deterministic.

Batch invariance (fp32, CPU): a prompt gets the same greedy completion whatever the other
prompts of its batch when all prompts tokenise to the same length (no padding; tested). With
prompts of different lengths the padded rows see a different mask and matmul shape, which can
change logits in the last bits (about 1e-5 for the toy model) and so, rarely, flip a near-tied
argmax (none in 200 mixed-length toy prompts); in bf16/fp16 or on GPU flips are more likely.
Sampling with ``seed`` is reproducible for the same prompts and ``batch_size``, but not across
different batch compositions.
"""
from __future__ import annotations

import contextlib

import torch
from transformers import GenerationConfig

from hpc.models.chat import stop_token_ids


def _eos_ids(model, tokenizer) -> list[int]:
    """Token ids that end a completion: :func:`hpc.models.chat.stop_token_ids` (eos and the
    chat template's end-of-turn token) plus the model's configured eos."""
    ids = set(stop_token_ids(tokenizer))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    ids.discard(None)
    return sorted(ids)


def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def _through_eos(ids: torch.Tensor, eos_ids: list[int]) -> list[int]:
    """``ids`` (T,) up to and including the first eos token, as a list."""
    hits = torch.isin(ids, torch.tensor(eos_ids, device=ids.device)).nonzero()
    return (ids[: int(hits[0]) + 1] if len(hits) else ids).tolist()


def generate_tokens(model, tokenizer, prompts: list[str], max_new_tokens: int, *,
                    do_sample=False, temperature=1.0, top_p=1.0, num_return_sequences=1,
                    batch_size=64, seed=None) -> list[list[int]]:
    """Like :func:`generate`, but return each completion's token ids, up to and including the
    eos token that ended it (a completion cut by ``max_new_tokens`` has no eos)."""
    greedy = not do_sample or temperature == 0
    n_rows = 1 if greedy else num_return_sequences  # greedy samples are all the same text
    eos_ids = _eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    sampling = ({} if greedy else
                {"temperature": float(temperature), "top_p": float(top_p), "top_k": 0})
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=not greedy,
                               num_return_sequences=n_rows, repetition_penalty=1.0,
                               pad_token_id=pad_id, eos_token_id=eos_ids, **sampling)
    device = _model_device(model)
    was_training = model.training
    model.eval()
    rng = (torch.random.fork_rng(devices=[device] if device.type == "cuda" else [])
           if seed is not None else contextlib.nullcontext())
    out: list[list[int]] = []
    try:
        with rng, torch.inference_mode():
            if seed is not None:
                torch.manual_seed(seed)
            for start in range(0, len(prompts), batch_size):
                batch = tokenizer(prompts[start:start + batch_size], return_tensors="pt",
                                  padding=True, padding_side="left").to(device)
                ids = model.generate(input_ids=batch["input_ids"],
                                     attention_mask=batch["attention_mask"],
                                     generation_config=gen_cfg)
                new = ids[:, batch["input_ids"].shape[1]:]
                for row in new:
                    out.extend([_through_eos(row, eos_ids)] * (num_return_sequences // n_rows))
    finally:
        model.train(was_training)
    return out


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, *, do_sample=False,
             temperature=1.0, top_p=1.0, num_return_sequences=1, batch_size=64,
             seed=None) -> list[str]:
    """Complete every prompt; return ``len(prompts) * num_return_sequences`` strings.

    Completions are decoded without special tokens and cut at the first eos. Prompt ``i``'s
    samples are at ``i*n .. i*n+n-1`` (``n = num_return_sequences``). Sampling uses only
    ``temperature`` and ``top_p`` (the model's own top_k, repetition penalty and so on are
    switched off); ``do_sample`` with ``temperature == 0`` means greedy, and greedy decoding
    with ``n > 1`` decodes once and repeats the completion ``n`` times. ``seed`` seeds a
    forked RNG, so the caller's global torch RNG state is left as it was. ``batch_size``
    counts prompts per ``generate`` call (each expands to ``n`` rows). The model is put in
    eval mode for the call and restored afterwards; works with PEFT models.
    """
    ids = generate_tokens(model, tokenizer, prompts, max_new_tokens, do_sample=do_sample,
                          temperature=temperature, top_p=top_p,
                          num_return_sequences=num_return_sequences, batch_size=batch_size,
                          seed=seed)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)

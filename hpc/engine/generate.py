"""Batched text generation: completions only, prompt-major, by one of two paths.

* ``engine`` (the default): the decoding engine of a :class:`hpc.engine.decoder.Decoder`
  (static KV cache, continuous batching, CUDA graphs on GPU); each prompt is prefilled unpadded.
* ``hf``: Hugging Face ``model.generate`` (the reference path), described below.

The path is the decoder's (``model.engine``, :class:`hpc.engine.config.EngineConfig`), or the
call's (``path=``). Without a decoder a call decodes through a fresh default one (nothing
kept between such calls). Sampling on both paths is keyed (:mod:`hpc.models.sampling`):
prompt ``first_index + i``'s sample ``j`` depends only on (seed, first_index + i, j), not on
the batch or the number of ranks.

Reference path:

Prompts are left-padded with an attention mask, so position ids start at 0 on the first real
token of every row (``generate`` derives them from the mask). Greedy decoding is deterministic.

Batch invariance (fp32, CPU): a prompt gets the same greedy completion whatever the other
prompts of its batch when all prompts tokenise to the same length (no padding; tested). With
prompts of different lengths the padded rows see a different mask and matmul shape, which can
change logits in the last bits (about 1e-5 for the toy model) and so, rarely, flip a near-tied
argmax (none in 200 mixed-length toy prompts); in bf16/fp16 or on GPU flips are more likely.
"""
from __future__ import annotations

import torch
from transformers import GenerationConfig, LogitsProcessorList

from hpc.engine.config import PATHS
from hpc.engine.decoder import Decoder
from hpc.engine.scheduler import Request
from hpc.models.chat import stop_token_ids
from hpc.models.quantize import generation_weights
from hpc.models.sampling import KeyedGumbelProcessor, Sampling


def eos_ids(model, tokenizer) -> list[int]:
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


def _through_eos(ids: torch.Tensor, eos: list[int]) -> list[int]:
    """``ids`` (T,) up to and including the first eos token, as a list."""
    hits = torch.isin(ids, torch.tensor(eos, device=ids.device)).nonzero()
    return (ids[: int(hits[0]) + 1] if len(hits) else ids).tolist()


def _sampling(do_sample, temperature, top_p, seed) -> Sampling | None:
    """The keyed sampling of a call, None for greedy; without ``seed`` one is drawn from the
    global torch RNG."""
    if not do_sample or temperature == 0:
        return None
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, ()).item())
    return Sampling(float(temperature), float(top_p), int(seed))


def generate_tokens(model, tokenizer, prompts: list[str], max_new_tokens: int, *,
                    do_sample=False, temperature=1.0, top_p=1.0, num_return_sequences=1,
                    batch_size=64, seed=None, first_index=0, decoder: Decoder | None = None,
                    path: str | None = None) -> list[list[int]]:
    """Like :func:`generate`, but return each completion's token ids, up to and including the
    eos token that ended it (a completion cut by ``max_new_tokens`` has no eos)."""
    decoder = decoder or Decoder()
    sampling = _sampling(do_sample, temperature, top_p, seed)
    n_rows = 1 if sampling is None else num_return_sequences  # greedy samples are all alike
    keys = [(first_index + i, j) for i in range(len(prompts)) for j in range(n_rows)]
    path = path or decoder.path
    if path not in PATHS:
        raise ValueError(f"generation path {path!r} is not one of {PATHS}")
    was_training = model.training
    model.eval()
    try:
        texts = [prompts[p - first_index] for p, _ in keys]
        with generation_weights(model):  # the quantised base copy of a training job, if any
            if path == "engine":
                rows = _engine_rows(decoder, model, tokenizer, texts, keys, max_new_tokens,
                                    sampling, batch_size * n_rows)
            else:
                rows = _hf_rows(model, tokenizer, texts, keys, max_new_tokens, sampling,
                                batch_size * n_rows)
                decoder.count_tokens(rows)
    finally:
        model.train(was_training)
    return [row for row in rows for _ in range(num_return_sequences // n_rows)]


def _engine_rows(decoder, model, tokenizer, texts, keys, max_new_tokens, sampling,
                 rows) -> list:
    """Completions of ``texts`` (one per row, keyed by ``keys``) through the decoder's engine
    with at most ``rows`` rows decoding at once; the peft adapter of ``model``, if any, on
    every row."""
    ids = [tokenizer(t)["input_ids"] for t in texts]
    requests = [Request(p, max_new_tokens, 0, pi, si) for p, (pi, si) in zip(ids, keys)]
    return decoder.run_requests(model, requests, eos_ids(model, tokenizer), sampling, rows)


def _hf_rows(model, tokenizer, texts, keys, max_new_tokens, sampling, rows) -> list:
    """Completions of ``texts`` through HF ``generate``, ``rows`` per call, greedy; sampled
    rows get their keyed Gumbel noise from :class:`KeyedGumbelProcessor`."""
    eos = eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    gen_cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                               repetition_penalty=1.0, pad_token_id=pad_id,
                               eos_token_id=eos)
    device = _model_device(model)
    out: list[list[int]] = []
    with torch.inference_mode():
        for start in range(0, len(texts), rows):
            batch = tokenizer(texts[start:start + rows], return_tensors="pt", padding=True,
                              padding_side="left").to(device)
            width = batch["input_ids"].shape[1]
            processors = LogitsProcessorList()
            if sampling is not None:
                key = torch.tensor(keys[start:start + rows], dtype=torch.int64, device=device)
                processors.append(KeyedGumbelProcessor(sampling, key[:, 0], key[:, 1], width))
            ids = model.generate(input_ids=batch["input_ids"],
                                 attention_mask=batch["attention_mask"],
                                 generation_config=gen_cfg, logits_processor=processors)
            out.extend(_through_eos(row, eos) for row in ids[:, width:])
    return out


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, *, do_sample=False,
             temperature=1.0, top_p=1.0, num_return_sequences=1, batch_size=64,
             seed=None, first_index=0, decoder: Decoder | None = None,
             path: str | None = None) -> list[str]:
    """Complete every prompt; return ``len(prompts) * num_return_sequences`` strings.

    Completions are decoded without special tokens and cut at the first eos. Prompt ``i``'s
    samples are at ``i*n .. i*n+n-1`` (``n = num_return_sequences``). Sampling uses only
    ``temperature`` and ``top_p`` (the model's own top_k, repetition penalty and so on are
    switched off); ``do_sample`` with ``temperature == 0`` means greedy, and greedy decoding
    with ``n > 1`` decodes once and repeats the completion ``n`` times. Samples are keyed by
    (``seed``, ``first_index`` + prompt position, sample index) (module docstring); without
    ``seed`` one is drawn from the global torch RNG. ``batch_size`` counts prompts decoding at
    once (each expands to ``n`` rows). ``decoder``: the job's :class:`Decoder` (default: a
    fresh one); ``path``: ``'engine'`` or ``'hf'`` (default: the decoder's). The model is put
    in eval mode for the call and restored afterwards; works with PEFT models (their adapter
    on every row).
    """
    ids = generate_tokens(model, tokenizer, prompts, max_new_tokens, do_sample=do_sample,
                          temperature=temperature, top_p=top_p,
                          num_return_sequences=num_return_sequences, batch_size=batch_size,
                          seed=seed, first_index=first_index, decoder=decoder, path=path)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)

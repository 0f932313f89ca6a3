"""Batched text generation: completions only, prompt-major, through a decoding backend
(:mod:`hpc.engine.backend`): the job's (``decoder=``), a fresh one of a registered name
(``backend=``), else a fresh one of the package's engine.

Sampling on every backend is keyed (:mod:`hpc.models.sampling`): prompt ``first_index + i``'s
sample ``first_sample + j`` depends only on (seed, first_index + i, first_sample + j), not on
the batch, the number of ranks or how the samples are split between calls.
"""
from __future__ import annotations

import torch

from hpc.engine.backend import DecodeBackend, make_backend
from hpc.engine.scheduler import Request
from hpc.models.chat import stop_token_ids
from hpc.models.quantize import generation_weights
from hpc.models.sampling import Sampling


def eos_ids(model, tokenizer) -> list[int]:
    """Token ids that end a completion: :func:`hpc.models.chat.stop_token_ids` (eos and the
    chat template's end-of-turn token) plus the model's configured eos."""
    ids = set(stop_token_ids(tokenizer))
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if configured is not None:
        ids.update(configured if isinstance(configured, (list, tuple)) else [configured])
    ids.discard(None)
    return sorted(ids)


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
                    batch_size=64, seed=None, first_index=0, first_sample=0,
                    decoder: DecodeBackend | None = None,
                    backend: str | None = None) -> list[list[int]]:
    """Like :func:`generate`, but return each completion's token ids, up to and including the
    eos token that ended it (a completion cut by ``max_new_tokens`` has no eos)."""
    decoder = make_backend(backend) if backend else decoder or make_backend()
    sampling = _sampling(do_sample, temperature, top_p, seed)
    n_rows = 1 if sampling is None else num_return_sequences  # greedy samples are all alike
    keys = [(first_index + i, first_sample + j) for i in range(len(prompts))
            for j in range(n_rows)]
    was_training = model.training
    model.eval()
    try:
        texts = [prompts[p - first_index] for p, _ in keys]
        ids = [tokenizer(t)["input_ids"] for t in texts]
        requests = [Request(p, max_new_tokens, 0, pi, si) for p, (pi, si) in zip(ids, keys)]
        with generation_weights(model):  # the quantised base copy of a training job, if any
            rows = decoder.decode(model, requests, eos_ids(model, tokenizer), sampling,
                                  batch_size * n_rows)
    finally:
        model.train(was_training)
    return [row for row in rows for _ in range(num_return_sequences // n_rows)]


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, *, do_sample=False,
             temperature=1.0, top_p=1.0, num_return_sequences=1, batch_size=64,
             seed=None, first_index=0, first_sample=0, decoder: DecodeBackend | None = None,
             backend: str | None = None) -> list[str]:
    """Complete every prompt; return ``len(prompts) * num_return_sequences`` strings.

    Completions are decoded without special tokens and cut at the first eos. Prompt ``i``'s
    samples are at ``i*n .. i*n+n-1`` (``n = num_return_sequences``). Sampling uses only
    ``temperature`` and ``top_p`` (the model's own top_k, repetition penalty and so on are
    switched off); ``do_sample`` with ``temperature == 0`` means greedy, and greedy decoding
    with ``n > 1`` decodes once and repeats the completion ``n`` times. Samples are keyed by
    (``seed``, ``first_index`` + prompt position, ``first_sample`` + sample index) (module
    docstring: samples 8..15 of one call equal samples 8..15 of a call for 16); without
    ``seed`` one is drawn from the global torch RNG. ``batch_size`` counts prompts decoding at
    once (each expands to ``n`` rows). ``decoder``: the job's backend; ``backend``: a
    registered backend's name, decoding through a fresh one (default: the decoder, else a
    fresh engine). The model is put
    in eval mode for the call and restored afterwards; works with PEFT models (their adapter
    on every row).
    """
    ids = generate_tokens(model, tokenizer, prompts, max_new_tokens, do_sample=do_sample,
                          temperature=temperature, top_p=top_p,
                          num_return_sequences=num_return_sequences, batch_size=batch_size,
                          seed=seed, first_index=first_index, first_sample=first_sample,
                          decoder=decoder,
                          backend=backend)
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def member_completions(model, tokenizer, factors: dict, prompts: list[str],
                       max_new_tokens: int, batch_size: int, *,
                       decoder: DecodeBackend | None = None, backend: str | None = None,
                       n_members: int | None = None) -> list[list[str]]:
    """Greedy completions of the first ``n_members`` (default all k) of k members on every
    prompt: a list per member of len(prompts) strings, decoded in one backend call with up
    to ``batch_size`` prompts a member at once. ``factors``: {peft LoRA layer name: (A' (k, r,
    in), B' (k, out, r))} (:meth:`hpc.engine.backend.DecodeBackend.decode`); the model's own
    adapter is untouched. ``decoder`` / ``backend`` as for :func:`generate`."""
    decoder = make_backend(backend) if backend else decoder or make_backend()
    k = next(iter(factors.values()))[0].shape[0]
    n = k if n_members is None else n_members
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    requests = [Request(p, max_new_tokens, m, i, 0) for m in range(n) for i, p in enumerate(ids)]
    was_training = model.training
    model.eval()
    try:
        rows = decoder.decode(model, requests, eos_ids(model, tokenizer), None, batch_size * k,
                              members=factors)
    finally:
        model.train(was_training)
    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    return [texts[m * len(prompts):(m + 1) * len(prompts)] for m in range(n)]


"""What a decoding engine holds, in bytes, and its budget: pure arithmetic on a
:class:`hpc.engine.shape.ModelShape` (no torch), shared by the engine and the memory plan."""
from __future__ import annotations

GIB = 2 ** 30
PREFILL_TOKENS = 8192  # most prompt tokens (padded) per prefill forward
MAX_LEN_STEP = 64  # an engine's max_len is rounded up to a multiple of this
ENGINE_MEMORY_SHARE = 0.5  # of the device's free memory, model.engine_memory_gib = 0 on CUDA
CPU_ENGINE_MEMORY_GIB = 8.0  # the budget of model.engine_memory_gib = 0 on CPU
SLOT_STATE_BYTES = 6 * 8  # int64 per slot: token, position, member, two sampling keys, live
SAMPLING_BYTES_PER_LOGIT = 24  # keyed sampling's temporaries per (row, vocab entry) at their
#   peak (int64 hash words, float32 uniforms, noise, scores, top-p's sort)


def bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most ``cap`` (and >= 1)."""
    return min(cap, 1 << max(0, n - 1).bit_length())


def rounded_length(max_len: int) -> int:
    """An engine's positions per slot: ``max_len`` rounded up to a multiple of MAX_LEN_STEP."""
    return -(-max_len // MAX_LEN_STEP) * MAX_LEN_STEP


def engine_memory(shape, slots: int, max_len: int, k: int = 0, dtype_bytes: int = 2,
                  member_params: int = 0, member_bytes: int = 4,
                  prompt_tokens: int | None = None) -> dict:
    """Bytes a :class:`hpc.engine.runner.DecodeEngine` holds, by part: {part: bytes}.

    ``shape``: a :class:`hpc.engine.shape.ModelShape` (layers L, kv_heads g, head_dim d,
    hidden h, intermediate I, vocab V); ``slots`` rows of ``max_len`` tokens (a built engine's
    figure is :func:`rounded_length`); ``k`` members of ``member_params`` LoRA parameters each
    (one member's r * (in + out) summed over its adapted linears) of ``member_bytes`` each;
    ``dtype_bytes``: bytes per value of the model's dtype (e); ``prompt_tokens``: the longest
    prompt P (default max_len).

    * ``kv_cache``: slots * max_len * :meth:`~hpc.engine.shape.ModelShape.kv_token_bytes`
      (2 L g d e a token);
    * ``members``: k * member_params * member_bytes (the stacked A_cat, B_cat);
    * ``slot_buffers``: slots * (4 V + SLOT_STATE_BYTES) (fp32 logits and int64 state per slot);
    * ``step_peak``: the larger transient of a decode step over all slots, slots *
      (:meth:`~hpc.engine.shape.ModelShape.activation_token_bytes` + V (e + 4 +
      SAMPLING_BYTES_PER_LOGIT)) (one layer's activations, the logits in the model dtype and
      fp32, keyed sampling's temporaries), and a prefill forward: the larger of T tokens'
      activations, T = min(slots * P, max(PREFILL_TOKENS, P)), and its last logits
      slots * V (e + 4).

    The first three live as long as the engine; the last only during a step (coefficients
    measured on CPU with a tensor-lifetime tracker: docs/engine.md)."""
    e = dtype_bytes
    prompt = max_len if prompt_tokens is None else prompt_tokens
    per_token = shape.activation_token_bytes(e)
    logits = slots * shape.vocab * (e + 4)
    step = slots * per_token + logits + slots * shape.vocab * SAMPLING_BYTES_PER_LOGIT
    prefill = max(min(slots * prompt, max(PREFILL_TOKENS, prompt)) * per_token, logits)
    return {"kv_cache": slots * max_len * shape.kv_token_bytes(e),
            "members": k * member_params * member_bytes,
            "slot_buffers": slots * (4 * shape.vocab + SLOT_STATE_BYTES),
            "step_peak": max(step, prefill)}


def engine_bytes(shape, slots: int, max_len: int, k: int = 0, dtype_bytes: int = 2,
                 member_params: int = 0, member_bytes: int = 4,
                 prompt_tokens: int | None = None) -> int:
    """Total bytes of :func:`engine_memory` (same arguments): the engine's peak."""
    return sum(engine_memory(shape, slots, max_len, k, dtype_bytes, member_params,
                             member_bytes, prompt_tokens).values())


def slots_within(budget_bytes: int, shape, max_len: int, k: int = 0, dtype_bytes: int = 2,
                 member_params: int = 0, member_bytes: int = 4, most: int = 1 << 20) -> int:
    """The most slots (<= ``most``) whose :func:`engine_bytes` fits in ``budget_bytes``; 0 when
    not even one slot fits."""
    lo, hi = 0, most
    while lo < hi:  # engine_bytes grows with slots
        mid = (lo + hi + 1) // 2
        if engine_bytes(shape, mid, max_len, k, dtype_bytes, member_params,
                        member_bytes) <= budget_bytes:
            lo = mid
        else:
            hi = mid - 1
    return lo


def budget_left(capacity_bytes: int, resident_bytes: int) -> int:
    """The one formula of an engine's derived budget, the job's and the plan's:
    ENGINE_MEMORY_SHARE of what everything resident (``resident_bytes``: weights, adapters,
    optimizer state, and on a device the CUDA context and other processes) leaves of
    ``capacity_bytes``, rounded down to whole GiB (so ranks with a few MiB more or less
    agree)."""
    return int(ENGINE_MEMORY_SHARE * max(0, capacity_bytes - resident_bytes)) // GIB * GIB

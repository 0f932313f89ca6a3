"""Which models the package's decoding engine runs, read from ``config.json`` alone (no torch).

The engine runs the Hugging Face model's own modules, so it runs every decoder of the Qwen2 /
Llama shape: GQA attention with rotary embeddings, a SwiGLU MLP and RMSNorms, biases or not,
tied or untied embeddings:

* ``qwen2`` (Qwen2, Qwen2.5): q/k/v biases;
* ``llama`` (Llama 2, Llama 3.x): ``attention_bias`` / ``mlp_bias`` as configured, RoPE scaled
  as the config gives it (``llama3``, ``linear``, ``yarn``);
* ``mistral``: no biases, while every row fits its ``sliding_window`` (then sliding attention
  is full attention);
* ``qwen3``: an RMSNorm over each head of q and k before the rotation.

RoPE types whose frequencies depend on the batch (``dynamic``, ``longrope``: recomputed from
the longest position on the host) and sliding-window attention that would act are refused, in
one line that names the backend that runs them (``model.engine=hf``).
"""
from __future__ import annotations

ARCHITECTURES = ("qwen2", "qwen3", "llama", "mistral")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
OTHER_BACKEND = "model.engine=hf"


def rope_types(config: dict) -> set:
    """The RoPE types of a ``config.json`` dict: ``rope_parameters`` (transformers 5) or
    ``rope_scaling`` (older files), one per layer type where they are given per layer type."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    per_type = [v for v in rope.values() if isinstance(v, dict)] or [rope]
    return {p.get("rope_type") or p.get("type") or "default" for p in per_type}


def sliding_window_acts(config: dict, max_len: int) -> bool:
    """Whether sliding-window attention changes what a row of up to ``max_len`` tokens sees."""
    if "sliding_attention" in (config.get("layer_types") or ()):
        return True
    if config.get("model_type") in ("qwen2", "qwen3"):
        return bool(config.get("use_sliding_window"))
    window = config.get("sliding_window")
    return window is not None and window < max_len


def engine_refusal(config: dict, max_len: int) -> str:
    """'' when the package's engine runs this ``config.json`` for rows of up to ``max_len``
    tokens; else one line saying why, naming the backend that runs it."""
    kind = config.get("model_type", "")
    if kind not in ARCHITECTURES:
        what = f"{kind or 'unknown'}-architecture models"
    elif not rope_types(config) <= set(STATIC_ROPE):
        what = (f"RoPE of type {', '.join(sorted(rope_types(config) - set(STATIC_ROPE)))} "
                f"(frequencies that depend on the batch)")
    elif sliding_window_acts(config, max_len):
        what = (f"sliding-window attention (window {config.get('sliding_window')}, rows of up "
                f"to {max_len} tokens)")
    else:
        return ""
    return (f"the package's decoding engine does not run {what}; it runs "
            f"{', '.join(ARCHITECTURES)} models with RoPE of type {', '.join(STATIC_ROPE)}: "
            f"use {OTHER_BACKEND}")

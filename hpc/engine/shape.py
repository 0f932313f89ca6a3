"""The one shape of a decoder model: :class:`ModelShape`, from ``config.json`` alone (no torch).

The engine sizes its KV cache with it, the memory plan every phase, ESSA its members per
pass and the scaling model its LoRA sizes; per-token memory has one formula here
(:meth:`ModelShape.kv_token_bytes`, :meth:`ModelShape.activation_token_bytes`).

Qwen2 / Llama family (Qwen2, Qwen3, Llama, Mistral): GQA attention, SwiGLU MLP, RMSNorm:
``hidden_size`` h, ``num_hidden_layers`` L, ``num_attention_heads`` a, ``num_key_value_heads``
g (default a), ``head_dim`` d (default h / a), ``intermediate_size`` I, ``vocab_size`` V,
``tie_word_embeddings`` (default false); q/k/v biases for model type ``qwen2``, q/k/v/o biases
when ``attention_bias`` is true (Llama, Qwen3), MLP biases when ``mlp_bias`` is true (Llama),
q/k norms (d each) for ``qwen3``. Parameters: V*h embeddings, per layer q (h*a*d), k and v
(h*g*d each), o (a*d*h), 3*h*I MLP, 2*h norms (+ a*d + 2*g*d q/k/v biases, + h o bias,
+ 2*I + h MLP biases, + 2*d q/k norms), a final h norm, V*h lm_head unless tied.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from hpc.runtime.errors import UserError

# config.json of the released Qwen2.5 models (the -Instruct and -Math variants have the same
# shapes): the sizes the papers run, for benchmarks, the GPU checks and the plan's tests.
QWEN25 = {
    "1.5B": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, intermediate_size=8960, vocab_size=151936,
                 tie_word_embeddings=True),
    "7B": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
               tie_word_embeddings=False),
    "32B": dict(hidden_size=5120, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, intermediate_size=27648, vocab_size=152064,
                tie_word_embeddings=False),
}
STORED_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # config.json's dtype (torch_dtype)
ACTIVATION_VALUES = (4, 3)  # (x hidden, x intermediate) values per token live in one layer
#   while decoding (the engine's step, measured with a tensor-lifetime tracker)


@dataclass(frozen=True)
class ModelShape:
    """The figures of a decoder-only model's ``config.json`` that memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    stored_bytes: int = 2  # bytes a value in the checkpoint files (config.json's dtype)
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_config(cls, config, source: str = "config.json") -> "ModelShape":
        """From ``config.json`` as a dict, or a Hugging Face config object."""
        if not isinstance(config, dict):
            config = config.to_dict()

        def need(key):
            if not isinstance(config.get(key), int):
                raise UserError(f"{source}: missing integer '{key}', needed for the memory plan")
            return config[key]

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        kind, attention_bias = config.get("model_type"), bool(config.get("attention_bias"))
        return cls(hidden=hidden, layers=need("num_hidden_layers"), heads=heads,
                   kv_heads=config.get("num_key_value_heads") or heads,
                   head_dim=config.get("head_dim") or hidden // heads,
                   intermediate=need("intermediate_size"), vocab=need("vocab_size"),
                   tied=bool(config.get("tie_word_embeddings", False)),
                   qkv_bias=attention_bias or kind == "qwen2",
                   stored_bytes=STORED_BYTES.get(str(config.get("dtype")
                                                     or config.get("torch_dtype")), 2),
                   o_bias=attention_bias and kind != "qwen2",
                   mlp_bias=bool(config.get("mlp_bias")), qk_norm=kind == "qwen3")

    @classmethod
    def from_folder(cls, path: str) -> "ModelShape":
        file = os.path.join(path, "config.json")
        try:
            with open(file) as fh:
                return cls.from_config(json.load(fh), file)
        except (OSError, json.JSONDecodeError) as err:
            raise UserError(f"cannot read {file} for the memory plan: {err}") from None

    @classmethod
    def qwen25(cls, size: str) -> "ModelShape":
        """The released Qwen2.5 model of ``size`` (a key of :data:`QWEN25`)."""
        return cls.from_config(dict(QWEN25[size], model_type="qwen2"))

    def module_shapes(self) -> dict:
        """(in_features, out_features) of each linear layer of a decoder layer."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (self.hidden, q), "k_proj": (self.hidden, kv),
                "v_proj": (self.hidden, kv), "o_proj": (q, self.hidden),
                "gate_proj": (self.hidden, self.intermediate),
                "up_proj": (self.hidden, self.intermediate),
                "down_proj": (self.intermediate, self.hidden)}

    def largest_linear(self) -> int:
        """Weights of the largest linear of a decoder layer."""
        return max(i * o for i, o in self.module_shapes().values())

    def largest_tensor(self) -> int:
        """Values of the largest tensor of the checkpoint (the embedding or LM head, V h, or a
        decoder linear)."""
        return max(self.vocab * self.hidden, self.largest_linear())

    def layer_parameters(self) -> int:
        weights = sum(i * o for i, o in self.module_shapes().values())
        bias = (self.heads + 2 * self.kv_heads) * self.head_dim if self.qkv_bias else 0
        bias += (self.hidden if self.o_bias else 0) + (
            2 * self.intermediate + self.hidden if self.mlp_bias else 0)
        norms = 2 * self.hidden + (2 * self.head_dim if self.qk_norm else 0)
        return weights + bias + norms

    def parameters(self) -> int:
        embeddings = self.vocab * self.hidden
        return (embeddings * (1 if self.tied else 2) + self.layers * self.layer_parameters()
                + self.hidden)

    def lora_parameters(self, rank: int, targets) -> int:
        """Parameters of a rank-``rank`` LoRA on ``targets`` of every layer: r * (in + out)
        per adapted linear; names that are not linears of a decoder layer count nothing."""
        shapes = self.module_shapes()
        return self.layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)

    def kv_token_bytes(self, elem: int) -> int:
        """Keys and values of one token over all layers: 2 L g d values of ``elem`` bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * elem

    def activation_token_bytes(self, elem: int) -> int:
        """One decoder layer's activations live per token while decoding:
        (4 h + 3 I) values of ``elem`` bytes (:data:`ACTIVATION_VALUES`)."""
        return (ACTIVATION_VALUES[0] * self.hidden + ACTIVATION_VALUES[1] * self.intermediate) \
            * elem

    def training_layer_bytes(self, elem: int, lora_targets=(), full: bool = False) -> int:
        """Activations one decoder layer keeps for backward, per token (docs/memory-plan.md);
        ``full``: every weight trains, so the inputs of the linear layers are kept too."""
        h_coef = 5 if elem == 4 else 6  # the RMSNorms' fp32 upcasts cost one more h in 16 bits
        kv = self.heads * self.head_dim  # K and V saved at all heads (repeat_kv, padded path)
        values = h_coef * self.hidden + 2 * kv + 3 * self.intermediate
        if full:  # measured: (3*h + I) more in fp32, (4*h + I) in 16 bits
            values += (h_coef - 2) * self.hidden + self.intermediate
        shapes = self.module_shapes()
        upcast = sum(shapes[t][0] for t in lora_targets if t in shapes) * 4 if elem < 4 else 0
        return values * elem + upcast

    def training_token_bytes(self, elem: int, lora_targets=(), full: bool = False) -> int:
        """Activations kept for backward over all layers + the logits, per token."""
        return (self.layers * self.training_layer_bytes(elem, lora_targets, full)
                + self.vocab * (elem + 4))

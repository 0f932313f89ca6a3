"""The roofline cost source: per-GPU seconds of a described model on a described GPU. Decode
steps are bound by reading the weights plus a per-sequence term, with a batch capped by the KV
cache or by the memory plan's engine (:mod:`compare.plan_terms`); training by FLOPs at a fixed
MFU.

Units: seconds, bytes, bytes/s, FLOP/s; "tokens/s" are per GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from compare.network import GPU
from compare.plan_terms import model_shape
from compare.sharding import FGRPO_MODES
from hpc.engine.shape import ModelShape
from hpc.runtime.errors import UserError

DECODE_MFU = 0.5  # MFU of the per-sequence decode FLOPs
TRAIN_MFU = 0.4   # MFU of training
GEN_BATCH = 64    # concurrent sequences of a measured generation throughput (--gen-batch)


@dataclass(frozen=True)
class Model:
    params: float      # parameters
    layers: int
    hidden: int
    intermediate: int  # MLP width
    kv_dim: int        # key/value width (kv heads x head dim)
    lora_rank: int
    weight_bytes: float = 2.0  # per parameter (bf16)

    @property
    def shape(self) -> ModelShape:
        """The one model shape of these widths (:func:`compare.plan_terms.model_shape`)."""
        return model_shape(self.layers, self.hidden, self.intermediate, self.kv_dim)

    @property
    def lora_params(self) -> float:
        """LoRA on q, k, v, o, gate, up, down: rank x (in + out) per matrix."""
        return self.shape.lora_parameters(self.lora_rank, self.shape.module_shapes())

    @property
    def search_dim(self) -> int:
        """ESSA's dimension as the paper counts it: the rank singular values of the A and the
        B factor of each of the 4 attention adapters (q, k, v, o) per layer (8,192 for
        Qwen2.5-32B at rank 16)."""
        return self.layers * 4 * 2 * self.lora_rank

    @property
    def kv_bytes_per_token(self) -> float:
        return float(self.shape.kv_token_bytes(2))  # K and V, bf16


QWEN25_32B = Model(params=32.5e9, layers=64, hidden=5120, intermediate=27648, kv_dim=1024,
                   lora_rank=16)


class Roofline:
    """Per-GPU costs of a described model: decode steps bound by reading the weights plus a
    per-sequence term, batch capped by the KV cache; training by FLOPs at a fixed MFU.
    ``prompt``, ``completion`` (mean) and ``max_new`` are tokens; ``mode`` names the F-GRPO
    layout (:data:`compare.sharding.FGRPO_MODES`) for the assumption lines."""

    def __init__(self, model: Model, gpu: GPU, prompt: int, completion: int, max_new: int,
                 full: bool, decode_mfu: float = DECODE_MFU, train_mfu: float = TRAIN_MFU,
                 mem_util: float = 0.9, gen_tps: float | None = None,
                 gen_batch: int = GEN_BATCH, train_tps: float | None = None,
                 decoding: dict | None = None, mode: str = "replica"):
        self.model, self.gpu, self.full, self.mode = model, gpu, full, mode
        # {"essa" | "fgrpo": compare.plan_terms.Decoding}: the memory plan's weight bytes
        # and concurrency of that method's decoding (else this model's own bf16 KV arithmetic)
        self.decoding = decoding or {}
        self.prompt, self.completion, self.max_new = prompt, completion, max_new
        weights = model.params * model.weight_bytes
        self.step_fixed = weights / gpu.hbm
        kv_free = gpu.memory * mem_util - weights
        self.max_batch = int(kv_free // (model.kv_bytes_per_token * (prompt + max_new)))
        if self.max_batch < 1:
            raise UserError(f"the {model.params:.3g}-parameter model leaves no room for a KV "
                            f"cache on a {gpu.memory / 1e9:.0f} GB GPU")
        if gen_tps is None:
            ctx = prompt + completion / 2
            self.per_seq = 2 * model.params / (gpu.flops * decode_mfu) + \
                ctx * model.kv_bytes_per_token / gpu.hbm
        else:  # a measured batch was held concurrently, whatever the KV estimate says
            self.max_batch = max(self.max_batch, gen_batch)
            self.per_seq = (gen_batch / gen_tps - self.step_fixed) / gen_batch
            if self.per_seq <= 0:
                raise UserError(f"--gen-tps {gen_tps:g} at batch {gen_batch} beats the "
                                f"weight-read bound of {gen_batch / self.step_fixed:.0f} tokens/s")
        self.gen_tps_given, self.gen_batch, self.train_tps_given = gen_tps, gen_batch, train_tps
        self.mem_util = mem_util
        flops_per_token = (10 if full else 8) * model.params
        self.train_tps = train_tps or gpu.flops * train_mfu / flops_per_token
        self.decode_mfu, self.train_mfu = decode_mfu, train_mfu
        self.trainable = model.params if full else model.lora_params

    def terms(self, method: str | None = None) -> tuple:
        """(seconds of a decode step's weight read, most concurrent sequences) of ``method``'s
        decoding: the memory plan's (:attr:`decoding`), else this model's own."""
        d = self.decoding.get(method)
        if d is None:
            return self.step_fixed, self.max_batch
        most = max(d.concurrency, self.gen_batch) if self.gen_tps_given else d.concurrency
        return d.weight_bytes / self.gpu.hbm, most

    def tokens_per_s(self, batch: int, method: str | None = None) -> float:
        return batch / (self.terms(method)[0] + batch * self.per_seq)

    def generate(self, n: int, method: str | None = None) -> float:
        """Seconds for one GPU to complete ``n`` sequences: throughput at min(n, concurrency),
        but never less than max_new sequential decode steps (the longest completion)."""
        fixed, most = self.terms(method)
        b = min(n, most)
        step = fixed + b * self.per_seq
        return max(n * self.completion / self.tokens_per_s(b, method), self.max_new * step)

    def essa_generate(self, n: int) -> float:
        return self.generate(n, "essa")

    def fgrpo_generate(self, n: int) -> float:
        return self.generate(n, "fgrpo")

    def train(self, n: int) -> float:
        return n * (self.prompt + self.completion) / self.train_tps

    @property
    def grad_bytes(self) -> float:
        return 4.0 * self.trainable  # fp32 gradients

    @property
    def optimizer_s(self) -> float:
        return 32.0 * self.trainable / self.gpu.hbm  # AdamW: read+write param, grad, 2 moments

    def assumptions(self) -> list:
        m = self.model
        gen = (f"generation: {self.gen_tps_given:g} tokens/s per GPU at batch "
               f"{self.gen_batch} as given, over a weight read of "
               f"{1e3 * self.step_fixed:.1f} ms a decode step" if
               self.gen_tps_given else
               f"generation: each decode step reads the {m.weight_bytes * m.params / 1e9:.0f} GB "
               f"of bf16 weights ({1e3 * self.step_fixed:.1f} ms) plus, per sequence, "
               f"{1e3 * self.per_seq:.2f} ms (2 x params FLOPs at {self.decode_mfu:.0%} MFU and "
               f"its KV-cache read)")
        return [
            f"model: {m.params / 1e9:.1f}B parameters, {m.layers} layers, hidden {m.hidden}, "
            f"LoRA rank {m.lora_rank} on q,k,v,o,gate,up,down = {m.lora_params / 1e6:.0f}M "
            f"parameters; ESSA searches {m.search_dim} singular values (the paper's count: "
            f"{m.layers} layers x 4 attention matrices x 2 factors x rank {m.lora_rank})",
            "each GPU decodes from a whole bf16 replica (no tensor or pipeline parallelism) for "
            "both methods; " + FGRPO_MODES[self.mode],
            gen + f"; at most {self.max_batch} concurrent sequences (KV cache of "
            f"{self.prompt}+{self.max_new} tokens in what the weights leave of "
            f"{self.mem_util:.0%} of {self.gpu.memory / 1e9:.0f} GB); "
            f"{self.tokens_per_s(self.max_batch):.0f} tokens/s per GPU at that batch",
            *[f"{d.describe()}: {self.tokens_per_s(self.terms(m)[1], m):.0f} tokens/s per GPU "
              f"there; this replaces the line above for {d.method}" for m, d in
              self.decoding.items()],
            f"completions: prompt {self.prompt}, mean {self.completion}, max {self.max_new} "
            f"tokens; a GPU's generation takes at least max-new sequential decode steps",
            f"training: {self.train_tps:.0f} tokens/s per GPU (" +
            ("as given" if self.train_tps_given else
             f"{10 if self.full else 8} x params FLOPs a token: old log-probs, forward, "
             f"backward{' with weight gradients' if self.full else ''}, recomputation; "
             f"{self.train_mfu:.0%} MFU") + "); no KL reference model (beta = 0)",
            f"GRPO gradients: {self.trainable / 1e6:.0f}M fp32 values "
            f"({self.grad_bytes / 1e6:.0f} MB) all-reduced once per optimizer step; AdamW "
            f"costs {1e3 * self.optimizer_s:.1f} ms (HBM-bound)",
        ]

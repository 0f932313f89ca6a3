"""The decode step and the prefill of a Qwen2-, Qwen3-, Llama- or Mistral-architecture model
(:mod:`hpc.engine.architectures`) over a static KV cache, with per-row LoRA members:
:class:`DecodeEngine`.

It runs the Hugging Face model's own modules (embeddings, q/k/v/o and MLP linears with their
biases, RMSNorms, Qwen3's q/k norms, rotary embedding with its scaling, LM head); no weight is
copied.

* **slots**: a :class:`hpc.engine.kv_cache.KVCache` of ``[layers, slots, kv_heads, max_len,
  head_dim]`` allocated once; a request takes a free slot, is prefilled (admitted requests in
  one right-padded causal forward, :meth:`DecodeEngine.prefill`), then decodes one token per
  step (:mod:`hpc.engine.scheduler` decides which);
* **decode step** (:meth:`DecodeEngine.decode_step`): the first ``rows`` slots, one token each,
  per-row rotary positions, attention over the first ``ctx`` cache positions with a per-row
  length mask. ``rows`` and ``ctx`` are rounded up to buckets (powers of two), so a step has
  one of a few static shapes: on CUDA with graphs each shape is captured once and replayed
  (:mod:`hpc.engine.graphs`); elsewhere the same function runs eagerly;
* **members**: k LoRA adapters stacked per adapted linear as ``A_cat`` (k*r, in) and ``B_cat``
  (out, k*r); a row of member m computes ``base(x) + ((x A_cat^T) * onehot_m) B_cat^T *
  scaling`` (the one-hot mask keeps member m's r columns), so rows of any members mix freely in
  a batch and the step has no host work per member. k = 0 is the bare model; a peft model's own
  adapter is k = 1 (no mask; the same ops as peft's LoRA forward).

Build an engine through its owner, :meth:`hpc.engine.engine_backend.EngineBackend.engine_for`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hpc.engine.architectures import engine_refusal
from hpc.engine.kv_cache import KVCache
from hpc.engine.memory import engine_memory
from hpc.engine.scheduler import Scheduler
from hpc.engine.shape import ModelShape
from hpc.models.sampling import Sampling
from hpc.runtime.errors import UserError

ADAPTER = "default"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEARS = ATTENTION + ("gate_proj", "up_proj", "down_proj")


@dataclass
class Site:
    """One linear of a decoder layer: its base module and, when adapted, stacked members.

    a_cat (k*r, in), b_cat (out, k*r) in the adapter dtype; cols (k*r,) int64: the member of
    each rank column; scaling: peft's alpha / r."""

    name: str
    base: torch.nn.Module
    a_cat: torch.Tensor | None = None
    b_cat: torch.Tensor | None = None
    cols: torch.Tensor | None = None
    scaling: float = 1.0

    def __call__(self, x: torch.Tensor, member: torch.Tensor | None) -> torch.Tensor:
        """x (rows, t, in) -> (rows, t, out); ``member`` (rows,) int64 or None (k <= 1)."""
        out = self.base(x)
        if self.a_cat is None:
            return out
        xa = F.linear(x.to(self.a_cat.dtype), self.a_cat)  # (rows, t, k*r)
        if member is not None:
            xa = xa * (member[:, None, None] == self.cols).to(xa.dtype)
        return (out + F.linear(xa, self.b_cat) * self.scaling).to(out.dtype)


def _core(model, max_len: int):
    """(the HF causal LM, {id(module): name in ``model``}) of a HF or peft model; UserError
    (one line) for a model the engine does not run."""
    names = {id(m): n for n, m in model.named_modules()}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    refusal = engine_refusal(base.config.to_dict(), max_len)
    if refusal:
        raise UserError(refusal)
    return base, names


class DecodeEngine:
    """Static state for decoding ``slots`` rows of up to ``max_len`` tokens with ``k`` members.

    Build with :meth:`hpc.engine.engine_backend.EngineBackend.engine_for` (kept and reused by its owner);
    load members with :meth:`set_members`; decode with :meth:`run`. ``ranks``: {adapted module
    name: r}. ``replay``: None (every step eager), :class:`hpc.engine.graphs.GraphedDecode`
    (CUDA graphs, self-checked) or a subclass of it; called with the engine.
    ``graph_failure``: why a captured step failed its self-check ('' while none did); the
    engine then decodes eagerly.
    """

    def __init__(self, model, slots: int, max_len: int, k: int, ranks: dict, replay=None):
        base, names = _core(model, max_len)
        cfg = base.config
        self.model, self.k, self.ranks = model, k, ranks
        self.embed, self.norm = base.model.embed_tokens, base.model.norm
        self.rotary, self.lm_head = base.model.rotary_emb, base.lm_head
        self.shape = ModelShape.from_config(cfg)
        self.heads, self.kv_heads = self.shape.heads, self.shape.kv_heads
        self.head_dim = self.shape.head_dim
        self.qk_norm = self.shape.qk_norm
        self.layers = []
        param = next(base.parameters())
        self.device, self.dtype = param.device, param.dtype
        seen = set()
        for layer in base.model.layers:
            sites = {}
            for attr in LINEARS:
                holder = layer.self_attn if attr in ATTENTION else layer.mlp
                module = getattr(holder, attr)
                name = names[id(module)]
                lora = isinstance(module, LoraLayer)
                sites[attr] = Site(name, module.base_layer if lora else module)
                if name in ranks:
                    seen.add(name)
                    if k:
                        self._stack(sites[attr], module, k, ranks[name])
            self.layers.append((layer, sites))
        if set(ranks) - seen:
            raise UserError(f"the decoding engine adapts only the linears of decoder layers, "
                            f"not {sorted(set(ranks) - seen)[0]}")
        self.cache = KVCache(len(self.layers), slots, self.kv_heads, max_len, self.head_dim,
                             self.dtype, self.device)
        long = dict(dtype=torch.int64, device=self.device)
        self.tokens = torch.zeros(slots, **long)  # input token of each slot's next step
        self.positions = torch.zeros(slots, **long)  # cache position that token goes to
        self.members = torch.zeros(slots, **long)
        self.logits = None  # (slots, vocab) float32, written by decode_step
        self.replay = replay
        self.graphs = replay(self) if replay is not None else None
        self.graph_failure = ""
        self.member_params, self.member_bytes = member_size(model, ranks)

    def memory(self) -> dict:
        """:func:`engine_memory` of this engine's shape (bytes by part)."""
        return engine_memory(self.shape, self.slots, self.cache.max_len, self.k,
                             self.dtype.itemsize, self.member_params, self.member_bytes)

    @property
    def slots(self) -> int:
        return self.cache.slots

    def _stack(self, site: Site, module, k: int, r: int) -> None:
        a = module.lora_A[ADAPTER].weight
        site.scaling = module.scaling[ADAPTER]
        site.a_cat = a.new_zeros((k * r, a.shape[1]))
        site.b_cat = a.new_zeros((module.lora_B[ADAPTER].weight.shape[0], k * r))
        site.cols = torch.arange(k, device=a.device).repeat_interleave(r)

    @torch.inference_mode()
    def set_members(self, factors: dict | None) -> None:
        """Copy members into the stacked buffers: {module: (A (k, r, in), B (k, out, r))};
        None: the peft model's own adapter (k = 1)."""
        for _, sites in self.layers:
            for site in sites.values():
                if site.a_cat is None:
                    continue
                if factors is None:
                    module = self.model.get_submodule(site.name)
                    a = module.lora_A[ADAPTER].weight[None]
                    b = module.lora_B[ADAPTER].weight[None]
                else:
                    a, b = factors[site.name]
                site.a_cat.copy_(a.reshape(site.a_cat.shape))
                site.b_cat.copy_(b.permute(1, 0, 2).reshape(site.b_cat.shape))

    def _block(self, layer, sites, h, cos, sin, member, attend):
        """One decoder layer on h (rows, t, hidden); ``attend(q, k, v)`` writes the cache and
        returns the attention output (rows, heads, t, head_dim)."""
        rows, t, _ = h.shape
        x = layer.input_layernorm(h)
        q = sites["q_proj"](x, member).view(rows, t, -1, self.head_dim)
        k = sites["k_proj"](x, member).view(rows, t, -1, self.head_dim)
        if self.qk_norm:  # Qwen3: an RMSNorm over each head, before the rotation
            q, k = layer.self_attn.q_norm(q), layer.self_attn.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = sites["v_proj"](x, member).view(rows, t, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        a = attend(q, k, v).transpose(1, 2).reshape(rows, t, -1)
        h = h + sites["o_proj"](a, member)
        x = layer.post_attention_layernorm(h)
        mlp = layer.mlp
        return h + sites["down_proj"](mlp.act_fn(sites["gate_proj"](x, member))
                                      * sites["up_proj"](x, member), member)

    def _member_arg(self, member: torch.Tensor) -> torch.Tensor | None:
        return member if self.k > 1 else None

    def decode_step(self, rows: int, ctx: int) -> None:
        """One token for slots [0, rows): reads ``tokens``, ``positions``, ``members``, writes
        the cache at each row's position and ``logits[:rows]`` (float32). Attends to cache
        positions [0, ctx); every row's position must be < ctx. The function CUDA graphs
        capture."""
        tok, pos = self.tokens[:rows], self.positions[:rows]
        member = self._member_arg(self.members[:rows])
        h = self.embed(tok)[:, None, :]  # (rows, 1, hidden)
        cos, sin = self.rotary(h, pos[:, None])
        mask = (torch.arange(ctx, device=self.device)[None, :] <= pos[:, None])[:, None, None]
        index = torch.arange(rows, device=self.device)
        for i, (layer, sites) in enumerate(self.layers):
            keys, values = self.cache.k[i], self.cache.v[i]

            def attend(q, k, v, keys=keys, values=values):
                keys[index, :, pos] = k[:, :, 0]
                values[index, :, pos] = v[:, :, 0]
                return F.scaled_dot_product_attention(
                    q, keys[:rows, :, :ctx], values[:rows, :, :ctx], attn_mask=mask,
                    scale=self.head_dim ** -0.5, enable_gqa=True)

            h = self._block(layer, sites, h, cos, sin, member, attend)
        logits = self.lm_head(self.norm(h))[:, 0].float()  # (rows, 1, V) as in HF -> (rows, V)
        if self.logits is None:
            self.logits = logits.new_zeros((self.slots, logits.shape[-1]))
        self.logits[:rows] = logits

    def prefill(self, ids: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                member: torch.Tensor) -> torch.Tensor:
        """Prompts ``ids`` (n, T) right-padded, true ``lengths`` (n,), into cache ``slots`` (n,)
        positions [0, T); returns the logits (n, vocab) float32 after each prompt's last
        token. Padding sits after the real tokens, so causal attention never sees it."""
        n, t = ids.shape
        h = self.embed(ids)
        pos = torch.arange(t, device=self.device)[None].expand(n, t)
        cos, sin = self.rotary(h, pos)
        member = self._member_arg(member)
        for i, (layer, sites) in enumerate(self.layers):
            keys, values = self.cache.k[i], self.cache.v[i]

            def attend(q, k, v, keys=keys, values=values):
                keys[slots, :, :t] = k
                values[slots, :, :t] = v
                return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                      scale=self.head_dim ** -0.5,
                                                      enable_gqa=True)

            h = self._block(layer, sites, h, cos, sin, member, attend)
        last = self.norm(h)[torch.arange(n, device=self.device), lengths - 1]
        return self.lm_head(last[:, None])[:, 0].float()

    def step(self, rows: int, ctx: int) -> torch.Tensor:
        """:meth:`decode_step` (replayed from a CUDA graph when enabled); logits (rows, V).
        A shape whose self-check fails turns this engine's graphs off: the step runs eagerly."""
        if self.graphs is not None and not self.graphs.run(rows, ctx):
            self.graph_failure, self.graphs = self.graphs.failure, None
        if self.graphs is None:
            self.decode_step(rows, ctx)
        return self.logits[:rows]

    @torch.inference_mode()
    def run(self, requests: list, eos_ids: list, sampling: Sampling | None = None) -> list:
        """Decode every request; returns each one's new tokens (through its eos, if any).

        ``requests``: :class:`hpc.engine.scheduler.Request` list, in any order (results
        follow it)."""
        return Scheduler(self, requests, eos_ids, sampling).run()


def member_size(model, ranks: dict) -> tuple:
    """(parameters of one member: r * (in + out) summed over the adapted linears ``ranks``,
    bytes per parameter of the adapter's dtype)."""
    params, elem = 0, 4
    for name in ranks:
        module = model.get_submodule(name)
        a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
        params += a.numel() + b.numel()
        elem = a.element_size()
    return params, elem


def adapter_ranks(model) -> dict:
    """{module name: r} of the peft model's default adapter ({} for a plain model)."""
    ranks = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            if module.merged:
                raise UserError(f"{name}: the decoding engine needs an unmerged LoRA adapter")
            ranks[name] = module.r[ADAPTER]
    return ranks

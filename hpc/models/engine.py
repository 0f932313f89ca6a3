"""A decoding engine for Qwen2-architecture models: static KV cache, continuous batching,
per-row LoRA members, keyed sampling, and (on CUDA) the decode step captured as CUDA graphs.

It runs the Hugging Face model's own modules (embeddings, q/k/v/o and MLP linears, RMSNorms,
rotary embedding, LM head); no weight is copied. Per call:

* **requests**: prompt token ids, each with its own ``max_new`` limit, member index and sampling
  key (prompt index, sample index);
* **slots**: a KV cache of ``[layers, slots, kv_heads, max_len, head_dim]`` allocated once
  (:class:`KVCache`); a request takes a free slot, is prefilled (admitted requests in one
  right-padded causal forward), then decodes one token per step; a row that emits eos or reaches
  its ``max_new`` frees its slot at once and waiting requests are admitted, so a completion
  costs its own length, not its batch's longest;
* **decode step** (:meth:`DecodeEngine.decode_step`): the first ``rows`` slots, one token each,
  per-row rotary positions, attention over the first ``ctx`` cache positions with a per-row
  length mask. ``rows`` and ``ctx`` are rounded up to buckets (powers of two), so a step has one
  of a few static shapes: on CUDA with ``cuda_graphs`` each shape is captured once and replayed
  (:class:`GraphedDecode`); elsewhere the same function runs eagerly. Finished rows are moved
  down into free low slots when no request waits, so ``rows`` shrinks with the live rows;
* **members**: k LoRA adapters stacked per adapted linear as ``A_cat`` (k*r, in) and ``B_cat``
  (out, k*r); a row of member m computes ``base(x) + ((x A_cat^T) * onehot_m) B_cat^T * scaling``
  (the one-hot mask keeps member m's r columns), so rows of any members mix freely in a batch
  and the step has no host work per member. k = 0 is the bare model; a peft model's own adapter
  is k = 1 (no mask; the same ops as peft's LoRA forward).

Per step the host reads back only the new tokens (rows,) to see which rows ended.

**Memory.** :func:`engine_memory` is the one formula of what an engine holds (KV cache, stacked
members, per-slot buffers, the transient peak of a step); :func:`engine_for` sizes every engine
within a byte budget (:func:`memory_budget`: ``model.engine_memory_gib``, or a share of the
device's free memory) and at most ``model.engine_slots`` slots, so a call with more requests
than slots decodes them in waves through the slots (continuous batching), and an engine larger
than the current phase asks for is replaced by one of that phase's size.

**Self-check.** The first time a decode shape is captured as a CUDA graph, a few steps replayed
from the graph are compared with the same steps run eagerly (:func:`compare_steps`); on a
mismatch the engine decodes eagerly from then on and :func:`graph_check_failure` says why, for
the job to switch graphs off on every rank and record it (:func:`hpc.job.loop.share_graph_check`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from transformers.models.qwen2.modeling_qwen2 import apply_rotary_pos_emb

from hpc.models.sampling import Sampling, pick_tokens
from hpc.runtime.errors import UserError

ADAPTER = "default"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LINEARS = ATTENTION + ("gate_proj", "up_proj", "down_proj")
PREFILL_TOKENS = 8192  # most prompt tokens (padded) per prefill forward
ADMIT_SHARE = 8  # with live rows, admit once 1/ADMIT_SHARE of the slots are free
GIB = 2 ** 30
MAX_LEN_STEP = 64  # an engine's max_len is rounded up to a multiple of this
ENGINE_MEMORY_SHARE = 0.5  # of the device's free memory, model.engine_memory_gib = 0 on CUDA
CPU_ENGINE_MEMORY_GIB = 8.0  # the budget of model.engine_memory_gib = 0 on CPU
SLOT_STATE_BYTES = 6 * 8  # int64 per slot: token, position, member, two sampling keys, live
ACTIVATION_VALUES = (4, 3)  # (x hidden, x intermediate) values per token live in one layer
SAMPLING_BYTES_PER_LOGIT = 24  # keyed sampling's temporaries per (row, vocab entry) at their
#   peak (int64 hash words, float32 uniforms, noise, scores, top-p's sort)
GRAPH_CHECK_STEPS = 3  # steps of a newly captured shape compared with eager ones
GRAPH_CHECK_TOLERANCE = 1 / 64  # |graph - eager| logits, relative to max(1, max |eager|):
#   four bfloat16 ulps (2**-8 each) of the largest logit


def bucket(n: int, cap: int) -> int:
    """Smallest power of two >= n, at most ``cap`` (and >= 1)."""
    return min(cap, 1 << max(0, n - 1).bit_length())


@dataclass(frozen=True)
class DecodeShape:
    """The figures of a decoder model that the engine's memory depends on, named as in
    :class:`hpc.models.memory_plan.ModelShape` (which :func:`engine_memory` also takes)."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> "DecodeShape":
        """From a Hugging Face model config object."""
        heads = config.num_attention_heads
        return cls(layers=config.num_hidden_layers,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads,
                   head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
                   hidden=config.hidden_size, intermediate=config.intermediate_size,
                   vocab=config.vocab_size)


def engine_memory(shape, slots: int, max_len: int, k: int = 0, dtype_bytes: int = 2,
                  member_params: int = 0, member_bytes: int = 4,
                  prompt_tokens: int | None = None) -> dict:
    """Bytes a :class:`DecodeEngine` holds, by part: {part: bytes}. Pure arithmetic.

    ``shape``: layers L, kv_heads g, head_dim d, hidden h, intermediate I, vocab V (a
    :class:`DecodeShape` or memory_plan's ModelShape); ``slots`` rows of ``max_len`` tokens
    (the engine rounds max_len up to a multiple of MAX_LEN_STEP: pass the rounded figure for
    a built engine); ``k`` members of ``member_params`` LoRA parameters each (one member's r *
    (in + out) summed over its adapted linears) of ``member_bytes`` each; ``dtype_bytes``: bytes
    per value of the model's dtype (e); ``prompt_tokens``: the longest prompt P (default
    max_len).

    * ``kv_cache``: 2 * L * slots * g * max_len * d * e (keys and values of every slot);
    * ``members``: k * member_params * member_bytes (the stacked A_cat, B_cat);
    * ``slot_buffers``: slots * (4 V + SLOT_STATE_BYTES) (fp32 logits and int64 state per slot);
    * ``step_peak``: the larger transient of a decode step over all slots, slots * ((4 h + 3 I)
      e + V (e + 4 + SAMPLING_BYTES_PER_LOGIT)) (one layer's activations, the logits in the
      model dtype and fp32, keyed sampling's temporaries), and a prefill forward: the larger of
      T (4 h + 3 I) e, T = min(slots * P, max(PREFILL_TOKENS, P)) tokens, and its last logits
      slots * V (e + 4).

    The first three live as long as the engine; the last only during a step (coefficients
    measured on CPU with a tensor-lifetime tracker: README, "Decoding engine")."""
    e = dtype_bytes
    prompt = max_len if prompt_tokens is None else prompt_tokens
    per_token = (ACTIVATION_VALUES[0] * shape.hidden + ACTIVATION_VALUES[1] * shape.intermediate) * e
    logits = slots * shape.vocab * (e + 4)
    step = slots * per_token + logits + slots * shape.vocab * SAMPLING_BYTES_PER_LOGIT
    prefill = max(min(slots * prompt, max(PREFILL_TOKENS, prompt)) * per_token, logits)
    return {"kv_cache": 2 * shape.layers * slots * shape.kv_heads * max_len * shape.head_dim * e,
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


_DERIVED_BUDGET: dict = {}  # device -> bytes, derived once per process


def memory_budget(device: torch.device, gib: float) -> int:
    """The engine's budget in bytes: ``gib`` GiB when > 0; else on CUDA :func:`budget_left` of
    the device's memory with what is not free at the first call of the process as resident
    (whole GiB, so ranks with a few MiB more or less agree), on CPU CPU_ENGINE_MEMORY_GIB. A job
    with a memory plan takes the plan's budget instead
    (:func:`hpc.models.generation.set_planned_budget`)."""
    if gib > 0:
        return int(gib * GIB)
    if device.type != "cuda":
        return int(CPU_ENGINE_MEMORY_GIB * GIB)
    if str(device) not in _DERIVED_BUDGET:
        free, total = torch.cuda.mem_get_info(device)
        _DERIVED_BUDGET[str(device)] = budget_left(total, total - free)
    return _DERIVED_BUDGET[str(device)]


def budget_left(capacity_bytes: int, resident_bytes: int) -> int:
    """The one formula of an engine's derived budget, the job's and the plan's
    (:func:`hpc.models.memory_plan.engine_budget`): ENGINE_MEMORY_SHARE of what everything
    resident (``resident_bytes``: weights, adapters, optimizer state, and on a device the CUDA
    context and other processes) leaves of ``capacity_bytes``, rounded down to whole GiB."""
    return int(ENGINE_MEMORY_SHARE * max(0, capacity_bytes - resident_bytes)) // GIB * GIB


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


class KVCache:
    """Keys and values of every slot: two tensors [layers, slots, kv_heads, max_len, head_dim]
    in the model's dtype, allocated once."""

    def __init__(self, layers, slots, kv_heads, max_len, head_dim, dtype, device):
        shape = (layers, slots, kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slots, self.max_len = slots, max_len

    def move(self, src: torch.Tensor, dst: torch.Tensor, length: int) -> None:
        """Copy the first ``length`` positions of slots ``src`` (n,) into slots ``dst`` (n,)."""
        for t in (self.k, self.v):
            t[:, dst, :, :length] = t[:, src, :, :length]

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes


def _core(model):
    """(Qwen2ForCausalLM, {id(module): name in ``model``}) of a HF or peft model."""
    names = {id(m): n for n, m in model.named_modules()}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(base.config, "model_type", "") != "qwen2":
        raise UserError(f"the decoding engine runs Qwen2-architecture models, not "
                        f"{type(base).__name__} (use model.engine=hf)")
    if getattr(base.config, "use_sliding_window", False):
        raise UserError("the decoding engine has no sliding-window attention "
                        "(use model.engine=hf)")
    return base, names


class DecodeEngine:
    """Static state for decoding ``slots`` rows of up to ``max_len`` tokens with ``k`` members.

    Build with :func:`engine_for` (cached per model and shape); load members with
    :meth:`set_members`; decode with :meth:`run`. ``ranks``: {adapted module name: r}.
    ``replay``: None (every step eager), :class:`GraphedDecode` (CUDA graphs, self-checked) or
    a subclass of it; called with the engine.
    """

    def __init__(self, model, slots: int, max_len: int, k: int, ranks: dict, replay=None):
        base, names = _core(model)
        cfg = base.config
        self.model, self.k, self.ranks = model, k, ranks
        self.embed, self.norm = base.model.embed_tokens, base.model.norm
        self.rotary, self.lm_head = base.model.rotary_emb, base.lm_head
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads
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
        self.shape = DecodeShape.from_config(cfg)
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
        q = sites["q_proj"](x, member).view(rows, t, -1, self.head_dim).transpose(1, 2)
        k = sites["k_proj"](x, member).view(rows, t, -1, self.head_dim).transpose(1, 2)
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
            self.graphs = None
        if self.graphs is None:
            self.decode_step(rows, ctx)
        return self.logits[:rows]

    @torch.inference_mode()
    def run(self, requests: list, eos_ids: list, sampling: Sampling | None = None) -> list:
        """Decode every request; returns each one's new tokens (through its eos, if any).

        ``requests``: :class:`Request` list, in any order (results follow it)."""
        return _Scheduler(self, requests, eos_ids, sampling).run()


@dataclass
class Request:
    """One completion to decode: prompt token ids, its own new-token limit, member index (0
    when k <= 1) and sampling key (prompt index, sample index)."""

    prompt: list
    max_new: int
    member: int = 0
    prompt_index: int = 0
    sample_index: int = 0


class _Scheduler:
    """Continuous batching over an engine's slots (one :meth:`DecodeEngine.run` call)."""

    def __init__(self, engine: DecodeEngine, requests: list, eos_ids: list,
                 sampling: Sampling | None):
        self.e, self.requests, self.sampling = engine, requests, sampling
        self.eos = set(eos_ids)
        if any(not r.prompt or r.max_new < 1 for r in requests):
            raise ValueError("every request needs at least one prompt token and max_new >= 1")
        too_long = [len(r.prompt) + r.max_new for r in requests if
                    len(r.prompt) + r.max_new > engine.cache.max_len]
        if too_long:
            raise ValueError(f"a request needs {max(too_long)} positions, the engine holds "
                             f"{engine.cache.max_len}")
        self.waiting = list(range(len(requests)))[::-1]  # pop() takes the next request
        self.slot_of: dict = {}  # request -> slot
        self.req_of: dict = {}  # slot -> request
        self.out = [[] for _ in requests]
        long = dict(dtype=torch.int64, device=engine.device)
        self.key_prompt = torch.zeros(engine.slots, **long)
        self.key_sample = torch.zeros(engine.slots, **long)
        self.length = [0] * engine.slots  # a live slot's next cache position + 1
        self.live = torch.zeros(engine.slots, **long)  # 1 for a live slot

    def run(self) -> list:
        e = self.e
        while self.waiting or self.req_of:
            free = e.slots - len(self.req_of)
            if self.waiting and (not self.req_of or free >= max(1, e.slots // ADMIT_SHARE)):
                self._admit()
                continue
            if not self.waiting:
                self._compact()
            rows = bucket(max(self.req_of) + 1, e.slots)
            ctx = bucket(max(self.length[s] for s in self.req_of), e.cache.max_len)
            logits = e.step(rows, ctx)
            new = self._pick(logits, torch.arange(rows, device=e.device))
            e.tokens[:rows] = new
            e.positions[:rows] += self.live[:rows]  # free rows stay at position 0
            self._take(list(range(rows)), new.tolist())
        return self.out

    def _pick(self, logits, slots):
        if self.sampling is None or self.sampling.temperature == 0:
            return logits.argmax(dim=-1)
        req = [self.req_of.get(int(s)) for s in slots.tolist()]
        done = torch.tensor([len(self.out[r]) if r is not None else 0 for r in req],
                            device=logits.device)
        return pick_tokens(logits, self.sampling, self.key_prompt[slots],
                           self.key_sample[slots], done)

    def _take(self, slots: list, tokens: list) -> None:
        """Append each live slot's new token; free the slots whose request ended."""
        for s, t in zip(slots, tokens):
            r = self.req_of.get(s)
            if r is None:
                continue
            self.out[r].append(t)
            self.length[s] += 1
            if t in self.eos or len(self.out[r]) >= self.requests[r].max_new:
                del self.req_of[s], self.slot_of[r]
                self.length[s] = 0
                self.live[s] = 0
                self.e.positions[s] = 0

    def _admit(self) -> None:
        """Prefill waiting requests into the lowest free slots (chunks of PREFILL_TOKENS)."""
        e = self.e
        free = [s for s in range(e.slots) if s not in self.req_of]
        batch = []
        while self.waiting and len(batch) < len(free):
            width = max([len(self.requests[r].prompt) for r in batch] +
                        [len(self.requests[self.waiting[-1]].prompt)])
            if batch and width * (len(batch) + 1) > PREFILL_TOKENS:
                break
            batch.append(self.waiting.pop())
        slots = free[:len(batch)]
        width = max(len(self.requests[r].prompt) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.int64)
        for i, r in enumerate(batch):
            ids[i, :len(self.requests[r].prompt)] = torch.tensor(self.requests[r].prompt)
        lengths = torch.tensor([len(self.requests[r].prompt) for r in batch])
        dev = dict(device=e.device)
        slot_t = torch.tensor(slots, **dev)
        e.members[slot_t] = torch.tensor([self.requests[r].member for r in batch], **dev)
        self.key_prompt[slot_t] = torch.tensor([self.requests[r].prompt_index for r in batch],
                                               **dev)
        self.key_sample[slot_t] = torch.tensor([self.requests[r].sample_index for r in batch],
                                               **dev)
        for s, r in zip(slots, batch):
            self.req_of[s], self.slot_of[r] = r, s
            self.length[s] = len(self.requests[r].prompt)
        self.live[slot_t] = 1
        logits = e.prefill(ids.to(e.device), lengths.to(e.device), slot_t, e.members[slot_t])
        new = self._pick(logits, slot_t)
        e.tokens[slot_t] = new
        e.positions[slot_t] = lengths.to(e.device)
        self._take(slots, new.tolist())

    def _compact(self) -> None:
        """With nothing waiting: move the live rows above ``bucket(live)`` into free lower
        slots, so decode steps cover fewer rows."""
        e = self.e
        live = len(self.req_of)
        target = bucket(live, e.slots)
        high = sorted(s for s in self.req_of if s >= target)
        if not high:
            return
        low = [s for s in range(target) if s not in self.req_of][:len(high)]
        src, dst = torch.tensor(high, device=e.device), torch.tensor(low, device=e.device)
        e.cache.move(src, dst, max(self.length[s] for s in high))
        for t in (e.tokens, e.positions, e.members, self.key_prompt, self.key_sample, self.live):
            t[dst] = t[src]
        for s, d in zip(high, low):
            r = self.req_of.pop(s)
            self.req_of[d], self.slot_of[r] = r, d
            self.length[d], self.length[s] = self.length[s], 0
        # rows beyond the live ones still run in a bucket: keep their cache writes in range
        e.positions[src] = 0
        self.live[src] = 0


class GraphedDecode:
    """CUDA graphs of :meth:`DecodeEngine.decode_step`, one per (rows, ctx) bucket, captured on
    first use (after one warm-up call on a side stream) in one shared memory pool, and checked
    against the eager step (:func:`compare_steps`) before the first replay.

    A subclass may override :meth:`capture` (what "replaying" a shape runs); the test of the
    self-check replaces it by a perturbed eager step, which runs on any device."""

    def __init__(self, engine: DecodeEngine):
        self.engine, self.replays, self.pool = engine, {}, None

    def capture(self, rows: int, ctx: int):
        """Capture ``decode_step(rows, ctx)``; returns the function that replays it."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.engine.decode_step(rows, ctx)  # warm-up: allocations, library handles
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.engine.decode_step(rows, ctx)
        self.pool = graph.pool()
        return graph.replay

    def run(self, rows: int, ctx: int) -> bool:
        """Replay the step of shape (rows, ctx), capturing and checking it on first use.
        False when the check failed (nothing replayed; :func:`disable_cuda_graphs` says why)."""
        replay = self.replays.get((rows, ctx))
        if replay is None:
            replay = self.capture(rows, ctx)
            failure = compare_steps(self.engine, replay, rows, ctx)
            if failure:
                disable_cuda_graphs(f"decode shape (rows {rows}, context {ctx}): {failure}")
                return False
            self.replays[(rows, ctx)] = replay
        replay()
        return True


def compare_steps(engine: DecodeEngine, replay, rows: int, ctx: int,
                  steps: int = GRAPH_CHECK_STEPS) -> str:
    """Run ``steps`` decode steps of shape (rows, ctx) eagerly and through ``replay`` from the
    engine's current inputs; each next step feeds the eager step's greedy tokens at the same
    cache positions. Returns '' when every step's logits agree within GRAPH_CHECK_TOLERANCE *
    max(1, max |eager logit|) and the greedy tokens are equal wherever the eager step's top two
    logits are further apart than that, else what differed. The engine's input tokens are
    restored; the cache positions written are the rows' current ones, which the next real step
    writes again."""
    saved = engine.tokens[:rows].clone()
    try:
        for i in range(steps):
            engine.decode_step(rows, ctx)
            eager = engine.logits[:rows].clone()
            replay()
            graph = engine.logits[:rows]
            tol = GRAPH_CHECK_TOLERANCE * max(1.0, float(eager.abs().max()))
            diff = float((graph - eager).abs().max())
            if not diff <= tol:  # NaN fails too
                return (f"step {i + 1} of {steps}: logits differ by up to {diff:.3g}, more than "
                        f"the tolerance {tol:.3g}")
            top2 = eager.topk(2, dim=-1).values
            clear = top2[:, 0] - top2[:, 1] > tol
            flips = int(((graph.argmax(-1) != eager.argmax(-1)) & clear).sum())
            if flips:
                return f"step {i + 1} of {steps}: greedy tokens differ in {flips} of {rows} rows"
            engine.tokens[:rows] = eager.argmax(-1)
    finally:
        engine.tokens[:rows] = saved
    return ""


_GRAPH_CHECK = {"failure": ""}  # this process: why CUDA graphs are off ('' = they are not)


def disable_cuda_graphs(reason: str) -> None:
    """Turn CUDA graphs off for the rest of this process (engines built or reused later decode
    eagerly); the first reason is kept."""
    _GRAPH_CHECK["failure"] = _GRAPH_CHECK["failure"] or reason


def reset_graph_check() -> None:
    """CUDA graphs on again (each job starts so: :func:`hpc.models.generation.configure`)."""
    _GRAPH_CHECK["failure"] = ""


def graph_check_failure() -> str:
    """Why CUDA graphs are off in this process ('' while they are on)."""
    return _GRAPH_CHECK["failure"]


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


@torch.inference_mode()
def engine_for(model, slots: int, max_len: int, k: int, replay=None, *, most: int = 0,
               budget_bytes: int = 0, max_slots: int = 0) -> DecodeEngine:
    """The model's engine for a call that needs ``slots`` rows of ``max_len`` tokens with
    exactly ``k`` members, kept on the model (attribute ``_decode_engine``) and reused across
    calls with its cache and CUDA graphs. Built in inference mode: its tensors are only ever
    touched inside it.

    Size: ``bucket(slots)``, at most ``max_slots`` (0 = no cap) and at most the slots whose
    :func:`engine_bytes` fits ``budget_bytes`` (0 = :func:`memory_budget` of the device, CPU
    default); max_len rounded up to MAX_LEN_STEP. ``most``: the rows of the calling phase
    (default ``slots``): the engine on the model is reused when it has the same members,
    adapter and ``replay``, at least ``max_len`` positions and between the call's size and
    ``bucket(most)`` (capped alike) slots; else it is freed and one of the call's size built.
    So a phase never holds more slots than it asks for, whatever an earlier phase held."""
    ranks = adapter_ranks(model) if k else {}
    param = next(model.parameters())
    shape = DecodeShape.from_config(model.config)
    length = -(-max_len // MAX_LEN_STEP) * MAX_LEN_STEP
    params, elem = member_size(model, ranks)
    budget = budget_bytes or memory_budget(param.device, 0)
    cap = slots_within(budget, shape, length, k, param.element_size(), params, elem,
                       most=max_slots or 1 << 20)
    if cap < 1:
        one = engine_bytes(shape, 1, length, k, param.element_size(), params, elem)
        raise UserError(f"the decoding engine's memory budget ({budget / GIB:.2f} GiB, "
                        f"model.engine_memory_gib) holds no row of {length} tokens (one needs "
                        f"{one / GIB:.2f} GiB): raise model.engine_memory_gib")
    want = min(bucket(slots, 1 << 30), cap)
    top = max(want, min(bucket(most or slots, 1 << 30), cap))
    if graph_check_failure():
        replay = None
    engine = model.__dict__.get("_decode_engine")
    if engine is not None and engine.graphs is not None and graph_check_failure():
        engine.graphs = None  # another rank's check failed: this one decodes eagerly too
        engine.replay = None
    fits = (engine is not None and engine.k == k and engine.ranks == ranks
            and want <= engine.slots <= top and engine.cache.max_len >= max_len
            and engine.replay == replay)
    if not fits:
        engine = None  # no reference to the old engine may outlive its release
        release_engine(model)  # the old cache, members and graphs go before the new ones come
        engine = DecodeEngine(model, want, length, k, ranks, replay)
        model.__dict__["_decode_engine"] = engine
    return engine


def release_engine(model, above: int = 0) -> bool:
    """Drop the model's engine (its KV cache, stacked members, buffers and CUDA graphs with
    their memory pool) if it has one of more than ``above`` slots; True when one went. The
    graphs refer back to the engine, so that cycle is broken here: the memory goes back to
    the allocator now, not at the next garbage collection. Callers must hold no reference to
    the engine (:func:`engine_for` drops its own before building the next one)."""
    engine = model.__dict__.get("_decode_engine")
    if engine is None or engine.slots <= above:
        return False
    del model.__dict__["_decode_engine"]
    engine.graphs = engine.replay = None
    engine.cache = engine.logits = None
    engine.layers = []
    return True


def end_phase(model, next_rows: int = 0, next_k: int = 1) -> bool:
    """After a phase that decoded (an evaluation): release the model's engine unless the next
    phase, which decodes ``next_rows`` rows at once with ``next_k`` members (0 rows: none, as
    the export), could reuse it (:func:`engine_for` reuses an engine of the same members and
    at most ``bucket(next_rows)`` slots). True when it went."""
    engine = model.__dict__.get("_decode_engine")
    keep = engine is not None and next_rows and engine.k == next_k
    return release_engine(model, above=bucket(next_rows, 1 << 30) if keep else 0)

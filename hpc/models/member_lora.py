"""k LoRA adapters on one peft model at once: member m's factors apply to member m's rows.

The base weights are shared. While :class:`MemberLora` is active, every adapted Linear of the
peft model computes, for the rows of member m,

    out = base(x) + ((x @ A'_m^T) @ B'_m^T) * scaling

with A' (k, r, in) and B' (k, out, r) stacked over the k members and applied by batched matmuls
(``torch.bmm``); the peft LoRA layer (and its weights) is swapped out of the model meanwhile.
The batch is laid out member-major: a batch of k*n rows holds member m's rows at
m*n .. m*n+n-1. HF ``generate`` keeps row order under left padding and the KV cache rows follow,
so this layout holds at every step; the member of a row is read off shapes only, nothing
synchronises with the host.

Two arithmetics:

* **exact** (the CPU default): the delta uses the same ops in the same order and dtype as peft's
  vanilla LoRA path (matmul by A, matmul by B, times scaling, added to the base output). On CPU
  in fp32 every row then gets the same bits as one-at-a-time evaluation whenever the matmuls
  have >= 12 rows per member (MKL's sgemm; see :mod:`hpc.engine.hf_backend`).
* **fused** (the CUDA default): built for decoding, where a GPU at small batch waits on the host
  issuing kernels (measured: README, "Speed"), so host ops per layer are what costs. Factors
  are cast once to the base weight's dtype and ``scaling`` is folded into B'. Layers that read
  the same input tensor (``q/k/v_proj``, ``gate/up_proj``: :data:`SHARED_INPUT`) share one
  ``bmm`` by the A's stacked along the rank
  (each B' is zero-padded to that width), and each layer adds its delta in place on the base
  output (``baddbmm_``). Per decoding step of a q/k/v/o adapter that is 12 host ops per
  transformer layer above plain generation, against 20 when every layer runs its own two
  matmuls. Logits stay as close to the fp32 model's as peft's own bf16 logits are; cuBLAS picks
  kernels by shape, so fitness agrees with one-at-a-time evaluation up to greedy flips at near
  ties, not bitwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hpc.models.adapter_space import ADAPTER
from hpc.runtime.errors import UserError

SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Sibling layers that HF decoder blocks (Llama, Qwen2, Mistral...) call on one input tensor.
Only a speed hint: a layer called on another tensor computes its own product."""


class MemberLora:
    """Context manager: per-row LoRA factors of k members on ``peft_model``.

    ``factors``: {module name: (A' (k, r, in), B' (k, out, r))}, as from
    ``SingularValueSpace.factors_batch``, on the model's device. Every batch passed through the
    model while active must have a multiple of k rows, member-major. ``fused`` (default: on
    CUDA only) selects the fused arithmetic (module docstring). On exit the peft layers are put
    back and their weights are as they were.
    """

    def __init__(self, peft_model, factors: dict, fused: bool | None = None):
        self.model = peft_model
        self.factors = factors
        self.fused = (next(peft_model.parameters()).device.type == "cuda" if fused is None
                      else fused)
        self.swapped: list = []

    def __enter__(self) -> "MemberLora":
        peft_layers = {name: self.model.get_submodule(name) for name in self.factors}
        for name, module in peft_layers.items():
            if module.merged or ADAPTER in getattr(module, "lora_variant", {}):
                raise UserError(f"{name}: batched members need an unmerged vanilla LoRA "
                                f"adapter (no DoRA or other variant)")
        members = (_fused_layers(peft_layers, self.factors) if self.fused else
                   {name: ExactMemberLinear(module, *self.factors[name])
                    for name, module in peft_layers.items()})
        for name, layer in members.items():
            parent, _, child = name.rpartition(".")
            holder = self.model.get_submodule(parent)
            self.swapped.append((holder, child, peft_layers[name]))
            setattr(holder, child, layer)
        return self

    def __exit__(self, *exc) -> None:
        for holder, child, peft_layer in self.swapped:
            setattr(holder, child, peft_layer)
        self.swapped.clear()


def member_rows(x: torch.Tensor, k: int) -> torch.Tensor:
    """(k*n, t, in) -> (k, n*t, in): member m's rows m*n .. m*n+n-1 become batch m."""
    if x.shape[0] % k:
        raise ValueError(f"batch of {x.shape[0]} rows is not a multiple of {k} members")
    return x.reshape(k, -1, x.shape[-1])


class ExactMemberLinear(torch.nn.Module):
    """Peft's LoRA arithmetic for k members, in the adapter's dtype (fp32 even on a bf16
    model), added to the base output and cast back. A' (k, r, in), B' (k, out, r)."""

    def __init__(self, peft_layer, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.base = peft_layer.base_layer
        self.scaling = peft_layer.scaling[ADAPTER]
        self.a_t, self.b_t = a.transpose(1, 2), b.transpose(1, 2)  # (k, in, r), (k, r, out)

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:  # x (k*n, t, in)
        result = self.base(x, *args, **kwargs)  # (k*n, t, out), shared base weight
        rows = member_rows(x.to(self.a_t.dtype), self.a_t.shape[0])  # (k, n*t, in)
        delta = torch.bmm(torch.bmm(rows, self.a_t), self.b_t) * self.scaling  # (k, n*t, out)
        return (result + delta.reshape(result.shape)).to(result.dtype)


class SharedLowRank:
    """x @ A_cat for the fused layers of one :data:`SHARED_INPUT` group (or one layer alone).

    ``a_cat`` (k, in, R): the group's A'^T side by side, R = sum of their ranks; ``readers``:
    the group's layer count. A product is kept only until every reader has had it, so siblings
    called on the same tensor object (q, k, v on one hidden state) compute it once and nothing
    is held between layers or steps. The input must not be modified in place between sibling
    calls (HF attention and MLP blocks don't; inference tensors have no version counter to
    check)."""

    def __init__(self, a_cat: torch.Tensor, readers: int):
        self.a_cat, self.k, self.readers = a_cat, a_cat.shape[0], readers
        self.x = self.xa = None
        self.reads = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (k*n, t, in) -> (k, n*t, R)."""
        if x is self.x:
            self.reads += 1
            xa = self.xa
        else:
            xa = torch.bmm(member_rows(x, self.k), self.a_cat)
            self.x, self.xa, self.reads = x, xa, 1
        if self.reads >= self.readers:
            self.x = self.xa = None
        return xa


def _plain_linear(base) -> bool:
    """True if ``base`` is an ``nn.Linear`` that F.linear can stand in for: no subclass (e.g.
    quantised), no hooks, no patched forward (accelerate's offload hooks patch it)."""
    return (type(base) is torch.nn.Linear and not base._forward_hooks
            and not base._forward_pre_hooks and "forward" not in vars(base))


class FusedMemberLinear(torch.nn.Module):
    """One adapted Linear on the fused path: base output, then ``baddbmm_`` of the shared
    low-rank product by this layer's zero-padded scaling * B'^T (k, R, out), in place."""

    def __init__(self, base, low_rank: SharedLowRank, sb_pad: torch.Tensor):
        super().__init__()
        self.base = None if _plain_linear(base) else base  # a plain Linear: F.linear directly
        self.weight, self.bias = base.weight, base.bias
        self.low_rank, self.sb_pad = low_rank, sb_pad
        self.k, self.out_features = sb_pad.shape[0], sb_pad.shape[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (k*n, t, in)
        out = F.linear(x, self.weight, self.bias) if self.base is None else self.base(x)
        out.view(self.k, -1, self.out_features).baddbmm_(self.low_rank(x), self.sb_pad)
        return out


def _fused_layers(peft_layers: dict, factors: dict) -> dict:
    """{name: FusedMemberLinear}: siblings of a :data:`SHARED_INPUT` group under one parent
    with the same input width share a :class:`SharedLowRank`; every other layer has its own."""
    groups: dict = {}
    for name, (a, _) in factors.items():
        parent, _, child = name.rpartition(".")
        family = next((f for f in SHARED_INPUT if child in f), (child,))
        groups.setdefault((parent, family, a.shape[2]), []).append(name)
    layers = {}
    for names in groups.values():
        dtype = peft_layers[names[0]].base_layer.weight.dtype
        low_rank = SharedLowRank(torch.cat(
            [factors[n][0].transpose(1, 2).to(dtype) for n in names], dim=2),  # (k, in, R)
            readers=len(names))
        k, _, width = low_rank.a_cat.shape
        start = 0
        for n in names:
            a, b = factors[n]
            sb_pad = b.new_zeros((k, width, b.shape[1]), dtype=dtype)
            sb_pad[:, start:start + a.shape[1]] = (
                b * peft_layers[n].scaling[ADAPTER]).transpose(1, 2).to(dtype)
            start += a.shape[1]
            layers[n] = FusedMemberLinear(peft_layers[n].base_layer, low_rank, sb_pad)
    return layers

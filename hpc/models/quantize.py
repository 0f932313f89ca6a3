"""Weight-only quantisation of a model's base linears by torchao (config key ``model.quantize``).

What is quantised: the seven linears of every decoder layer (q/k/v/o_proj, gate/up/down_proj;
inside a peft LoRA wrapper its ``base_layer``). Embeddings, norms and the LM head stay in the
model dtype (the LM head may share its weight with the embedding), and LoRA factors stay in
their own dtype on top, so the decoding engine's per-row member deltas are unchanged: its
``Site`` calls the (quantised) base module, whose ``F.linear`` torchao serves.

* ``int8``: torchao ``Int8WeightOnlyConfig`` (per output row: int8 values, one float32 scale,
  whatever the weight dtype, and one int8 zero point), i.e. ``1 + 5 / in_features`` bytes per
  weight (:func:`bytes_per_parameter`). Any device.
* ``int4``: torchao ``Int4WeightOnlyConfig`` (groups of 128 along the input, tinygemm's
  ``tile_packed_to_4d`` layout, served by torch's own CUDA int4 kernel): CUDA and bfloat16 only.

Two ways to apply it, each linear as its weight arrives during the load
(:func:`hpc.models.streaming.stream_weights`; after the whole load under the reference
``model.load=transformers``):

* :class:`QuantizeInPlace` (:func:`quantize_base`): in place (ESSA, ``hpc-eval``): the job
  decodes only, so the base weights exist once, quantised, and never whole in ``model.dtype``.
* :class:`GenerationCopy` (:func:`attach_generation_copy`): training jobs (F-GRPO, SFT), whose training forward must stay
  on the unquantised weights: a quantised copy of the base linears is kept beside the model (an
  extra ~half of the bf16 linears at int8) and :func:`generation_weights` swaps it in while
  :mod:`hpc.engine.generate` decodes (rollouts, evaluation). The sampling policy then differs
  slightly from the trained one.

torchao is the optional extra ``quant`` (``pip install 'essa-hpc[quant]'``); it is imported only
when a job asks for quantisation.
"""
from __future__ import annotations

import contextlib

import torch

from hpc.runtime.errors import UserError

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INT4_GROUP = 128
COPY = "_generation_linears"  # model attribute: {module name: quantised Linear}


def _torchao():
    """The torchao.quantization module; UserError naming the extra when it is not installed."""
    try:
        import torchao.quantization as tq
    except ImportError:
        raise UserError("model.quantize needs torchao: install the extra "
                        "(pip install 'essa-hpc[quant]')") from None
    return tq


def check_quantize(mode: str, dtype: str, device: torch.device) -> None:
    """UserError (one line) unless ``mode`` can run with weights of ``dtype`` on ``device``;
    called at job start, before any model is loaded."""
    if mode == "none":
        return
    _torchao()
    if mode == "int4" and device.type != "cuda":
        raise UserError(f"model.quantize=int4: torchao has no int4 weight-only kernel for "
                        f"device {device.type} (int4 runs on CUDA; use model.quantize=int8)")
    if mode == "int4" and dtype != "bfloat16":
        raise UserError(f"model.quantize=int4 needs model.dtype=bfloat16 (got {dtype})")


def _config(mode: str):
    tq = _torchao()
    if mode == "int8":
        return tq.Int8WeightOnlyConfig(set_inductor_config=False)
    return tq.Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d",
                                   set_inductor_config=False)


def base_linears(model) -> dict:
    """{module name: nn.Linear} of the decoder layers' base linears (module docstring): a
    linear named ``layers.<i>.<...>.<LINEARS>`` or the ``base_layer`` of one."""
    found = {}
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or ".layers." not in f".{name}":
            continue
        parts = name.split(".")
        if parts[-1] in LINEARS or (parts[-1] == "base_layer" and parts[-2] in LINEARS):
            found[name] = module
    return found


def is_quantized(weight) -> bool:
    """Whether ``weight`` is one of torchao's quantised tensors (INT8: ``Int8Tensor``, whose
    ``qdata`` is int8; INT4: its tile-packed tensor), not a plain or distributed tensor."""
    return type(weight).__module__.partition(".")[0] == "torchao"


def quantized_linears(model) -> int:
    """How many decoder linears of ``model`` decode from quantised weights: its base linears
    quantised in place plus those of its generation copy; 0 without ``model.quantize``. The
    run file's attribute ``quantized_linears``: what the load did, beside what the config asked."""
    linears = list(base_linears(model).values()) + list((model.__dict__.get(COPY) or {}).values())
    return sum(is_quantized(linear.weight) for linear in linears)


class QuantizeInPlace:
    """``model.quantize`` in place, one decoder linear at a time as its weight arrives
    (:func:`hpc.models.streaming.stream_weights`): the decoding-only jobs (ESSA, ``hpc-eval``)
    never hold the whole model in ``model.dtype``."""

    def __init__(self, model, mode: str):
        self.targets = {id(m) for m in base_linears(model).values()} if mode != "none" else set()
        self.config = _config(mode) if mode != "none" else None

    def wants(self, module) -> bool:
        return id(module) in self.targets

    def arrived(self, module, weight) -> None:
        _torchao().quantize_(module, self.config)


class GenerationCopy:
    """A quantised copy of each decoder linear made as its weight arrives (``weight``: the whole
    tensor, also under FSDP2), kept beside ``model`` for :func:`generation_weights` (the training
    jobs, F-GRPO and SFT, whose training forward stays on the unquantised weights)."""

    def __init__(self, model, mode: str):
        self.names = ({id(m): name for name, m in base_linears(model).items()}
                      if mode != "none" else {})
        self.config = _config(mode) if mode != "none" else None
        if self.names:
            model.__dict__[COPY] = self.copies = {}

    def wants(self, module) -> bool:
        return id(module) in self.names

    def arrived(self, module, weight) -> None:
        self.copies[self.names[id(module)]] = _quantised_copy(weight, self.config)


def arrive_all(arrival, model) -> None:
    """``arrival`` (:class:`QuantizeInPlace` or :class:`GenerationCopy`) for every decoder linear
    of a model whose weights are all in (the reference load, ``model.load=transformers``)."""
    for module in list(base_linears(model).values()):
        if arrival.wants(module):
            arrival.arrived(module, module.weight)


def quantize_base(model, mode: str):
    """Quantise the base linears of ``model`` (HF or peft) in place; returns ``model``."""
    arrive_all(QuantizeInPlace(model, mode), model)
    return model


@torch.no_grad()
def _quantised_copy(weight: torch.Tensor, config) -> torch.nn.Linear:
    """A new bias-free Linear holding a quantised copy of ``weight`` (out, in); the bias, if
    any, is the live module's, taken at each swap (:func:`generation_weights`)."""
    copy = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    copy.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
    _torchao().quantize_(copy, config)
    return copy.eval()


def attach_generation_copy(model, mode: str):
    """Keep a quantised copy of the base linears beside ``model`` (unregistered: not a
    parameter, not in a state dict, not seen by an optimizer or gradient reduction) for
    :func:`generation_weights`; the model's own weights stay as they are. Returns ``model``.
    The copy is made once: only for a frozen base (LoRA training)."""
    arrive_all(GenerationCopy(model, mode), model)
    return model


@contextlib.contextmanager
def generation_weights(model):
    """Within the block, ``model``'s base linears are its quantised generation copy (if
    :func:`attach_generation_copy` made one; else nothing changes)."""
    copies = model.__dict__.get(COPY)
    if not copies:
        yield
        return
    originals = {}
    for name, quantised in copies.items():
        parent, _, attr = name.rpartition(".")
        holder = model.get_submodule(parent)
        originals[name] = getattr(holder, attr)
        quantised.bias = originals[name].bias  # the live one: gathered under FSDP2
        setattr(holder, attr, quantised)
    try:
        yield
    finally:
        for name, linear in originals.items():
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, linear)
            copies[name].bias = None


def bytes_per_parameter(mode: str, in_features: int, weight_bytes: int = 2) -> float:
    """Bytes per base-linear weight with ``mode`` (``weight_bytes``: the model dtype's, 2 for
    bf16), torchao's scales (and zero points) included: none ``weight_bytes``; int8 one byte
    plus a float32 scale and an int8 zero point per output row (``in_features`` weights); int4
    half a byte plus a bf16 scale and zero point per group of :data:`INT4_GROUP` inputs."""
    if mode == "none":
        return float(weight_bytes)
    if mode == "int8":
        return 1.0 + (4 + 1) / in_features
    return 0.5 + 2 * 2 / INT4_GROUP

"""How the gradient methods hold, reduce and update their trained weights across ranks: DDP or
FSDP2, with fp32 master weights and 16-bit compute (torchtitan's ``parallelize`` step, in one
place). ``fgrpo.parallel.strategy`` picks one.

* ``ddp``: every rank holds the whole model in ``model.dtype``; after the backward the gradients
  are averaged by one flat fp32 all-reduce (:func:`hpc.runtime.dist.all_reduce_mean_`). A
  trained tensor in a 16-bit dtype (full fine-tuning in bf16) gets an fp32 master: the gradient
  is copied into it, AdamW (fp32 moments) steps the master, and the compute tensor is
  overwritten with the master rounded to bf16, so updates below half a bf16 ulp accumulate in
  the master instead of vanishing. fp32 tensors (LoRA factors) are their own masters.
* ``fsdp2``: the model is loaded in fp32 and ``fully_shard`` is applied to every decoder layer
  and then to the root, over the default process group (NCCL on GPUs, gloo on CPU). Each rank
  holds 1/N of every parameter (the fp32 master) and of its AdamW moments; a layer's weights
  are all-gathered in ``model.dtype`` just before its forward and backward
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``) and freed after, and the
  backward reduce-scatters its gradients in fp32, averaged over ranks. LoRA and full
  fine-tuning alike (under LoRA the frozen base weights are sharded too). Every forward is a
  collective: ranks must run the same number of them (equal rows per rank), except inside
  :func:`gathered`, where the rollouts and evaluations decode with whole weights and no
  collective.
"""
from __future__ import annotations

import contextlib
import copy

import torch
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hpc.models.loading import DTYPES
from hpc.models.offload import HostCopy
from hpc.runtime.atomic import replaced_dir
from hpc.runtime.dist import all_reduce_mean_
from hpc.runtime.errors import UserError
from hpc.runtime.readback import adam_state, bad_field, tensors

PARALLELISMS = ("ddp", "fsdp2")


def load_dtype(parallelism: str, dtype: str) -> str:
    """The dtype to load the model in: ``dtype`` (DDP), float32 under FSDP2 (the sharded fp32
    parameters are the masters; ``dtype`` is the compute dtype of the all-gathered copies)."""
    return "float32" if parallelism == "fsdp2" else dtype


def _hf_model(model):
    """The transformers model under a peft wrapper (or ``model`` itself)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def decoder_layers(model) -> list:
    """The decoder layers of ``model``: the modules of the classes transformers never splits
    across devices (``_no_split_modules``, e.g. Qwen2DecoderLayer)."""
    names = set(getattr(_hf_model(model), "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UserError(f"FSDP2 sharding: found no decoder layers in "
                        f"{type(_hf_model(model)).__name__} to shard")
    return layers


def shard_units(model, compute_dtype: str, mesh=None) -> None:
    """Apply FSDP2 in place: ``fully_shard`` on each decoder layer (weights freed after its
    forward, gathered again for its backward), then on the transformers root (embeddings,
    final norm, LM head; kept gathered between forward and backward). ``model`` holds fp32
    weights (or ``meta`` ones, :func:`hpc.models.streaming.shard_skeleton`);
    ``compute_dtype`` is what the forward and backward run in; ``mesh``: the device mesh to
    shard over (default: every rank of the default process group, on the model's device
    type)."""
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[compute_dtype], reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(_hf_model(model), mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def settle(model):
    """After a sharded model's weights are in: FSDP2 settles its per-unit state on the first
    forward, among it which parameters train (their gradients are cast back to fp32): run it
    now, before anything (peft's disable_adapter for the reference log-probs) marks the LoRA
    factors frozen for a while. Returns ``model``."""
    with torch.no_grad():
        model(input_ids=torch.zeros((1, 1), dtype=torch.long,
                                    device=next(model.parameters()).device))
    # The root stays gathered after a forward; reshard it, so that model.parameters() are the
    # shards (the masters the optimizer steps), not the gathered copies.
    _hf_model(model).reshard()
    return model


def shard_model(model, compute_dtype: str, mesh=None):
    """:func:`shard_units` then :func:`settle` on a model whose weights are in. Returns
    ``model``."""
    shard_units(model, compute_dtype, mesh)
    return settle(model)


def is_sharded(model) -> bool:
    return isinstance(_hf_model(model), FSDPModule)


@contextlib.contextmanager
def gathered(model, decoder, to_host: bool = False):
    """Within the block every FSDP2 unit of ``model`` holds its whole weights in the compute
    dtype (one all-gather each) and keeps them through forwards, so rollouts and evaluations
    decode with plain tensors and no collective, each rank as many forwards as it needs. On
    leaving: ``decoder``'s engine built on those weights (with its KV cache) is released and
    the weights resharded, freeing the gathered copy. A no-op for an unsharded model.

    ``to_host``: each unit's fp32 shards go to host memory (:class:`HostCopy`) as soon as that
    unit is gathered, and come back once it is resharded, so the rank never holds the shards
    and the gathered model whole at once (units are gathered one after the other)."""
    if not is_sharded(model):
        yield model
        return
    root = _hf_model(model)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]  # outer before inner
    owned, claimed = {}, set()
    for unit in reversed(units):  # a unit's own shards: its parameters but its inner units'
        owned[unit] = [p for p in unit.parameters() if id(p) not in claimed]
        claimed.update(id(p) for p in owned[unit])
    moved = {}
    try:
        for unit in units:
            unit.set_reshard_after_forward(False, recurse=False)
            unit.unshard()
            if to_host:
                moved[unit] = HostCopy(_local(p) for p in owned[unit])
        yield model
    finally:
        decoder.release()
        for unit in units:  # each unit's gathered copy freed before its shards come back
            unit.reshard()
            unit.set_reshard_after_forward(unit is not root, recurse=False)
            if unit in moved:
                moved.pop(unit).restore()


@contextlib.contextmanager
def decoding(model, weights: "TrainedWeights", offload: str, decoder, reference=None):
    """The weights of a rollout or evaluation: ``model`` gathered for decoding (FSDP2,
    :func:`gathered`) with the training state that ``offload`` (``fgrpo.parallel.offload``:
    none/optimizer/state, :mod:`hpc.models.offload`) names in host memory for the block. The
    optimizer's tensors leave before the gathering starts and come back after the gathered
    copy (and ``decoder``'s engine on it) is freed; ``state`` also moves the shards of ``model`` (unit by unit) and of the
    sharded ``reference`` model."""
    moved = [HostCopy(weights.optimizer_tensors())] if offload != "none" else []
    if offload == "state" and reference is not None and is_sharded(reference):
        moved.append(HostCopy(_local(p) for p in reference.parameters()))
    try:
        with gathered(model, decoder, to_host=offload == "state" and is_sharded(model)):
            yield model
    finally:
        for m in moved:
            m.restore()


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


class TrainedWeights:
    """The trained tensors of a model, their fp32 masters and the AdamW optimizer over them.

    ``params``: the tensors the forward uses (``requires_grad``), plain (DDP) or FSDP2
    DTensors. ``masters``: what AdamW steps, fp32: the params themselves when they are fp32
    (LoRA, fp32 models, every FSDP2 shard), else fp32 copies (full fine-tuning in bf16 under
    DDP). Each training pass: :meth:`zero_grad`, backward(s), :meth:`reduce_gradients`,
    :meth:`step`.
    """

    def __init__(self, params: list, lr: float, weight_decay: float):
        self.params = list(params)
        self.sharded = any(isinstance(p, DTensor) for p in self.params)
        self.masters = [p if p.dtype == torch.float32 else
                        p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)

    def set_learning_rate(self, lr: float) -> None:
        """The learning rate of AdamW's next steps (a schedule's value for the step)."""
        for group in self.opt.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        for p, m in zip(self.params, self.masters):
            if p is not m and p.grad is not None:
                p.grad.zero_()

    def ensure_gradients(self) -> None:
        """Zero gradients where none exist: a rank whose share of a step has no rows (dynamic
        sampling keeps the groups each rank sampled) still joins the all-reduce."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def reduce_gradients(self, world) -> None:
        """Average the masters' gradients over ranks. FSDP2 did it during the backward
        (reduce-scatter); DDP copies the compute gradients into the fp32 masters and
        all-reduces those in one flat buffer."""
        if self.sharded:
            return
        for p, m in zip(self.params, self.masters):
            if p is not m:
                m.grad = p.grad.float()
        all_reduce_mean_([m.grad for m in self.masters], world, tag="grad_allreduce")

    def step(self, max_grad_norm: float) -> bool:
        """Clip (``max_grad_norm`` > 0) and step the masters, then copy them into the compute
        tensors, unless a gradient holds NaN or inf: then leave weights and optimizer state
        untouched and return False (the caller counts a skipped step). Gradients are reduced
        first, so every rank takes the same decision."""
        grads = [m.grad for m in self.masters]
        norm = torch.nn.utils.get_total_norm(grads)
        if not torch.isfinite(_full(norm)):
            return False
        if max_grad_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(self.masters, max_grad_norm, norm)
        self.opt.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if p is not m:
                    p.copy_(m)
        return True

    def optimizer_tensors(self) -> list:
        """What ``fgrpo.parallel.offload=optimizer`` moves to host memory while the GPU decodes: the
        AdamW moments (this rank's shards under FSDP2) and DDP's fp32 master copies of 16-bit
        weights (8-12 bytes a trained parameter)."""
        held = [_local(v) for s in self.opt.state.values() for v in s.values()
                if torch.is_tensor(v) and v.dim() > 0]
        return held + [m for p, m in zip(self.params, self.masters) if p is not m]

    def free_gradients(self) -> None:
        """Drop every gradient (after the optimizer step): none is alive during the rollout
        and evaluation; the next backward allocates them again, as the first one did."""
        for p, m in zip(self.params, self.masters):
            p.grad = None
            m.grad = None

    def state_dict(self) -> dict:
        """The masters and the optimizer state, as plain CPU-storable tensors (DDP: replicated,
        any rank count loads them; FSDP2's go through :func:`sharded_state` instead)."""
        opt = self.opt.state_dict()
        return {"params": [_local(m).detach().cpu() for m in self.masters],
                "optimizer": {"state": {i: {k: _local(v) for k, v in s.items()}
                                        for i, s in opt["state"].items()},
                              "param_groups": opt["param_groups"]}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`; a shard of another shape (written by another number of
        ranks) is a UserError."""
        saved = state["params"]
        if not isinstance(saved, list) or not all(
                isinstance(s, torch.Tensor) and s.is_floating_point() for s in saved):
            raise bad_field("checkpoint", "params", "is not a list of float tensors")
        shapes = [tuple(_local(m).shape) for m in self.masters]
        if len(saved) != len(self.masters) or any(
                tuple(s.shape) != shape for s, shape in zip(saved, shapes)):
            raise UserError("the checkpoint's weights do not match this job's model and rank "
                            "count; resume with the model and number of ranks that wrote it")
        dtypes = [m.dtype for m in self.masters]
        tensors(saved, "checkpoint", "params", shapes, dtypes)
        opt = adam_state(state["optimizer"], "checkpoint", shapes, dtypes)
        try:
            self.opt.load_state_dict({
                "state": {i: {k: self._as_param(self.masters[int(i)], v) for k, v in s.items()}
                          for i, s in opt["state"].items()},
                "param_groups": opt["param_groups"]})
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as err:
            raise bad_field("checkpoint", "optimizer", f"is not this optimizer's state ({err})"
                            ) from None
        with torch.no_grad():
            for m, s in zip(self.masters, saved):
                _local(m).copy_(s)
            for p, m in zip(self.params, self.masters):
                if p is not m:
                    p.copy_(m)

    @staticmethod
    def _as_param(master, value):
        """An optimizer state tensor shaped like its parameter, as a DTensor laid out like it
        (a sharded parameter's moments are sharded the same); scalars (step) stay plain. Each
        gets memory of its own (a tensor read from a file may sit in storage that cannot be
        freed or resized, which :class:`HostCopy` needs)."""
        value = value.to(master.device, copy=True)
        if isinstance(master, DTensor) and value.dim() > 0:
            return DTensor.from_local(value, master.device_mesh,
                                      master.placements, run_check=False, shape=master.shape,
                                      stride=master.stride())
        return value


_TRAINED = StateDictOptions(ignore_frozen_params=True)  # LoRA: not the frozen base weights


def sharded_state(model, weights: TrainedWeights) -> dict:
    """Collective: the trained tensors of the FSDP2-sharded ``model`` and the AdamW state of
    ``weights`` as ``torch.distributed.checkpoint`` saves and reshards them: {"model": {name:
    DTensor}, "optimizer": {"state": {name: {exp_avg, exp_avg_sq: DTensor, step}},
    "param_groups": [...]}}, keyed by parameter names, not by rank (an optimizer without
    state yet gets its zero state first, as ``get_state_dict`` does)."""
    model_state, optimizer_state = get_state_dict(model, weights.opt, options=_TRAINED)
    return {"model": model_state, "optimizer": optimizer_state}


def load_sharded_state(model, weights: TrainedWeights, state: dict) -> None:
    """Collective: restore :func:`sharded_state`'s dict (filled by ``dcp.load``, laid out over
    this job's ranks) into ``model``'s trained tensors (FSDP2's masters) and ``weights``'
    optimizer."""
    set_state_dict(model, weights.opt, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"],
                   # the frozen weights are absent by design; dcp.load already refused a
                   # checkpoint that lacks any trained tensor of the template
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


def save_gathered_adapter(peft_model, out_dir: str, is_root: bool) -> None:
    """Write the trained tensors (LoRA) of an FSDP2-sharded peft model as a peft adapter folder.
    Collective: every rank gathers each trained tensor (``full_tensor``); rank 0 writes."""
    full = {name: _full(p.detach()).cpu() for name, p in peft_model.named_parameters()
            if p.requires_grad}
    if is_root:
        with replaced_dir(out_dir) as tmp:
            peft_model.save_pretrained(tmp, state_dict=full)


def save_full_model(model, tokenizer, out_dir: str, dtype: str, is_root: bool) -> None:
    """Write ``model`` (plain or FSDP2-sharded) as a ``save_pretrained`` folder (safetensors,
    config, tokenizer) in ``dtype`` that plain ``AutoModelForCausalLM.from_pretrained`` loads.
    Collective: every rank calls it; the full state dict is gathered onto rank 0's host memory
    (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``), which writes it."""
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    if not is_root:
        return
    first = {}  # a tied parameter (LM head = embeddings) is stored once, under its first name
    tied = [name for name, p in model.named_parameters(remove_duplicate=False)
            if first.setdefault(id(p), name) != name]
    full = {k: v.to(DTYPES[dtype]) for k, v in full.items() if k not in tied}
    config = copy.deepcopy(model.config)
    config.dtype = dtype  # save_pretrained records the (fp32 master) parameters' dtype
    with replaced_dir(out_dir) as tmp:
        model.save_pretrained(tmp, state_dict=full)
        config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)

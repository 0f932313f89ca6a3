"""The load (``model.load=streamed``): a model built without its weights, wrapped and sharded as
the job needs, then filled tensor by tensor from its memory-mapped checkpoint files, so that no
rank ever holds the whole model on its device or in host memory unless it keeps it whole.

1. :func:`skeleton`: the transformers model of ``config.json`` whose parameters are stubs on the
   device (one element expanded to the parameter's shape: no memory) and whose buffers (RoPE's
   ``inv_freq``) are real.
2. The caller's wrapping of the skeleton: LoRA attached or loaded (peft makes its factors, real,
   on the stubs' device; :func:`hpc.models.loading.load_model`).
3. FSDP2 (:func:`shard_skeleton`): ``fully_shard`` on ``meta`` parameters, then each rank's
   shards given memory, 1/N of every tensor (``to_empty``), the LoRA factors' rows put back.
4. :func:`stream_weights`: each checkpoint tensor read from its file (``safe_open``:
   memory-mapped, a sharded parameter's rows only), cast to its parameter's dtype on the host,
   copied to the device; a decoder linear's weight is quantised (``model.quantize`` in place)
   or copied quantised for rollouts (:mod:`hpc.models.quantize`) as soon as it arrives.

What a rank holds at the load's peak (``plan_load_parts`` of :mod:`hpc.plan.terms` charges it):
its share of the weights (all of them unsharded, 1/N under FSDP2) plus one tensor in transit
(the whole tensor unsharded, its rows under FSDP2; a decoder linear in ``model.dtype`` and its
quantisation temporaries under ``model.quantize``); host memory per rank: that one tensor, read
from the memory-mapped file (its pages are the page cache's, shared by the node's ranks).

``model.load=transformers`` is the reference: ``from_pretrained`` whole in host memory, then
moved to the device, then wrapped and sharded (:func:`hpc.models.loading.load_model`); both
paths give the same tensors bit for bit (tests/test_streamed_load.py).
"""
from __future__ import annotations

import json
import os

import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from torch.distributed.tensor import DTensor
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from hpc.runtime.errors import UserError

SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"


class WeightFiles:
    """The weight files of a model folder, opened memory-mapped: ``{tensor name: file}`` from
    the index (``*.index.json``) or the single file; :meth:`read` copies one tensor, or a block
    of its leading rows, out of the mapping and nothing else. safetensors, or PyTorch's
    ``pytorch_model.bin`` (``torch.load(mmap=True)``, tensors only)."""

    def __init__(self, folder: str):
        self.folder = folder
        self._open = {}
        for index, single in ((SAFETENSORS_INDEX, SAFETENSORS), (BIN_INDEX, BIN)):
            if os.path.isfile(os.path.join(folder, index)):
                try:
                    with open(os.path.join(folder, index)) as fh:
                        self.file_of = {str(k): str(v) for k, v in
                                        json.load(fh)["weight_map"].items()}
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
                    raise UserError(f"cannot load the model in {folder}: {index} is not a "
                                    f"weight index ({type(err).__name__}: {err})") from None
                outside = [f for f in self.file_of.values()
                           if os.path.basename(f) != f or f.startswith(".")]
                if outside:
                    raise UserError(f"cannot load the model in {folder}: {index} names a "
                                    f"weight file outside the folder: {outside[0]!r}")
                return
            if os.path.isfile(os.path.join(folder, single)):
                self.file_of = {name: single for name in self._handle(single).keys()}
                return
        raise UserError(f"model folder {folder} has no weight files ({SAFETENSORS} or {BIN})")

    def _handle(self, file: str):
        if file not in self._open:
            path = os.path.join(self.folder, file)
            try:
                self._open[file] = (safe_open(path, framework="pt", device="cpu")
                                    if file.endswith(".safetensors") else
                                    torch.load(path, map_location="cpu", mmap=True,
                                               weights_only=True))
            except Exception as err:  # noqa: BLE001 - any reader failure is a bad file
                text = str(err).strip()
                raise UserError(f"cannot load the model in {self.folder}: weight file {file}: "
                                f"{text.splitlines()[0] if text else type(err).__name__}"
                                ) from None
        return self._open[file]

    def names(self) -> list:
        return list(self.file_of)

    def read(self, name: str, rows: tuple | None = None) -> torch.Tensor:
        """Tensor ``name`` on the host (its rows ``[start, stop)`` only when ``rows`` is given)."""
        handle = self._handle(self.file_of[name])
        if isinstance(handle, dict):  # a memory-mapped pytorch_model.bin: a view of the map
            full = handle[name]
            return full if rows is None else full[rows[0]:rows[1]]
        if rows is None:
            return handle.get_tensor(name)
        return handle.get_slice(name)[rows[0]:rows[1]]


def _hf_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _owners(model) -> dict:
    """``{id(parameter): [(module, attribute), ...]}``: every place a parameter is registered
    (two for a tied one)."""
    owners = {}
    for module in model.modules():
        for attr, p in module._parameters.items():
            if p is not None:
                owners.setdefault(id(p), []).append((module, attr))
    return owners


def _swap(model, which, make) -> None:
    """Replace every parameter ``p`` of ``model`` with ``which(p)`` true by ``make(p)``, in every
    module that registers it (a tied parameter stays one)."""
    owners = _owners(model)
    for p in list({id(p): p for p in model.parameters() if which(p)}.values()):
        new = make(p)
        for module, attr in owners[id(p)]:
            module._parameters[attr] = new


STUB = "_hpc_stub"  # attribute of a parameter that holds no values yet


def _stub(p, device) -> torch.nn.Parameter:
    """A parameter of ``p``'s shape and dtype on ``device`` that takes no memory (one element,
    expanded: stride 0), marked as a stub."""
    new = torch.nn.Parameter(torch.zeros((), dtype=p.dtype, device=device).expand(p.shape),
                             requires_grad=p.requires_grad)
    setattr(new, STUB, True)
    return new


def is_stub(p) -> bool:
    return getattr(p, STUB, False)


def skeleton(folder: str, dtype: torch.dtype, device: torch.device):
    """The causal LM of ``folder``'s ``config.json`` (its ``generation_config.json`` too), in
    eval mode, whose parameters are stubs on ``device`` in ``dtype`` (no memory; peft and
    transformers see their shapes, dtypes and device) and whose buffers are computed, on
    ``device``. Tied parameters (an LM head sharing the embedding) stay one parameter."""
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.tie_weights()  # outside: the context would give the LM head a parameter of its own
    except Exception as err:  # noqa: BLE001 - any failure is a bad model folder
        text = str(err).strip()
        raise UserError(f"cannot load the model in {folder}: "
                        f"{text.splitlines()[0] if text else type(err).__name__}") from None
    if os.path.isfile(os.path.join(folder, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(folder, local_files_only=True)
    _swap(model, lambda p: p.is_meta, lambda p: _stub(p, device))
    for module in model.modules():
        for name, buf in module._buffers.items():
            if buf is not None:
                module._buffers[name] = buf.to(device)
    return model.eval()


def shard_skeleton(model, shard, device: torch.device) -> None:
    """FSDP2 on a skeleton: ``shard(model)`` (``fully_shard`` of its units) applied to it with
    every parameter on ``meta`` (FSDP2 shards those without memory; a stub is not contiguous,
    which it refuses), then each rank's shards given uninitialised memory on ``device``, its
    local rows only (FSDP2's ``to_empty``). What already held values (LoRA factors, buffers)
    is put back: each shard its rows."""
    kept = {name: p.detach().clone() for name, p in model.named_parameters() if not is_stub(p)}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    _swap(model, lambda p: True, lambda p: torch.nn.Parameter(
        torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad))
    shard(model)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in kept:
                if isinstance(p, DTensor):
                    start, stop = shard_rows(p)
                    p.to_local().copy_(kept[name][start:stop])
                else:
                    p.copy_(kept[name])
        for name, b in model.named_buffers():
            b.copy_(buffers[name])


def _checkpoint_name_map(model, names: list) -> dict:
    """``{checkpoint tensor name: parameter name in model.named_parameters()}``: the same name,
    under a peft wrapper its ``base_layer``, or with / without the base model's prefix."""
    params = dict(model.named_parameters(remove_duplicate=False))
    prefix = getattr(model, "base_model_prefix", "") + "."
    out = {}
    for name in names:
        module, _, leaf = name.rpartition(".")
        for candidate in (name, f"{module}.base_layer.{leaf}", prefix + name,
                          name[len(prefix):] if name.startswith(prefix) else None):
            if candidate in params:
                out[name] = candidate
                break
    return out


def shard_rows(p: DTensor) -> tuple:
    """``[start, stop)``: the rows of FSDP2's dim-0 shard of ``p`` that this rank holds
    (``torch.chunk``'s split: ceil(rows / N) a rank, the last ones short or empty)."""
    rank, n = p.device_mesh.get_local_rank(), p.device_mesh.size()
    rows = p.shape[0]
    chunk = -(-rows // n)
    start = min(rank * chunk, rows)
    stop = min(start + chunk, rows)
    if p.to_local().shape[0] != stop - start:
        raise RuntimeError(f"unexpected FSDP2 shard: {stop - start} rows expected, "
                           f"{p.to_local().shape[0]} held")
    return start, stop


def streamed_model(folder: str, dtype: torch.dtype, device: torch.device, wrap=None, shard=None,
                   arrival=None, files=None):
    """The whole streamed load: :func:`skeleton`, ``wrap(model) -> model`` (LoRA), FSDP2's
    ``shard(model)`` (:func:`shard_skeleton`), then :func:`stream_weights` with
    ``arrival(model)`` (None: nothing arrives) from ``files`` (default: ``folder``'s
    :class:`WeightFiles`). Returns the model."""
    model = skeleton(folder, dtype, device)
    model = wrap(model) if wrap else model
    if shard:
        shard_skeleton(model, shard, device)
    stream_weights(model, folder, arrival(model) if arrival else None, files)
    return model


@torch.no_grad()
def stream_weights(model, folder: str, arrived=None, files=None) -> None:
    """Fill ``model``'s base weights from ``folder``'s checkpoint, one tensor at a time: read
    (a sharded parameter's rows only), cast to the parameter's dtype on the host, copied to its
    device: a stub (:func:`skeleton`) is replaced by the tensor, an FSDP2 shard
    (:func:`materialize_shards`) or a loaded parameter overwritten. ``arrived``: None, or an
    object with ``wants(module) -> bool`` and ``arrived(module, weight)``,
    called once a weight that it wants is in place (``weight``: the whole tensor on the device,
    also for a sharded parameter, whose other rows are then read too). ``files``: what the
    tensors are read from (default ``WeightFiles(folder)``; any object with its ``names`` and
    ``read``). UserError naming a tensor the checkpoint lacks or holds in another shape."""
    files = files or WeightFiles(folder)
    hf = _hf_model(model)
    params = dict(hf.named_parameters(remove_duplicate=False))
    owners = _owners(hf)
    modules = dict(hf.named_modules())
    filled = set()
    for name, target in _checkpoint_name_map(hf, files.names()).items():
        p = params[target]
        if id(p) in filled:  # a tied parameter the checkpoint also holds under its other name
            continue
        module_name, _, leaf = target.rpartition(".")
        wanted = arrived is not None and leaf == "weight" and arrived.wants(modules[module_name])
        sharded = isinstance(p, DTensor)
        rows = shard_rows(p) if sharded and not wanted else None
        host = files.read(name, rows)
        expected = (rows[1] - rows[0], *p.shape[1:]) if rows else tuple(p.shape)
        if tuple(host.shape) != tuple(expected):
            raise UserError(f"cannot load the model in {folder}: tensor {name} is "
                            f"{tuple(files.read(name).shape) if rows else tuple(host.shape)} "
                            f"in the checkpoint, {tuple(p.shape)} in the model")
        value = host.to(device=p.device, dtype=p.dtype, copy=True)  # the host read goes
        del host
        if sharded:
            start, stop = shard_rows(p)
            offset = rows[0] if rows else 0
            p.to_local().copy_(value[start - offset:stop - offset])
        elif is_stub(p):
            new = torch.nn.Parameter(value, requires_grad=p.requires_grad)
            for module, attr in owners[id(p)]:
                module._parameters[attr] = new
        else:
            p.copy_(value)
        filled.add(id(p))
        if wanted:
            arrived.arrived(modules[module_name], value)
        del value
    missing = [n for n, p in hf.named_parameters() if is_stub(p) or (
        isinstance(p, DTensor) and id(p) not in filled and "lora_" not in n)]
    if missing:
        raise UserError(f"cannot load the model in {folder}: its weight files lack "
                        f"{len(missing)} tensor(s) of the model, first {missing[0]} (model.load="
                        f"transformers loads checkpoints that need transformers' conversions)")

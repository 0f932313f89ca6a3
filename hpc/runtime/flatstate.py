"""A nested training state as named tensors + a JSON skeleton, so a checkpoint holds no code.

``flatten(state)`` accepts dicts (str or int keys), lists, tuples, None, bool, int, float, str,
bytes, torch tensors, numpy arrays and numpy scalars, nested freely (e.g. a torch optimizer's
``state_dict()``, whose per-parameter state has int keys). Every tensor, array, numpy scalar and
bytes value becomes one CPU tensor ``"t<N>"`` (for safetensors); the skeleton is JSON-able and
says where each goes back. ``unflatten`` rebuilds the same structure with the same types and
values (tensors on CPU, detached); anything it does not recognise is refused as a UserError.
Its dicts raise a one-line UserError naming the checkpoint for a missing key, so a checkpoint
from another version or edited by hand never ends in a KeyError traceback.
"""
from __future__ import annotations

import numpy as np
import torch

from hpc.runtime.errors import UserError


class CheckpointDict(dict):
    """A dict read from a checkpoint: a missing key is a one-line UserError, not a KeyError."""

    source = "checkpoint"

    def __missing__(self, key):
        raise UserError(f"{self.source} has no entry {key!r}: it was written by another "
                        f"version of this program or edited; cannot resume from it")


def flatten(state) -> tuple[dict, object]:
    """``state`` -> ({name: CPU tensor}, JSON-able skeleton)."""
    tensors: dict = {}

    def store(tensor: torch.Tensor, kind: str) -> dict:
        name = f"t{len(tensors)}"
        # A private contiguous copy: safetensors refuses tensors that share memory.
        tensors[name] = tensor.detach().to("cpu", copy=True).contiguous()
        return {"type": kind, "tensor": name}

    def encode(value):
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, np.generic):
            return value
        if isinstance(value, torch.Tensor):
            return store(value, "tensor")
        if isinstance(value, np.ndarray):
            # np.array, not np.ascontiguousarray, which makes a 0-d array 1-d
            return store(torch.from_numpy(np.array(value, order="C")), "ndarray")
        if isinstance(value, np.generic):
            return store(torch.from_numpy(np.asarray(value).reshape(1)), "numpy_scalar")
        if isinstance(value, (bytes, bytearray)):
            return store(torch.frombuffer(bytearray(value), dtype=torch.uint8)
                         if value else torch.zeros(0, dtype=torch.uint8), "bytes")
        if isinstance(value, dict):
            for key in value:
                if not isinstance(key, (str, int)) or isinstance(key, bool):
                    raise TypeError(f"checkpoint dict keys must be str or int, got {key!r}")
            return {"type": "dict", "items": [[k, encode(v)] for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            return {"type": type(value).__name__, "items": [encode(v) for v in value]}
        raise TypeError(f"cannot store a {type(value).__name__} in a checkpoint")

    return tensors, encode(state)


# torch dtypes numpy has (bfloat16 and the float8s have none: never written as arrays)
_NUMPY_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                 torch.float16, torch.float32, torch.float64, torch.uint16, torch.uint32,
                 torch.uint64)


def unflatten(tensors: dict, skeleton, source: str):
    """Inverse of :func:`flatten`; ``source`` (e.g. the file) names the checkpoint in errors."""

    def bad(what) -> UserError:
        return UserError(f"{source} is not a checkpoint this program wrote ({what}); "
                         f"refusing to load it")

    def tensor(node) -> torch.Tensor:
        name = node.get("tensor")
        if not isinstance(name, str) or name not in tensors:
            raise bad(f"missing tensor {name!r}")
        return tensors[name]

    def array(node) -> np.ndarray:
        value = tensor(node)
        if value.dtype not in _NUMPY_DTYPES:
            raise bad(f"a {value.dtype} tensor {node['tensor']!r} where a numpy array is stored")
        return value.numpy()

    def items(node) -> list:
        value = node.get("items", [])
        if not isinstance(value, list):
            raise bad(f"{type(value).__name__} items in a {node.get('type')}")
        return value

    def decode(node):
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if not isinstance(node, dict):
            raise bad(f"unexpected {type(node).__name__} in the skeleton")
        kind = node.get("type")
        if kind == "tensor":
            return tensor(node)
        if kind == "ndarray":
            return array(node)
        if kind == "numpy_scalar":
            value = array(node)
            if value.shape != (1,):
                raise bad(f"a numpy scalar of shape {value.shape}")
            return value[0]
        if kind == "bytes":
            value = tensor(node)
            if value.dtype != torch.uint8 or value.dim() != 1:
                raise bad(f"bytes stored as a {value.dtype} tensor of shape {tuple(value.shape)}")
            return value.numpy().tobytes()
        if kind in ("list", "tuple"):
            decoded = [decode(v) for v in items(node)]
            return decoded if kind == "list" else tuple(decoded)
        if kind == "dict":
            out = CheckpointDict()
            out.source = source
            for pair in items(node):
                if not (isinstance(pair, list) and len(pair) == 2 and
                        isinstance(pair[0], (str, int)) and not isinstance(pair[0], bool)):
                    raise bad("malformed dict entry")
                out[pair[0]] = decode(pair[1])
            return out
        raise bad(f"unknown node type {kind!r}")

    return decode(skeleton)

"""Checks on values read back from files a job wrote earlier (checkpoints, run files).

A run folder may be shared and writable by others, and a file in it may be damaged or edited, so
every value read back is checked for type, shape and range before use; anything else is one
:class:`UserError` line naming the file and the field (the checkpoint module then falls back to
the previous checkpoint). JSON is parsed with a size and a nesting limit, so a crafted file
cannot exhaust the stack (RecursionError) or the memory.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np

from hpc.runtime.errors import UserError

MAX_JSON_BYTES = 256 * 2 ** 20  # a checkpoint skeleton of a 32B model's optimizer: a few MiB
MAX_JSON_DEPTH = 64             # a checkpoint skeleton nests ~3 levels per level of its state
MAX_STEP = 2 ** 40              # steps, generations: far beyond any run, far below int64
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def bad_field(source: str, field: str, why: str) -> UserError:
    """The one line for a value read back that cannot be used."""
    return UserError(f"{source}: field {field!r} {why}; it was damaged or not written by this "
                     f"program")


def bounded_json(text):
    """``json.loads(text)`` (str or bytes); ValueError (with the reason) for malformed JSON, more
    than MAX_JSON_BYTES or nesting deeper than MAX_JSON_DEPTH, never a RecursionError."""
    data = text.encode() if isinstance(text, str) else bytes(text)
    if len(data) > MAX_JSON_BYTES:
        raise ValueError(f"{len(data)} bytes of JSON, more than {MAX_JSON_BYTES}")
    brackets = np.frombuffer(_JSON_STRING.sub(b'""', data), dtype=np.uint8)
    depth = np.cumsum(np.isin(brackets, (ord("["), ord("{"))).astype(np.int64) -
                      np.isin(brackets, (ord("]"), ord("}"))))
    if depth.size and depth.max() > MAX_JSON_DEPTH:
        raise ValueError(f"JSON nested {int(depth.max())} levels deep, more than "
                         f"{MAX_JSON_DEPTH}")
    return json.loads(data)


def count(value, source: str, field: str, maximum: int = MAX_STEP) -> int:
    """``value`` as an int in [0, maximum]: a Python or numpy integer, not a bool or a string."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise bad_field(source, field, f"is a {type(value).__name__}, not an integer")
    if not 0 <= int(value) <= maximum:
        raise bad_field(source, field, f"is {int(value)}, outside [0, {maximum}]")
    return int(value)


def amount(value, source: str, field: str, minimum: float = 0.0) -> float:
    """``value`` as a finite float >= ``minimum`` (seconds, token counts: 0)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer,
                                                                    np.floating)):
        raise bad_field(source, field, f"is a {type(value).__name__}, not a number")
    if not (math.isfinite(float(value)) and value >= minimum):
        raise bad_field(source, field, f"is {value}, not a finite number >= {minimum}")
    return float(value)


def array(value, source: str, field: str, shape: tuple, kinds: str = "iuf") -> np.ndarray:
    """``value`` as a numpy array of ``shape`` (None: any length) whose dtype kind is in
    ``kinds`` (numpy's letters: i, u integers, f floats, b bool)."""
    if not isinstance(value, np.ndarray):
        raise bad_field(source, field, f"is a {type(value).__name__}, not an array")
    if value.dtype.kind not in kinds or len(value.shape) != len(shape) or any(
            want is not None and got != want for got, want in zip(value.shape, shape)):
        raise bad_field(source, field, f"is a {value.dtype} array of shape {value.shape}, "
                                       f"expected kind {kinds!r} and shape {shape}")
    return value

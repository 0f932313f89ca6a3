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

import numpy as np

from hpc.runtime.errors import UserError
from hpc.runtime.methods import methods

MAX_JSON_BYTES = 256 * 2 ** 20  # a checkpoint skeleton of a 32B model's optimizer: a few MiB
MAX_JSON_DEPTH = 64             # a checkpoint skeleton nests ~3 levels per level of its state
MAX_JSON_ITEMS = 2 ** 22        # values in one document: a skeleton of a 32B model's optimizer
                                # has ~10^4, CMA-ES histories ~10^5; 15M empty lists take GiBs
MAX_STEP = 2 ** 40              # steps, generations: far beyond any run, far below int64
SCAN_CHUNK = 2 ** 22            # bytes :func:`bounded_json` scans at once (its arrays: ~20x this)
_QUOTE, _BACKSLASH, _COMMA = ord('"'), ord("\\"), ord(",")
_OPEN, _CLOSE = (ord("["), ord("{")), (ord("]"), ord("}"))


def bad_field(source: str, field: str, why: str) -> UserError:
    """The one line for a value read back that cannot be used."""
    return UserError(f"{source}: field {field!r} {why}; it was damaged or not written by this "
                     f"program")


class _Scan:
    """Nesting depth and value count of JSON text fed in chunks: brackets and commas outside
    strings, a quote preceded by an odd run of backslashes escaped. State carried between
    chunks: the depth, whether inside a string, the backslashes the last chunk ended with."""

    def __init__(self):
        self.depth = self.deepest = self.commas = 0
        self.in_string, self.backslashes = 0, 0

    def feed(self, chunk: np.ndarray) -> None:
        """Scan ``chunk`` (uint8, the next bytes of the document)."""
        n = chunk.size
        if n == 0:
            return
        backslash = chunk == _BACKSLASH
        quote = chunk == _QUOTE
        if backslash.any():
            index = np.arange(n, dtype=np.int32)
            # the index of the last byte before each position that is not a backslash (the
            # previous chunk's trailing backslashes sit at negative indices)
            last_other = np.maximum.accumulate(
                np.where(backslash, np.int32(-1 - self.backslashes), index))
            run = np.empty(n, dtype=np.int32)  # backslashes right before each position
            run[0] = self.backslashes
            run[1:] = index[:-1] - last_other[:-1]
            quote &= run % 2 == 0
            del run, last_other, index
        elif self.backslashes % 2:
            quote[0] = False
        quotes = int(np.count_nonzero(quote))
        outside = ((np.cumsum(quote, dtype=np.int32) + self.in_string) % 2 == 0 if quotes else
                   np.full(n, not self.in_string))
        opens = ((chunk == _OPEN[0]) | (chunk == _OPEN[1])) & outside
        closes = ((chunk == _CLOSE[0]) | (chunk == _CLOSE[1])) & outside
        if opens.any() or closes.any():
            depth = np.cumsum(opens.view(np.int8) - closes.view(np.int8), dtype=np.int32)
            self.deepest = max(self.deepest, self.depth + int(depth.max()))
            self.depth += int(depth[-1])
        self.commas += int(np.count_nonzero((chunk == _COMMA) & outside))
        self.in_string = (self.in_string + quotes) % 2
        if not backslash[-1]:
            self.backslashes = 0
        elif backslash.all():
            self.backslashes += n
        else:  # the first byte from the end that is not a backslash
            self.backslashes = int(np.argmin(backslash[::-1]))


def bounded_json(text):
    """``json.loads(text)`` (str, bytes or a memoryview of UTF-8 bytes); ValueError (with the
    reason) for malformed JSON, more than MAX_JSON_BYTES, nesting deeper than MAX_JSON_DEPTH or
    more than MAX_JSON_ITEMS values (counted by their commas), never a RecursionError or a
    MemoryError. The limits are checked before parsing, by a scan in SCAN_CHUNK pieces, so the
    memory it takes is the text as a str (1 byte a character for ASCII, which checkpoints
    are), about 20 SCAN_CHUNK of scan arrays (80 MiB), and the parsed value."""
    if not isinstance(text, str) and len(text) > MAX_JSON_BYTES:
        raise ValueError(f"{len(text)} bytes of JSON, more than {MAX_JSON_BYTES}")
    scan, size = _Scan(), 0
    for start in range(0, len(text), SCAN_CHUNK):
        piece = text[start:start + SCAN_CHUNK]
        if isinstance(piece, str):  # quotes, backslashes, brackets are ASCII: any cut will do
            piece = piece.encode("utf-8", "surrogatepass")
            size += len(piece)
            if size > MAX_JSON_BYTES:
                raise ValueError(f"more than {MAX_JSON_BYTES} bytes of JSON")
        scan.feed(np.frombuffer(piece, dtype=np.uint8))
        del piece
        if scan.deepest > MAX_JSON_DEPTH:
            raise ValueError(f"JSON nested {scan.deepest} levels deep, more than "
                             f"{MAX_JSON_DEPTH}")
        if scan.commas >= MAX_JSON_ITEMS:
            raise ValueError(f"more than {MAX_JSON_ITEMS} JSON values")
    return json.loads(text if isinstance(text, str) else str(text, "utf-8"))


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


def finite(value: np.ndarray, source: str, field: str) -> np.ndarray:
    """``value`` (a numeric array) if it holds no NaN or infinity."""
    if not np.isfinite(value).all():
        raise bad_field(source, field, "holds NaN or infinite values")
    return value


def tensors(value, source: str, field: str, shapes: list, dtypes: list) -> list:
    """``value`` as a list of finite torch tensors of ``shapes`` (tuples) and ``dtypes`` (torch
    float dtypes), one each."""
    import torch

    if not (isinstance(value, list) and len(value) == len(shapes) and all(
            isinstance(t, torch.Tensor) and t.is_floating_point() and tuple(t.shape) == shape
            for t, shape in zip(value, shapes))):
        want = (f"a float tensor of shape {shapes[0]}" if len(shapes) == 1 else
                f"{len(shapes)} float tensors of the trained parameters' shapes")
        raise bad_field(source, field, f"is not {want}")
    for i, (t, dtype) in enumerate(zip(value, dtypes)):
        if t.dtype != dtype:
            where = field if len(shapes) == 1 else f"{field}[{i}]"
            raise bad_field(source, where, f"is {t.dtype}, where the job keeps {dtype}")
    for i, t in enumerate(value):
        if not torch.isfinite(t).all():
            raise bad_field(source, f"{field}[{i}]", "holds NaN or infinite values")
    return value


MAX_LR = 10.0  # the largest learning rate the configs accept (fgrpo.optim.learning_rate, sft.lr)


def adam_state(value, source: str, shapes: list, dtypes: list) -> dict:
    """``value`` as a torch Adam/AdamW ``state_dict()`` over parameters of ``shapes`` and
    ``dtypes``, as the optimizer creates it: per parameter ``step`` (a finite number >= 0; a
    tensor: float32 or float64, which count steps exactly), ``exp_avg`` (finite) and
    ``exp_avg_sq`` (finite, >= 0), each of the parameter's shape and dtype (``load_state_dict``
    would cast a bfloat16 moment to the parameter's dtype without a word: another model);
    param groups whose ``params`` are the
    indices 0..n-1, ``lr`` in [0, MAX_LR], ``betas`` two numbers in [0, 1), ``eps`` > 0 and
    ``weight_decay`` >= 0, all finite."""
    import torch

    if not (isinstance(value, dict) and isinstance(value.get("state"), dict) and
            isinstance(value.get("param_groups"), list) and value["param_groups"]):
        raise bad_field(source, "optimizer", "is not an optimizer state (state, param_groups)")
    indices = []
    for g, group in enumerate(value["param_groups"]):
        where = f"optimizer.param_groups[{g}]"
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise bad_field(source, where, "is not a parameter group with a params list")
        indices += [count(i, source, f"{where}.params", maximum=len(shapes) - 1)
                    for i in group["params"]]
        lr = amount(group.get("lr"), source, f"{where}.lr")
        if not lr <= MAX_LR:
            raise bad_field(source, f"{where}.lr", f"is {lr}, outside [0, {MAX_LR}]")
        betas = group.get("betas")
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2 and
                all(0 <= amount(b, source, f"{where}.betas") < 1 for b in betas)):
            raise bad_field(source, f"{where}.betas", f"is {betas!r}, not two numbers in "
                                                      f"[0, 1)")
        if not amount(group.get("eps"), source, f"{where}.eps") > 0:
            raise bad_field(source, f"{where}.eps", "is not positive")
        amount(group.get("weight_decay"), source, f"{where}.weight_decay")
    if sorted(indices) != list(range(len(shapes))):
        raise bad_field(source, "optimizer.param_groups", f"list the parameters {indices}, "
                                                          f"not 0..{len(shapes) - 1} once each")
    for i, moments in value["state"].items():
        where = f"optimizer.state[{i!r}]"
        index = count(i, source, where, maximum=len(shapes) - 1)
        if not isinstance(moments, dict):
            raise bad_field(source, where, "is not a dict of moments")
        step = moments.get("step")
        if isinstance(step, torch.Tensor) and step.dtype not in (torch.float32, torch.float64):
            raise bad_field(source, f"{where}.step", f"is a {step.dtype} tensor; the optimizer "
                                                     f"keeps float32")
        amount(step.item() if isinstance(step, torch.Tensor) and step.numel() == 1 else step,
               source, f"{where}.step")
        for name in ("exp_avg", "exp_avg_sq"):
            tensors([moments.get(name)], source, f"{where}.{name}", [shapes[index]],
                    [dtypes[index]])
        if (moments["exp_avg_sq"] < 0).any():
            raise bad_field(source, f"{where}.exp_avg_sq", "holds negative values")
    return value


def run_folder_entries(out_dir: str, method: str) -> None:
    """UserError (one line) unless the entries a job of ``method`` reads and writes in
    ``out_dir`` are of the kind it expects: ``out_dir`` itself not a symbolic link (a link to
    another run folder would have this job write that run's files), ``checkpoints`` a folder,
    ``.lock`` and ``<method>.h5`` plain files, and no checkpoints of another training method
    (``<other>.h5`` beside ``checkpoints/``: checkpoint retention would delete that run's
    checkpoints, and ``--resume`` would read them)."""
    import os
    import stat

    if os.path.islink(out_dir):
        raise UserError(f"run.out {out_dir} is a symbolic link (to {os.readlink(out_dir)!r}); a "
                        f"job writes only into its own run folder: give run.out the real path")
    kinds = {"checkpoints": (stat.S_ISDIR, "a folder"), ".lock": (stat.S_ISREG, "a plain file"),
             f"{method}.h5": (stat.S_ISREG, "a plain file")}
    for name, (is_kind, kind) in kinds.items():
        path = os.path.join(out_dir, name)
        try:
            mode = os.lstat(path).st_mode
        except (FileNotFoundError, NotADirectoryError):  # absent, or a parent is a file
            continue
        if stat.S_ISLNK(mode):
            continue  # refused where it is opened, with the link's target named
        if not is_kind(mode):
            raise UserError(f"{path} is not {kind}; the run folder {out_dir} was damaged or "
                            f"is not a {method} run folder: remove it or give run.out another "
                            f"folder")
    ckpts = os.path.join(out_dir, "checkpoints")
    keeping = [name for name, spec in methods().items() if spec.keeps_checkpoints]
    others = [m for m in keeping if m != method and
              os.path.lexists(os.path.join(out_dir, f"{m}.h5"))]
    if method in keeping and others and os.path.isdir(ckpts) and os.listdir(ckpts):
        raise UserError(f"run folder {out_dir} holds a {others[0]} run ({others[0]}.h5 and "
                        f"checkpoints/); this {method} job would read or delete its "
                        f"checkpoints there: give run.out another folder")

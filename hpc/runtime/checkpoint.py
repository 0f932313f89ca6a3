"""Atomic, checksummed checkpoints with retention; a damaged one falls back to the previous.

Layout: ``<dir>/step-<NNNNNNNN>.safetensors`` and ``<dir>/step-<NNNNNNNN>.sha256``. The state (a
nested dict, see :mod:`hpc.runtime.flatstate`) is stored as safetensors tensors plus a JSON
skeleton in the file's metadata: loading one runs no code from it, unlike a pickle (a run
folder in shared project space could otherwise hand every rank arbitrary code at ``--resume``;
the checksum is no defence, since whoever writes the file writes it too). A checkpoint is
written to a temporary file, fsynced, checksummed, then renamed into place, so a kill at any
moment leaves either the old set or the new one. Written by rank 0 only.

Checkpoints of earlier versions (``step-*.pt``, pickles) are never loaded: resuming a folder
that has only those is a one-line error.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import struct
import sys

from safetensors import SafetensorError
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from hpc.runtime.atomic import write_bytes
from hpc.runtime.errors import UserError
from hpc.runtime.flatstate import flatten, unflatten

SUFFIX = ".safetensors"
FORMAT = "essa-hpc-checkpoint/1"


def _path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}{SUFFIX}")


def _sha_path(path: str) -> str:
    return path[:-len(SUFFIX)] + ".sha256"


def save_checkpoint(directory: str, step: int, state: dict, keep: int = 3) -> str:
    """Write ``state`` for ``step`` atomically with its sha256; keep the newest ``keep``."""
    os.makedirs(directory, exist_ok=True)
    tensors, skeleton = flatten(state)
    data = save_tensors(tensors, metadata={"format": FORMAT, "skeleton": json.dumps(skeleton)})
    path = _path(directory, step)
    try:
        write_bytes(_sha_path(path), hashlib.sha256(data).hexdigest().encode())
        write_bytes(path, data)
    except OSError as err:
        if os.path.exists(_sha_path(path)):
            os.remove(_sha_path(path))
        raise UserError(f"cannot write checkpoint {path} ({len(data) / 2 ** 20:.1f} MiB): "
                        f"{err.strerror or err}; earlier checkpoints are intact",
                        same_on_all_ranks=False) from None
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        for stale in (old, _sha_path(old)):
            try:
                os.remove(stale)
            except FileNotFoundError:
                pass
    return path


def list_checkpoints(directory: str) -> list:
    """Checkpoint paths in ``directory``, oldest first."""
    return sorted(glob.glob(os.path.join(directory, f"step-*{SUFFIX}")))


def _decode(path: str, data: bytes) -> dict:
    """The state in ``data`` (checksum already verified); UserError if it is not ours."""
    def refuse(why: str) -> UserError:
        return UserError(f"checkpoint {path} is not one this program wrote ({why}); "
                         f"refusing to load it")

    try:
        (header_len,) = struct.unpack("<Q", data[:8])
        metadata = json.loads(data[8:8 + header_len]).get("__metadata__") or {}
        tensors = load_tensors(data)
    except (struct.error, ValueError, AttributeError, SafetensorError) as err:
        raise refuse(f"not a readable safetensors file: {err}") from None
    if metadata.get("format") != FORMAT:
        raise refuse(f"format {metadata.get('format')!r}, expected {FORMAT!r}")
    try:
        skeleton = json.loads(metadata["skeleton"])
    except (KeyError, ValueError) as err:
        raise refuse(f"no readable skeleton: {err}") from None
    state = unflatten(tensors, skeleton, f"checkpoint {path}")
    if not isinstance(state, dict):
        raise refuse("its state is not a dict")
    return state


def _verified(path: str) -> dict | None:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        with open(_sha_path(path), "rb") as fh:
            expected = fh.read().decode(errors="replace").strip()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != expected:
        return None
    return _decode(path, data)


def load_latest(directory: str, warn=True) -> dict | None:
    """The newest checkpoint whose checksum matches; damaged ones are reported and skipped.

    Returns None when the folder has no checkpoint; raises UserError when every one is damaged,
    when a checksummed one is not a checkpoint of this program, and when the folder holds only
    checkpoints of an earlier version (pickles, which this version never loads).
    """
    paths = list_checkpoints(directory)
    if not paths:
        old = sorted(glob.glob(os.path.join(directory, "step-*.pt")))
        if old:
            raise UserError(f"{directory} holds only checkpoints of an earlier version "
                            f"({os.path.basename(old[-1])}: a pickle, which could run code when "
                            f"loaded); this version cannot resume them: finish the run with the "
                            f"version that wrote it, or start a fresh run in another folder")
    for path in reversed(paths):
        state = _verified(path)
        if state is not None:
            return state
        if warn:
            print(f"warning: checkpoint {path} is truncated or corrupted (checksum mismatch); "
                  f"trying the previous one", file=sys.stderr, flush=True)
    if paths:
        raise UserError(f"every checkpoint in {directory} is damaged; cannot resume")
    return None

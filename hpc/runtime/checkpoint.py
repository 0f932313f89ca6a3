"""Atomic, checksummed checkpoints with retention; a damaged one falls back to the previous.

Layout: ``<dir>/step-<NNNNNNNN>.pt`` (torch.save of a dict) and ``<dir>/step-<NNNNNNNN>.sha256``.
A checkpoint is written to a temporary file, fsynced, checksummed, then renamed into place, so
a kill at any moment leaves either the old set or the new one. Written by rank 0 only.
"""
from __future__ import annotations

import glob
import hashlib
import io
import os
import sys

import torch

from hpc.runtime.atomic import write_bytes
from hpc.runtime.errors import UserError


def _path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}.pt")


def save_checkpoint(directory: str, step: int, state: dict, keep: int = 3) -> str:
    """Write ``state`` for ``step`` atomically with its sha256; keep the newest ``keep``."""
    os.makedirs(directory, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    path = _path(directory, step)
    try:
        write_bytes(path[:-3] + ".sha256", hashlib.sha256(data).hexdigest().encode())
        write_bytes(path, data)
    except OSError as err:
        if os.path.exists(path[:-3] + ".sha256"):
            os.remove(path[:-3] + ".sha256")
        raise UserError(f"cannot write checkpoint {path} ({len(data) / 2 ** 20:.1f} MiB): "
                        f"{err.strerror or err}; earlier checkpoints are intact",
                        same_on_all_ranks=False) from None
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        for suffix in (".pt", ".sha256"):
            try:
                os.remove(old[:-3] + suffix)
            except FileNotFoundError:
                pass
    return path


def list_checkpoints(directory: str) -> list:
    """Checkpoint paths in ``directory``, oldest first."""
    return sorted(glob.glob(os.path.join(directory, "step-*.pt")))


def _verified(path: str) -> dict | None:
    try:
        with open(path, "rb") as fh:
            data = fh.read()
        with open(path[:-3] + ".sha256", "rb") as fh:
            expected = fh.read().decode().strip()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != expected:
        return None
    return torch.load(io.BytesIO(data), weights_only=False)


def load_latest(directory: str, warn=True) -> dict | None:
    """The newest checkpoint whose checksum matches; damaged ones are reported and skipped.

    Returns None when the folder has no checkpoint; raises UserError when every one is damaged.
    """
    paths = list_checkpoints(directory)
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

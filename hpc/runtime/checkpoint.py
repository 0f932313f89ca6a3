"""Atomic, checksummed checkpoints with retention; a damaged one falls back to the previous.

Layout: ``<dir>/step-<NNNNNNNN>.safetensors`` and ``<dir>/step-<NNNNNNNN>.sha256``. The state (a
nested dict, see :mod:`hpc.runtime.flatstate`) is stored as safetensors tensors plus a JSON
skeleton in the file's metadata: loading one runs no code from it, unlike a pickle (a run
folder in shared project space could otherwise hand every rank arbitrary code at ``--resume``;
the checksum is no defence, since whoever writes the file writes it too). A checkpoint is
written to a temporary file, fsynced, checksummed, then renamed into place, so a kill at any
moment leaves either the old set or the new one (under an unpredictable temporary name,
created without following links: :mod:`hpc.runtime.atomic`). Written by rank 0 only. Read back,
a name that is a symbolic link, JSON nested too deep and (through ``load_latest``'s ``accept``)
any field of the wrong type, shape or range make the checkpoint unusable like a checksum
mismatch: a warning, then the previous checkpoint.

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

from hpc.runtime.atomic import open_plain, refuse_link, write_bytes
from hpc.runtime.errors import UserError
from hpc.runtime.flatstate import flatten, unflatten
from hpc.runtime.readback import bounded_json

SUFFIX = ".safetensors"
FORMAT = "essa-hpc-checkpoint/1"


def _path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:08d}{SUFFIX}")


def _sha_path(path: str) -> str:
    return path[:-len(SUFFIX)] + ".sha256"


def save_checkpoint(directory: str, step: int, state: dict, keep: int = 3) -> str:
    """Write ``state`` for ``step`` atomically with its sha256; keep the newest ``keep``."""
    refuse_link(directory)
    tensors, skeleton = flatten(state)
    data = save_tensors(tensors, metadata={"format": FORMAT, "skeleton": json.dumps(skeleton)})
    path = _path(directory, step)
    try:
        os.makedirs(directory, exist_ok=True)
        write_bytes(_sha_path(path), hashlib.sha256(data).hexdigest().encode())
        write_bytes(path, data)
    except (OSError, UserError) as err:
        if os.path.exists(_sha_path(path)) and not os.path.islink(_sha_path(path)):
            os.remove(_sha_path(path))
        if isinstance(err, UserError):  # a symbolic link planted at one of the names
            raise
        raise UserError(f"cannot write checkpoint {path} ({len(data) / 2 ** 20:.1f} MiB): "
                        f"{err.strerror or err}; {left_in(directory, path)}",
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


def left_in(directory: str, failed: str = "") -> str:
    """What a failed write (of checkpoint ``failed``, if one) leaves to resume from in
    ``directory``, for its error line."""
    if os.path.lexists(directory) and not os.path.isdir(directory):
        return (f"{directory} is no longer a folder (something replaced it), so no checkpoint "
                f"of this run is left to resume from")
    paths = [p for p in list_checkpoints(directory) if p != failed and os.path.isfile(p)]
    if not paths:
        return f"no checkpoint is left in {directory} to resume from"
    return (f"{len(paths)} earlier checkpoint(s) are left to resume from, the newest "
            f"{os.path.basename(paths[-1])}")


def step_of(path: str) -> int:
    """The step of checkpoint ``path`` (a name :func:`list_checkpoints` lists)."""
    return int(os.path.basename(path)[len("step-"):-len(SUFFIX)])


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
        header = bounded_json(memoryview(data)[8:8 + header_len])  # no copy of the bytes
        metadata = (header.get("__metadata__") if isinstance(header, dict) else None) or {}
        tensors = load_tensors(data)
    except (struct.error, ValueError, AttributeError, SafetensorError) as err:
        raise refuse(f"not a readable safetensors file: {err}") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        raise refuse(f"format {getattr(metadata, 'get', lambda _: None)('format')!r}, "
                     f"expected {FORMAT!r}")
    try:
        skeleton = bounded_json(metadata["skeleton"])
    except (KeyError, TypeError, ValueError) as err:
        raise refuse(f"no readable skeleton: {err}") from None
    state = unflatten(tensors, skeleton, f"checkpoint {path}")
    if not isinstance(state, dict):
        raise refuse("its state is not a dict")
    return state


def _read(path: str) -> bytes:
    with os.fdopen(open_plain(path), "rb") as fh:  # a symbolic link there: UserError
        if os.fstat(fh.fileno()).st_nlink > 1:  # another name may be changed under it
            raise UserError(f"checkpoint file {path} is a hard link to another name; a job "
                            f"reads only plain files of its own")
        return fh.read()


def _verified(path: str) -> dict | None:
    """The state in ``path`` if its checksum matches, None if not or unreadable; UserError if
    it is not a checkpoint of this program or a name is a symbolic link."""
    try:
        data = _read(path)
        expected = _read(_sha_path(path)).decode(errors="replace").strip()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != expected:
        return None
    return _decode(path, data)


def load_latest(directory: str, warn=True, accept=None) -> dict | None:
    """The newest usable checkpoint; damaged and unusable ones are reported and skipped.

    A checkpoint is usable when its checksum matches, it is a checkpoint of this program and
    ``accept(state, path)`` (if given: check the fields read back, :mod:`hpc.runtime.readback`,
    and restore them) raises no UserError. Returns None when the folder has no checkpoint;
    raises UserError when none is usable and when the folder holds only checkpoints of an
    earlier version (pickles, which this version never loads).
    """
    refuse_link(directory, same_on_all_ranks=True)  # every rank reads the checkpoints
    if os.path.lexists(directory) and not os.path.isdir(directory):
        raise UserError(f"{directory} is not a folder; the run folder was damaged: remove it "
                        f"or give run.out another folder")
    paths = list_checkpoints(directory)
    if not paths:
        old = sorted(glob.glob(os.path.join(directory, "step-*.pt")))
        if old:
            raise UserError(f"{directory} holds only checkpoints of an earlier version "
                            f"({os.path.basename(old[-1])}: a pickle, which could run code when "
                            f"loaded); this version cannot resume them: finish the run with the "
                            f"version that wrote it, or start a fresh run in another folder")
    newest_error = None
    for path in reversed(paths):
        try:
            state = _verified(path)
            if state is not None and accept is not None:
                accept(state, path)
        except UserError as err:
            why = str(err) if path in str(err) else f"checkpoint {path}: {err}"
            newest_error = newest_error or why
        else:
            if state is not None:
                return state
            why = f"checkpoint {path} is truncated or corrupted (checksum mismatch)"
        if warn and path != paths[0]:  # the last one's reason is the error line below
            print(f"warning: {why}; trying the previous one", file=sys.stderr, flush=True)
    if newest_error is not None:
        raise UserError(f"every checkpoint in {directory} is damaged or unusable; cannot resume "
                        f"(the newest: {newest_error})")
    if paths:
        raise UserError(f"every checkpoint in {directory} is damaged; cannot resume")
    return None

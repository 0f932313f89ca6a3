"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), resharded on load.

Under FSDP2 each rank holds 1/N of every trained tensor and of its AdamW moments (DTensors).
Every rank writes its own part with ``dcp.save`` into ``<dir>/sharded/step-<NNNNNNNN>/`` (one
``__<rank>_0.distcp`` file per rank and DCP's ``.metadata``, which records each saved chunk's
offsets); ``dcp.load`` reads into the tensors of the job that resumes, laid out over however
many ranks it has, each rank reading only the byte ranges its shards need (torchtitan's
checkpointer works the same way). So a run preempted on 4 ranks resumes on 2 or 3.

Crash safety: the folder is written under a temporary name beside its final one, every file
fsynced (DCP's ``sync_files``), and renamed into place by rank 0 once every rank's part is on
disk. The step's ordinary checkpoint (:mod:`hpc.runtime.checkpoint`, rank 0) then commits it:
it holds the manifest (folder name, rank count, each file's sha256). A kill at any moment
leaves the previous committed set intact; a folder no checkpoint names is unfinished and
:func:`prune_sharded` removes it (with the folders of pruned checkpoints).

Read back: the manifest's fields are checked (:func:`check_manifest`), then every file's
sha256 (:func:`verify_sharded`, each rank hashing a share of the files); a mismatch or a
missing file makes the checkpoint unusable, and the job loop falls back to the previous one.
DCP's ``.metadata`` is a pickle: :class:`CheckedReader` unpickles it with a loader that builds
only DCP's metadata classes and refuses to read any file the manifest does not name (DCP's
other entries are read with ``torch.load(weights_only=True)``), so no checkpoint file runs
code or points the job at another file.
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
import io
import logging
import os
import pickle
import re
import shutil
import tempfile

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from hpc.runtime.atomic import open_plain, refuse_link
from hpc.runtime.checkpoint import left_in, list_checkpoints, step_of
from hpc.runtime.errors import UserError
from hpc.runtime.readback import bad_field, count

FOLDER = "sharded"
METADATA = ".metadata"
_NAME = re.compile(r"(__\d{1,7}_\d{1,4}\.distcp|\.metadata)\Z")
_SHA256 = re.compile(r"[0-9a-f]{64}\Z")
# What DCP's .metadata pickle may build: its metadata classes and the torch types they hold.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta",
        "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16",
              "int8", "uint8", "bool"},
    "torch.serialization": {"_get_layout"},  # a layout by name ("torch.strided")
    "pathlib": {"PosixPath"},                # the folder it was saved to (storage_meta)
}


def sharded_root(ckpt_dir: str) -> str:
    return os.path.join(ckpt_dir, FOLDER)


def folder_name(step: int) -> str:
    return f"step-{step:08d}"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with os.fdopen(open_plain(path), "rb") as fh:
        for block in iter(lambda: fh.read(2 ** 24), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_sharded(ckpt_dir: str, world, step: int, state: dict) -> dict | None:
    """Collective: write ``state`` (nested dict of DTensors, tensors and plain values, as
    ``get_state_dict`` returns) for ``step`` into ``<ckpt_dir>/sharded/step-<NNNNNNNN>``.
    Returns on rank 0 the manifest for the step's checkpoint (``folder``, ``ranks``,
    ``files``: {name: sha256}), None on the other ranks. A failed write is a UserError on
    every rank, naming what is left to resume from."""
    root, name = sharded_root(ckpt_dir), folder_name(step)
    tmp, error = None, None
    if world.is_root:
        refuse_link(ckpt_dir)
        refuse_link(root)
        try:
            os.makedirs(root, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root)
            os.chmod(tmp, 0o755)
        except OSError as err:
            error = f"cannot write the sharded checkpoint of step {step} in {root} " \
                    f"({err.strerror or err}); {left_in(ckpt_dir)}"
    tmp, error = world.comm.bcast((tmp, error), root=0)
    if error:
        raise UserError(error)
    try:
        mine, error = {}, None
        try:
            dcp.save(state, storage_writer=FileSystemWriter(tmp, single_file_per_rank=True,
                                                            sync_files=True))
            mine = {f: _sha256(os.path.join(tmp, f)) for f in os.listdir(tmp)
                    if f.startswith(f"__{world.rank}_") and _NAME.match(f)}
            if world.is_root:
                mine[METADATA] = _sha256(os.path.join(tmp, METADATA))
        except (CheckpointException, OSError, UserError) as err:
            error = f"rank {world.rank}: {_reason(err)}"
        gathered = world.comm.allgather((mine, error))
        errors = [e for _, e in gathered if e is not None]
        if errors:
            raise UserError(f"cannot write the sharded checkpoint of step {step} in {root} "
                            f"({errors[0]}); {left_in(ckpt_dir)}")
        if not world.is_root:
            return None
        files = {f: sha for part, _ in gathered for f, sha in part.items()}
        _fsync_dir(tmp)
        final = os.path.join(root, name)
        if os.path.lexists(final):  # never committed (a kill before its checkpoint) or
            _remove(final)          # damaged and fallen back from: replaced
        os.rename(tmp, final)
        _fsync_dir(root)
        return {"folder": name, "ranks": world.size, "files": files}
    finally:
        if world.is_root and tmp is not None and os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        os.remove(path)


def _reason(err: BaseException) -> str:
    """The first line of why DCP failed (a CheckpointException wraps each rank's error)."""
    failures = getattr(err, "failures", None)
    if failures:
        rank, cause = sorted(failures.items(), key=lambda item: item[0])[0]
        if isinstance(cause, tuple):  # (exception, its traceback summary)
            cause = cause[0]
        return f"rank {rank}: {_reason(cause)}"
    text = getattr(err, "strerror", None) or str(err) or type(err).__name__
    if getattr(err, "filename", None):
        text = f"{text}: {os.path.basename(err.filename)}"
    return text.strip().splitlines()[0][:300]


def prune_sharded(ckpt_dir: str) -> None:
    """Remove every entry of ``<ckpt_dir>/sharded`` that no checkpoint in ``ckpt_dir`` commits:
    the folders of pruned checkpoints, unfinished ones and temporary leftovers (rank 0, after
    the step's checkpoint is written, when no sharded write is under way)."""
    root = sharded_root(ckpt_dir)
    if not os.path.isdir(root) or os.path.islink(root):
        return
    committed = {folder_name(step_of(p)) for p in list_checkpoints(ckpt_dir)}
    for entry in os.listdir(root):
        if entry not in committed:
            _remove(os.path.join(root, entry))


def check_manifest(value, source: str, step: int) -> dict:
    """The manifest field ``sharded`` of checkpoint ``source`` of ``step``, checked: a dict of
    ``folder`` (this step's name), ``ranks`` (>= 1) and ``files`` ({DCP file name: sha256},
    ``.metadata`` among them); else one UserError line (the checkpoint is unusable)."""
    if not isinstance(value, dict) or set(value) != {"folder", "ranks", "files"}:
        raise bad_field(source, "sharded", "is not a manifest of folder, ranks and files")
    if value["folder"] != folder_name(step):
        raise bad_field(source, "sharded.folder", f"is {value['folder']!r}, not "
                                                  f"{folder_name(step)!r}")
    count(value["ranks"], source, "sharded.ranks", maximum=2 ** 20)
    files = value["files"]
    if not (isinstance(files, dict) and METADATA in files and all(
            isinstance(f, str) and _NAME.match(f) and isinstance(h, str) and _SHA256.match(h)
            for f, h in files.items())):
        raise bad_field(source, "sharded.files", "is not {DCP file name: sha256}")
    return value


def verify_sharded(ckpt_dir: str, world, manifest: dict) -> str | None:
    """Collective: None if every file of ``manifest`` is a plain file of its folder with its
    sha256, else why not (the same line on every rank). File i is hashed by rank i % size."""
    folder = os.path.join(sharded_root(ckpt_dir), manifest["folder"])
    reason = None
    names = sorted(manifest["files"])
    try:
        for d in (sharded_root(ckpt_dir), folder):
            refuse_link(d)
        if not os.path.isdir(folder):
            raise FileNotFoundError(f"no folder {folder}")
        for i in range(world.rank, len(names), world.size):
            if _sha256(os.path.join(folder, names[i])) != manifest["files"][names[i]]:
                reason = f"{names[i]} in {folder} is damaged (checksum mismatch)"
                break
    except (OSError, UserError) as err:
        reason = f"{_reason(err)} ({folder})"
    reasons = [r for r in world.comm.allgather(reason) if r is not None]
    return reasons[0] if reasons else None


def _enum_member(cls, name):
    """What ``builtins.getattr`` may build in the metadata: a member of an Enum class that
    :data:`_ALLOWED` let in: early Python 3.11 releases pickle an Enum member as ``getattr(cls,
    name)`` (3.11.2, Debian 12's, does; 3.11.7 pickles ``cls(value)``)."""
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str)
            and name in cls.__members__):
        raise pickle.UnpicklingError(f"the metadata calls getattr({cls!r:.80}, {name!r:.80}), "
                                     f"which names no member of an allowed Enum")
    return cls[name]


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only the classes of :data:`_ALLOWED` (and their Enum members by name:
    :func:`_enum_member`); anything else is an UnpicklingError."""

    def find_class(self, module, name):
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        raise pickle.UnpicklingError(f"the metadata names {module}.{name}, which a DCP "
                                     f"checkpoint's metadata does not hold")


class CheckedReader(FileSystemReader):
    """DCP's file reader with a restricted metadata unpickler (:data:`_ALLOWED`) and a check
    that the metadata points only at the files of ``allowed`` in the checkpoint's folder."""

    def __init__(self, path: str, allowed: set):
        super().__init__(path)
        self.allowed = set(allowed)
        self.refused: str | None = None  # why the metadata was refused (DCP rewraps it)

    def read_metadata(self, *args, **kwargs) -> Metadata:
        try:
            return self._checked_metadata()
        except (pickle.UnpicklingError, OSError, UserError, EOFError, AttributeError,
                ValueError, TypeError) as err:
            self.refused = self.refused or _reason(err)
            raise

    def _checked_metadata(self) -> Metadata:
        with os.fdopen(open_plain(os.path.join(self.path, METADATA)), "rb") as fh:
            metadata = _MetadataUnpickler(io.BytesIO(fh.read())).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"the metadata is a {type(metadata).__name__}")
        for info in (metadata.storage_data or {}).values():
            relative = getattr(info, "relative_path", None)
            if relative not in self.allowed:
                raise pickle.UnpicklingError(f"the metadata points at {relative!r}, not a "
                                             f"file of the checkpoint")
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


@contextlib.contextmanager
def _quiet():
    """DCP logs a failed metadata read with its traceback on the root logger; the caller says
    why in one line instead."""
    level = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(level)


def load_sharded(ckpt_dir: str, manifest: dict, state: dict, step: int) -> None:
    """Collective: fill ``state`` (laid out as this job holds it, e.g. ``get_state_dict``'s)
    in place from the checkpoint of ``manifest`` (verified first: :func:`verify_sharded`),
    resharding from its rank count to this job's. A checkpoint that does not fit (another
    model, crafted metadata) is one UserError line on every rank."""
    folder = os.path.join(sharded_root(ckpt_dir), manifest["folder"])
    reader = CheckedReader(folder, set(manifest["files"]))
    try:
        with _quiet():
            dcp.load(state, storage_reader=reader)
    except (CheckpointException, pickle.UnpicklingError, OSError, ValueError, RuntimeError,
            KeyError, TypeError) as err:
        why = f"its metadata: {reader.refused}" if reader.refused else _reason(err)
        raise UserError(f"the sharded checkpoint of step {step} ({folder}, written by "
                        f"{manifest['ranks']} ranks) does not fit this job: {why}; "
                        f"resume with the model and trained parameters that wrote it") from None



def read_full(ckpt_dir: str, manifest: dict) -> dict:
    """One process, no process group: the sharded checkpoint of ``manifest`` with every tensor
    whole ({"model": {name: tensor}, "optimizer": {...}}), for inspection and tests; read
    through :class:`CheckedReader` like a resume (as DCP's own ``dcp_to_torch_save`` reads)."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict = {}
    folder = os.path.join(sharded_root(ckpt_dir), manifest["folder"])
    _load_state_dict(state, storage_reader=CheckedReader(folder, set(manifest["files"])),
                     planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    return state

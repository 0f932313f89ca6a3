"""One HDF5 file per run, written by rank 0 alone and flushed after every step.

Schema (documented in the README):

* root attributes: ``method``, ``config`` (effective config, YAML text), ``package_version``,
  ``git_commit``, ``world_size``, ``hosts`` (JSON list, one per rank), ``device_model``,
  ``torch_version``, ``cpu_kernels`` (torch's CPU kernel set), ``cuda_version``, ``mpi_version``, ``start_time`` (ISO 8601, UTC),
  ``status`` (``running``, ``complete``, ``preempted``, ``failed``, ``lost``: a rank was lost) and method-specific ones.
* step-indexed groups: each group holds ``step`` (int64, (n,)) and any number of datasets whose
  first axis is the row. Standard groups:
  ``metrics/<name>`` float64 (n,); ``timings/<phase>`` float64 (n, world_size) seconds, one
  column per rank (a run resumed on another rank count: as many columns as its largest
  segment, NaN for ranks a step did not have); ``segments/world_size`` int64, one row per
  start or resume at the step it started from; ``bytes/<tag>`` int64 (n,) payload bytes per
  rank in that step;
  ``eval/*`` at evaluation steps; methods add their own (``essa/fitness`` (n, P) ...).
  A key missing from a row is NaN (floats) or 0 (integers).
* where the model came from: ``model_folder`` (absolute; a built-in model's name),
  ``model_revision`` (the commit of a Hub id's cached snapshot, '' for a folder), and with an
  adapter ``adapter_folder``, ``adapter_revision`` (:mod:`hpc.job.inputs`); ``model_build``: a
  built-in model's build, ``"<version> sha256:<weights>"`` ('' for the user's model).

Rank 0's store also hands the scalars of every row to the ``run.report_to`` reporters
(TensorBoard, W&B: :mod:`hpc.runtime.report_to`), at the row's step.

The file uses the default (oldest compatible) HDF5 format and is flushed after every row, so a
job killed with SIGKILL leaves a file that h5py and ``h5dump`` read, holding every flushed step.
Readers open files with locking disabled, so they work on files of jobs still running.

A failed write (disk full, quota) is different: HDF5 may have written part of a metadata flush,
and then the file can no longer be opened (how often: README, "Faults"). So the job loop puts
the file's bytes (:meth:`RunStore.snapshot`) in every checkpoint, and a resumed run starts
from that copy (``backup``), which also brings back a missing or damaged file. At a failed
write the store ends with one line (a :class:`UserError`) and sends every later write of the
library to ``/dev/null``, so nothing half-written is added at exit.
"""
from __future__ import annotations

import contextlib
import datetime
import errno
import io
import json
import os
import re
import subprocess
import sys

import h5py
import numpy as np

from hpc import __version__
from hpc.runtime.atomic import refuse_link, write_bytes
from hpc.runtime.errors import UserError
from hpc.runtime.readback import MAX_STEP
from hpc.runtime.report_to import scalars
from hpc.runtime.world import mpi_library

_CHUNK_ROWS = 64
ROWS_ATTR = "rows"  # a step-indexed group's committed rows: readers read no further
MAX_ROW_VALUES = 2 ** 28  # values in one row (ESSA's final mean over a 32B model's LoRA: ~1e8)
SPARSE_CHECKED_BYTES = 2 ** 26  # a dataset larger than this must have its rows stored


def _git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), timeout=5)
        return out.stdout.strip() if out.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def environment_attrs(world, device) -> dict:
    """Versions, hosts and device model of this job (collective: call on every rank)."""
    import torch  # here, not at the top: the offline report reads run files without torch

    hosts = world.comm.allgather(world.hostname)  # once per run, not a hot path
    if device.type == "cuda":
        device_model = torch.cuda.get_device_name(device)
    else:
        device_model = "cpu"
    return {
        "package_version": __version__,
        "git_commit": _git_commit(),
        "world_size": world.size,
        "hosts": json.dumps(hosts),
        "device_model": device_model,
        "torch_version": str(torch.__version__),
        "cpu_kernels": torch.backends.cpu.get_cpu_capability(),  # AVX512, AVX2, DEFAULT...
        "cuda_version": torch.version.cuda or "",
        "mpi_version": mpi_library(),
    }


class RunStore:
    """Writer of one run file. On ranks other than 0 every method is a no-op.

    ``resume``: append to the existing file. With a ``backup`` (the bytes of :meth:`snapshot`
    kept in the checkpoint resumed from) the file is first replaced by it, with a warning on
    stderr if it was missing or damaged. Without one a missing file is started afresh and a
    damaged one is a :class:`UserError`.
    """

    def __init__(self, path: str, active: bool, attrs: dict | None = None, resume: bool = False,
                 backup: bytes | None = None):
        self.path = path
        self.file = None
        # run.report_to (hpc.runtime.report_to): each also gets every row's scalars
        self.reporters: list = []
        self._open: dict = {}  # group -> {name: Dataset}, see _datasets
        self._pending: dict = {}  # group -> rows written but not yet committed (_commit)
        if not active:
            return
        refuse_link(path)
        if resume and backup is not None:
            self._restore(backup)
        elif resume and os.path.exists(path) and not readable(path):
            raise UserError(f"--resume: the run file {path} is damaged and there is no copy of "
                            f"it in a checkpoint; move it away to start a new one",
                            same_on_all_ranks=False)
        with self._writing():
            if not (resume and os.path.exists(path)):
                self._create()
            self.file = h5py.File(path, "a")
            self._check_own_file()
            self.file.attrs["status"] = "running"
            for key, value in (attrs or {}).items():
                self.file.attrs[key] = value
            self.file.flush()

    def _create(self) -> None:
        """A new file with its start time, built in memory, written beside ``path`` and renamed
        into place (:func:`write_bytes`: no name in the run folder is followed as a link)."""
        buffer = io.BytesIO()
        with h5py.File(buffer, "w") as fresh:
            fresh.attrs["start_time"] = datetime.datetime.now(
                datetime.timezone.utc).isoformat(timespec="seconds")
        write_bytes(self.path, buffer.getvalue())

    def _check_own_file(self) -> None:
        """The file just opened must be the plain file at ``path`` (not reached through a link
        planted after :func:`refuse_link`, not a hard link to another name) and hold only plain
        datasets (:func:`check_plain`); else it is closed and a UserError raised."""
        opened = os.fstat(self.file.id.get_vfd_handle())
        there = os.lstat(self.path)
        try:
            if (opened.st_dev, opened.st_ino) != (there.st_dev, there.st_ino) or \
                    opened.st_nlink != 1:
                raise UserError(f"the run file {self.path} is a link to another file; a job "
                                f"writes only plain files of its run folder: remove it",
                                same_on_all_ranks=False)
            check_plain(self.file, self.path)
        except UserError:
            self.file.close()
            self.file = None
            raise

    def _restore(self, backup: bytes) -> None:
        """Put the checkpoint's copy in place (atomically). Rows after the checkpoint would be
        truncated anyway, so the copy is used even when the file reads; a warning only says
        when it was missing or damaged (then a failed write left it so)."""
        damage = ("missing" if not os.path.exists(self.path) else
                  None if readable(self.path) else "damaged")
        with self._writing():
            write_bytes(self.path, backup)
        if damage:
            print(f"warning: the run file {self.path} was {damage}; restored from the "
                  f"checkpoint", file=sys.stderr, flush=True)

    @contextlib.contextmanager
    def _writing(self):
        """Turn a failed write of the file (an errno in h5py's message, or an OSError) into a
        UserError, after detaching the file (:meth:`_abandon`); other errors pass unchanged."""
        try:
            yield
        except (OSError, RuntimeError) as err:
            code = getattr(err, "errno", None) or _errno_in(str(err))
            if not code:
                raise
            self._abandon()
            hint = ("free space, then rerun with --resume (a damaged run file is restored from "
                    "the checkpoint)" if code in (errno.ENOSPC, errno.EDQUOT) else
                    "this file system refuses HDF5's file locks: export "
                    "HDF5_USE_FILE_LOCKING=FALSE for the job (hpc-doctor checks it)"
                    if code == errno.ENOLCK else
                    "rerun with --resume once the output folder is writable")
            raise UserError(f"cannot write the run file {self.path}: {os.strerror(code)}; "
                            f"{hint}", same_on_all_ranks=False) from None

    def _abandon(self) -> None:
        """Point the file's descriptor at /dev/null and close it: whatever HDF5 still wants to
        flush goes nowhere, and the file on disk stays as the failed write left it."""
        file, self.file = self.file, None
        self._open.clear()
        if file is None:
            return
        try:
            null = os.open(os.devnull, os.O_RDWR)
            os.dup2(null, file.id.get_vfd_handle())
            os.close(null)
            file.close()
        except (OSError, RuntimeError, ValueError):  # HDF5 is in an error state: nothing to save
            pass

    def snapshot(self) -> bytes | None:
        """The file's bytes now (it is flushed after every row), for a checkpoint; None on
        ranks other than 0."""
        if self.file is None:
            return None
        with self._writing():
            self.file.flush()
        handle = self.file.id.get_vfd_handle()  # the file opened, whatever is at path now
        data, size = bytearray(), os.fstat(handle).st_size
        while len(data) < size:
            chunk = os.pread(handle, size - len(data), len(data))
            if not chunk:
                break
            data += chunk
        return bytes(data)

    def set_attrs(self, **attrs) -> None:
        if self.file is None:
            return
        with self._writing():
            for key, value in attrs.items():
                self.file.attrs[key] = value
            self.file.flush()

    def write_row(self, group: str, step: int, flush: bool = True, **values) -> None:
        """Append one row at ``step`` to every dataset of ``group`` (missing keys padded)."""
        if self.file is None:
            return
        with self._writing():
            self._append(group, step, flush, values)
        if self.reporters:  # the row as stored: a missing key's fill value too
            padded = {name: ds.fillvalue for name, ds in self._open[group].items()
                      if name != "step" and name not in values}
            self._report(group, step, {**values, **padded})

    def _report(self, group: str, step: int, values: dict) -> None:
        row = scalars(values)
        for reporter in self.reporters if row else ():
            reporter.add(group, step, row)

    def replay(self) -> None:
        """Send every committed row's scalars to the reporters, in step order: a resumed run's
        reporters start over from what the run file holds (:mod:`hpc.runtime.report_to`)."""
        if self.file is None or not self.reporters:
            return
        rows = []

        def visit(name, obj):
            if isinstance(obj, h5py.Group) and "step" in obj:
                n = committed_rows(obj)
                columns = {key: obj[key][:n] for key in obj if key != "step"
                           and isinstance(obj[key], h5py.Dataset) and obj[key].ndim == 1}
                rows.extend((int(step), name, {key: column[i] for key, column in
                                               columns.items()})
                            for i, step in enumerate(obj["step"][:n]))

        self.file.visititems(visit)
        for step, group, values in sorted(rows, key=lambda row: row[0]):
            self._report(group, step, values)

    def _append(self, group: str, step: int, flush: bool, values: dict) -> None:
        datasets = self._datasets(group)
        n = datasets["step"].shape[0] if "step" in datasets else 0
        for name, value in [("step", np.int64(step))] + list(values.items()):
            arr = np.asarray(value)
            if name not in datasets:
                dtype = np.int64 if arr.dtype.kind in "iub" else np.float64
                rows = _CHUNK_ROWS if arr.nbytes * _CHUNK_ROWS <= 2 ** 20 else 1
                datasets[name] = self.file[group].create_dataset(
                    name, shape=(n,) + arr.shape, maxshape=(None,) + arr.shape, dtype=dtype,
                    chunks=(rows,) + arr.shape, fillvalue=0 if dtype == np.int64 else np.nan)
            ds = datasets[name]
            if arr.shape != ds.shape[1:]:
                ds, arr = self._fit_row(group, name, ds, arr)
                datasets[name] = ds
            ds.resize(n + 1, axis=0)
            ds[n] = arr
        for name, ds in datasets.items():
            if name not in values and name != "step":
                ds.resize(n + 1, axis=0)  # missing key: the fill value (NaN or 0)
        self._pending[group] = n + 1
        if flush:
            self._commit()

    def _commit(self) -> None:
        """Make the rows written since the last commit visible to readers: flush them, then
        raise each group's ``rows`` attribute (the committed length, which :class:`RunFile`
        honours) and flush again, so a reader never sees a row whose datasets are half
        written, whichever of the two flushes it reads in the middle of."""
        self.file.flush()
        for group, rows in self._pending.items():
            self.file[group].attrs[ROWS_ATTR] = np.int64(rows)
        self._pending.clear()
        self.file.flush()

    def _fit_row(self, group: str, name: str, ds, arr: np.ndarray) -> tuple:
        """(dataset, row) for a row whose shape differs from the dataset's rows (per-rank
        ``timings`` after a resume on another rank count): the dataset is widened where the row
        is wider (rebuilt extendible in every axis when it was created fixed), the row padded
        with the fill value (NaN) where it is narrower."""
        if arr.ndim != ds.ndim - 1:
            raise ValueError(f"{group}/{name}: a row of shape {arr.shape} for rows of shape "
                             f"{ds.shape[1:]}")
        shape = tuple(max(a, b) for a, b in zip(ds.shape[1:], arr.shape))
        if shape != ds.shape[1:]:
            if all(m is None or m >= s for m, s in zip(ds.maxshape[1:], shape)):
                ds.resize(ds.shape[:1] + shape)
            else:
                data, fill, rows = ds[()], ds.fillvalue, ds.chunks[0]
                del self.file[group][name]
                ds = self.file[group].create_dataset(
                    name, shape=ds.shape[:1] + shape, maxshape=(None,) * (len(shape) + 1),
                    dtype=data.dtype, chunks=(rows,) + shape, fillvalue=fill)
                ds[(slice(None),) + tuple(slice(0, s) for s in data.shape[1:])] = data
        padded = np.full(shape, ds.fillvalue, dtype=ds.dtype)
        padded[tuple(slice(0, s) for s in arr.shape)] = arr
        return ds, padded

    def _datasets(self, group: str) -> dict:
        """{name: open h5py Dataset} of ``group`` (created if new), kept open: looking them up
        by name on every row cost more than writing the row."""
        if group not in self._open:
            grp = self.file.require_group(group)
            self._open[group] = {name: grp[name] for name in grp
                                 if isinstance(grp[name], h5py.Dataset)}
        return self._open[group]

    def log_step(self, step: int, metrics: dict | None = None, timings: dict | None = None,
                 nbytes: dict | None = None) -> None:
        """One training step: scalar metrics, per-rank phase seconds, payload bytes by tag."""
        if metrics:
            self.write_row("metrics", step, flush=False, **metrics)
        if timings:
            self.write_row("timings", step, flush=False, **timings)
        if nbytes is not None:
            self.write_row("bytes", step, flush=False, **nbytes)
        if self.file is not None:
            with self._writing():
                self._commit()
        for reporter in self.reporters:
            reporter.flush()

    def truncate_after(self, step: int | None) -> None:
        """Drop the rows from the first whose step is > ``step`` on (used when resuming from a
        checkpoint; rows are in step order); ``None`` drops every row (a run restarting from
        step 0 redoes its start evaluation too)."""
        if self.file is None:
            return

        def visit(_, obj):
            if isinstance(obj, h5py.Group) and "step" in obj:
                later = obj["step"][:] > step if step is not None else \
                    np.ones(obj["step"].shape, dtype=bool)
                keep = int(np.argmax(later)) if later.any() else len(later)
                for name in obj:
                    if isinstance(obj[name], h5py.Dataset):
                        obj[name].resize(keep, axis=0)
                obj.attrs[ROWS_ATTR] = np.int64(keep)

        with self._writing():
            self.file.visititems(visit)
            self.file.flush()

    def mark_lost(self, hosts: list, lost: list, message: str) -> None:
        """The job is aborting because ranks ``lost`` (of ``hosts``, the host of each rank) are
        gone: close the file with status ``lost`` and name them (attributes ``lost_ranks``,
        ``lost_hosts``, ``lost_reason``). The run resumes from its last checkpoint."""
        if self.file is None:
            return
        self.set_attrs(lost_ranks=np.array(lost, dtype=np.int64),
                       lost_hosts=sorted({hosts[r] for r in lost if r < len(hosts)}),
                       lost_reason=message)
        self.close("lost")

    def close(self, status: str = "complete") -> None:
        if self.file is None:
            return
        with self._writing():
            self.file.attrs["status"] = status
            self.file.attrs["end_time"] = datetime.datetime.now(
                datetime.timezone.utc).isoformat(timespec="seconds")
            self._commit()  # a failure here still finds the file open to detach
            self._open.clear()
            self.file.close()
        self.file = None
        for reporter in self.reporters:
            reporter.close(status)
        self.reporters = []


_MAX_DEPTH = 8  # groups within groups: the store writes 2 ("eval/..."); a link cycle never ends


def check_plain(file: h5py.File, source: str) -> None:
    """UserError (one line naming ``source`` and the object) unless every object of ``file`` is
    a group or a plain dataset stored in the file itself, reached by a hard link: no external
    or soft link, no virtual dataset, no external storage, so appending to the file cannot
    write into another file. Each step-indexed group's ``step`` is a 1-D integer dataset in
    [-1, MAX_STEP], and every dataset of the group is numeric and extendible along its first
    axis (a row is appended at ``len(step)`` whatever its length)."""
    def refuse(name: str, what: str) -> UserError:
        return UserError(f"the run file {source} holds {what} at /{name}; the job appends only "
                         f"to plain datasets of its own file: move the file away (a checkpoint "
                         f"keeps a copy of it)", same_on_all_ranks=False)

    def walk(group: h5py.Group, prefix: str, depth: int) -> None:
        if depth > _MAX_DEPTH:
            raise refuse(prefix, f"groups nested more than {_MAX_DEPTH} deep")
        for name in group:
            path = prefix + name
            link = group.get(name, getlink=True)
            if isinstance(link, h5py.ExternalLink):
                raise refuse(path, f"an external link to {link.filename}:{link.path}")
            if not isinstance(link, h5py.HardLink):
                raise refuse(path, f"a {type(link).__name__}")
            obj = group[name]
            if isinstance(obj, h5py.Group):
                walk(obj, path + "/", depth + 1)
            elif not isinstance(obj, h5py.Dataset):
                raise refuse(path, f"a {type(obj).__name__}")
            elif "step" not in group:
                raise refuse(path, "a dataset outside a step-indexed group")
            elif obj.is_virtual or obj.external:
                raise refuse(path, "a virtual dataset" if obj.is_virtual else
                             "a dataset stored in another file")
        if "step" in group:
            _check_step_group(group, prefix, refuse)

    walk(file, "", 0)


def check_snapshot(data, source: str) -> None:
    """:func:`check_plain` for the bytes of a run file kept in a checkpoint (``source``)."""
    if not isinstance(data, bytes):
        raise UserError(f"{source}: field 'run_file' is a {type(data).__name__}, not the bytes "
                        f"of a run file")
    try:
        with h5py.File(io.BytesIO(data), "r") as copy:
            check_plain(copy, f"copy in {source}")
    except (OSError, RuntimeError, ValueError, KeyError) as err:
        raise UserError(f"{source}: field 'run_file' is not a readable HDF5 file ({err})") \
            from None


def _check_step_group(group: h5py.Group, prefix: str, refuse) -> None:
    step = group["step"]
    if not isinstance(step, h5py.Dataset) or step.ndim != 1 or step.dtype.kind not in "iu":
        raise refuse(prefix + "step", "a step dataset that is not 1-D integer (shape "
                     f"{getattr(step, 'shape', None)}, {getattr(step, 'dtype', 'group')})")
    # Every row writes its step, so a step column larger than the bytes stored for it is a
    # crafted sparse one (reading it would allocate its whole logical size).
    chunk = int(np.prod(step.chunks or (1,))) * step.dtype.itemsize
    if step.shape[0] * step.dtype.itemsize > step.id.get_storage_size() + chunk:
        raise refuse(prefix + "step", f"a step dataset of {step.shape[0]} rows with "
                     f"{step.id.get_storage_size()} bytes stored (rows never written)")
    try:
        steps = step[()]
    except OSError as err:  # e.g. a Fletcher-32 checksum that fails
        raise refuse(prefix + "step", f"a dataset that does not read ({err})") from None
    if steps.size and not (-1 <= steps.min() and steps.max() <= MAX_STEP):
        raise refuse(prefix + "step", f"steps outside [-1, {MAX_STEP}]")
    for name in group:
        ds = group[name]
        if isinstance(ds, h5py.Dataset) and (
                ds.ndim < 1 or ds.dtype.kind not in "iuf" or ds.chunks is None or
                ds.maxshape[0] is not None):
            raise refuse(prefix + name, f"a dataset of shape {ds.shape} and type {ds.dtype} "
                         f"that is not an extendible numeric column")
        if isinstance(ds, h5py.Dataset) and (ds.shape[0] > step.shape[0] or
                                             int(np.prod(ds.shape[1:])) > MAX_ROW_VALUES):
            raise refuse(prefix + name, f"a dataset of shape {ds.shape}: more rows than its "
                         f"step column ({step.shape[0]}) or more than {MAX_ROW_VALUES} values "
                         f"a row")
        if isinstance(ds, h5py.Dataset) and name != "step":
            logical = ds.size * ds.dtype.itemsize
            chunk = int(np.prod(ds.chunks or (1,))) * ds.dtype.itemsize
            if logical > max(SPARSE_CHECKED_BYTES, ds.id.get_storage_size() + chunk):
                raise refuse(prefix + name, f"a dataset of {logical} bytes with "
                             f"{ds.id.get_storage_size()} stored (rows never written)")
        if isinstance(ds, h5py.Dataset) and ds.fletcher32:
            try:
                ds[()]
            except OSError as err:
                raise refuse(prefix + name, f"a dataset that does not read ({err})") from None


def committed_rows(group: h5py.Group) -> int:
    """The rows of a step-indexed group a reader may use: the committed length (``rows``,
    raised after each row's datasets are written and flushed), never more than any of its
    datasets holds; a file without the attribute (an earlier version): its shortest dataset."""
    lengths = [group[k].shape[0] for k in group
               if isinstance(group[k], h5py.Dataset) and group[k].ndim >= 1]
    rows = min(lengths) if lengths else 0
    if ROWS_ATTR in group.attrs:
        rows = min(rows, max(0, int(group.attrs[ROWS_ATTR])))
    return rows


def _errno_in(message: str) -> int | None:
    """The errno of a failed file write in an HDF5 error message ("errno = 28, ...")."""
    found = re.search(r"errno = (\d+)", message)
    return int(found.group(1)) if found else None


def readable(path: str) -> bool:
    """True if ``path`` opens and every dataset in it reads."""
    try:
        RunFile(path)
    except (OSError, RuntimeError, KeyError, ValueError):
        return False
    return True


class RunFile:
    """Read a run file (complete, or still being written) into numpy arrays and frames."""

    def __init__(self, path: str):
        self.path = path
        with h5py.File(path, "r", locking=False) as f:
            self.attrs = {k: (v.decode() if isinstance(v, bytes) else v)
                          for k, v in f.attrs.items()}
            self.groups = {}

            def visit(name, obj):
                if isinstance(obj, h5py.Group) and "step" in obj:
                    columns = {k: obj[k] for k in obj if isinstance(obj[k], h5py.Dataset)}
                    rows = committed_rows(obj)
                    self.groups[name] = {k: ds[:rows] for k, ds in columns.items()}

            f.visititems(visit)

    def group(self, name: str) -> dict:
        """Arrays of one step-indexed group (empty dict if the run has not written it yet)."""
        return self.groups.get(name, {})

    def frame(self, group: str = "metrics"):
        """A pandas DataFrame of the 1-D series of ``group`` (one row per step)."""
        import pandas as pd  # here: slow to import, and only these two readers use it

        data = {k: v for k, v in self.group(group).items() if v.ndim == 1}
        return pd.DataFrame(data)

    def timings_frame(self):
        """Long-format pandas DataFrame: step, rank, phase, seconds."""
        import pandas as pd  # here: see frame()

        g = self.group("timings")
        rows = []
        for phase, arr in g.items():
            if phase == "step":
                continue
            for i, step in enumerate(g["step"]):
                for rank, sec in enumerate(np.atleast_1d(arr[i])):
                    rows.append((int(step), rank, phase, float(sec)))
        return pd.DataFrame(rows, columns=["step", "rank", "phase", "seconds"])

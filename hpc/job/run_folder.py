"""A job's run folder, torch-free: ``run.out`` filled in, the checks on what the folder holds,
its lock, and the newest unfinished run that ``--resume`` takes when ``run.out`` names a new
folder per job.

:func:`check_run_folder` runs them before the imports (:func:`hpc.job.inputs.check_inputs`, on
every rank alike, in about a second); :func:`hpc.job.lifecycle.start_job` runs them again once
the ranks agree, then creates the folder and takes its lock on rank 0.
"""
from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import shutil
import socket
import string
import sys
import tempfile

from hpc.runtime.atomic import open_plain
from hpc.runtime.errors import UserError, shown
from hpc.runtime.readback import run_folder_entries


def run_folder(template: str, method: str, job_id: str) -> str:
    """``run.out`` with ``{method}`` and ``{jobid}`` filled in; only those two plain fields."""
    try:
        fields = list(string.Formatter().parse(template))
    except ValueError as err:
        fields, bad = [], err
    else:
        bad = next((f"{{{name}{':' + spec if spec else ''}{'!' + conv if conv else ''}}}"
                    for _, name, spec, conv in fields
                    if name is not None and (name not in ("method", "jobid") or spec or conv)),
                   None)
    if bad is not None:
        raise UserError(f"config key 'run.out': {shown(template)} may only use the fields "
                        f"{{method}} and {{jobid}}, without format specs ("
                        f"{shown(bad) if isinstance(bad, str) else bad})")
    return template.format(method=method, jobid=job_id)


def check_writable(out_dir: str, min_free_mb: float) -> None:
    """Create ``out_dir`` if absent; UserError (one line) unless a file can be written there and
    its disk has ``min_free_mb`` MiB free."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=out_dir)  # follows no link
        with os.fdopen(fd, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as err:
        raise UserError(f"output folder {out_dir} is not writable: {err.strerror or err}")
    free_mb = shutil.disk_usage(out_dir).free / 2 ** 20
    if free_mb < min_free_mb:
        raise UserError(f"the disk of {out_dir} has {free_mb:.0f} MiB free, less than "
                        f"run.min_free_mb={min_free_mb:.0f}: free space or write elsewhere")


LOCK_FILE = ".lock"
_HELD = (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)  # flock's errors for a lock held elsewhere
_held_lock = None  # the open lock file of this process's run folder, held until exit


def lock_run_folder(out_dir: str, job_id: str) -> None:
    """Make ``out_dir`` this job's alone until the process ends (rank 0 only).

    An exclusive ``flock`` on ``<out_dir>/.lock``, which then records host, pid and job id for
    the message another job gets. The kernel releases the lock when the process ends however it
    ends (exit, SIGKILL, MPI_Abort), so a dead holder never blocks a new job; the file stays.
    On a file system without flock (e.g. Lustre mounted without ``-o flock``) the run goes on
    unlocked, with a warning. A symbolic or hard link at ``.lock`` is refused (one line).
    """
    global _held_lock
    path = os.path.join(out_dir, LOCK_FILE)
    fh = os.fdopen(open_plain(path, os.O_RDWR | os.O_CREAT), "r+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno not in _HELD:
            print(f"warning: cannot lock {path} ({err.strerror}): nothing stops a second job "
                  f"from writing to this run folder", file=sys.stderr, flush=True)
            fh.close()
            return
        fh.seek(0)
        holder = fh.read().strip() or "unknown"
        fh.close()
        raise _in_use(out_dir, holder) from None
    fh.seek(0)
    fh.truncate()
    fh.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "job": job_id}))
    fh.flush()
    _held_lock = fh


def _unfinished(folder: str, method: str) -> float | None:
    """The time a run of ``method`` in ``folder`` last wrote, if it is unfinished (its run file
    not ``complete``, or only checkpoints) and no job holds the folder; None otherwise."""
    run_file, ckpts = os.path.join(folder, f"{method}.h5"), os.path.join(folder, "checkpoints")
    if os.path.isfile(run_file):
        import h5py

        try:
            with h5py.File(run_file, "r", locking=False) as f:
                status = f.attrs.get("status", b"")
        except (OSError, RuntimeError, KeyError, ValueError):
            status = b""  # damaged: --resume restores it from the checkpoint
        if (status.decode() if isinstance(status, bytes) else str(status)) == "complete":
            return None
        written = os.path.getmtime(run_file)
    elif os.path.isdir(ckpts):
        written = os.path.getmtime(ckpts)
    else:
        return None
    return None if _lock_holder(folder) is not None else written  # else a job runs there


def newest_unfinished(template: str, method: str) -> str:
    """``--resume`` where run.out names a new folder per job (``{jobid}`` outside Slurm): the
    folder of the newest unfinished run of ``method`` among those ``template`` names; one line
    if there is none."""
    pattern = template.replace("{jobid}", "*").format(method=method)
    found = [(when, folder) for folder in glob.glob(pattern)
             if (when := _unfinished(folder, method)) is not None]
    if not found:
        raise UserError(f"--resume: no unfinished {method} run in {pattern} (every one is "
                        f"complete, in use or absent); give run.out=<its folder>")
    return max(found)[1]


def check_resumable(out_dir: str, method: str) -> None:
    """``--resume`` needs a run of ``method`` in ``out_dir`` (a run file or checkpoints)."""
    if not os.path.isdir(out_dir):
        raise UserError(f"--resume: there is no run folder {out_dir}; check run.out (without "
                        f"--resume a fresh run starts there)")
    if not (os.path.exists(os.path.join(out_dir, f"{method}.h5")) or
            os.path.isdir(os.path.join(out_dir, "checkpoints"))):
        raise UserError(f"--resume: run folder {out_dir} holds no {method} run ({method}.h5 "
                        f"or checkpoints/); check run.out")


def check_run_folder(template: str, method: str, resume: bool) -> None:
    """UserError (one line) for a run folder a job of ``method`` could not use, found before
    any rank imports torch: ``run.out``'s fields; where ``run.out`` names one folder (no
    ``{jobid}``, or Slurm's job id fills it), what that folder holds (:func:`run_folder_entries`),
    with ``--resume`` a run there to resume, and a job already running in it. Where
    ``{jobid}`` is the start's time (outside Slurm), a fresh run gets a new folder and
    ``--resume`` needs an unfinished run among those ``run.out`` names. Nothing is created or
    locked here: :func:`hpc.job.lifecycle.start_job` checks again and takes the folder."""
    job_id = os.environ.get("SLURM_JOB_ID", "")
    if "{jobid}" in template and not job_id:
        run_folder(template, method, "")  # its fields
        if resume:
            newest_unfinished(template, method)
        return
    out_dir = run_folder(template, method, job_id)
    run_folder_entries(out_dir, method)
    if resume:
        check_resumable(out_dir, method)
    in_use = _lock_holder(out_dir)
    if in_use is not None:
        raise _in_use(out_dir, in_use)


def _lock_holder(out_dir: str) -> str | None:
    """What the lock file of ``out_dir`` says of the job that holds it ("unknown" if empty), or
    None if no job holds it. A shared lock, taken and dropped at once: the ranks of one job
    probe together without stopping each other."""
    path = os.path.join(out_dir, LOCK_FILE)
    if not os.path.isfile(path) or os.path.islink(path):
        return None
    with open(path) as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in _HELD:
                return None  # no flock on this file system: start_job warns
            return fh.read().strip() or "unknown"
    return None


def _in_use(out_dir: str, holder: str) -> UserError:
    return UserError(f"run folder {out_dir} is in use by another job ({holder}); give this job "
                     f"another run.out, or wait for that one to end")

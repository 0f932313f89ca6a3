"""The run root, the folder in which the jobs create their run folders (:func:`run_root`):
writable on every rank, the same folder on every node (a token file rank 0 writes is read by
every rank), with room for the run's checkpoints, and fit for HDF5's file locks, which the run
file is written under (they fail on many NFS and Lustre mounts: ``HDF5_USE_FILE_LOCKING=FALSE``
then turns them off).

Every rank writes its own probe files (FSDP2's sharded checkpoints are written by every rank)
and removes them; nothing else is left in the run root.
"""
from __future__ import annotations

import os
import secrets
import shutil
import tempfile

import h5py

from hpc.doctor.findings import Finding

CHECK = "run root"
SHARED_FIX = ("put run.out (RUN_ROOT in the job scripts) on a file system every node mounts at "
              "the same path")
LOCKING_FIX = ("export HDF5_USE_FILE_LOCKING=FALSE for the jobs (this file system does not take "
               "HDF5's file locks; the run file is written by rank 0 alone)")


def run_root(template: str) -> str:
    """The folder ``run.out`` = ``template`` creates run folders in: its part before the first
    component with a field (``runs/{method}-{jobid}``: ``runs``), else its parent folder."""
    root = template
    while "{" in root:
        root = os.path.dirname(root)
    if root == template:
        root = os.path.dirname(template.rstrip(os.sep)) if template != os.sep else template
    return root or "."


def _reason(err: OSError) -> str:
    return err.strerror or str(err).splitlines()[0]


def check_writable(root: str) -> list:
    """Create ``root`` as a job would and write a file in it."""
    try:
        os.makedirs(root, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".hpc-doctor-write.", dir=root)
        with os.fdopen(fd, "w") as fh:
            fh.write("ok")
        os.remove(probe)
    except OSError as err:
        return [Finding(CHECK, f"{os.path.abspath(root)} is not writable ({_reason(err)})",
                        "set run.out (RUN_ROOT in the job scripts) to a folder every rank can "
                        "write")]
    return []


def write_token(root: str) -> dict:
    """Rank 0: a token file in ``root``; {'name', 'token'} ('' when it cannot be written)."""
    token = secrets.token_hex(16)
    name = f".hpc-doctor-token.{token[:12]}"
    try:
        with open(os.path.join(root, name), "x") as fh:
            fh.write(token)
    except OSError:
        return {"name": "", "token": ""}
    return {"name": name, "token": token}


def check_same_folder(root: str, written: dict) -> list:
    """Whether this rank reads the token file rank 0 wrote (``written``: :func:`write_token`)."""
    if not written["name"]:
        return []  # rank 0 could not write: check_writable says so
    try:
        with open(os.path.join(root, written["name"])) as fh:
            if fh.read() == written["token"]:
                return []
    except OSError:
        pass
    return [Finding(CHECK, f"{os.path.abspath(root)} is not the folder rank 0 wrote to (its "
                           f"token file {written['name']} is not there)", SHARED_FIX)]


def remove_token(root: str, written: dict) -> None:
    """Rank 0, once every rank has read it."""
    if written["name"]:
        try:
            os.remove(os.path.join(root, written["name"]))
        except OSError:
            pass


def free_bytes(root: str) -> int:
    try:
        return shutil.disk_usage(root).free
    except OSError:
        return -1


def check_free_space(root: str, need: int, why: str) -> list:
    """At least ``need`` bytes free on ``root``'s file system (``why``: how they add up)."""
    free = free_bytes(root)
    if free < 0 or free >= need:
        return []
    return [Finding(CHECK, f"{os.path.abspath(root)} has {free / 2**30:.2f} GiB free, the run "
                           f"needs about {need / 2**30:.2f} GiB ({why})",
                    "free space there, or set run.out on a larger file system")]


def check_hdf5_locking(root: str) -> list:
    """Create, write and reopen an HDF5 file in ``root`` as the run file is (h5py's default
    locking, which ``HDF5_USE_FILE_LOCKING`` sets)."""
    path = os.path.join(root, f".hpc-doctor-lock.{secrets.token_hex(6)}.h5")
    try:
        with h5py.File(path, "w") as f:
            f.create_dataset("probe", data=[1.0])
        with h5py.File(path, "r") as f:
            f["probe"][:]
    except OSError as err:
        message = str(err).splitlines()[0]
        if "lock" in message.lower():
            return [Finding("HDF5 file locking", f"in {os.path.abspath(root)}: {message}",
                            LOCKING_FIX)]
        return [Finding(CHECK, f"HDF5 cannot write in {os.path.abspath(root)}: {message}",
                        "set run.out to a folder on another file system")]
    finally:
        try:
            os.remove(path)
        except OSError:
            pass
    return []


def locking_text() -> str:
    """How the run file is locked here: HDF5's default, or off by HDF5_USE_FILE_LOCKING."""
    setting = os.environ.get("HDF5_USE_FILE_LOCKING", "")
    if setting.upper() in ("FALSE", "0"):
        return f"off (HDF5_USE_FILE_LOCKING={setting})"
    return f"on (HDF5_USE_FILE_LOCKING={setting or 'unset'}): a probe file written and read"

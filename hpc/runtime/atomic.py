"""Write-and-replace: a file or folder is written beside its final path, then renamed into place,
so a reader (or a job killed at any moment) sees the old version or the new one, never half of
one. Every file and folder the package writes for others to read goes through here."""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile


@contextlib.contextmanager
def replaced_file(path: str, fsync: bool = True):
    """Yield a temporary path beside ``path``; when the block ends without error, that file is
    fsynced (``fsync``) and renamed over ``path``. On error it is removed and ``path`` is left
    as it was."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    try:
        yield tmp
        if fsync:
            with open(tmp, "rb") as fh:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_bytes(path: str, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically (fsynced before the rename)."""
    with replaced_file(path) as tmp, open(tmp, "wb") as fh:
        fh.write(data)


@contextlib.contextmanager
def replaced_dir(path: str, keep_existing: bool = False):
    """Yield a temporary folder beside ``path`` (mode 755); when the block ends without error it
    is renamed to ``path``, replacing an older folder there, or, with ``keep_existing``, given
    up if a folder already exists there (another process finished first). On error it is
    removed and ``path`` is left as it was."""
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; others read what lands at path
        yield tmp
        if not os.path.lexists(path):
            os.rename(tmp, path)
        elif not keep_existing:
            trash = tempfile.mkdtemp(prefix=f".{name}.old-", dir=parent)
            os.rename(path, os.path.join(trash, name))
            os.rename(tmp, path)
            shutil.rmtree(trash)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

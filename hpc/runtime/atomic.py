"""Write-and-replace: a file or folder is written beside its final path, then renamed into place,
so a reader (or a job killed at any moment) sees the old version or the new one, never half of
one. Every file and folder the package writes for others to read goes through here, and so does
every file a job opens in its run folder: no name there is trusted not to be a planted symbolic
link (a run folder may be shared and group-writable)."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile

from hpc.runtime.errors import UserError


def refuse_link(path: str, same_on_all_ranks: bool = False) -> None:
    """UserError if ``path`` is a symbolic link: a job reads and writes only plain files of its
    run folder (on a shared, group-writable folder a planted link would make it write wherever
    the link points). ``same_on_all_ranks``: every rank checks it (see UserError)."""
    if os.path.islink(path):
        raise UserError(f"{path} is a symbolic link (to {os.readlink(path)!r}); a job reads and "
                        f"writes only plain files of its run folder: remove the link",
                        same_on_all_ranks=same_on_all_ranks)


def open_plain(path: str, flags: int = os.O_RDONLY):
    """``os.open(path, flags)`` that refuses to follow a symbolic link at ``path`` (UserError,
    as :func:`refuse_link`); with ``O_CREAT`` it refuses a regular file that is a hard link to
    another name too, and anything but a regular file (a FIFO there does not block: opened
    with ``O_NONBLOCK``, which regular files ignore). Returns the descriptor."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
    except OSError as err:
        if err.errno == errno.ELOOP:
            refuse_link(path)
        if err.errno == errno.EISDIR:
            raise UserError(f"{path} is a folder, not a plain file; a job writes only plain "
                            f"files of its run folder: remove it", same_on_all_ranks=False
                            ) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or (flags & os.O_CREAT and info.st_nlink > 1):
        os.close(fd)
        raise UserError(f"{path} is not a plain file of its own (a "
                        f"{'hard link' if stat.S_ISREG(info.st_mode) else 'special file'}); "
                        f"a job writes only plain files of its run folder: remove it",
                        same_on_all_ranks=False)
    return fd


@contextlib.contextmanager
def replaced_file(path: str):
    """Yield a new binary file open for writing beside ``path``; when the block ends without
    error it is fsynced and renamed over ``path``. On error it is removed and
    ``path`` is left as it was.

    The temporary file has an unpredictable name and is created with ``O_EXCL`` (``mkstemp``),
    so a symbolic link planted beside ``path`` is never followed; a link at ``path`` itself is
    refused (:func:`refuse_link`) rather than replaced."""
    folder, name = os.path.split(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    refuse_link(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=folder)
    try:
        os.fchmod(fd, 0o644)  # mkstemp makes it private; others read what lands at path
        with os.fdopen(fd, "wb") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        refuse_link(path)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)


def write_bytes(path: str, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically (fsynced before the rename)."""
    with replaced_file(path) as fh:
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

"""File helpers shared by the results tables and the tuned-config store."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Optional

from .errors import MegaMoEError


def atomic_write(path: Path, write: Callable[[str], None], *, prefix: Optional[str] = None) -> None:
    """Replace ``path`` with what ``write(tmp)`` puts into a temporary file beside it (named
    ``prefix...``, by default ``.<name>.``...``.tmp``), readable by everyone like a plain write.

    The file is fsynced before the rename and the directory after it, so a crash leaves
    either the old file or the new one; on any failure the temporary file is removed and
    the old file is untouched.
    """
    fd, tmp = tempfile.mkstemp(prefix=prefix if prefix is not None else f".{path.name}.", suffix=".tmp",
                               dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def check_writable(path: Path, what: str, *, replaced: bool = False) -> None:
    """Raise ``MegaMoEError`` naming ``path`` unless the ``what`` (e.g. "results file") can be
    written there, before any work whose result would go there starts.

    The filesystem is asked by doing it: an existing file is opened for appending (its bytes are
    left as they were); for a new one, a temporary file is created beside it and removed (the
    name itself stays untouched, so a process about to create it never sees an empty file).  So
    a read-only mount, an immutable file and a missing permission all count, for root too
    (``os.access`` says yes to root on every one of them).  ``replaced``: the file is rewritten
    by renaming a temporary file over it, so the folder must take new files as well.
    """
    path = Path(path)
    if path.is_dir():
        raise MegaMoEError(f"{path}: is a directory; expected a {what}")
    if path.exists() and not path.is_file():
        # Opening a FIFO for writing waits for a reader; a device is no place for a file.
        kind = "a FIFO" if path.is_fifo() else "a socket" if path.is_socket() else "a device" if (
            path.is_char_device() or path.is_block_device()) else "not a regular file"
        raise MegaMoEError(f"{path}: is {kind}; expected a {what} (a regular file)")
    folder = path.parent
    if not folder.exists():
        raise MegaMoEError(f"{path}: folder {folder} does not exist")
    if not folder.is_dir():
        raise MegaMoEError(f"{path}: {folder} is not a folder")

    def refuse(exc: OSError, where: str) -> MegaMoEError:
        reason = (exc.strerror or type(exc).__name__).lower()
        return MegaMoEError(f"{path}: cannot write the {what} here ({where}{reason}); "
                            "choose another path or make it writable")

    exists = path.exists()
    if exists:
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_APPEND))
        except OSError as exc:
            raise refuse(exc, "") from None
    if replaced or not exists:
        try:
            fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=folder)
            os.close(fd)
            os.unlink(probe)
        except OSError as exc:
            raise refuse(exc, f"its folder {folder}: " if exists else "") from None

"""File helpers shared by the results tables and the tuned-config store."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable, Optional


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

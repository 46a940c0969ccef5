"""The run folder: the files the launcher and the ranks of one run exchange, and how they are written.

The launcher (``bench.launcher``) makes the folder, and reads what the ranks (``bench.worker``)
write there while they run; neither imports the other, both import this module::

    plan.json            the launcher: the points and any extra sections (tune, profile)
    launcher.json        the launcher: its pid and start time, the run id and the results file,
                         so a later command can tell a run whose launcher died and save its rows
    rank<R>.pid          each rank: its pid, so the launcher can stop ranks torchrun orphans
    env.json             rank 0: the environment columns of every row
    progress.jsonl       rank 0: one line per point started
    rows.jsonl           rank 0: one line per point finished (its result row)
    fatal.rank<R>.txt    a rank that cannot go on: rank, point, phase, cause
    failures.json        ``bench.torchrun``: torchrun's per-rank failure records
    torchrun.log         the launcher: what torchrun and every rank printed

Appends are one ``write`` of whole lines, fsync'd, so a reader never sees half a line
(``JsonlTail`` reads whole lines only) and a later crash loses nothing already appended.

Every process of a run dies with the one that started it (``die_with_parent``): the launcher
starts torchrun, torchrun starts the ranks, and a parent killed by a signal it cannot catch
(SIGKILL from the OOM killer, ``timeout -s KILL``, a batch scheduler) takes them with it.

Imports: none of ``megamoe_cli.bench``.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, Dict, List, Optional

PLAN_FILE = "plan.json"
LOG_FILE = "torchrun.log"
ROWS_FILE = "rows.jsonl"
PID_FILE = "rank{rank}.pid"
FATAL_FILE = "fatal.rank{rank}.txt"
ENV_FILE = "env.json"
PROGRESS_FILE = "progress.jsonl"
LAUNCHER_FILE = "launcher.json"
# Written by bench.torchrun when ranks fail: their torch.distributed.elastic failure records.
FAILURES_FILE = "failures.json"
# torchrun's log folder (per-rank error files), inside the run folder so it goes with it.
ELASTIC_DIR = "elastic"
# How a rank says it only lost contact with its peers (a consequence of another rank's failure).
LOST_CONTACT = "lost contact with the other ranks"


# The pid of the process a run's process must die with; set by the parent in the child's
# environment, so the child can tell that its parent died before it asked to die with it.
PARENT_PID_ENV = "MEGAMOE_PARENT_PID"
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent ends, however it ends.

    Linux only (``prctl(PR_SET_PDEATHSIG)``); elsewhere nothing changes and False is returned.
    The parent can die between the fork and this call, and then no signal comes: the child is
    already someone else's, which ``getppid`` shows against the pid the parent put in
    ``$MEGAMOE_PARENT_PID``, and the child sends ``sig`` to itself."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    expected = os.environ.get(PARENT_PID_ENV, "")
    if expected.isdigit() and os.getppid() != int(expected):
        os.kill(os.getpid(), sig)
    return True


def die_with_this_process(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` that has the child die with the process starting it, for a child whose own
    code cannot be relied on to ask (``megamoe ab`` runs other trees' ``megamoe profile``): the
    kernel keeps the parent-death signal across ``exec``.  A parent gone before the child asked
    is caught as ``die_with_parent`` catches it."""
    parent = os.getpid()

    def preexec() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:
            os.kill(os.getpid(), sig)

    return preexec


def process_start_time(pid: int) -> Optional[int]:
    """When ``pid`` started (clock ticks since boot, from /proc), to tell a process from a later
    one that reuses its pid; None when it is gone or unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` by a rename, so a reader sees the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def append_line(path: Path, line: str) -> None:
    """One line appended in one write, fsync'd."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def append_json(path: Path, record: Any) -> None:
    append_line(path, json.dumps(record))


class JsonlTail:
    """Reads the complete lines appended to a JSON Lines file since the last call."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0

    def read(self) -> List[Dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        return [json.loads(line) for line in data[:end].splitlines() if line.strip()]

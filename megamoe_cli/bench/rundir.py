"""The run folder: the files the launcher and the ranks of one run exchange, and how they are written.

The launcher (``bench.launcher``) makes the folder, and reads what the ranks (``bench.worker``)
write there while they run; neither imports the other, both import this module::

    plan.json            the launcher: the points and any extra sections (tune, profile)
    rank<R>.pid          each rank: its pid, so the launcher can stop ranks torchrun orphans
    env.json             rank 0: the environment columns of every row
    progress.jsonl       rank 0: one line per point started
    rows.jsonl           rank 0: one line per point finished (its result row)
    fatal.rank<R>.txt    a rank that cannot go on: rank, point, phase, cause
    failures.json        ``bench.torchrun``: torchrun's per-rank failure records
    torchrun.log         the launcher: what torchrun and every rank printed

Appends are one ``write`` of whole lines, fsync'd, so a reader never sees half a line
(``JsonlTail`` reads whole lines only) and a later crash loses nothing already appended.

Imports: none of ``megamoe_cli.bench``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List

PLAN_FILE = "plan.json"
LOG_FILE = "torchrun.log"
ROWS_FILE = "rows.jsonl"
PID_FILE = "rank{rank}.pid"
FATAL_FILE = "fatal.rank{rank}.txt"
ENV_FILE = "env.json"
PROGRESS_FILE = "progress.jsonl"
# Written by bench.torchrun when ranks fail: their torch.distributed.elastic failure records.
FAILURES_FILE = "failures.json"
# torchrun's log folder (per-rank error files), inside the run folder so it goes with it.
ELASTIC_DIR = "elastic"
# How a rank says it only lost contact with its peers (a consequence of another rank's failure).
LOST_CONTACT = "lost contact with the other ranks"


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

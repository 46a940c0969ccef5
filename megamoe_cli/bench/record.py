"""``megamoe record`` as a library: the published record, a sweep measured by the bench launcher
and kept as a results folder with what it was measured on.

The folder holds, named after the sweep (``record`` for ``sweeps/record.yaml``):

    <name>.csv    every point's row (``bench.results``), appended as each point finishes
    <name>.json   the metadata (``metadata``): the sweep (its file, name, description and the
                  SHA-256 of its text), the command line, run id, start and end time, ranks and
                  device, the outcome (status, points measured and failed, the message), the
                  environment the ranks reported (GPU, count, driver, torch, CUDA, Python,
                  commit, dirty tree, host) and the files of the record
    <name>.md     the summary table (``compare.summary``), headed by the sweep, date, GPU and
                  commit (written by the command, as ``report --markdown`` writes it)
    <name>.png    latency against tokens per rank (the command, with matplotlib)

A record is written once: a folder that already holds one of these files is refused before any
rank starts.  The metadata is written when the run ends, however it ends (a failed or stopped
run says so in it), atomically.

Imports: ``envinfo``, ``launcher``, ``results``, ``rundir``, ``sweep`` (module level).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from ..errors import MegaMoEError
from ..files import check_writable
from .envinfo import ENV_COLUMNS, utc_now
from .launcher import (PACKAGE_ROOT, BenchResult, check_backends, check_memory, check_points, resolve_device,
                       run_bench)
from .results import STATUS_OK, check_output_path
from .rundir import write_text_atomic
from .sweep import Sweep, load_sweep, read_sweep_file

DEFAULT_SWEEP = PACKAGE_ROOT / "sweeps" / "record.yaml"
SUFFIXES = (".csv", ".json", ".md", ".png")
# How a record run ended (its metadata's status).
OK = "ok"  # every point measured
POINTS_FAILED = "points failed"  # the run finished; some points' rows say why they failed
STOPPED = "stopped"  # the run stopped early (a rank failed, a deadline, a stop signal)


@dataclass
class RecordPlan:
    """What a record run will measure and write, checked before any rank starts."""

    sweep: Sweep
    sweep_path: Path
    sweep_sha256: str
    folder: Path
    device: str
    world_size: int
    plot: bool  # a plot will be drawn (matplotlib is there)

    @property
    def name(self) -> str:
        return self.sweep.name

    def path(self, suffix: str) -> Path:
        return self.folder / f"{self.name}{suffix}"

    @property
    def files(self) -> List[str]:
        return [self.path(s).name for s in SUFFIXES if s != ".png" or self.plot]


@dataclass
class RecordRun:
    plan: RecordPlan
    result: Optional[BenchResult]
    metadata: Dict[str, Any] = field(default_factory=dict)

    @property
    def rows(self) -> List[Dict[str, Any]]:
        return self.result.rows if self.result is not None else []


def plan_record(sweep_path: Union[str, os.PathLike, None], folder: Union[str, os.PathLike], *, device: str = "auto",
                nproc: Optional[int] = None, plot: bool = True) -> RecordPlan:
    """Load the sweep, resolve the ranks, refuse what this machine cannot run (the fused backends
    off Hopper GPUs, points past the ranks' memory) and a folder that already holds a record of this name or cannot take one."""
    path = Path(sweep_path) if sweep_path is not None else DEFAULT_SWEEP
    if sweep_path is None and not path.is_file():
        raise MegaMoEError(f"no sweep given and the default {path} is not there; name one with --sweep")
    text = read_sweep_file(path)
    sweep = load_sweep(path)
    kind, world_size, _ = resolve_device(device, nproc)
    check_points(sweep.points, world_size)
    try:
        check_backends(sweep.points, kind, world_size)
        check_memory(sweep.points, kind, world_size)
    except MegaMoEError as exc:
        raise MegaMoEError(f"{path}: {exc}") from None
    out = Path(folder).expanduser()
    if out.exists() and not out.is_dir():
        raise MegaMoEError(f"{out}: not a folder; a record is a folder of files")
    plan = RecordPlan(sweep, path, hashlib.sha256(text.encode()).hexdigest(), out, kind, world_size, plot)
    there = [plan.path(s) for s in SUFFIXES if plan.path(s).exists()]
    if there:
        raise MegaMoEError(f"{out} already holds a record named {plan.name} ({', '.join(p.name for p in there)}); "
                           "a record is written once: choose another folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MegaMoEError(f"{out}: cannot create the folder ({(exc.strerror or type(exc).__name__).lower()})") from None
    check_output_path(plan.path(".csv"))
    check_writable(plan.path(".json"), "record metadata", replaced=True)
    return plan


def _plain(value: Any) -> Any:
    """A JSON value: numpy scalars as Python's, missing (NaN, pandas' NA) as None."""
    value = value.item() if hasattr(value, "item") else value
    try:
        missing = value is None or bool(value != value)
    except TypeError:  # pandas' NA refuses to be a truth value
        missing = True
    return None if missing else value


def _rows_written(plan: RecordPlan) -> List[Dict[str, Any]]:
    """The rows in the record's results file (a fresh file: this run's only), as far as they read."""
    from .results import read_results

    try:
        return read_results(plan.path(".csv")).to_dict("records")
    except (MegaMoEError, OSError):
        return []


def metadata(plan: RecordPlan, result: Optional[BenchResult], *, started: str, status: str, message: str,
             argv: Optional[Sequence[str]] = None, rows: Optional[List[Dict[str, Any]]] = None) -> Dict[str, Any]:
    """The record's ``<name>.json``; ``rows`` where there is no result (a stopped run)."""
    rows = result.rows if result is not None else (rows or [])
    env = {key: rows[0].get(key) for key in ENV_COLUMNS} if rows else {}
    return {
        "record": plan.name,
        "sweep": {"file": str(plan.sweep_path), "name": plan.sweep.name, "description": plan.sweep.description,
                  "sha256": plan.sweep_sha256, "points": len(plan.sweep.points)},
        "command": list(argv if argv is not None else sys.argv),
        "run_id": result.run_id if result is not None else (rows[0].get("run_id") if rows else None),
        "started": started,
        "finished": utc_now(),
        "world_size": plan.world_size,
        "device": plan.device,
        "status": status,
        "message": message,
        "points_measured": sum(1 for r in rows if r.get("status") == STATUS_OK),
        "points_failed": sum(1 for r in rows if r.get("status") != STATUS_OK),
        "env": {k: _plain(v) for k, v in env.items()},
        "files": plan.files,
    }


def run_record(plan: RecordPlan, *, launch: Optional[Callable[..., BenchResult]] = None,
               timeout_s: Optional[float] = None, argv: Optional[Sequence[str]] = None) -> RecordRun:
    """Measure the plan's sweep into ``<name>.csv`` and write ``<name>.json``.

    ``launch`` replaces ``launcher.run_bench`` (same signature; the command passes one that shows
    progress).  An exception while the ranks run (a stop signal) still writes the metadata, with
    status ``stopped``, then propagates."""
    launch = launch or run_bench
    started = utc_now()
    try:
        result = launch(plan.sweep.points, nproc=plan.world_size, out_path=plan.path(".csv"), device=plan.device,
                        timeout_s=timeout_s)
    except BaseException as exc:
        why = "interrupted" if isinstance(exc, KeyboardInterrupt) else f"{type(exc).__name__}: {exc}"
        meta = metadata(plan, None, started=started, status=STOPPED, argv=argv, rows=_rows_written(plan),
                        message=f"{why}; the rows measured before it are in {plan.path('.csv').name}")
        write_text_atomic(plan.path(".json"), json.dumps(meta, indent=2) + "\n")
        raise
    status = STOPPED if not result.ok else POINTS_FAILED if result.num_failed_rows else OK
    meta = metadata(plan, result, started=started, status=status, message=result.message, argv=argv)
    write_text_atomic(plan.path(".json"), json.dumps(meta, indent=2) + "\n")
    return RecordRun(plan, result, meta)

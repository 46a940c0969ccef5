"""Run a list of points on N ranks under torchrun and collect the rows.

``run_bench`` writes the plan to a run folder, starts::

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m megamoe_cli.bench.worker --plan plan.json --rows rows.jsonl --run-dir DIR

and follows the run by polling two files rank 0 appends to (``progress.jsonl``:
a point started; ``rows.jsonl``: a point finished).  Each row is appended to
``out_path`` as soon as it arrives, so an interrupted run keeps what it measured.

Nothing waits forever: the run is bounded by a start-up deadline, by each
point's ``timeout_s`` (plus a grace period), by an optional overall timeout,
and by a short grace after any rank dies or reports a fatal error.  torchrun
puts each worker in its own session, so stopping a run signals torchrun's
process group and then every worker by the PID it recorded (SIGTERM, then
SIGKILL for survivors).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import MegaMoEError
from ..layout import BufferConfig
from .results import append_rows, check_output_path
from .sweep import Point, points_to_json
from .worker import ENV_FILE, FATAL_FILE, PID_FILE, PROGRESS_FILE

# Multicast / NVLS stays off on these machines (see SPEC §9); set for every run.
RUN_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

CPU_RANKS = 2
DEFAULT_STARTUP_TIMEOUT_S = 300.0
DEFAULT_GRACE_S = 10.0
SHUTDOWN_S = 60.0
POLL_S = 0.2
LOG_TAIL_LINES = 8
MESSAGE_CHARS = 300

STATUS_OK = "ok"
STATUS_FAILED = "failed"

# This checkout's root: workers import the package from here (it is not installed).
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class BenchEvent:
    """Progress of a run, for the caller to render.

    ``kind``: ``info`` (a plain message, e.g. which device), ``start`` (point
    ``index`` began), ``row`` (point ``index`` finished; ``row`` holds it),
    ``error`` (the run stopped; ``message`` says why).
    """

    kind: str
    total: int
    message: str = ""
    index: Optional[int] = None
    point: Optional[Point] = None
    row: Optional[Dict[str, Any]] = None


@dataclass
class BenchResult:
    status: str  # "ok": every point has a row and all ranks exited cleanly; else "failed"
    message: str
    rows: List[Dict[str, Any]]
    device: str
    nproc: int
    run_id: str
    out_path: Optional[Path]
    run_dir: Optional[Path] = None  # kept after a failure (torchrun.log, fatal.*.txt)
    num_points: int = 0
    returncode: Optional[int] = None

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    @property
    def num_failed_rows(self) -> int:
        return sum(1 for r in self.rows if r.get("status") != STATUS_OK)

    def frame(self):
        from .results import rows_frame

        return rows_frame(self.rows)


# ---------------------------------------------------------------------------
# Device and plan


def resolve_device(device: str, nproc: Optional[int]) -> Tuple[str, int, str]:
    """``(device kind, number of ranks, a sentence saying what will run)``."""
    if device not in ("auto", "cuda", "cpu"):
        raise MegaMoEError(f"device must be auto, cuda or cpu, got {device!r}")
    if nproc is not None and (not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1):
        raise MegaMoEError(f"nproc must be a positive integer, got {nproc!r}")
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and num_gpus == 0:
        raise MegaMoEError("device cuda was asked for, but torch sees no CUDA device")
    if device == "cuda" or (device == "auto" and num_gpus > 0):
        ranks = nproc or num_gpus
        if ranks > num_gpus:
            raise MegaMoEError(f"nproc={ranks} ranks need {ranks} GPUs, but this machine has {num_gpus}")
        return "cuda", ranks, f"running {ranks} rank(s) on CUDA, one per GPU (NCCL)"
    ranks = nproc or CPU_RANKS
    why = "no CUDA device found, so " if device == "auto" else ""
    return "cpu", ranks, f"{why}running {ranks} CPU rank(s) with gloo; times are not GPU times"


def check_points(points: Sequence[Point], world_size: int) -> None:
    """Everything that depends on the world size, checked before anything starts."""
    if not points:
        raise MegaMoEError("nothing to run: the sweep has no points")
    for index, point in enumerate(points):
        if not isinstance(point, Point):
            raise MegaMoEError(f"point {index} must be a sweep.Point, got {type(point).__name__}")
        where = f"point {index} ({point.describe()})"
        if not isinstance(point.num_tokens, int) and len(point.num_tokens) != world_size:
            raise MegaMoEError(
                f"{where}: num_tokens gives {len(point.num_tokens)} per-rank counts; "
                f"the run has {world_size} ranks"
            )
        try:
            BufferConfig(
                num_ranks=world_size,
                num_max_tokens_per_rank=point.num_max_tokens_per_rank,
                shape=point.shape,
                block_m=point.block_m or 64,
            )
        except MegaMoEError as exc:
            raise MegaMoEError(f"{where}: {exc}") from None


def torchrun_command(nproc: int, plan: Path, rows: Path, run_dir: Path) -> List[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.5",
        "-m",
        "megamoe_cli.bench.worker",
        "--plan",
        str(plan),
        "--rows",
        str(rows),
        "--run-dir",
        str(run_dir),
    ]


def run_environment(extra: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ)
    env.update(extra or {})
    env.update(RUN_ENV)
    paths = [str(PACKAGE_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


# ---------------------------------------------------------------------------
# Processes


def _process_state(pid: int) -> Optional[str]:
    """Linux state letter of ``pid`` ('Z' zombie), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            return "?"
        return "?"


def _alive(pid: int) -> bool:
    state = _process_state(pid)
    return state is not None and state != "Z"


def _is_our_worker(pid: int, run_dir: Path) -> bool:
    """Guard against PID reuse: the process must have this run's folder on its command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return str(run_dir).encode() in f.read()
    except FileNotFoundError:
        return False
    except OSError:
        return True


def worker_pids(run_dir: Path) -> Dict[int, int]:
    """rank -> pid, from the files the workers wrote."""
    pids: Dict[int, int] = {}
    for path in run_dir.glob(PID_FILE.format(rank="*")):
        try:
            data = json.loads(path.read_text())
            pids[int(data["rank"])] = int(data["pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return pids


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_run(proc: subprocess.Popen, run_dir: Path, grace_s: float = DEFAULT_GRACE_S) -> None:
    """SIGTERM torchrun (its process group) and every recorded worker; SIGKILL what is left after ``grace_s``."""
    workers = [pid for pid in worker_pids(run_dir).values() if _is_our_worker(pid, run_dir)]
    if proc.poll() is None:
        _signal(proc.pid, signal.SIGTERM, group=True)
    for pid in workers:
        if _alive(pid):
            _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not any(_alive(pid) for pid in workers):
            break
        time.sleep(0.1)
    if proc.poll() is None:
        _signal(proc.pid, signal.SIGKILL, group=True)
    for pid in workers:
        if _alive(pid) and _is_our_worker(pid, run_dir):
            _signal(pid, signal.SIGKILL)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


class _JsonlTail:
    """Reads the complete lines appended to a file since the last call."""

    def __init__(self, path: Path):
        self.path = path
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


# ---------------------------------------------------------------------------
# Failure messages


def _fatal_messages(run_dir: Path) -> List[str]:
    messages = []
    for path in sorted(run_dir.glob(FATAL_FILE.format(rank="*"))):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text:
            first = text.splitlines()[0]
            messages.append(first if len(first) <= MESSAGE_CHARS else first[: MESSAGE_CHARS - 3] + "...")
    return messages


_EXIT_RE = re.compile(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)")


def _torchrun_exits(log_text: str) -> List[str]:
    """'rank R exited with code C' from torchrun's failure summary; exits by a signal
    (usually torchrun stopping the survivors) come after the ranks that failed first."""
    exited: Dict[int, str] = {}
    signalled: Dict[int, str] = {}
    for rank, code in _EXIT_RE.findall(log_text):
        code_i = int(code)
        if code_i < 0:
            try:
                name = signal.Signals(-code_i).name
            except ValueError:
                name = f"signal {-code_i}"
            signalled[int(rank)] = f"rank {rank} was stopped by {name}"
        else:
            exited[int(rank)] = f"rank {rank} exited with code {code_i}"
    return [exited[r] for r in sorted(exited)] + [signalled[r] for r in sorted(signalled)]


def _log_tail(log_path: Path) -> str:
    try:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])


# ---------------------------------------------------------------------------
# The run


def _new_run_id() -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{stamp}-{uuid.uuid4().hex[:6]}"


def run_bench(
    points: Sequence[Point],
    nproc: Optional[int] = None,
    out_path: Optional[Union[str, Path]] = None,
    *,
    device: str = "auto",
    timeout_s: Optional[float] = None,
    on_event: Optional[Callable[[BenchEvent], None]] = None,
    env: Optional[Mapping[str, str]] = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    grace_s: float = DEFAULT_GRACE_S,
    keep_run_dir: bool = False,
    run_root: Optional[Union[str, Path]] = None,
    plan_extra: Optional[Mapping[str, Any]] = None,
) -> BenchResult:
    """Measure ``points`` on ``nproc`` ranks; append each row to ``out_path`` as it finishes.

    ``device``: ``auto`` (CUDA with one rank per GPU when torch sees a GPU,
    else 2 gloo CPU ranks), ``cuda`` or ``cpu``; ``nproc`` overrides the rank
    count.  ``timeout_s`` caps the whole run (default: only the start-up and
    per-point deadlines).  ``env`` adds environment variables for the ranks.
    The run folder (plan, rows, torchrun.log) is made under ``run_root``
    (default: the system temporary folder) and removed after a clean run
    unless ``keep_run_dir``.  ``plan_extra`` adds sections to the plan the
    workers read (``megamoe tune`` passes its candidate lists this way).

    Returns a :class:`BenchResult`; a run that stopped early has status
    ``failed``, a message naming the point it stopped at, the rows measured
    before it, and one failed row for the point in flight.  Bad input raises
    :class:`MegaMoEError` before anything starts.
    """
    points = list(points)
    device_kind, world_size, note = resolve_device(device, nproc)
    check_points(points, world_size)
    out = Path(out_path) if out_path is not None else None
    if out is not None:
        check_output_path(out)
    total = len(points)

    def emit(kind: str, **fields: Any) -> None:
        if on_event is not None:
            on_event(BenchEvent(kind=kind, total=total, **fields))

    emit("info", message=note)
    run_id = _new_run_id()
    run_dir = Path(tempfile.mkdtemp(prefix=f"megamoe-bench-{run_id}-", dir=run_root))
    plan_path = run_dir / "plan.json"
    rows_path = run_dir / "rows.jsonl"
    log_path = run_dir / "torchrun.log"
    plan = {
        "run_id": run_id,
        "device": device_kind,
        "startup_timeout_s": startup_timeout_s,
        "points": points_to_json(points),
    }
    clash = sorted(set(plan_extra or {}) & set(plan))
    if clash:
        raise MegaMoEError(f"plan_extra may only add sections to the plan, not replace {clash}")
    plan.update(plan_extra or {})
    plan_path.write_text(json.dumps(plan, indent=1))

    rows: List[Dict[str, Any]] = []
    rows_tail = _JsonlTail(rows_path)
    progress_tail = _JsonlTail(run_dir / PROGRESS_FILE)
    started_at = time.monotonic()
    # What the run waits for next, and until when (each deadline includes the grace period).
    deadline = started_at + startup_timeout_s + grace_s
    waiting_for = f"the ranks did not start within {startup_timeout_s:g} s"
    overall = started_at + timeout_s if timeout_s is not None else None
    stop_reason = ""
    dead_since: Optional[float] = None
    started = -1

    def take_rows() -> None:
        nonlocal deadline, waiting_for, started
        for event in progress_tail.read():
            index = int(event["index"])
            if 0 <= index < total:
                started = max(started, index)
                deadline = time.monotonic() + points[index].timeout_s + grace_s
                waiting_for = f"point {index} did not finish within its timeout_s={points[index].timeout_s:g} s"
                emit("start", index=index, point=points[index])
        for row in rows_tail.read():
            index = len(rows)
            if out is not None:
                append_rows(out, [row])
            rows.append(row)
            emit("row", index=index, point=points[index] if index < total else None, row=row)
            following = index + 1
            if following < total:
                wait = points[following].timeout_s
                waiting_for = f"point {following} did not start within {wait:g} s of the previous one"
            else:
                wait = SHUTDOWN_S
                waiting_for = f"the ranks did not exit within {wait:g} s of the last point"
            deadline = time.monotonic() + wait + grace_s

    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            torchrun_command(world_size, plan_path, rows_path, run_dir),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=run_environment(env),
            start_new_session=True,
        )
    try:
        while True:
            take_rows()
            if proc.poll() is not None:
                break
            now = time.monotonic()
            if dead_since is None and len(rows) < total:
                pids = worker_pids(run_dir)
                if _fatal_messages(run_dir) or any(not _alive(pid) for pid in pids.values()):
                    dead_since = now
            if dead_since is not None and now - dead_since > grace_s:
                stop_reason = "a rank stopped and the others did not finish"
                break
            if now > deadline:
                stop_reason = waiting_for
                break
            if overall is not None and now > overall:
                stop_reason = f"the run exceeded its timeout of {timeout_s:g} s"
                break
            time.sleep(POLL_S)
    except BaseException:
        terminate_run(proc, run_dir, grace_s)
        raise
    if proc.poll() is None or any(_alive(pid) for pid in worker_pids(run_dir).values()):
        terminate_run(proc, run_dir, grace_s)
    take_rows()
    returncode = proc.returncode

    if returncode == 0 and len(rows) >= total and not stop_reason:
        if not keep_run_dir:
            shutil.rmtree(run_dir, ignore_errors=True)
        failed = sum(1 for r in rows if r.get("status") != STATUS_OK)
        message = f"{len(rows)} point(s) measured" + (f", {failed} failed" if failed else "")
        return BenchResult(
            STATUS_OK, message, rows, device_kind, world_size, run_id, out,
            run_dir if keep_run_dir else None, total, returncode,
        )

    # The point the run stopped at: the first one without a row, unless the
    # dying ranks already recorded the point they were on as failed.
    in_flight = len(rows) < total and (not rows or rows[-1].get("status") == STATUS_OK or started >= len(rows))
    if in_flight:
        stopped_at = len(rows)
    elif rows and rows[-1].get("status") != STATUS_OK:
        stopped_at = len(rows) - 1
    else:
        stopped_at = total
    message = _failure_message(points, stopped_at, run_dir, log_path, returncode, stop_reason)
    if in_flight:
        row = _in_flight_row(points[stopped_at], run_id, world_size, device_kind, run_dir, message)
        if out is not None:
            append_rows(out, [row])
        rows.append(row)
        emit("row", index=stopped_at, point=points[stopped_at], row=row)
    not_run = total - len(rows)
    if not_run:
        message += f"; {not_run} later point(s) not run"
    message += f" (run files kept in {run_dir})"
    emit("error", message=message)
    return BenchResult(
        STATUS_FAILED, message, rows, device_kind, world_size, run_id, out, run_dir, total, returncode
    )


def _failure_message(
    points: Sequence[Point],
    stopped_at: int,
    run_dir: Path,
    log_path: Path,
    returncode: Optional[int],
    stop_reason: str,
) -> str:
    total = len(points)
    if stopped_at < total:
        where = f"run stopped at point {stopped_at} of {total} ({points[stopped_at].describe()})"
    else:
        where = f"run ended badly after all {total} points"
    causes = []
    if stop_reason:
        causes.append(stop_reason)
    log_text = ""
    try:
        log_text = log_path.read_text(errors="replace")
    except OSError:
        pass
    causes.extend(_torchrun_exits(log_text))
    causes.extend(_fatal_messages(run_dir))
    if not causes:
        causes.append(f"torchrun exited with code {returncode}")
        tail = _log_tail(log_path)
        if tail:
            causes.append("last output:\n" + tail)
    return f"{where}: " + "; ".join(causes)


def _in_flight_row(
    point: Point, run_id: str, world_size: int, device: str, run_dir: Path, message: str
) -> Dict[str, Any]:
    from .envinfo import host_info
    from .results import STATUS_FAILED, make_row

    try:
        env = json.loads((run_dir / ENV_FILE).read_text())
    except (OSError, ValueError):
        env = host_info()
    return make_row(
        point, run_id=run_id, world_size=world_size, device=device, env=env,
        status=STATUS_FAILED, error=message,
    )

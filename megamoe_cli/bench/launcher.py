"""Run a list of points on N ranks under torchrun and collect the rows.

``run_bench`` writes the plan to a run folder, starts torchrun through
``bench.torchrun`` (which keeps the ranks' elastic failure records)::

    python -m megamoe_cli.bench.torchrun DIR/failures.json --standalone --nproc-per-node N \\
        --log-dir DIR/elastic -m megamoe_cli.bench.worker --plan plan.json --rows rows.jsonl --run-dir DIR

and follows the run by polling two files rank 0 appends to (``progress.jsonl``:
a point started; ``rows.jsonl``: a point finished).  Each row is appended to
``out_path`` as soon as it arrives, so an interrupted run keeps what it measured.

Nothing waits forever: the run is bounded by a start-up deadline, by each
point's ``timeout_s`` (plus a grace period), by an optional overall timeout,
and by a short grace after any rank dies or reports a fatal error.  torchrun
puts each worker in its own session, so the launcher records every rank's
PID while torchrun lives (torchrun's children, and the PID file each rank
writes); stopping a run sends SIGTERM to torchrun and to every recorded rank's
process group, then SIGKILL to what is left.  An exception in the caller's
thread (Ctrl-C, or SIGTERM/SIGHUP turned into one by the CLI) stops the run
the same way, after which the rows already measured are appended to
``out_path``.

Whatever ends the launcher, torchrun and the ranks end with it (``rundir.die_with_parent``).
A launcher killed by a signal no program can catch (SIGKILL: the OOM killer, ``timeout -s
KILL``, a batch scheduler) leaves the rows rank 0 finished in the run folder, with
``launcher.json`` naming the results file they were for; the next run into that file (and
``megamoe report`` of it) appends them (``recover_rows``) and says so.

A failed run names the rank that failed first and its cause, from the
failure records torchrun's agent collects (each rank's exit code or signal
and its ``@record`` error file); the run folder, with every rank's output in
``torchrun.log``, is kept and named.  A clean run's folder is removed.

Before anything starts, ``check_points``, ``check_backends`` and ``check_memory`` refuse what
cannot run: a backend this machine lacks, a point whose memory (the estimate ``megamoe sizes``
prints, on a GPU; a per-backend model, on CPU ranks) exceeds what the ranks have.

Imports: ``results``, ``rundir``, ``sweep`` (module level); ``envinfo``, ``metrics`` (inside functions).
The launcher starts ``bench.worker`` by module name and reads what it writes through
``bench.rundir``, so neither imports the other.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ..errors import MegaMoEError
from ..layout import BufferConfig
from .results import append_rows, check_output_path
from .rundir import (ELASTIC_DIR, ENV_FILE, FAILURES_FILE, FATAL_FILE, LAUNCHER_FILE, LOG_FILE, LOST_CONTACT,
                     PARENT_PID_ENV, PID_FILE, PLAN_FILE, PROGRESS_FILE, ROWS_FILE, JsonlTail, process_start_time,
                     write_text_atomic)
from .sweep import Point, points_to_json

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
    ``error`` (the run stopped; ``message`` says why), ``stopped`` (an exception
    in the caller's thread, such as Ctrl-C, stopped the run; ``message`` says what
    was kept; the exception follows).
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
    """``(device kind, number of ranks, a sentence saying what will run)``; ``nproc`` is the
    number of ranks asked for (None: one per GPU, or 2 on CPU)."""
    if device not in ("auto", "cuda", "cpu"):
        raise MegaMoEError(f"device must be auto, cuda or cpu, got {device!r}")
    if nproc is not None and (not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1):
        raise MegaMoEError(f"the number of ranks must be a positive integer, got {nproc!r}")
    if device == "cpu" or (device == "auto" and no_nvidia_driver()):
        num_gpus = 0  # known without importing torch (seconds), so refusals on CPU machines come at once
    else:
        import torch

        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device == "cuda" and num_gpus == 0:
        raise MegaMoEError("device cuda was asked for, but torch sees no CUDA device")
    if device == "cuda" or (device == "auto" and num_gpus > 0):
        ranks = nproc or num_gpus
        if ranks > num_gpus:
            raise MegaMoEError(f"{ranks} ranks need {ranks} GPUs (one rank per GPU), but this machine has {num_gpus}")
        return "cuda", ranks, f"running {ranks} rank(s) on CUDA, one per GPU (NCCL)"
    ranks = nproc or CPU_RANKS
    why = "no CUDA device found, so " if device == "auto" else ""
    return "cpu", ranks, f"{why}running {ranks} CPU rank(s) with gloo; times are not GPU times"


def no_nvidia_driver() -> bool:
    """No NVIDIA driver is loaded and no NVIDIA device node exists: torch would see no CUDA
    device.  (With a driver, only torch can say which devices a process may use.)"""
    return not os.path.exists("/proc/driver/nvidia") and not any(Path("/dev").glob("nvidia[0-9]*"))


def fused_unavailable(device_kind: str, world_size: int) -> Optional[str]:
    """Why the fused kernel (sm_90a code) cannot run on a run's ranks, or None when it can: CPU
    ranks, or a GPU of another architecture (named with its ``sm_`` version)."""
    if device_kind != "cuda":
        return "this run is on CPU ranks"
    import torch

    for index in range(min(world_size, torch.cuda.device_count())):
        major, minor = torch.cuda.get_device_capability(index)
        if (major, minor) != (9, 0):
            return f"GPU {index} is {torch.cuda.get_device_name(index)} (sm_{major}{minor})"
    return None


def check_backends(points: Sequence[Point], device_kind: str, world_size: int) -> None:
    """Refuse, before any rank starts, a backend this machine cannot run, saying why (the
    ranks would otherwise start, build and fail at every such point).  The fused kernel is
    sm_90a code: it runs on Hopper GPUs only."""
    from ..backends import CUDA_ONLY, HOPPER_ONLY
    from ..baselines.peers import unavailable

    for name in sorted({p.backend for p in points}):
        missing = unavailable(name)
        if missing:
            raise MegaMoEError(missing)
    names = sorted({p.backend for p in points} & HOPPER_ONLY)
    cuda = sorted({p.backend for p in points} & (CUDA_ONLY - HOPPER_ONLY))
    if not names:
        if cuda and device_kind != "cuda":
            raise MegaMoEError(f"backend {' and '.join(cuda)} needs a CUDA GPU, and this run is on CPU ranks; "
                               "leave it out, or run on a machine with a GPU")
        return
    which = " and ".join(names)
    problem = fused_unavailable(device_kind, world_size)
    if problem is None:
        return
    if device_kind != "cuda":
        raise MegaMoEError(f"backend {which} runs on Hopper GPUs (sm_90a) only, and {problem}; "
                           "leave it out, or run on a machine with Hopper GPUs")
    raise MegaMoEError(f"backend {which} runs on Hopper GPUs (sm_90a) only; {problem}")


# What one CPU rank (one core, gloo) takes, measured on the 2-core machine the CPU tests run on.
# Generating and quantizing one expert weight (every point makes its problem afresh):
CPU_S_PER_WEIGHT_GENERATED = 40e-9
# Per backend: seconds per weight of every expert a call reaches (the reference and the unfused
# pipeline dequantize those experts on every call; torch-bf16 reads its BF16 copy), FLOP/s of
# its GEMMs, and seconds per local weight spent once in prepare (torch-bf16's BF16 copy).
CPU_BACKEND_COSTS = {
    "reference": (42e-9, 6e9, 0.0),
    "torch": (20e-9, 12e9, 0.0),
    "torch-bf16": (5e-9, 3.4e9, 35e-9),
}
CPU_START_S = 25.0  # torchrun and two ranks importing torch on two cores
CPU_POINT_S = 3.0  # a point's collectives, bookkeeping and row


def estimate_cpu_seconds(points: Sequence[Point], world_size: int) -> float:
    """A rough wall time for ``points`` on ``world_size`` CPU ranks: each point generates its
    experts' weights, and every call (warm-up, timed, and the reference check) goes over every
    expert it reaches.  Within about 30% of what the 2-core CPU test machine measures; meant to
    tell seconds from hours."""
    cores = max(1, os.cpu_count() or 1)
    slowdown = max(1.0, world_size / cores)  # ranks beyond the cores share them
    total = CPU_START_S
    for point in points:
        shape = point.shape
        local_experts = max(1, shape.num_experts // world_size)
        expert_weights = 3 * shape.hidden * shape.intermediate
        tokens = sum(point.tokens_for_rank(r, world_size) for r in range(world_size))
        pairs_per_rank = tokens * shape.num_topk / world_size
        reached = local_experts * (1.0 - (1.0 - 1.0 / local_experts) ** pairs_per_rank)
        flops = 2.0 * pairs_per_rank * expert_weights

        def call_s(backend: str) -> float:
            per_weight, rate, _ = CPU_BACKEND_COSTS.get(backend, CPU_BACKEND_COSTS["torch"])
            return reached * expert_weights * per_weight + flops / rate

        calls = point.warmup + point.iters * point.calls_per_sample
        prepare = local_experts * expert_weights * (
            CPU_S_PER_WEIGHT_GENERATED + CPU_BACKEND_COSTS.get(point.backend, CPU_BACKEND_COSTS["torch"])[2])
        check = call_s("reference") if point.check else 0.0
        total += CPU_POINT_S + slowdown * (prepare + calls * call_s(point.backend) + check)
    return total


# What one CPU rank holds, measured on the CPU test machine (peak resident memory): the
# interpreter with torch and gloo; per expert weight on the rank (generated in FP32, then
# quantized); per token, per byte of top-k x (hidden + 2 x intermediate) (the routed rows through
# both GEMMs, and the reference's check of them).
CPU_RANK_BYTES = 350 * 2 ** 20
CPU_BYTES_PER_WEIGHT = 4.5
CPU_BYTES_PER_ROUTED_ELEMENT = {"reference": 10, "torch": 16}


def memory_needed(shape, ranks: int, tokens: int, block_m: Optional[int] = None):
    """``(layout, weight_bytes)``: one rank's symmetric buffer for ``tokens`` per rank and its
    experts' weights: what ``megamoe sizes`` prints and checks against the GPU's memory."""
    from ..layout import build_layout
    from .metrics import expert_weight_bytes

    extra = {"block_m": block_m} if block_m is not None else {}
    layout = build_layout(BufferConfig(num_ranks=ranks, num_max_tokens_per_rank=tokens, shape=shape, **extra))
    return layout, shape.num_experts // ranks * expert_weight_bytes(shape)


def point_bytes(point: Point, device_kind: str, world_size: int) -> int:
    """About how much memory one rank needs for ``point``: on a GPU, ``memory_needed``'s buffer
    and weights; on a CPU rank, the model above."""
    shape = point.shape
    tokens = max(point.num_max_tokens_per_rank, max(point.tokens_for_rank(r, world_size) for r in range(world_size)))
    if device_kind == "cuda":
        layout, weights = memory_needed(shape, world_size, tokens, point.block_m)
        return layout.total_bytes + weights
    local_weights = max(1, shape.num_experts // world_size) * 3 * shape.hidden * shape.intermediate
    per_element = CPU_BYTES_PER_ROUTED_ELEMENT.get(point.backend, CPU_BYTES_PER_ROUTED_ELEMENT["torch"])
    routed = tokens * shape.num_topk * (shape.hidden + 2 * shape.intermediate)
    return int(CPU_RANK_BYTES + CPU_BYTES_PER_WEIGHT * local_weights + per_element * routed)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2 ** 30:.3g} GiB"


def _available_cpu_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpu_memory(world_size: int) -> Tuple[int, str]:
    import torch

    sizes = [(torch.cuda.get_device_properties(i).total_memory, i) for i in range(world_size)]
    memory, index = min(sizes)
    return memory, f"GPU {index} ({torch.cuda.get_device_name(index)})"


def check_memory(points: Sequence[Point], device_kind: str, world_size: int, tokens_name: str = "num_tokens") -> None:
    """Refuse, before any rank starts, a point the ranks' memory cannot hold, naming the tokens
    (``tokens_name``: how the caller spells them, e.g. ``--tokens``) and where the limit comes
    from: the GPU's memory, or the memory this machine has available for its CPU ranks."""
    if not points:
        return
    sized = [(point_bytes(p, device_kind, world_size), i, p) for i, p in enumerate(points)]
    need, index, point = max(sized, key=lambda item: item[0])
    tokens = point.num_tokens if isinstance(point.num_tokens, int) else list(point.num_tokens)
    where = f"{tokens_name} {tokens}: point {index} ({point.describe()})"
    if device_kind == "cuda":
        memory, gpu = _gpu_memory(world_size)
        if need > memory:
            raise MegaMoEError(
                f"{where} needs about {_gib(need)} per GPU (its symmetric buffer and expert weights, as `megamoe "
                f"sizes --ranks {world_size} --tokens {point.num_max_tokens_per_rank}` prints), more than the "
                f"{_gib(memory)} of {gpu}; lower {tokens_name} or add ranks")
        return
    available = _available_cpu_bytes()
    if available is not None and need * world_size > available:
        raise MegaMoEError(
            f"{where} needs about {_gib(need)} per CPU rank ({_gib(need * world_size)} for {world_size} ranks), more "
            f"than the {_gib(available)} this machine has available (MemAvailable); lower {tokens_name}")


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
    run_dir = Path(run_dir)
    return [
        sys.executable,
        "-m",
        "megamoe_cli.bench.torchrun",
        str(run_dir / FAILURES_FILE),
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
        "--monitor-interval",
        "0.5",
        "--log-dir",
        str(run_dir / ELASTIC_DIR),
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


def _children(pid: int) -> List[int]:
    """The processes whose parent is ``pid``, read from /proc (torchrun's ranks are not our
    children, so they cannot be waited for)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    found: List[int] = []
    try:
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(child) for child in f.read().split())
        return found
    except (OSError, ValueError):
        found = []  # a thread that just ended, or a kernel without these files: ask every process
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        found.append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    return found


def _leads_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


class RunProcesses:
    """torchrun and the ranks it started, recorded while they can still be found: torchrun
    starts each rank in a session of its own, so once torchrun is gone (killed, crashed)
    nothing leads to them but what was recorded here."""

    def __init__(self, proc: subprocess.Popen, run_dir: Path, world_size: int):
        self.proc = proc
        self.run_dir = run_dir
        self.world_size = world_size
        self.ranks: set = set()
        self.groups: set = set()  # process groups the ranks lead (a rank's own children are in them)

    def record(self) -> None:
        found = set(worker_pids(self.run_dir).values())
        if self.proc.poll() is None:
            found.update(_children(self.proc.pid))
        for pid in found - self.ranks:
            if _alive(pid) and _is_our_worker(pid, self.run_dir):
                self.ranks.add(pid)
                if _leads_group(pid):
                    self.groups.add(pid)

    @property
    def complete(self) -> bool:
        return len(self.ranks) >= self.world_size

    def alive(self) -> List[int]:
        return [pid for pid in self.ranks if _alive(pid)]


def _signal(pid: int, sig: int, group: bool = False) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def terminate_run(proc: subprocess.Popen, run_dir: Path, grace_s: float = DEFAULT_GRACE_S,
                  processes: Optional[RunProcesses] = None) -> None:
    """SIGTERM torchrun (its process group) and every rank (its process group: a rank's own
    children go with it); SIGKILL what is left after ``grace_s``.  The ranks are the ones
    ``processes`` recorded, plus any found now (PID files, torchrun's children), taken before
    torchrun is signalled: once it exits, its children are no longer its children."""
    processes = processes or RunProcesses(proc, run_dir, 0)
    processes.record()
    if proc.poll() is None:
        _signal(proc.pid, signal.SIGTERM, group=True)
    for pid in processes.ranks:
        if pid in processes.groups:
            _signal(pid, signal.SIGTERM, group=True)
        elif _alive(pid):
            _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if proc.poll() is not None and not processes.alive():
            break
        time.sleep(0.1)
    if proc.poll() is None:
        _signal(proc.pid, signal.SIGKILL, group=True)
    for pid in processes.ranks:
        if pid in processes.groups:
            _signal(pid, signal.SIGKILL, group=True)  # also what the rank started, if it outlived it
        elif _alive(pid) and _is_our_worker(pid, run_dir):
            _signal(pid, signal.SIGKILL)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass


class SignalsHeld:
    """Holds SIGINT, SIGTERM and SIGHUP while torchrun starts: a Python handler raising between
    the fork and the line that records torchrun's PID would leave torchrun running with nothing
    to stop it.  ``deliver()``, called where a stop is handled, raises what was held."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self):
        self.saved: Dict[int, Any] = {}
        self.held: List[int] = []

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                handler = signal.getsignal(sig)
                if callable(handler):  # SIG_DFL and SIG_IGN raise nothing to hold
                    self.saved[sig] = handler
                    signal.signal(sig, lambda signum, frame: self.held.append(signum))
        return self

    def __exit__(self, *exc_info):
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)

    def deliver(self) -> None:
        if self.held:
            signum = self.held[0]
            self.held.clear()
            self.saved[signum](signum, None)


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
            messages.append(_clip(text.splitlines()[0]))
    return messages


def _clip(text: str) -> str:
    return text if len(text) <= MESSAGE_CHARS else text[: MESSAGE_CHARS - 3] + "..."


# Exception types the worker records for its own failures; their names add nothing to the text.
_OWN_ERRORS = ("RankFailed", "RankTimeout", "LostPeerError")


def rank_failures(run_dir: Path) -> List[Dict[str, Any]]:
    """The failed ranks' torch.distributed.elastic records (``bench.torchrun``): rank, exit
    code or signal, the message of the rank's error file, when it failed.  Empty when torchrun
    saw no failed rank (or was itself stopped before it could say)."""
    try:
        records = json.loads((run_dir / FAILURES_FILE).read_text())
    except (OSError, ValueError):
        return []
    return [r for r in records if isinstance(r, dict) and "rank" in r] if isinstance(records, list) else []


def _secondary(record: Dict[str, Any]) -> bool:
    """A rank that failed because another did: it lost contact with its peers, or torchrun
    stopped it (SIGTERM) after the first failure."""
    message = record.get("message") or ""
    return record.get("signal") == "SIGTERM" or message.startswith("LostPeerError:") or LOST_CONTACT in message


def first_failure(records: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The rank that failed first: the earliest of the ranks that failed on their own account,
    else the earliest of all.  (torchrun's own pick, the smallest time stamp in whole seconds,
    ties between a rank that died and the one it left waiting, and names the lower rank.)"""
    if not records:
        return None
    return min(records, key=lambda r: (_secondary(r), r.get("time_ns", 0), r.get("rank", 0)))


def describe_failure(record: Dict[str, Any], others: int) -> str:
    rank = record.get("rank")
    code = record.get("exitcode", 0)
    how = f"killed by {record.get('signal') or f'signal {-code}'}" if code < 0 else f"exit code {code}"
    message = (record.get("message") or "").strip()
    for name in _OWN_ERRORS:
        message = message[len(name) + 2:] if message.startswith(f"{name}: ") else message
    message = message[len(f"rank {rank}: "):] if message.startswith(f"rank {rank}: ") else message
    first = "failed first" if others else "failed"
    text = f"rank {rank} {first} ({how}): {_clip(message.splitlines()[0])}" if message else \
        f"rank {rank} {first} ({how}, no error record)"
    if others:
        text += f"; {others} other rank(s) stopped after it"
    return text


def _first_fatal_message(run_dir: Path) -> Optional[str]:
    """The ranks' own accounts (``fatal.rank<R>.txt``) when torchrun left no failure records
    (the launcher stopped it at a deadline): the earliest written that is not a lost contact."""
    found = []
    for path in run_dir.glob(FATAL_FILE.format(rank="*")):
        try:
            text = path.read_text().strip()
            written = path.stat().st_mtime_ns
            rank = int(path.name[len(FATAL_FILE.split("{")[0]):].split(".")[0])
        except (OSError, ValueError):
            continue
        if text:
            found.append((LOST_CONTACT in text, written, rank, text.splitlines()[0]))
    if not found:
        return None
    _, _, rank, text = min(found)
    text = text[len(f"rank {rank}: "):] if text.startswith(f"rank {rank}: ") else text
    first = "failed first" if len(found) > 1 else "failed"
    return f"rank {rank} {first}: {_clip(text)}"


def _log_tail(log_path: Path) -> str:
    try:
        lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return "\n".join(lines[-LOG_TAIL_LINES:])


# ---------------------------------------------------------------------------
# The run


def _write_launcher_file(run_dir: Path, run_id: str, out: Optional[Path], *, done: bool) -> None:
    """Who runs this folder's run and where its rows go; ``done``: every row it will write is in
    ``out`` (nothing for ``recover_rows`` to do)."""
    info = {"pid": os.getpid(), "start": process_start_time(os.getpid()),
            "run_id": run_id or _read_launcher_file(run_dir).get("run_id", ""),
            "out": str(out.resolve()) if out is not None else None, "done": done}
    write_text_atomic(run_dir / LAUNCHER_FILE, json.dumps(info))


def _read_launcher_file(run_dir: Path) -> Dict[str, Any]:
    try:
        info = json.loads((run_dir / LAUNCHER_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _launcher_alive(info: Mapping[str, Any]) -> bool:
    pid = info.get("pid")
    if not isinstance(pid, int) or not _alive(pid):
        return False
    return info.get("start") is None or process_start_time(pid) == info.get("start")


def recover_rows(out_path: Union[str, Path], root: Optional[Union[str, Path]] = None) -> List[str]:
    """Append to ``out_path`` the rows of runs whose launcher died before it saved them (a
    signal no program can catch: SIGKILL from the OOM killer, ``timeout -s KILL``, a scheduler).
    Their run folders (under ``root``, default the temporary folder) say which results file
    they were for; the rows of a run already in the file are not appended again.  Returns one
    line per run recovered (or that could not be), naming the rows, the file and the folder."""
    out = Path(out_path)
    target = str(out.resolve())
    base = Path(root) if root is not None else Path(tempfile.gettempdir())
    try:
        folders = sorted(p for p in base.glob("megamoe-bench-*") if p.is_dir())
    except OSError:
        return []
    messages = []
    for folder in folders:
        info = _read_launcher_file(folder)
        if info.get("out") != target or info.get("done") or _launcher_alive(info):
            continue
        with _folder_lock(folder) as locked:
            info = _read_launcher_file(folder)  # another command may have recovered it meanwhile
            message = _recover_run(folder, info, out) if locked and not info.get("done") else None
        if message:
            messages.append(message)
    return messages


@contextlib.contextmanager
def _folder_lock(folder: Path):
    """An exclusive lock on a run folder (True when held): two commands reading the same results
    file at once recover a run's rows once."""
    import fcntl

    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield True
    finally:
        os.close(fd)


def _recover_run(folder: Path, info: Mapping[str, Any], out: Path) -> Optional[str]:
    """Append the rows of ``folder``'s run that ``out`` lacks; the line that says so (None: none)."""
    run_id = str(info.get("run_id", ""))
    for pid in worker_pids(folder).values():  # a rank on a system without a parent-death signal
        if _alive(pid) and _is_our_worker(pid, folder):
            _signal(pid, signal.SIGKILL)
    try:
        finished = JsonlTail(folder / ROWS_FILE).read()
    except ValueError:
        finished = []
    try:
        saved = 0
        if out.exists() and out.stat().st_size:
            from .results import read_results

            saved = int((read_results(out)["run_id"] == run_id).sum())
        missing = [row for row in finished[saved:] if row.get("run_id") == run_id]
        append_rows(out, missing)
        write_text_atomic(folder / LAUNCHER_FILE, json.dumps({**info, "done": True}))
    except (MegaMoEError, OSError) as exc:
        return (f"rows of run {run_id} that its launcher (pid {info.get('pid')}) did not save could not be added "
                f"to {out}: {exc}; they are in {folder / ROWS_FILE}")
    if not missing:
        return None
    return (f"recovered {len(missing)} row(s) of run {run_id} into {out}: its megamoe process (pid {info.get('pid')}) "
            f"ended before saving them (run files kept in {folder})")


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
    The run folder (plan, rows, torchrun.log, the ranks' failure records) is
    made under ``run_root`` (default: the system temporary folder) and removed
    after a run whose every point is ok, unless ``keep_run_dir``; a run with
    failed points, or one that stopped early, keeps it (``BenchResult.run_dir``).
    ``plan_extra`` adds sections to the plan the workers read (``megamoe tune``
    passes its candidate lists this way).

    Returns a :class:`BenchResult`; a run that stopped early has status
    ``failed``, a message naming the point it stopped at and the rank that
    failed first, the rows measured before it, and one failed row for the
    point in flight.  Bad input raises :class:`MegaMoEError` before anything
    starts.  An exception raised in the caller's thread while the ranks run
    (``KeyboardInterrupt``, including the CLI's SIGTERM and SIGHUP) stops every
    rank, appends the rows already finished to ``out_path`` and propagates.
    """
    points = list(points)
    device_kind, world_size, note = resolve_device(device, nproc)
    check_points(points, world_size)
    check_memory(points, device_kind, world_size)
    out = Path(out_path) if out_path is not None else None
    if out is not None:
        check_output_path(out)  # the caller says what it warns of (the CLI prints it before the run)
    total = len(points)

    def emit(kind: str, **fields: Any) -> None:
        if on_event is not None:
            on_event(BenchEvent(kind=kind, total=total, **fields))

    if out is not None:
        for message in recover_rows(out, run_root):
            emit("info", message=message)

    run_id = _new_run_id()
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
    emit("info", message=note)
    run_dir = Path(tempfile.mkdtemp(prefix=f"megamoe-bench-{run_id}-", dir=run_root))
    plan_path = run_dir / PLAN_FILE
    rows_path = run_dir / ROWS_FILE
    log_path = run_dir / LOG_FILE
    plan_path.write_text(json.dumps(plan, indent=1))
    _write_launcher_file(run_dir, run_id, out, done=False)

    rows: List[Dict[str, Any]] = []
    rows_tail = JsonlTail(rows_path)
    progress_tail = JsonlTail(run_dir / PROGRESS_FILE)
    started_at = time.monotonic()
    # What the run waits for next, and until when (each deadline includes the grace period).
    deadline = started_at + startup_timeout_s + grace_s
    waiting_for = f"the ranks did not start within {startup_timeout_s:g} s"
    overall = started_at + timeout_s if timeout_s is not None else None
    stop_reason = ""
    dead_since: Optional[float] = None
    started = -1

    def take_rows() -> None:
        # A stop signal raised between reading a row and recording it would lose the row, or
        # leave it in out_path uncounted: it waits until the rows read are all recorded.
        with SignalsHeld() as held:
            take_rows_now()
        held.deliver()

    def take_rows_now() -> None:
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

    held = SignalsHeld()
    with held, open(log_path, "wb") as log:
        proc = subprocess.Popen(
            torchrun_command(world_size, plan_path, rows_path, run_dir),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**run_environment(env), PARENT_PID_ENV: str(os.getpid())},
            start_new_session=True,
        )
        processes = RunProcesses(proc, run_dir, world_size)
    try:
        held.deliver()
        while True:
            if not processes.complete:
                processes.record()
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
    except BaseException as exc:
        _stop_run(exc, proc, processes, run_dir, grace_s, take_rows, emit, rows, total, out)
        raise
    if proc.poll() is None or any(_alive(pid) for pid in worker_pids(run_dir).values()) or processes.alive():
        terminate_run(proc, run_dir, grace_s, processes)
    take_rows()
    returncode = proc.returncode

    if returncode == 0 and len(rows) >= total and not stop_reason:
        failed = sum(1 for r in rows if r.get("status") != STATUS_OK)
        message = f"{len(rows)} point(s) measured" + (f", {failed} failed" if failed else "")
        kept = keep_run_dir or failed > 0
        if failed:
            message += f" (run files kept in {run_dir}: torchrun.log holds every rank's output and tracebacks)"
        if kept:
            _write_launcher_file(run_dir, run_id, out, done=True)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
        return BenchResult(
            STATUS_OK, message, rows, device_kind, world_size, run_id, out,
            run_dir if kept else None, total, returncode,
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
    message += f" (run files kept in {run_dir}: torchrun.log holds every rank's output and tracebacks)"
    _write_launcher_file(run_dir, run_id, out, done=True)
    emit("error", message=message)
    return BenchResult(
        STATUS_FAILED, message, rows, device_kind, world_size, run_id, out, run_dir, total, returncode
    )


def _stop_run(exc: BaseException, proc: subprocess.Popen, processes: RunProcesses, run_dir: Path,
              grace_s: float, take_rows: Callable[[], None], emit: Callable[..., None],
              rows: List[Dict[str, Any]], total: int, out: Optional[Path]) -> None:
    """The caller's thread raised while the run went on (Ctrl-C, a stop signal the CLI turned
    into an exception, a results file that could not be written): stop every rank, then append
    the rows rank 0 finished before it stopped, so what was measured is kept.  An interrupted
    run's folder goes (its rows are in ``out``); another failure's stays, and is named."""
    terminate_run(proc, run_dir, grace_s, processes)
    lost = ""
    try:
        take_rows()
    except Exception as error:  # the interruption stays what the caller sees
        lost = f"; rows after the first {len(rows)} not saved: {error}"
    if not lost:
        try:
            _write_launcher_file(run_dir, "", out, done=True)
        except OSError:
            pass
    if isinstance(exc, KeyboardInterrupt):
        where = f", in {out}" if out is not None and rows else ""
        if lost:  # the rows that did not reach ``out`` are still in the run folder's rows.jsonl
            lost += f" (they are in {run_dir / ROWS_FILE})"
        else:
            shutil.rmtree(run_dir, ignore_errors=True)
        emit("stopped", message=f"stopped: every rank ended; {len(rows)} of {total} point(s) measured{where}{lost}")
        return
    emit("stopped", message=f"stopped by an error: every rank ended; {len(rows)} of {total} point(s) "
                            f"measured{lost} (run files kept in {run_dir})")
    if isinstance(exc, MegaMoEError):
        exc.args = (f"{exc}; the run was stopped (run files kept in {run_dir})",)


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
    records = rank_failures(run_dir)
    first = first_failure(records)
    if first is not None:
        causes.append(describe_failure(first, len(records) - 1))
    else:
        fatal = _first_fatal_message(run_dir)
        if fatal:
            causes.append(fatal)
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

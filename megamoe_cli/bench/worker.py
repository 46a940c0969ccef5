"""One rank of a benchmark run; the launcher starts it under torchrun::

    python -m megamoe_cli.bench.worker --plan PLAN.json --rows ROWS.jsonl --run-dir DIR

For every point of the plan, all ranks step through the same phases (problem,
prepare, timing, check) and agree after each one (an all-gather of each rank's
error, if any).  A phase that raises on any rank turns the point into a failed
row with every rank's error text, and the sweep goes on with the next point.
Rank 0 appends each finished row to ``--rows`` at once (fsync'd), so rows
survive a later crash.

A watchdog bounds every point by its ``timeout_s``: a rank stuck past it (a
peer died inside a collective, a kernel that never ends) records the point as
failed, writes ``fatal.rank<R>.txt`` naming the point and phase, and exits
non-zero instead of hanging.

A rank that cannot go on leaves its account in two places: ``fatal.rank<R>.txt``
(read by rank 0, to say in the point's row what a lost peer died of, and by the
launcher while the run is still going) and torch.distributed.elastic's error
record, the JSON file torchrun names in ``TORCHELASTIC_ERROR_FILE`` (``main`` is
wrapped in ``@record``; the paths that leave by ``os._exit`` record their own).
torchrun hands those records to the launcher (``bench.torchrun``), which names
the rank that failed first from them.  ``RankFailed`` carries a rank's own
failure, ``LostPeerError`` a rank that only lost contact with a failed peer.

A plan with a ``tune`` section (written by ``megamoe tune``) times each point's candidate
kernel configs in lockstep instead (``bench.tune.tune_point``), and one with a ``profile``
section (``megamoe profile``) times the fused kernel alone (``bench.profile.profile_point``);
the agreement (``Worker.agree``), watchdog and row handling are the same.  How a point is set
up, timed and checked is ``bench.session``'s, for all three.

Files in ``--run-dir`` (``bench.rundir``): ``rank<R>.pid`` (so the launcher can kill ranks that
torchrun orphans), ``env.json`` (environment columns), ``progress.jsonl``
(rank 0: one line per point started) and ``fatal.rank<R>.txt``.

Imports: ``rundir``, ``session`` (module level); ``results``, ``sweep``, ``envinfo``, ``metrics``
and, for their plan sections, ``tune`` and ``profile`` (inside functions).  Nothing imports the worker: the
launcher starts it by module name.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .rundir import (ENV_FILE, FATAL_FILE, LOST_CONTACT, PID_FILE, PROGRESS_FILE, append_line, die_with_parent,
                     write_text_atomic)
from .session import RankSession, error_text, merge_errors

EXIT_TIMEOUT = 3

MAX_ERROR_CHARS = 1500
# How long rank 0 waits for a dead peer's own account before recording a lost point.
PEER_FATAL_WAIT_S = 2.0


class RowSink:
    """Rank 0's writer of finished rows; at most one row per point index."""

    def __init__(self, path: Path):
        self.path = path
        self.lock = threading.Lock()
        self.written: set = set()

    def write(self, index: int, row: Dict[str, Any]) -> None:
        from .results import append_rows

        with self.lock:
            if index in self.written:
                return
            append_rows(self.path, [row])
            self.written.add(index)


class Watchdog:
    """Ends the process when the armed deadline passes, after recording why."""

    def __init__(self, rank: int, run_dir: Path, on_expire: Callable[[str], None]):
        self.rank = rank
        self.run_dir = run_dir
        self.on_expire = on_expire
        self.lock = threading.Condition()
        self.deadline: Optional[float] = None
        self.label = ""
        self.seconds = 0.0
        self.phase = ""
        threading.Thread(target=self._loop, name="megamoe-watchdog", daemon=True).start()

    def arm(self, label: str, seconds: float) -> None:
        with self.lock:
            self.label, self.seconds, self.phase = label, seconds, ""
            self.deadline = time.monotonic() + seconds
            self.lock.notify()

    def disarm(self) -> None:
        with self.lock:
            self.deadline = None
            self.lock.notify()

    def _loop(self) -> None:
        with self.lock:
            while True:
                if self.deadline is None:
                    self.lock.wait()
                    continue
                left = self.deadline - time.monotonic()
                if left > 0:
                    self.lock.wait(timeout=left)
                    continue
                phase = f" in phase {self.phase}" if self.phase else ""
                message = (
                    f"rank {self.rank}: {self.label} did not finish within {self.seconds:g} s{phase}; "
                    "exiting instead of waiting forever"
                )
                break
        try:
            self.on_expire(message)
        finally:
            _fatal(self.run_dir, self.rank, message, RankTimeout(message))
            os._exit(EXIT_TIMEOUT)


class RankFailed(Exception):
    """This rank cannot go on; the message is the whole account: rank, point, phase, cause."""


class RankTimeout(RankFailed):
    """This rank's watchdog expired."""


class LostPeerError(Exception):
    """The ranks lost each other in the middle of a point (a peer died or hung)."""


def _fatal(run_dir: Path, rank: int, message: str, record: Optional[BaseException] = None) -> None:
    """Say why this rank stops; ``record``: also write it as the elastic error record, for a
    path that leaves by ``os._exit``, where ``@record`` on ``main`` never sees an exception."""
    print(f"megamoe worker: {message}", file=sys.stderr, flush=True)
    try:
        write_text_atomic(run_dir / FATAL_FILE.format(rank=rank), message + "\n")
    except OSError:
        pass
    if record is not None:
        try:
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler

            get_error_handler().record_exception(record)
        except Exception:
            traceback.print_exc(file=sys.stderr)


def _peer_fatal_messages(run_dir: Path, rank: int, world_size: int, wait_s: float) -> List[str]:
    """What the other ranks wrote before dying: the likely cause of a lost collective."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for peer in range(world_size):
            path = run_dir / FATAL_FILE.format(rank=peer)
            if peer != rank and path.exists():
                try:
                    found.append(path.read_text().strip())
                except OSError:
                    continue
        if found or time.monotonic() >= deadline:
            return [f for f in found if f]
        time.sleep(0.1)


class Worker:
    def __init__(self, plan: Dict[str, Any], rows_path: Path, run_dir: Path):
        import torch
        import torch.distributed as dist

        from .sweep import points_from_json

        self.torch = torch
        self.dist = dist
        self.plan = plan
        self.run_dir = run_dir
        self.points = points_from_json(plan["points"])
        self.run_id = plan["run_id"]
        self.device_kind = plan["device"]
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.sink = RowSink(rows_path) if self.rank == 0 else None
        self.env: Dict[str, Any] = {}
        self.current: Optional[Tuple[int, Any]] = None
        self.gpu = None
        self.session: Optional[RankSession] = None
        self.watchdog = Watchdog(self.rank, run_dir, self._record_in_flight_failure)

    # -- setup ------------------------------------------------------------

    def setup(self) -> None:
        torch, dist = self.torch, self.dist
        self.watchdog.arm("start-up (process group)", float(self.plan["startup_timeout_s"]))
        timeout = timedelta(seconds=max(p.timeout_s for p in self.points) + 30)
        if self.device_kind == "cuda":
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            dist.init_process_group("nccl", timeout=timeout, device_id=self.device)
            from ..errors import MegaMoEError
            from ..gpus import gpu_spec

            try:
                self.gpu = gpu_spec(torch.cuda.get_device_name(self.device))
            except MegaMoEError:
                self.gpu = None
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=timeout)
        self.group = dist.group.WORLD
        self.session = RankSession(rank=self.rank, world_size=self.world_size, device=self.device,
                                   group=self.group, barrier=self.barrier)
        if self.rank == 0:
            from . import envinfo

            self.env = envinfo.collect(self.device_kind)
            write_text_atomic(self.run_dir / ENV_FILE, json.dumps(self.env))
        self.watchdog.disarm()

    # -- helpers ----------------------------------------------------------

    def barrier(self) -> None:
        self.dist.barrier(group=self.group)

    def gather(self, value: Any) -> List[Any]:
        """All ranks' ``value``; a failure here means a peer is gone, so the run cannot go on."""
        out: List[Any] = [None] * self.world_size
        try:
            self.dist.all_gather_object(out, value, group=self.group)
        except Exception as exc:
            raise LostPeerError(
                f"{LOST_CONTACT} in phase {self.watchdog.phase}: {type(exc).__name__}: {exc}"
            ) from exc
        return out

    def agree(self, steps: Sequence[Tuple[str, Callable[[], None]]]) -> Optional[str]:
        """Run ``steps`` (name, callable) in order on every rank; after each one the ranks agree
        (an all-gather of each rank's error).  Returns None when every step passed on every rank,
        else the failed step's errors of every rank, naming them (``session.merge_errors``)."""
        for name, step in steps:
            self.watchdog.phase = name
            error = None
            try:
                step()
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                error = f"{name}: {error_text(exc)}"[:MAX_ERROR_CHARS]
            errors = self.gather(error)
            if any(errors):
                return merge_errors(errors)
        return None

    def row(self, point, **fields) -> Dict[str, Any]:
        """A result row of ``point`` measured by this run (``results.make_row``)."""
        from .results import make_row

        return make_row(
            point,
            run_id=self.run_id,
            world_size=self.world_size,
            device=self.device_kind,
            env=self.env,
            **fields,
        )

    def _record_in_flight_failure(self, message: str, prefix: str = "timeout: ") -> None:
        """Rank 0 records the point in flight as failed before the process ends."""
        if self.sink is None or self.current is None:
            return
        from .results import STATUS_FAILED

        index, point = self.current
        try:
            self.sink.write(index, self.row(point, status=STATUS_FAILED, error=prefix + message))
        except Exception:
            traceback.print_exc(file=sys.stderr)

    # -- one point --------------------------------------------------------

    def run(self) -> None:
        for index, point in enumerate(self.points):
            if self.rank == 0:
                append_line(self.run_dir / PROGRESS_FILE, json.dumps({"event": "start", "index": index}))
            self.current = (index, point)
            self.watchdog.arm(f"point {index} ({point.describe()})", point.timeout_s)
            row = self.run_point(index, point)
            self.watchdog.disarm()
            if self.sink is not None:
                self.sink.write(index, row)
            self.current = None
            self._release()

    def _release(self) -> None:
        gc.collect()
        if self.device_kind == "cuda":
            self.torch.cuda.empty_cache()

    def run_point(self, index: int, point) -> Dict[str, Any]:
        if "tune" in self.plan:
            from .tune import tune_point

            return tune_point(self, index, point)
        if "profile" in self.plan:
            from .profile import profile_point

            return profile_point(self, index, point)
        from .results import STATUS_FAILED, STATUS_OK

        session = self.session
        state: Dict[str, Any] = {}

        def problem() -> None:
            state["problem"] = session.problem(point)
            state["counts"] = session.expert_counts(state["problem"], point.num_experts)

        def prepare() -> None:
            from ..backends import get_backend

            runner = get_backend(point.backend).prepare(state["problem"], self.group, dict(point.config))
            state["runner"] = runner
            config = getattr(runner, "config", None)
            state["config"] = json.loads(json.dumps(point.config if config is None else dict(config), default=str))
            state["inputs_copy_timed"] = bool(getattr(runner, "inputs_copy_timed", True))
            session.flusher(point)

        def timing() -> None:
            state["timed"] = session.time(state["runner"], point)

        def check() -> None:
            if point.check:
                state["err_sq"] = session.reference(state["problem"]).squared_error(state["timed"].output)

        error = self.agree((("problem", problem), ("prepare", prepare), ("timing", timing), ("check", check)))
        if error is not None:
            state.clear()
            return self.row(point, status=STATUS_FAILED, error=error)

        self.watchdog.phase = "gather"
        mine = {
            "stats": state["timed"].stats,
            "counts": state["counts"],
            "num_tokens": state["problem"].num_tokens,
            "err_sq": state.get("err_sq"),
            "config": state["config"],
            "inputs_copy_timed": state["inputs_copy_timed"],
        }
        state.clear()
        everyone = self.gather(mine)
        return self._summarize(point, everyone, STATUS_OK)

    def _summarize(self, point, everyone: List[Dict[str, Any]], status: str) -> Dict[str, Any]:
        from ..errors import MegaMoEError
        from .metrics import metric_columns, traffic

        slowest = max(range(self.world_size), key=lambda r: everyone[r]["stats"].median_us)
        stats = everyone[slowest]["stats"]
        timing = {
            "time_us_median": stats.median_us,
            "time_us_min": stats.min_us,
            "time_us_max": stats.max_us,
            "slowest_rank": slowest,
        }
        try:
            model = traffic(point.shape, [e["counts"] for e in everyone], [e["num_tokens"] for e in everyone])
            metrics = metric_columns(model, stats.median_us, self.gpu)
        except MegaMoEError:
            metrics = {}
        from ..reference.layer import pooled_relative_error

        squares = [e["err_sq"] for e in everyone if e["err_sq"] is not None]
        layer, worst = pooled_relative_error(squares) if squares else (None, None)
        return self.row(
            point,
            status=status,
            timing=timing,
            metrics=metrics,
            rel_err=worst,
            rel_err_layer=layer,
            config=everyone[0]["config"],
            inputs_copy_timed=all(e["inputs_copy_timed"] for e in everyone),
        )


def _entry_point(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megamoe_cli.bench.worker")
    parser.add_argument("--plan", required=True, type=Path)
    parser.add_argument("--rows", required=True, type=Path)
    parser.add_argument("--run-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    # A rank outliving torchrun would hold its GPU and go on measuring for nobody; the rows it
    # finished are already on disk.
    die_with_parent(signal.SIGKILL)

    rank = int(os.environ.get("RANK", "0"))
    run_dir: Path = args.run_dir
    write_text_atomic(run_dir / PID_FILE.format(rank=rank), json.dumps({"pid": os.getpid(), "rank": rank}))
    worker = None
    try:
        plan = json.loads(args.plan.read_text())
        worker = Worker(plan, args.rows, run_dir)
        worker.setup()
        worker.run()
        worker.watchdog.arm("shutdown", 60.0)
        worker.dist.destroy_process_group()
        worker.watchdog.disarm()
        return 0
    except BaseException as exc:
        where = ""
        if worker is not None and worker.current is not None:
            index, point = worker.current
            where = f"point {index} ({point.describe()}): "
        lost = isinstance(exc, LostPeerError)
        message = f"rank {rank}: {where}{exc}" if lost else f"rank {rank}: {where}{type(exc).__name__}: {exc}"
        _fatal(run_dir, rank, message)
        if worker is not None and worker.current is not None and worker.sink is not None:
            causes = _peer_fatal_messages(run_dir, rank, worker.world_size, PEER_FATAL_WAIT_S)
            if causes and lost:
                # The peer's account is the cause; how this rank noticed (gloo's socket error text)
                # stays in its own error record and in torchrun.log.
                error = "; ".join(causes) + f" (rank {rank} lost contact with it in phase {worker.watchdog.phase})"
            else:
                error = "; ".join(causes + [message])
            worker._record_in_flight_failure(error[:MAX_ERROR_CHARS], prefix="")
        if not isinstance(exc, Exception):
            raise
        # Raised out of the @record entry point: written as this rank's elastic error record,
        # with the original exception's traceback chained to it.
        raise (LostPeerError if lost else RankFailed)(message) from exc


def main(argv: Optional[List[str]] = None) -> int:
    """The entry point under ``@record``: torchrun names this rank's error file in
    ``TORCHELASTIC_ERROR_FILE``, and ``record`` writes an exception that escapes the entry point
    there (message, traceback, time) before the process exits.  (Applied here, not at import,
    so importing this module for its constants does not import torch.)"""
    from torch.distributed.elastic.multiprocessing.errors import record

    return record(_entry_point)(argv)


if __name__ == "__main__":
    code = main()
    if code == 0:
        # A clean run leaves without the interpreter's teardown: every row and marker file is
        # written and synced by now, and destroying torch.distributed's C++ objects at interpreter
        # exit has aborted a rank ("terminate called without an active exception") after a clean
        # run, which the launcher then reported as a failed run.  (A failing rank exits normally,
        # so the order in which the launcher sees the ranks' causes stays as it was.)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(code)

"""One rank's side of a measurement: the problem of a point, the L2 flusher, the timing loop and
the check against the reference.  ``bench.worker`` (a bench point), ``bench.tune`` (a tune
point's candidates) and ``bench.profile`` (the kernel alone) all measure through it, so a point
is set up, timed and checked the same way whichever command asked.

Timing: each timed sample is preceded by a cross-rank barrier, so all ranks start it together and
the time includes waiting for the slowest peer inside the layer (that is what a model step sees).
On CUDA the interval is measured with events recorded on the current stream right after the
barrier; on CPU with ``time.perf_counter``.  The optional L2 flush (writing a 256 MB buffer) runs
before the barrier and is never inside the interval.

A sample is ``calls_per_sample`` calls back to back (no barrier or flush between them), reported
as the interval divided by ``calls_per_sample``: the time per call.  With the default 1 a sample
is one call right after the barrier, so it includes the ranks' host launch skew after the barrier;
with more, that skew is paid once per sample and the result approaches the steady state of a
decode step replayed from one CUDA graph (many MoE layers back to back, no host barrier between
them).

The check: the distributed reference output (``reference.layer.moe_reference_distributed``, collective)
is computed once per problem; each output is compared with it as ``reference.layer.squared_error``
(this rank's share of the layer's pooled error).

Imports: none of ``megamoe_cli.bench`` (torch, ``problem`` and ``reference`` inside the functions
that need them).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

L2_FLUSH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Stats:
    median_us: float
    min_us: float
    max_us: float

    @classmethod
    def of(cls, times_us: Sequence[float]) -> "Stats":
        if not times_us:
            raise ValueError("no timed iterations")
        return cls(statistics.median(times_us), min(times_us), max(times_us))


class L2Flusher:
    """Evicts the GPU L2 (and most of a CPU's caches) by writing a large buffer."""

    def __init__(self, device: Any, nbytes: int = L2_FLUSH_BYTES):
        import torch

        self.buffer = torch.empty(nbytes // 4, dtype=torch.int32, device=device)
        self.value = 0

    def __call__(self) -> None:
        self.value ^= 1
        self.buffer.fill_(self.value)


def _check_calls_per_sample(calls_per_sample: Any) -> None:
    if isinstance(calls_per_sample, bool) or not isinstance(calls_per_sample, int) or calls_per_sample < 1:
        raise ValueError(f"calls_per_sample must be an integer >= 1, got {calls_per_sample!r}")


def _synchronizer(device: str) -> Callable[[], None]:
    if device == "cuda":
        import torch

        return torch.cuda.synchronize
    return lambda: None


def time_sample(
    call: Callable[[], Any],
    *,
    barrier: Callable[[], None],
    device: str,
    flush: Optional[Callable[[], None]] = None,
    calls_per_sample: int = 1,
) -> Tuple[float, Any]:
    """One timed sample: (flush,) barrier, ``calls_per_sample`` calls back to back; returns
    (microseconds per call, the last call's return value)."""
    _check_calls_per_sample(calls_per_sample)
    result = None
    if device == "cuda":
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if flush is not None:
            flush()
            torch.cuda.synchronize()
        barrier()
        start.record()
        for _ in range(calls_per_sample):
            result = call()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) * 1e3 / calls_per_sample, result
    if flush is not None:
        flush()
    barrier()
    t0 = time.perf_counter()
    for _ in range(calls_per_sample):
        result = call()
    return (time.perf_counter() - t0) * 1e6 / calls_per_sample, result


def time_calls(
    call: Callable[[], Any],
    *,
    warmup: int,
    iters: int,
    barrier: Callable[[], None],
    device: str,
    flush: Optional[Callable[[], None]] = None,
    on_result: Optional[Callable[[Any], None]] = None,
    calls_per_sample: int = 1,
) -> List[float]:
    """Run ``warmup`` untimed calls then ``iters`` timed samples; return microseconds per call of each sample.

    A sample is ``calls_per_sample`` consecutive calls between one pair of events (after one
    flush and one barrier); its time is divided by ``calls_per_sample``.  ``on_result`` receives
    the last call's return value (the layer output used for the error check).
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    _check_calls_per_sample(calls_per_sample)
    result = None
    for _ in range(warmup):
        result = call()
    _synchronizer(device)()
    times_us: List[float] = []
    for _ in range(iters):
        us, result = time_sample(call, barrier=barrier, device=device, flush=flush,
                                 calls_per_sample=calls_per_sample)
        times_us.append(us)
    if on_result is not None:
        on_result(result)
    return times_us


def time_alternating(
    calls: Sequence[Callable[[], Any]],
    *,
    warmup: int,
    iters: int,
    barrier: Callable[[], None],
    device: str,
    calls_per_sample: int = 1,
) -> List[List[float]]:
    """Samples of several calls taken in turn (one of each per iteration): a clock that drifts
    over the run (a GPU heating up under prefill) weighs on each of them alike.  Returns the
    microseconds per call of each one's samples."""
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    _check_calls_per_sample(calls_per_sample)
    for call in calls:
        for _ in range(warmup):
            call()
    _synchronizer(device)()
    samples: List[List[float]] = [[] for _ in calls]
    for _ in range(iters):
        for call, into in zip(calls, samples):
            into.append(time_sample(call, barrier=barrier, device=device, calls_per_sample=calls_per_sample)[0])
    return samples


@dataclass
class Timed:
    """A point's timed samples: their statistics and the last call's output."""

    stats: Stats
    output: Any


class Reference:
    """The reference output of one problem, computed once (collective: every rank calls it)."""

    def __init__(self, problem: Any, group: Any):
        from ..reference.layer import moe_reference_distributed, squared_error

        self.y = moe_reference_distributed(problem, group)
        self.norm_sq = squared_error(self.y, self.y)[1]

    def squared_error(self, y: Any) -> Tuple[float, float]:
        """``(||y - y_ref||^2, ||y_ref||^2)``: this rank's share of the layer's pooled error."""
        from ..reference.layer import squared_error

        return squared_error(y, self.y)[0], self.norm_sq


class RankSession:
    """What one rank needs to measure points: its place in the group, its device, a barrier."""

    def __init__(self, *, rank: int, world_size: int, device: Any, group: Any = None,
                 barrier: Optional[Callable[[], None]] = None):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.device_kind = "cuda" if getattr(device, "type", device) == "cuda" else "cpu"
        self.group = group
        self.barrier = barrier or (lambda: None)
        self._flusher: Optional[L2Flusher] = None

    def problem(self, point: Any) -> Any:
        """This rank's share of ``point``'s problem (``problem.make_problem``)."""
        from ..problem import make_problem

        return make_problem(point.shape, self.rank, self.world_size,
                            point.tokens_for_rank(self.rank, self.world_size), point.num_max_tokens_per_rank,
                            device=self.device, seed=point.seed, routing=point.routing)

    def expert_counts(self, problem: Any, num_experts: int) -> List[int]:
        """Valid (token, slot) pairs this rank sends to each global expert (``bench.metrics``'s input)."""
        import torch

        valid = problem.topk_idx[problem.topk_idx >= 0]
        return torch.bincount(valid, minlength=num_experts).tolist()

    def flusher(self, point: Any) -> Optional[L2Flusher]:
        """The rank's L2 flusher when ``point`` flushes before each sample (made once per rank)."""
        if not point.flush_l2:
            return None
        if self._flusher is None:
            self._flusher = L2Flusher(self.device)
        return self._flusher

    def time(self, call: Callable[[], Any], point: Any, *, calls_per_sample: Optional[int] = None) -> Timed:
        """``point.warmup`` untimed calls, then ``point.iters`` samples of ``point.calls_per_sample``
        calls (``calls_per_sample`` overrides it), with the point's L2 flush."""
        outputs: List[Any] = []
        per_sample = getattr(point, "calls_per_sample", 1) if calls_per_sample is None else calls_per_sample
        times = time_calls(call, warmup=point.warmup, iters=point.iters, barrier=self.barrier,
                           device=self.device_kind, flush=self.flusher(point), on_result=outputs.append,
                           calls_per_sample=per_sample)
        return Timed(Stats.of(times), outputs[0])

    def reference(self, problem: Any) -> Reference:
        return Reference(problem, self.group)


def merge_errors(errors: Sequence[Optional[str]]) -> str:
    """Every rank's error (None: none) as one text naming the ranks: ``rank 1: X``,
    ``all ranks: X``, ``rank 0,2: A; rank 3: B``."""
    by_text: Dict[str, List[int]] = {}
    for rank, text in enumerate(errors):
        if text:
            by_text.setdefault(text, []).append(rank)
    parts = []
    for text, ranks in by_text.items():
        who = "all ranks" if len(ranks) == len(errors) > 1 else "rank " + ",".join(map(str, ranks))
        parts.append(f"{who}: {text}")
    return "; ".join(parts)


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def kernel_diagnostic(runner: Any) -> Optional[str]:
    """The fused kernel's own failure record (rank, phase, expected and observed) after a failed
    call, if it left one (``runner.buf.diagnostic()``; None for other backends)."""
    read = getattr(getattr(runner, "buf", None), "diagnostic", None)
    if read is None:
        return None
    try:
        return read()
    except Exception:
        return None


def load_backend(spec: str) -> Any:
    """A backend by registry name (``fused``), or by ``module:attribute`` naming a backend object
    or class (a stand-in that runs where the real one cannot, e.g. on CPU ranks in tests)."""
    if ":" not in spec:
        from ..backends import get_backend

        return get_backend(spec)
    backend = load_attribute(spec)
    return backend() if isinstance(backend, type) else backend


def load_attribute(spec: str) -> Any:
    """The attribute ``module:attribute`` names."""
    import importlib

    module_name, _, attribute = spec.partition(":")
    return getattr(importlib.import_module(module_name), attribute)

"""Timing one layer call the way every rank agrees on.

Each timed sample is preceded by a cross-rank barrier, so all ranks start it
together and the time includes waiting for the slowest peer inside the layer
(that is what a model step sees).  On CUDA the interval is measured with events
recorded on the current stream right after the barrier; on CPU with
``time.perf_counter``.  The optional L2 flush (writing a 256 MB buffer) runs
before the barrier and is never inside the interval.

A sample is ``calls_per_sample`` calls back to back (no barrier or flush
between them), reported as the interval divided by ``calls_per_sample``: the
time per call.  With the default 1 a sample is one call right after the
barrier, so it includes the ranks' host launch skew after the barrier; with
more, that skew is paid once per sample and the result approaches the steady
state of a decode step replayed from one CUDA graph (many MoE layers back to
back, no host barrier between them).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

L2_FLUSH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class Stats:
    median_us: float
    min_us: float
    max_us: float

    @classmethod
    def of(cls, times_us: List[float]) -> "Stats":
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

    A sample is ``calls_per_sample`` consecutive calls between one pair of
    events (after one flush and one barrier); its time is divided by
    ``calls_per_sample``.  ``on_result`` receives the last call's return value
    (the layer output used for the error check).
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if isinstance(calls_per_sample, bool) or not isinstance(calls_per_sample, int) or calls_per_sample < 1:
        raise ValueError(f"calls_per_sample must be an integer >= 1, got {calls_per_sample!r}")
    cuda = device == "cuda"
    if cuda:
        import torch

        sync = torch.cuda.synchronize
    else:
        def sync() -> None:
            return None

    result = None
    for _ in range(warmup):
        result = call()
    sync()

    times_us: List[float] = []
    if cuda:
        import torch

        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            if flush is not None:
                flush()
                sync()
            barrier()
            starts[i].record()
            for _ in range(calls_per_sample):
                result = call()
            ends[i].record()
            sync()
        times_us = [s.elapsed_time(e) * 1e3 / calls_per_sample for s, e in zip(starts, ends)]
    else:
        for _ in range(iters):
            if flush is not None:
                flush()
            barrier()
            t0 = time.perf_counter()
            for _ in range(calls_per_sample):
                result = call()
            times_us.append((time.perf_counter() - t0) * 1e6 / calls_per_sample)
    if on_result is not None:
        on_result(result)
    return times_us

"""Timing one layer call the way every rank agrees on.

Each timed call is preceded by a cross-rank barrier, so all ranks start it
together and the time includes waiting for the slowest peer inside the layer
(that is what a model step sees).  On CUDA the interval is measured with events
recorded on the current stream right after the barrier; on CPU with
``time.perf_counter``.  The optional L2 flush (writing a 256 MB buffer) runs
before the barrier and is never inside the interval.
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
) -> List[float]:
    """Run ``warmup`` untimed then ``iters`` timed calls; return microseconds per timed call.

    ``on_result`` receives the last call's return value (the layer output used
    for the error check).
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
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
            result = call()
            ends[i].record()
            sync()
        times_us = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)]
    else:
        for _ in range(iters):
            if flush is not None:
                flush()
            barrier()
            t0 = time.perf_counter()
            result = call()
            times_us.append((time.perf_counter() - t0) * 1e6)
    if on_result is not None:
        on_result(result)
    return times_us

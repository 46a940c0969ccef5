"""CUDA-graph replay of a layer call, shared by every ``-graph`` backend but the fused one.

Imports: torch only.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch


def capture(call: Callable[[], object], device: torch.device) -> torch.cuda.CUDAGraph:
    """``call`` captured into a CUDA graph on a side stream, ordered after the work already queued.
    The caller has made one eager call first (every rank together): it compiles kernels and sets
    up communicators, neither of which a capture may do."""
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    torch.cuda.current_stream(device).wait_stream(stream)
    return graph


class GraphReplay:
    """A runner whose ``__call__`` is ``_eager()``, or with ``graph`` set, one eager call and then
    replays of its capture.  Subclasses set ``graph``, ``problem`` (its ``device``) and ``y``."""

    graph: bool
    _graph: Optional[torch.cuda.CUDAGraph] = None

    def _eager(self) -> torch.Tensor:
        raise NotImplementedError

    def __call__(self) -> torch.Tensor:
        if not self.graph:
            return self._eager()
        if self._graph is None:
            self._eager()
            self._graph = capture(self._eager, self.problem.device)
        self._graph.replay()
        return self.y

"""DeepGEMM's fused SM90 Mega MoE (``fp8_mega_moe``): backends ``deepgemm-fused`` and
``deepgemm-fused-graph``.

One call copies this rank's FP8 tokens, their per-128 FP32 scales, ``topk_idx`` and
``topk_weights`` into DeepGEMM's symmetric buffer, then runs ``fp8_mega_moe`` (dispatch, both
expert GEMMs, SwiGLU with the clamp, combine): the same work, inputs and timed region as our
``fused`` backend's layer call.  Its symmetric buffer is made once per shape and token bound, by
every rank together, like ours.

DeepGEMM ships its SM90 fused kernel for FP8 weights only; an MXFP4 problem runs on its weights
converted once to FP8 blocks (``torch_fp8.fp8_weights_of``), and its row says so.
"""

from __future__ import annotations

from typing import Dict, Optional

import torch

from ...errors import MegaMoEError
from ...problem import Problem
from ...reference.quant import BLOCK
from ..graphs import GraphReplay
from ..torch_fp8 import fp8_weights_of
from . import DEEPGEMM, import_peer, version_of

_BUFFERS: Dict[tuple, object] = {}


def _world_group(name: str, problem: Problem):
    """The process group DeepGEMM's symmetric buffer is made over: the initialized one, or at world
    size 1 a one-rank NCCL group made here (a single process has none, and DeepGEMM needs one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    if problem.world_size != 1:
        raise MegaMoEError(f"backend {name!r}: world size {problem.world_size} needs an initialized process group")
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=problem.device)
    return dist.group.WORLD


def _check_view(name: str, what: str, tensor, dtype, shape) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape[1:]) != tuple(shape[1:]) or tensor.shape[0] < shape[0]:
        raise MegaMoEError(f"backend {name!r}: DeepGEMM's buffer holds {what} as {tensor.dtype} "
                           f"{tuple(tensor.shape)}, expected {dtype} with at least {tuple(shape)}; "
                           "this version's input layout is not the one this backend fills")


class _FusedPeerRunner(GraphReplay):
    def __init__(self, name: str, problem: Problem, group, dg, graph: bool):
        problem, weights_note = fp8_weights_of(problem)
        s = problem.shape
        self.problem, self.dg, self.graph = problem, dg, graph
        key = (id(group), s, problem.num_max_tokens_per_rank)
        buf = _BUFFERS.get(key)
        if buf is None:
            for old in _BUFFERS.values():  # every rank gets here together: a new buffer is collective
                old.destroy()
            _BUFFERS.clear()
            torch.cuda.empty_cache()
            buf = dg.get_symm_buffer_for_mega_moe(group, s.num_experts, problem.num_max_tokens_per_rank,
                                                  s.num_topk, s.hidden, s.intermediate)
            _BUFFERS[key] = buf
        self.buf = buf
        T = problem.num_tokens
        _check_view(name, "x", buf.x, problem.x.dtype, problem.x.shape)
        _check_view(name, "x_sf", buf.x_sf, torch.float32, (T, s.hidden // BLOCK))
        _check_view(name, "topk_weights", buf.topk_weights, torch.float32, problem.topk_weights.shape)
        if tuple(buf.topk_idx.shape[1:]) != (s.num_topk,):
            raise MegaMoEError(f"backend {name!r}: DeepGEMM's buffer holds topk_idx as {tuple(buf.topk_idx.shape)}, "
                               f"expected [*, {s.num_topk}]")
        self.l1, self.l2 = dg.transform_weights_for_mega_moe_sm90((problem.w1, problem.w1_sf),
                                                                  (problem.w2, problem.w2_sf))
        self.clamp = s.activation_clamp or None
        self.y = torch.empty(T, s.hidden, dtype=torch.bfloat16, device=problem.device)
        self._graph: Optional[torch.cuda.CUDAGraph] = None
        self.config = {"peer": version_of(DEEPGEMM), "kernel": "fp8_mega_moe",
                       "num_max_tokens_per_rank": int(buf.num_max_tokens_per_rank), "graph": graph}
        if weights_note:
            self.config["weights"] = weights_note

    def _eager(self) -> torch.Tensor:
        p, buf, T = self.problem, self.buf, self.problem.num_tokens
        buf.x[:T].copy_(p.x)
        buf.x_sf[:T].copy_(p.x_sf)
        buf.topk_idx[:T].copy_(p.topk_idx)
        buf.topk_weights[:T].copy_(p.topk_weights)
        self.dg.fp8_mega_moe(self.y, self.l1, self.l2, buf, activation_clamp=self.clamp)
        return self.y


class DeepGEMMFusedBackend:
    """Backends ``deepgemm-fused`` (eager) and ``deepgemm-fused-graph`` (captured after one eager
    call, then replayed); no config keys."""

    def __init__(self, graph: bool = False):
        self.graph = graph
        self.name = "deepgemm-fused-graph" if graph else "deepgemm-fused"

    def prepare(self, problem: Problem, group=None, config: Optional[dict] = None) -> _FusedPeerRunner:
        if config:
            raise MegaMoEError(f"backend {self.name!r} takes no config keys, got {', '.join(sorted(config))}")
        problem.validate()
        if problem.device.type != "cuda":
            raise MegaMoEError(f"backend {self.name!r} runs DeepGEMM's SM90 kernel and needs a Hopper GPU, "
                               f"got device {problem.device}")
        dg = import_peer(DEEPGEMM, self.name)
        if not hasattr(dg, "fp8_mega_moe"):
            raise MegaMoEError(f"backend {self.name!r}: {version_of(DEEPGEMM)} has no SM90 fp8_mega_moe")
        group = group if group is not None else _world_group(self.name, problem)
        return _FusedPeerRunner(self.name, problem, group, dg, self.graph)

"""DeepGEMM's SM90 FP8 grouped GEMMs inside our unfused pipeline: backends ``deepgemm`` and
``deepgemm-graph``.

The route, dispatch, pool and combine are the ``torch`` baseline's (``torch_fp8``), so the
pipelines differ only in their expert GEMMs:

* ``layout: contiguous`` (prefill): every expert's rows padded to DeepGEMM's M alignment in one
  pool, ``m_grouped_fp8_gemm_nt_contiguous`` with the expert of every pool row.  The eager call
  reads the filled rows' count on the host and multiplies only those, as engines do at prefill;
  the captured one cannot, and multiplies the whole worst-case pool (``-1`` rows included);
* ``layout: masked`` (decode): a fixed segment of ``max_m`` rows per local expert,
  ``m_grouped_fp8_gemm_nt_masked`` with the rows each expert received and the expected count.

Between the GEMMs, one Triton kernel applies SwiGLU (with the clamp), the routing weight and the
FP8 requantization per token per 128 channels, on the filled rows only.  Token rows are scattered
into the pool and L2 rows gathered out of it by the received rows' pool positions, so a masked
pool of mostly empty segments costs only its filled rows.  DeepGEMM reads FP32 scales of the
A operand MN-major; ours are K-major, and DeepGEMM transposes them in each call.

Both GEMMs write BF16, where the fused kernel keeps L1's output in FP32 before SwiGLU: the error
column shows what that costs.  MXFP4 problems run on their weights converted once to FP8 blocks
(``torch_fp8.fp8_weights_of``), the same values the fused kernel computes with.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from ...errors import MegaMoEError
from ...problem import Problem
from ...reference.layer import resolve_group
from ...reference.quant import BLOCK, FP8_DTYPE
from ..torch_fp8 import LaunchConfig, _Layout, _Runner
from . import DEEPGEMM, import_peer, version_of

LAYOUTS = ("auto", "contiguous", "masked")
CONFIG_KEYS = ("layout",)
# The masked layout's pool holds max_m rows for each local expert; above this many tokens over all
# ranks the contiguous layout's padding is cheaper than that.
MASKED_MAX_TOKENS = 256


def choose_layout(layout: str, world_size: int, num_max_tokens_per_rank: int) -> str:
    """``auto``: masked while every rank's tokens together are at most ``MASKED_MAX_TOKENS``
    (decode, where DeepGEMM's masked kernel is the one engines capture), contiguous above."""
    if layout != "auto":
        return layout
    return "masked" if world_size * num_max_tokens_per_rank <= MASKED_MAX_TOKENS else "contiguous"


class _MaskedLayout(_Layout):
    def __init__(self, problem: Problem, max_m: int):
        super().__init__(problem, max_m)
        self.pool = self.E_local * max_m


class _DeepGEMMRunner(_Runner):
    def __init__(self, problem: Problem, group, dg, layout: str, graph: bool):
        self.dg = dg
        self.masked = layout == "masked"
        # The FP8 masked grouped GEMM's name differs between DeepGEMM versions.
        self.masked_gemm = getattr(dg, "m_grouped_fp8_gemm_nt_masked", None) or getattr(
            dg, "m_grouped_fp8_fp4_gemm_nt_masked", None)
        if self.masked and self.masked_gemm is None:
            raise MegaMoEError(f"{version_of(DEEPGEMM)} has no FP8 masked grouped GEMM; use layout: contiguous")
        align = int(dg.get_mk_alignment_for_contiguous_layout())
        s = problem.shape
        if self.masked:
            # The most rows one expert can receive: every token of every rank, once each.
            block_m = -(-problem.world_size * problem.num_max_tokens_per_rank // align) * align
        else:
            block_m = align
        self.expected_m = max(1, math.ceil(problem.world_size * problem.num_max_tokens_per_rank * s.num_topk
                                           / s.num_experts))
        # The Triton launch knobs are unused here (no Triton GEMM runs); block_m is the pool's.
        launch = LaunchConfig(block_m=block_m, num_warps=4, l1_stages=0, l2_stages=0)
        super().__init__(problem, group, "deepgemm", launch, {}, graph, None)
        self.config.update(layout=layout, m_alignment=align, peer=version_of(DEEPGEMM))
        if self.masked:
            self.config.update(max_m=block_m, expected_m=self.expected_m)
        L, dev = self.layout, problem.device
        # Pool-ordered operands, one spare row last (where unfilled positions point).
        self.x_pool = torch.zeros(L.pool + 1, L.H, dtype=FP8_DTYPE, device=dev)
        self.xs_pool = torch.ones(L.pool + 1, L.H // BLOCK, dtype=torch.float32, device=dev)
        self.w_pool = torch.zeros(L.pool + 1, dtype=torch.float32, device=dev)
        self.h = torch.empty(L.pool, 2 * L.I, dtype=torch.bfloat16, device=dev)
        self.out = torch.empty(L.pool + 1, L.H, dtype=torch.bfloat16, device=dev)
        self.m_indices = torch.empty(L.pool, dtype=torch.int32, device=dev)

    def _make_layout(self, problem: Problem, block_m: int) -> _Layout:
        return _MaskedLayout(problem, block_m) if self.masked else _Layout(problem, block_m)

    def _segment_rows(self, per_expert: torch.Tensor) -> torch.Tensor:
        if self.masked:
            return torch.full_like(per_expert, self.layout.block_m)
        return super()._segment_rows(per_expert)

    def _experts_deepgemm(self, block_expert, seg_end, counts) -> None:
        L, p, dg = self.layout, self.problem, self.dg
        _, x_sf, weight = self._recv_views()
        pos = self.pool_pos.reshape(-1)
        src = self.src_row.reshape(-1).long()
        # Rows move as 4- and 8-byte words: index copies take one element per thread.
        self.x_pool.view(torch.int32).index_copy_(0, pos, self.recv.view(torch.int32)[src, : L.H // 4])
        self.xs_pool.index_copy_(0, pos, x_sf[src])
        self.w_pool.index_copy_(0, pos, weight[src])
        # Eager prefill sizes the GEMMs to the filled segments, as engines do (one read of the
        # counts on the host); a captured call cannot read them and runs the whole pool.
        pool = slice(0, L.pool if (self.masked or self.graph) else int(seg_end[-1].item()))
        if self.masked:
            E, m = L.E_local, L.block_m
            masked_m = counts.sum(0).to(torch.int32)
            self.masked_gemm(
                (self.x_pool[pool].view(E, m, L.H), self.xs_pool[pool].view(E, m, L.H // BLOCK)),
                (p.w1, p.w1_sf), self.h.view(E, m, 2 * L.I), masked_m, self.expected_m)
        else:
            self.m_indices.view(-1, L.block_m).copy_(block_expert.unsqueeze(1).expand(-1, L.block_m))
            dg.m_grouped_fp8_gemm_nt_contiguous((self.x_pool[pool], self.xs_pool[pool]), (p.w1, p.w1_sf),
                                                self.h[pool], self.m_indices[pool])
        self.kernels.swiglu_quant(self.h, self.w_pool, self.act, self.act_sf, group=BLOCK,
                                  activation_clamp=self.clamp, rows=pos.clamp(max=L.pool - 1))
        if self.masked:
            self.masked_gemm(
                (self.act.view(E, m, L.I), self.act_sf.view(E, m, L.I // BLOCK)), (p.w2, p.w2_sf),
                self.out[pool].view(E, m, L.H), masked_m, self.expected_m)
        else:
            dg.m_grouped_fp8_gemm_nt_contiguous((self.act[pool], self.act_sf[pool]), (p.w2, p.w2_sf),
                                                self.out[pool], self.m_indices[pool])
        self.cout.view(torch.int64).index_copy_(0, src, self.out.view(torch.int64)[pos])


class DeepGEMMBackend:
    """Backends ``deepgemm`` (eager) and ``deepgemm-graph`` (captured after one eager call, then
    replayed).  ``config`` may hold ``layout``: ``auto`` (default), ``contiguous`` or ``masked``."""

    def __init__(self, graph: bool = False):
        self.graph = graph
        self.name = "deepgemm-graph" if graph else "deepgemm"

    def prepare(self, problem: Problem, group=None, config: Optional[dict] = None) -> _DeepGEMMRunner:
        config = dict(config or {})
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise MegaMoEError(f"backend {self.name!r} takes config keys {', '.join(CONFIG_KEYS)}, "
                               f"got {', '.join(unknown)}")
        layout = config.get("layout", "auto")
        if layout not in LAYOUTS:
            raise MegaMoEError(f"backend {self.name!r}: layout must be one of {', '.join(LAYOUTS)}, got {layout!r}")
        problem.validate()
        if problem.device.type != "cuda":
            raise MegaMoEError(f"backend {self.name!r} runs DeepGEMM's SM90 kernels and needs a Hopper GPU, "
                               f"got device {problem.device}")
        s = problem.shape
        if s.hidden % BLOCK or s.intermediate % BLOCK:
            raise MegaMoEError(f"backend {self.name!r} needs hidden and intermediate multiples of {BLOCK}, "
                               f"got {s.hidden} and {s.intermediate}")
        dg = import_peer(DEEPGEMM, self.name)
        group = resolve_group(problem, group)
        if self.graph and group is not None:
            import torch.distributed as dist

            if dist.get_backend(group) != "nccl":
                raise MegaMoEError(f"backend {self.name!r} captures its all-to-alls, which needs an NCCL group, "
                                   f"got {dist.get_backend(group)}")
        layout = choose_layout(layout, problem.world_size, problem.num_max_tokens_per_rank)
        return _DeepGEMMRunner(problem, group, dg, layout, self.graph)

"""Work and traffic of one MoE layer call, and its roofline floor.

Everything here is a model of what the fused layer must move, computed from the
global routing (``counts[r][e]``: valid (token, top-k) pairs that rank ``r``
sends to global expert ``e``; expert ``e`` lives on rank ``e // E_local``).  The
same model is applied to every backend so their rows compare like for like.

Per rank ``d``:

- ``recv_pairs[d]``: pairs whose expert lives on ``d`` (from every rank);
  FLOPs ``= recv_pairs * 2 * hidden * intermediate * 3`` (L1 has 2*I outputs,
  L2 has H outputs, 2 FLOPs per multiply-add).
- weight bytes: FP8 weights and FP32 128x128-block scales of each local expert
  that receives at least one pair (an untouched expert is never read).
- HBM bytes: weight bytes + this rank's own activations in (x FP8, x scales,
  topk_idx int64, topk_weights FP32) and out (y BF16).
- NVLink: a pair whose expert lives on another rank is pulled there (FP8 row +
  FP32 scales + FP32 routing weight) and its BF16 output row is pushed back.
  ``link_in[d]`` counts bytes arriving at ``d`` (its pulls, peers' pushes of
  its tokens), ``link_out[d]`` bytes leaving it; links are full duplex, so the
  NVLink floor uses the busier direction.

Floor of the layer: ``max over ranks of max(weight_bytes / HBM_bw,
flops / FP8_peak, max(link_in, link_out) / NVLink_bw)``.  Rates reported in a
row (TFLOPS, GB/s) are per GPU: totals over ranks / world_size / time.

Imports: none of ``megamoe_cli.bench``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

from ..errors import MegaMoEError
from ..gpus import GpuSpec
from ..layout import SCALE_BLOCK, MoEShape

FP8_BYTES = 1
BF16_BYTES = 2
F32_BYTES = 4
I64_BYTES = 8


def expert_weight_bytes(shape: MoEShape) -> int:
    """L1 + L2 weights of one expert as the layer reads them: FP8 plus their per-128x128 FP32
    scales, or MXFP4 (half a byte per weight plus a byte per 32)."""
    h, i = shape.hidden, shape.intermediate
    if shape.weights == "fp4":
        return 3 * h * i // 2 + 3 * h * i // 32
    w1 = 2 * i * h * FP8_BYTES + (2 * i // SCALE_BLOCK) * (h // SCALE_BLOCK) * F32_BYTES
    w2 = h * i * FP8_BYTES + (h // SCALE_BLOCK) * (i // SCALE_BLOCK) * F32_BYTES
    return w1 + w2


def pulled_bytes_per_pair(shape: MoEShape) -> int:
    """One token row pulled for one expert: FP8 row + its scales + the routing weight."""
    return shape.hidden * FP8_BYTES + (shape.hidden // SCALE_BLOCK) * F32_BYTES + F32_BYTES


def pushed_bytes_per_pair(shape: MoEShape) -> int:
    """One BF16 output row pushed back into the source rank's combine slot."""
    return shape.hidden * BF16_BYTES


def activation_bytes(shape: MoEShape, num_tokens: int) -> int:
    """One rank's own inputs read (x, x scales, topk_idx, topk_weights) and y written."""
    h, k = shape.hidden, shape.num_topk
    bytes_in = num_tokens * (h * FP8_BYTES + (h // SCALE_BLOCK) * F32_BYTES + k * (I64_BYTES + F32_BYTES))
    bytes_out = num_tokens * h * BF16_BYTES
    return bytes_in + bytes_out


@dataclass(frozen=True)
class Traffic:
    """Per-rank work and bytes of one layer call (lists indexed by rank)."""

    num_pairs: int
    recv_pairs: List[int]
    remote_pairs_in: List[int]
    remote_pairs_out: List[int]
    flops: List[int]
    weight_bytes: List[int]
    hbm_bytes: List[int]
    link_in_bytes: List[int]
    link_out_bytes: List[int]

    @property
    def world_size(self) -> int:
        return len(self.recv_pairs)

    @property
    def nvlink_bytes(self) -> int:
        """Remote bytes moved by the whole layer (each byte counted once)."""
        return sum(self.link_in_bytes)


def traffic(shape: MoEShape, counts: Sequence[Sequence[int]], num_tokens: Sequence[int]) -> Traffic:
    """Model one call from the global routing counts ``[world_size][num_experts]``."""
    world_size = len(counts)
    if world_size == 0 or len(num_tokens) != world_size:
        raise MegaMoEError(
            f"routing counts cover {world_size} ranks and num_tokens {len(num_tokens)}; expected the same, > 0"
        )
    if shape.num_experts % world_size:
        raise MegaMoEError(
            f"num_experts={shape.num_experts} must be divisible by world_size={world_size}"
        )
    for r, row in enumerate(counts):
        if len(row) != shape.num_experts:
            raise MegaMoEError(
                f"routing counts of rank {r} have {len(row)} experts; expected num_experts={shape.num_experts}"
            )
    e_local = shape.num_experts // world_size
    owner = [e // e_local for e in range(shape.num_experts)]

    recv = [0] * world_size
    remote_in = [0] * world_size
    remote_out = [0] * world_size
    touched = [set() for _ in range(world_size)]
    for src, row in enumerate(counts):
        for e, n in enumerate(row):
            if n <= 0:
                continue
            dst = owner[e]
            recv[dst] += n
            touched[dst].add(e)
            if dst != src:
                remote_in[dst] += n
                remote_out[src] += n

    pull = pulled_bytes_per_pair(shape)
    push = pushed_bytes_per_pair(shape)
    per_expert = expert_weight_bytes(shape)
    weight = [len(t) * per_expert for t in touched]
    return Traffic(
        num_pairs=sum(recv),
        recv_pairs=recv,
        remote_pairs_in=remote_in,
        remote_pairs_out=remote_out,
        flops=[n * shape.flops_per_pair() for n in recv],
        weight_bytes=weight,
        hbm_bytes=[w + activation_bytes(shape, t) for w, t in zip(weight, num_tokens)],
        link_in_bytes=[remote_in[d] * pull + remote_out[d] * push for d in range(world_size)],
        link_out_bytes=[remote_out[d] * pull + remote_in[d] * push for d in range(world_size)],
    )


@dataclass(frozen=True)
class Floor:
    seconds: float
    bound: str  # "hbm", "compute" or "nvlink": the term that sets the floor


def floor_terms(t: Traffic, spec: GpuSpec) -> Dict[str, float]:
    """Seconds each resource alone needs on the busiest rank: ``hbm`` (its touched experts'
    weights read once), ``compute`` (its FLOPs at the FP8 peak), ``nvlink`` (its busier link
    direction)."""
    return {
        "hbm": max(t.weight_bytes) / spec.hbm_bytes_per_s,
        "compute": max(t.flops) / spec.fp8_flops,
        "nvlink": max(max(a, b) for a, b in zip(t.link_in_bytes, t.link_out_bytes)) / spec.nvlink_bytes_per_s,
    }


def roofline_floor(t: Traffic, spec: GpuSpec) -> Floor:
    terms = floor_terms(t, spec)
    bound = max(terms, key=terms.__getitem__)
    return Floor(terms[bound], bound)


NAN = float("nan")


def metric_columns(t: Traffic, time_us: Optional[float], spec: Optional[GpuSpec]) -> Dict[str, Any]:
    """The metric columns of a result row (see results.COLUMNS).

    ``time_us`` is the layer time (slowest rank's median); ``None``/NaN gives
    NaN rates.  ``spec`` is the GPU the run used; ``None`` (CPU, or a GPU we
    have no facts for) leaves the floor columns NaN.
    """
    usable = time_us is not None and math.isfinite(time_us) and time_us > 0
    seconds = time_us * 1e-6 if usable else NAN
    per_gpu = t.world_size * seconds
    columns: Dict[str, Any] = {
        "num_pairs": t.num_pairs,
        "recv_pairs_max": max(t.recv_pairs),
        "tflops": sum(t.flops) / per_gpu / 1e12 if usable else NAN,
        "hbm_gbps": sum(t.hbm_bytes) / per_gpu / 1e9 if usable else NAN,
        "nvlink_gbps": t.nvlink_bytes / per_gpu / 1e9 if usable else NAN,
        "floor_us": NAN,
        "floor_fraction": NAN,
        "floor_bound": "",
    }
    if spec is not None:
        floor = roofline_floor(t, spec)
        columns["floor_us"] = floor.seconds * 1e6
        columns["floor_bound"] = floor.bound
        if usable:
            columns["floor_fraction"] = columns["floor_us"] / time_us
    return columns

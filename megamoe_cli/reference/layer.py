"""Pure-PyTorch, quantization-aware MoE reference (INTERFACES.md "Numerics").

For every valid ``(token, slot)`` pair routed to expert ``e`` with weight ``w``::

    h    = dequant(x) @ dequant(w1[e]).T                  FP32
    act  = silu(h[:, :I]) * h[:, I:] * w                   FP32
    a, s = quantize_per_token(act)                         FP8 + FP32 scales per 128 channels
    out  = bf16(dequant(a, s) @ dequant(w2[e]).T)          FP32, rounded to BF16
    y    = bf16(sum over valid slots k = 0..topk-1 of float(out_k))   FP32, slot order

Each FP32 quantity is computed in FP64 from the FP32 operands and rounded once to
FP32 (the correctly rounded FP32 result).  That makes the reference independent
of how rows are grouped into matmuls and of TF32 settings: the per-token loop,
the grouped single-process version and the distributed version agree bit for bit
(barring a rounding tie), so any difference a test sees is a real one.

Memory: one expert's dequantized weights and at most ``ROW_CHUNK`` rows are
expanded at a time.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..errors import MegaMoEError
from ..layout import MoEShape
from ..problem import Problem
from .quant import BLOCK, FP8_DTYPE, dequantize_mxfp4, dequantize_per_block, dequantize_per_token, quantize_per_token

# Rows of one expert expanded to FP64 at once (4096 x 7168 x 8 B = 235 MB).
ROW_CHUNK = 4096


def _problem_from_args(
    op: str,
    x: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w1_sf: torch.Tensor,
    w2: torch.Tensor,
    w2_sf: torch.Tensor,
    activation_clamp: float = 0.0,
) -> Problem:
    """Validate single-process arguments (all experts local) through :meth:`Problem.validate`."""
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.dim() != 2:
        got = tuple(topk_idx.shape) if isinstance(topk_idx, torch.Tensor) else type(topk_idx).__name__
        raise MegaMoEError(f"{op}: topk_idx must be 2-D [num_tokens, num_topk], got {got}")
    if not isinstance(w1, torch.Tensor) or w1.dim() != 3:
        got = tuple(w1.shape) if isinstance(w1, torch.Tensor) else type(w1).__name__
        raise MegaMoEError(f"{op}: w1 must be 3-D [num_experts, 2*intermediate, hidden], got {got}")
    num_tokens, num_topk = topk_idx.shape
    num_experts, two_i, hidden = w1.shape
    weights = "fp4" if w1.dtype == torch.uint8 else "fp8"
    if weights == "fp4":
        hidden *= 2  # two e2m1 codes per byte
    if two_i % 2:
        raise MegaMoEError(f"{op}: w1 dim 1 must be 2*intermediate (even), got {two_i}")
    try:
        shape = MoEShape(hidden=hidden, intermediate=two_i // 2, num_experts=num_experts, num_topk=num_topk,
                         weights=weights, activation_clamp=activation_clamp)
        problem = Problem(
            shape, 0, 1, num_tokens, max(num_tokens, 1), x, x_sf, topk_idx, topk_weights, w1, w1_sf, w2, w2_sf
        )
        return problem.validate()
    except MegaMoEError as err:
        raise MegaMoEError(f"{op}: {err}") from None


def _dequantize_expert(
    w1: torch.Tensor, w1_sf: torch.Tensor, w2: torch.Tensor, w2_sf: torch.Tensor, e: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One expert's weights dequantized in FP32 and widened (exactly) to FP64: FP8 times its block
    scale, or MXFP4's e2m1 times 2^s (exact)."""
    if w1.dtype == torch.uint8:
        return dequantize_mxfp4(w1[e], w1_sf[e]).double(), dequantize_mxfp4(w2[e], w2_sf[e]).double()
    return dequantize_per_block(w1[e], w1_sf[e]).double(), dequantize_per_block(w2[e], w2_sf[e]).double()


def gather_rows(t: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``t[idx]`` along dim 0; FP8 rows move as bytes (not every build indexes FP8 on CUDA)."""
    if t.dtype == FP8_DTYPE:
        return t.view(torch.uint8)[idx].view(FP8_DTYPE)
    return t[idx]


def swiglu(gate: torch.Tensor, up: torch.Tensor, activation_clamp: float = 0.0) -> torch.Tensor:
    """``silu(gate) * up``, after ``gate <= c`` and ``-c <= up <= c`` when a clamp ``c`` is set."""
    if activation_clamp:
        gate = gate.clamp(max=activation_clamp)
        up = up.clamp(-activation_clamp, activation_clamp)
    return F.silu(gate) * up


def _expert_rows(
    x: torch.Tensor, x_sf: torch.Tensor, weights: torch.Tensor, w1_64: torch.Tensor, w2_64: torch.Tensor,
    activation_clamp: float = 0.0,
) -> torch.Tensor:
    """Rows ``x`` (fp8) through one expert, each scaled by its routing weight: bf16 ``[n, hidden]``."""
    intermediate = w2_64.shape[1]
    out = torch.empty(x.shape[0], w2_64.shape[0], dtype=torch.bfloat16, device=x.device)
    for start in range(0, x.shape[0], ROW_CHUNK):
        end = min(start + ROW_CHUNK, x.shape[0])
        x64 = dequantize_per_token(x[start:end], x_sf[start:end]).double()
        h = (x64 @ w1_64.T).float().double()
        gate, up = h[:, :intermediate], h[:, intermediate:]
        act = (swiglu(gate, up, activation_clamp) * weights[start:end].double().unsqueeze(1)).float()
        act_q, act_sf = quantize_per_token(act)
        a64 = dequantize_per_token(act_q, act_sf).double()
        out[start:end] = (a64 @ w2_64.T).float().bfloat16()
    return out


def combine_slots(slots: torch.Tensor) -> torch.Tensor:
    """``slots [T, topk, H]`` bf16 (zeros where the slot is -1) -> FP32 slot-order sum -> bf16 ``y``.

    Adding an empty slot's +0.0 leaves the FP32 sum unchanged, so this equals
    skipping -1 slots; a token without valid slots sums to zeros.
    """
    acc = torch.zeros(slots.shape[0], slots.shape[2], dtype=torch.float32, device=slots.device)
    for k in range(slots.shape[1]):
        acc += slots[:, k].float()
    return acc.bfloat16()


def pairs_by_expert(topk_idx: torch.Tensor, num_experts: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Valid flat pair ids ``token*topk + k`` sorted by expert (stable), and counts per expert [E]."""
    flat = topk_idx.reshape(-1)
    pairs = torch.nonzero(flat >= 0).squeeze(1)
    experts = flat[pairs]
    order = torch.argsort(experts, stable=True)
    pairs = pairs[order]
    counts = torch.bincount(experts, minlength=num_experts)
    return pairs, counts


def moe_reference_loop(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w1_sf: torch.Tensor,
    w2: torch.Tensor,
    w2_sf: torch.Tensor,
    activation_clamp: float = 0.0,
) -> torch.Tensor:
    """The recipe written token by token, slot by slot (all experts local; small shapes only)."""
    p = _problem_from_args("moe_reference_loop", x, x_sf, topk_idx, topk_weights, w1, w1_sf, w2, w2_sf,
                           activation_clamp)
    intermediate = p.shape.intermediate
    y = torch.zeros(p.num_tokens, p.shape.hidden, dtype=torch.bfloat16, device=x.device)
    experts: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
    idx_host = topk_idx.tolist()
    w_host = topk_weights.tolist()
    for t in range(p.num_tokens):
        x64 = dequantize_per_token(x[t : t + 1], x_sf[t : t + 1]).double()
        acc = torch.zeros(1, p.shape.hidden, dtype=torch.float32, device=x.device)
        for k in range(p.shape.num_topk):
            e = idx_host[t][k]
            if e < 0:
                continue
            if e not in experts:
                experts[e] = _dequantize_expert(w1, w1_sf, w2, w2_sf, e)
            w1_64, w2_64 = experts[e]
            h = (x64 @ w1_64.T).float()
            gate, up = h[:, :intermediate].double(), h[:, intermediate:].double()
            act = (swiglu(gate, up, activation_clamp) * w_host[t][k]).float()
            act_q, act_sf = quantize_per_token(act)
            out = (dequantize_per_token(act_q, act_sf).double() @ w2_64.T).float().bfloat16()
            acc = acc + out.float()
        y[t] = acc[0].bfloat16()
    return y


def moe_reference(
    x: torch.Tensor,
    x_sf: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    w1: torch.Tensor,
    w1_sf: torch.Tensor,
    w2: torch.Tensor,
    w2_sf: torch.Tensor,
    activation_clamp: float = 0.0,
) -> torch.Tensor:
    """Single process, all experts local, rows grouped by expert: bf16 ``y [num_tokens, hidden]``.
    FP8 or MXFP4 weights (SPEC §2b; uint8 ``w1``/``w2`` are MXFP4), with the SwiGLU clamp if given."""
    p = _problem_from_args("moe_reference", x, x_sf, topk_idx, topk_weights, w1, w1_sf, w2, w2_sf,
                           activation_clamp)
    T, K, H = p.num_tokens, p.shape.num_topk, p.shape.hidden
    pairs, counts = pairs_by_expert(topk_idx, p.shape.num_experts)
    flat_weights = topk_weights.reshape(-1)
    slots = torch.zeros(T * K, H, dtype=torch.bfloat16, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n == 0:
            continue
        ids = pairs[start : start + n]
        start += n
        tokens = ids // K
        w1_64, w2_64 = _dequantize_expert(w1, w1_sf, w2, w2_sf, e)
        slots[ids] = _expert_rows(gather_rows(x, tokens), x_sf[tokens], flat_weights[ids], w1_64, w2_64,
                                  activation_clamp)
    return combine_slots(slots.view(T, K, H))


# ---------------------------------------------------------------------------
# Expert parallelism over torch.distributed (gloo on CPU, NCCL on CUDA)
# ---------------------------------------------------------------------------


def resolve_group(problem: Problem, group) -> Optional[object]:
    """The process group to use for ``problem`` (None = single process); checks rank and size agree."""
    import torch.distributed as dist

    if problem.world_size == 1 and (group is None or not dist.is_initialized()):
        return None
    if not dist.is_available() or not dist.is_initialized():
        raise MegaMoEError(
            f"world_size={problem.world_size} needs an initialized torch.distributed process group, got none"
        )
    group = group if group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != problem.world_size or rank != problem.rank:
        raise MegaMoEError(
            f"problem is rank {problem.rank} of {problem.world_size}, "
            f"but the process group says rank {rank} of {size}"
        )
    return group


def exchange_counts(send_counts: torch.Tensor, world_size: int, group) -> torch.Tensor:
    """All-to-all of per-expert pair counts.

    ``send_counts [num_experts]`` int64 (pairs this rank sends to each global
    expert) -> ``[world_size, E_local]``: row ``r`` = pairs rank ``r`` sends to each
    of this rank's local experts.
    """
    import torch.distributed as dist

    staged = _host_staged(send_counts, group)
    recv = torch.empty_like(staged)
    dist.all_to_all_single(recv, staged.contiguous(), group=group)
    return recv.to(send_counts.device).view(world_size, -1)


def _host_staged(t: torch.Tensor, group) -> torch.Tensor:
    """``t`` on the host when ``group`` is gloo and ``t`` is on a GPU (gloo's all-to-all takes host
    tensors; a gloo group is what runs more ranks than GPUs), else ``t``."""
    import torch.distributed as dist

    if t.is_cuda and dist.get_backend(group) == "gloo":
        return t.cpu()
    return t


def all_to_all_rows(
    send: torch.Tensor, send_splits: List[int], recv_splits: List[int], group
) -> torch.Tensor:
    """Variable-size all-to-all of byte rows ``send [n, B]`` uint8 -> ``[sum(recv_splits), B]``.

    Rows travel as raw bytes so one collective carries FP8 values, FP32 scales
    and weights together (gloo has no FP8 all-to-all).
    """
    import torch.distributed as dist

    staged = _host_staged(send, group)
    recv = torch.empty(sum(recv_splits), send.shape[1], dtype=torch.uint8, device=staged.device)
    dist.all_to_all_single(
        recv, staged.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits, group=group
    )
    return recv.to(send.device)


def pack_rows(*parts: torch.Tensor) -> torch.Tensor:
    """Concatenate 2-D row tensors of any dtypes into one uint8 ``[n, total_bytes]``."""
    return torch.cat([p.contiguous().view(torch.uint8) for p in parts], dim=1)


def unpack_rows(packed: torch.Tensor, *layout: Tuple[torch.dtype, int]) -> List[torch.Tensor]:
    """Inverse of :func:`pack_rows`: ``layout`` lists ``(dtype, columns)`` per part."""
    out, offset = [], 0
    for dtype, cols in layout:
        nbytes = cols * torch.empty((), dtype=dtype).element_size()
        out.append(packed[:, offset : offset + nbytes].contiguous().view(dtype))
        offset += nbytes
    return out


def moe_reference_distributed(problem: Problem, group=None) -> torch.Tensor:
    """Expert-parallel reference: every rank calls it collectively with its own ``problem``.

    Counts go first, then one all-to-all carries each valid pair's FP8 row,
    scales and routing weight to the rank owning its expert; that rank runs its
    local experts and sends BF16 rows back in the order they came; the source
    combines in slot order.  Equals :func:`moe_reference` on the union of all
    ranks' tokens and experts.
    """
    problem.validate()
    group = resolve_group(problem, group)
    if group is None:
        return moe_reference(
            problem.x, problem.x_sf, problem.topk_idx, problem.topk_weights,
            problem.w1, problem.w1_sf, problem.w2, problem.w2_sf, problem.shape.activation_clamp,
        )
    R, E_local = problem.world_size, problem.num_experts_per_rank
    T, K, H = problem.num_tokens, problem.shape.num_topk, problem.shape.hidden
    dev = problem.device

    # Dispatch: pairs sorted by expert are also sorted by destination rank.
    pairs, counts = pairs_by_expert(problem.topk_idx, problem.shape.num_experts)
    recv_counts = exchange_counts(counts, R, group)
    send_splits = counts.view(R, E_local).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()
    tokens = pairs // K
    send = pack_rows(
        gather_rows(problem.x, tokens), problem.x_sf[tokens], problem.topk_weights.reshape(-1)[pairs].unsqueeze(1)
    )
    recv = all_to_all_rows(send, send_splits, recv_splits, group)
    x_q, x_sf, weights = unpack_rows(recv, (FP8_DTYPE, H), (torch.float32, H // BLOCK), (torch.float32, 1))
    weights = weights.squeeze(1)

    # Local experts: received rows are source-major, expert-sorted within each source.
    local_expert = torch.repeat_interleave(
        torch.arange(E_local, device=dev).repeat(R), recv_counts.reshape(-1)
    )
    order = torch.argsort(local_expert, stable=True)
    out = torch.empty(recv.shape[0], H, dtype=torch.bfloat16, device=dev)
    start = 0
    for e, n in enumerate(recv_counts.sum(0).tolist()):
        if n == 0:
            continue
        rows = order[start : start + n]
        start += n
        w1_64, w2_64 = _dequantize_expert(problem.w1, problem.w1_sf, problem.w2, problem.w2_sf, e)
        out[rows] = _expert_rows(gather_rows(x_q, rows), x_sf[rows], weights[rows], w1_64, w2_64,
                                 problem.shape.activation_clamp)

    # Combine: rows come back in the order this rank sent them.
    back = all_to_all_rows(out.view(torch.uint8), recv_splits, send_splits, group).view(torch.bfloat16)
    slots = torch.zeros(T * K, H, dtype=torch.bfloat16, device=dev)
    slots[pairs] = back
    return combine_slots(slots.view(T, K, H))


class _ReferenceRunner:
    def __init__(self, problem: Problem, group) -> None:
        self.problem = problem
        self.group = group
        self.config = {
            "algorithm": "single_process" if group is None else "all_to_all",
            "accumulate": "fp64, rounded to fp32",
        }

    def __call__(self) -> torch.Tensor:
        return moe_reference_distributed(self.problem, self.group)


class ReferenceBackend:
    """Backend ``reference``: the quantization-aware reference behind the backend contract."""

    name = "reference"

    def prepare(self, problem: Problem, group=None, config: Optional[dict] = None) -> _ReferenceRunner:
        if config:
            raise MegaMoEError(f"backend 'reference' takes no config keys, got {sorted(config)}")
        problem.validate()
        return _ReferenceRunner(problem, resolve_group(problem, group))


def squared_error(y: torch.Tensor, y_ref: torch.Tensor) -> Tuple[float, float]:
    """``(||y - y_ref||^2, ||y_ref||^2)`` in FP64: one rank's share of :func:`pooled_relative_error`."""
    if tuple(y.shape) != tuple(y_ref.shape):
        raise MegaMoEError(f"squared_error: y has shape {tuple(y.shape)}, the reference {tuple(y_ref.shape)}")
    ref = y_ref.double()
    return float((y.double() - ref).pow(2).sum()), float(ref.pow(2).sum())


def pooled_relative_error(per_rank: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """``(layer, worst_rank)`` from every rank's :func:`squared_error`: the relative L2 error
    ``||y - y_ref|| / ||y_ref||`` of the whole layer (every rank's rows pooled) and the largest of
    the ranks' own.

    Tests and ``megamoe tune`` judge the layer's error.  A kernel's FP32 activations differ from the
    reference's in the last bits, and where that crosses an FP8 rounding boundary the requantized
    value moves a whole FP8 step (up to 1/14 of its block's largest value), so a rank holding one
    token, whose error is a handful of such steps, scatters far more than the layer does
    (``scripts/tolerance_model.py``).  Either value is 0 where its reference norm is 0 and the
    outputs agree, inf where they do not or where anything is not finite."""

    def ratio(d: float, n: float) -> float:
        if not (math.isfinite(d) and math.isfinite(n)):
            return math.inf
        if n == 0.0:
            return 0.0 if d == 0.0 else math.inf
        return math.sqrt(d / n)

    per_rank = [(float(d), float(n)) for d, n in per_rank]
    layer = ratio(sum(d for d, _ in per_rank), sum(n for _, n in per_rank))
    return layer, max((ratio(d, n) for d, n in per_rank), default=0.0)

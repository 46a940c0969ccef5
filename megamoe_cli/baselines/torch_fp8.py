"""The unfused FP8 expert-parallel MoE layer a Hopper user writes from PyTorch and Triton: the
baseline the fused kernel is measured against (backends ``torch`` and ``torch-graph``).

One call (``runner()``) makes no host synchronization, so the whole layer can be captured into a
CUDA graph (``torch-graph`` replays it, as ``fused-graph`` does for the fused layer):

1. route (device): the valid ``(token, slot)`` pairs sorted by expert; each pair gets a row in
   its owner's segment of a send buffer, and the per-expert counts go into that segment's header;
2. dispatch: one ``all_to_all_single`` of fixed-size segments (NCCL on GPUs, gloo on CPU ranks).
   A segment holds ``capacity = num_max_tokens_per_rank * num_topk`` rows, each an FP8 token row,
   its per-128 FP32 scales and the routing weight: the most one rank can send to one peer.  Every
   call moves whole segments, the price of sizes that no host has to read;
3. pool (device): the received rows are numbered expert-major, each expert's rows padded to
   ``block_m``, so block ``b`` of the pool belongs to one expert (``block_expert[b]``, -1 unused);
4. L1 GEMM + SwiGLU x routing weight + FP8 requantization per token per 128 channels;
5. L2 GEMM, whose BF16 rows go straight into the combine send buffer, in the order they came;
6. combine: ``all_to_all_single`` back, then the FP32 sum of each token's slots in slot order.

The quantization points are the fused layer's (docs/INTERFACES.md, Numerics): FP8 rows with
1x128 scales, FP8 weights with 128x128 block scales, FP32 accumulation promoted per 128-K block,
FP32 L1 output, the activation requantized per token per 128 channels, BF16 L2 rows, FP32 combine.

GEMMs (config key ``gemm``):

* ``triton`` (default on CUDA): ``triton_fp8``'s block-scaled FP8 grouped GEMMs; L1's
  epilogue does SwiGLU and the requantization, L2 writes the combine rows;
* ``scaled_grouped_mm``: ``torch._scaled_grouped_mm``, one call per layer GEMM.  On Hopper it
  takes row-wise scales only, so this candidate runs a row-wise FP8 recipe instead: weights
  requantized with one scale per output channel once in ``prepare``, token rows and activations
  with one scale per row in the call.  Its error against the reference is therefore larger;
* ``scaled_mm``: block-scaled ``torch._scaled_mm`` per expert on its rows padded to a multiple of
  16 (cuBLAS refuses other row counts).  The per-expert sizes are read on the host, one sync per
  call, so it runs eagerly only;
* ``dequant`` (default on CPU): per expert, FP32 matmuls of the dequantized operands, sizes read
  on the host.

``$MEGAMOE_TORCH_GEMM`` names the GEMM when the config does not (``megamoe bench`` times each
candidate through it: ``MEGAMOE_TORCH_GEMM=scaled_mm megamoe bench --backend torch``); rows
record the GEMM that ran in their config.

Launch configs of the ``triton`` GEMMs (``LaunchConfig``: block_m, num_warps, the L1 and L2
pipeline depths, L2's output tile width ``l2_block_n`` and the launch-order grouping ``group_m``)
come from, key by key: the config the caller gives; else the tuned store
(``tuned.lookup_nearest`` under the ``baseline`` kernel: the user's store, then the one shipped
in ``megamoe_cli/data``, written by ``megamoe tune --backend torch-graph``), keyed by the GPU,
world size, shape, FP8 weights (MXFP4 layers run these GEMMs on their converted weights) and
the nearest token bucket of ``num_max_tokens_per_rank``; else ``default_launch_config``.  Rows
record which in ``config_source`` (``given``, ``tuned``, ``default``, or ``tuned+given`` /
``default+given`` for a partial config), with the entry (``tuned_entry``, ``tuned_store``) or why
there was none (``config_note``).  ``prepare`` compiles and loads both GEMMs for the config, so one
the GPU cannot run (shared memory, registers, a failed compile) is refused there, in one line.

``triton`` runs on CPU tensors too under Triton's interpreter (``TRITON_INTERPRET=1`` set before
``megamoe_cli.baselines.triton_fp8`` is imported), which is how the CPU tests check the kernels.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import torch

from ..errors import MegaMoEError
from ..kernel import tuned
from ..kernel.kernel_source import MAX_SMEM_BYTES  # sm_90's opt-in shared memory per block
from ..kernel.weight_layout import mxfp4_as_fp8_blocks
from ..problem import Problem
from ..reference.layer import resolve_group, swiglu
from ..reference.quant import BLOCK, FP8_DTYPE, FP8_MAX, dequantize_per_block, dequantize_per_token, quantize_per_token
from .graphs import GraphReplay

GEMMS = ("triton", "scaled_grouped_mm", "scaled_mm", "dequant")
# GEMMs whose call reads nothing on the host, so the layer can be captured into a CUDA graph.
CAPTURABLE_GEMMS = ("triton", "scaled_grouped_mm")
# The Triton GEMMs' launch knobs: what a tuned entry holds.
LAUNCH_KEYS = ("block_m", "num_warps", "num_stages", "l2_block_n", "group_m")
CONFIG_KEYS = ("gemm",) + LAUNCH_KEYS
# The GEMM to run when the config names none (the config's own key wins).
ENV_GEMM = "MEGAMOE_TORCH_GEMM"
BLOCK_MS = (16, 32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4, 5, 6)
# The L2 GEMM's output tile width (the L1 GEMM's is one scale block of activations, 128): a
# power of two that the 128-channel weight scale blocks tile whole.
L2_BLOCK_NS = (64, 128, 256)
L2_BLOCK_N = 128
GROUP_MS = (1, 2, 4, 8, 16, 32)
GROUP_M = 8


def default_block_m(world_size: int, num_max_tokens_per_rank: int, num_topk: int, num_experts: int) -> int:
    """Rows per pool block from the expected rows per expert at full buffers: the smallest block
    that holds them up to 64 (decode: 1-16 tokens/rank on 256 experts give 16), 128 from 256
    rows per expert (prefill: 8192 tokens/rank at 2 ranks give 512)."""
    rows = world_size * num_max_tokens_per_rank * num_topk / num_experts
    for block_m in BLOCK_MS[:3]:
        if rows <= block_m:
            return block_m
    return 128 if rows >= 256 else 64


def default_launch(block_m: int) -> Tuple[int, int, int]:
    """``(num_warps, L1 stages, L2 stages)``: two warpgroups for 128-row tiles; L1 loads two
    weight tiles (gate and up) per K step, so it keeps one stage fewer in shared memory."""
    return (8 if block_m == 128 else 4), 3, 4


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """One launch config of the Triton GEMMs: pool block rows, warps per program, the L1 and L2
    software-pipeline depths, L2's output tile width and how many row blocks share a weight
    tile in launch order."""

    block_m: int
    num_warps: int
    l1_stages: int
    l2_stages: int
    l2_block_n: int = L2_BLOCK_N
    group_m: int = GROUP_M

    def to_config(self) -> Dict[str, Any]:
        """The form configs, rows and the tuned store use (``num_stages`` as ``[L1, L2]``)."""
        return {"block_m": self.block_m, "num_warps": self.num_warps,
                "num_stages": [self.l1_stages, self.l2_stages], "l2_block_n": self.l2_block_n,
                "group_m": self.group_m}

    @property
    def label(self) -> str:
        stages = (str(self.l1_stages) if self.l1_stages == self.l2_stages
                  else f"{self.l1_stages}/{self.l2_stages}")
        return (f"block_m={self.block_m} num_warps={self.num_warps} num_stages={stages} "
                f"l2_block_n={self.l2_block_n} group_m={self.group_m}")

    def smem_floor_bytes(self) -> int:
        """Shared memory the deeper of the two GEMMs' pipelines needs at the least: an FP8 A
        tile and its weight tiles (L1: gate and up) in every stage but the one being consumed.
        Triton may need more (its epilogue's layout conversions), which loading it finds."""
        l1 = (self.l1_stages - 1) * (self.block_m * BLOCK + 2 * BLOCK * BLOCK)
        l2 = (self.l2_stages - 1) * (self.block_m * BLOCK + BLOCK * self.l2_block_n)
        return max(l1, l2)

    def problem(self, hidden: int) -> str:
        """Why this config cannot run at a layer of this ``hidden`` ('' when it may)."""
        if hidden % self.l2_block_n:
            return f"l2_block_n={self.l2_block_n} does not divide hidden={hidden}"
        need = self.smem_floor_bytes()
        if need > MAX_SMEM_BYTES:
            return (f"its pipelines need at least {need} bytes of shared memory, more than the "
                    f"{MAX_SMEM_BYTES} a Hopper block can have")
        return ""


def default_launch_config(world_size: int, num_max_tokens_per_rank: int, num_topk: int,
                          num_experts: int) -> LaunchConfig:
    """The launch config without a tuned entry: :func:`default_block_m` and :func:`default_launch`."""
    block_m = default_block_m(world_size, num_max_tokens_per_rank, num_topk, num_experts)
    num_warps, l1_stages, l2_stages = default_launch(block_m)
    return LaunchConfig(block_m, num_warps, l1_stages, l2_stages)


def _launch_over(base: LaunchConfig, config: Mapping[str, Any]) -> LaunchConfig:
    """``base`` with the launch keys ``config`` gives, each checked (MegaMoEError names the key)."""
    block_m = _int_key("block_m", config, BLOCK_MS, base.block_m)
    num_warps = _int_key("num_warps", config, NUM_WARPS, base.num_warps)
    l1_stages, l2_stages = base.l1_stages, base.l2_stages
    if "num_stages" in config:
        value = config["num_stages"]
        if isinstance(value, (list, tuple)):
            if len(value) != 2:
                raise MegaMoEError(f"num_stages must be one depth or [L1, L2], got {value!r}")
            l1_stages = _int_key("num_stages", {"num_stages": value[0]}, NUM_STAGES, 0)
            l2_stages = _int_key("num_stages", {"num_stages": value[1]}, NUM_STAGES, 0)
        else:
            l1_stages = l2_stages = _int_key("num_stages", config, NUM_STAGES, 0)
    l2_block_n = _int_key("l2_block_n", config, L2_BLOCK_NS, base.l2_block_n)
    group_m = _int_key("group_m", config, GROUP_MS, base.group_m)
    return LaunchConfig(block_m, num_warps, l1_stages, l2_stages, l2_block_n, group_m)


def baseline_stores() -> Tuple[Path, ...]:
    """The tuned stores the baseline reads, first hit wins: the user's, then the shipped one."""
    user = tuned.default_path()
    shipped = tuned.SHIPPED_BASELINE_PATH
    return (user,) if user.resolve() == shipped.resolve() else (user, shipped)


def tuned_key(problem: Problem, gpu: str) -> tuned.TunedKey:
    """The key the baseline looks its launch config up by: FP8 weights whatever the layer's
    format, since an MXFP4 layer runs the same FP8 GEMMs on its weights converted once."""
    shape = dataclasses.replace(problem.shape, weights="fp8")
    return tuned.make_key(gpu, problem.world_size, shape, problem.num_max_tokens_per_rank,
                          kernel=tuned.BASELINE_KERNEL)


def resolve_launch(problem: Problem, config: Mapping[str, Any], gpu: Optional[str],
                   stores: Optional[Sequence[os.PathLike]] = None) -> Tuple[LaunchConfig, Dict[str, Any]]:
    """``(launch config, what the row records about where it came from)`` for ``problem`` (its
    weights FP8) on ``gpu`` (None: no GPU to key a tuned entry by).  Keys ``config`` gives win,
    then the nearest-bucket tuned entry of the first store in ``stores`` that has one
    (default :func:`baseline_stores`), then :func:`default_launch_config`."""
    s = problem.shape
    default = default_launch_config(problem.world_size, problem.num_max_tokens_per_rank, s.num_topk, s.num_experts)
    given = {key: config[key] for key in LAUNCH_KEYS if key in config}
    if {"block_m", "num_warps", "num_stages"} <= set(given):
        return _launch_over(default, given), {"config_source": "given"}
    found, why_none = None, ""
    if gpu is None:
        why_none = "no GPU to key a tuned entry by"
    else:
        try:
            key = tuned_key(problem, gpu)
        except MegaMoEError as exc:  # a GPU the tuned store does not know
            key, why_none = None, str(exc)
        if key is not None:
            paths = [Path(p) for p in (stores if stores is not None else baseline_stores())]
            for path in paths:
                hit = tuned.lookup_nearest(key, path)
                if hit is not None:
                    found = (path, hit[0], hit[1])
                    break
            else:
                why_none = f"no tuned entry for {key} in {' or '.join(str(p) for p in paths)}"
    suffix = "+given" if given else ""
    if found is None:
        return _launch_over(default, given), {"config_source": "default" + suffix, "config_note": why_none}
    path, stored_key, entry = found
    try:
        base = _launch_over(default, {k: v for k, v in entry.items() if k in LAUNCH_KEYS})
    except MegaMoEError as exc:
        raise MegaMoEError(f"tuned config {path}, entry {stored_key}: {exc}") from None
    return _launch_over(base, given), {"config_source": "tuned" + suffix, "tuned_entry": str(stored_key),
                                        "tuned_store": store_name(path)}


def store_name(path: os.PathLike) -> str:
    """How rows name a store: the shipped one by its place in the package (the same on every
    machine), any other by its path."""
    return tuned.SHIPPED_BASELINE_NAME if Path(path) == tuned.SHIPPED_BASELINE_PATH else str(path)


def _gpu_name(device: torch.device) -> Optional[str]:
    """The GPU a tuned entry is keyed by (None off CUDA)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def _triton_kernels():
    """``triton_fp8`` if its kernels can run here, else the reason they cannot."""
    try:
        from . import triton_fp8
    except ImportError as exc:
        return None, f"triton is not importable ({exc})"
    return triton_fp8, None


def _probe_scaled_grouped_mm(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return "torch._scaled_grouped_mm needs CUDA"
    if not hasattr(torch, "_scaled_grouped_mm"):
        return "torch._scaled_grouped_mm is missing"
    try:
        a = torch.randn(32, 128, device=device).to(FP8_DTYPE)
        b = torch.randn(2, 128, 128, device=device).to(FP8_DTYPE)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        out = torch._scaled_grouped_mm(a, b.transpose(1, 2), torch.ones(32, device=device),
                                       torch.ones(2, 128, device=device), offs=offs, out_dtype=torch.bfloat16)
        want = torch.cat([a[:16].float() @ b[0].float().T, a[16:].float() @ b[1].float().T])
        err = float((out.float() - want).norm() / want.norm())
    except Exception as exc:  # any failure of an optional kernel means "not here"
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None if err < 2e-2 else f"relative error {err:.3g} against the FP32 product"


def _probe_scaled_mm(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return "block-scaled torch._scaled_mm needs CUDA"
    try:
        xq, x_sf = quantize_per_token(torch.randn(16, 256, device=device))
        wq = torch.randn(128, 256, device=device).to(FP8_DTYPE)
        w_sf = torch.ones(1, 2, device=device)
        got = _scaled_mm_block(xq, x_sf, wq, w_sf, torch.float32)
        want = dequantize_per_token(xq, x_sf) @ wq.float().T
        err = float((got - want).norm() / want.norm())
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None if err < 2e-2 else f"relative error {err:.3g} against the FP32 product"


def _scaled_mm_block(xq, x_sf, w, w_sf, out_dtype):
    """``dequant(xq) @ dequant(w).T`` with 1x128 (x) and 128x128 (w) block scales (cuBLAS)."""
    # cuBLAS wants the 1x128 scales M-major; w.t() is the column-major B operand, w_sf.t() its scales.
    return torch._scaled_mm(xq, w.t(), scale_a=x_sf.t().contiguous().t(), scale_b=w_sf.t(), out_dtype=out_dtype)


def _requantize_rowwise(w: torch.Tensor, w_sf: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled expert weights ``[E, N, K]`` as FP8 with one scale per output channel ``[E, N]``."""
    q = torch.empty_like(w)
    scales = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        v = dequantize_per_block(w[e], w_sf[e])
        scales[e] = v.abs().amax(dim=1).clamp_min(1e-4) / FP8_MAX
        q[e] = (v / scales[e].unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


class _Layout:
    """Sizes of the exchange buffers and the pool, the same on every rank."""

    def __init__(self, problem: Problem, block_m: int):
        s = problem.shape
        self.R, self.E_local = problem.world_size, problem.num_experts_per_rank
        self.H, self.I, self.K, self.E = s.hidden, s.intermediate, s.num_topk, s.num_experts
        self.block_m = block_m
        # One dispatched row: FP8 token row | FP32 scales (one per 128 channels) | FP32 routing weight.
        self.sf_bytes = 4 * (self.H // BLOCK)
        self.row_bytes = self.H + self.sf_bytes + 4
        self.capacity = problem.num_max_tokens_per_rank * self.K
        # Header rows at the start of each segment carry the per-local-expert counts (int32).
        self.header_rows = -(-4 * self.E_local // self.row_bytes)
        self.segment = self.header_rows + self.capacity
        self.rows = self.R * self.segment           # rows exchanged; row `rows` is a spare one
        self.pool = -(-(self.R * self.capacity + self.E_local * (block_m - 1)) // block_m) * block_m


def fp8_weights_of(problem: Problem) -> Tuple[Problem, Optional[str]]:
    """The problem with FP8 weights, and what its rows say about them: an MXFP4 problem's weights
    as FP8 and 128x128 block scales, converted once (the values the fused kernel's expansion
    computes with, weight_layout.mxfp4_as_fp8_blocks), read by the baseline's FP8 GEMMs at a byte
    per weight; an FP8 problem as it is (no note)."""
    if problem.shape.weights != "fp4":
        return problem, None
    w1, w1_sf = mxfp4_as_fp8_blocks(problem.w1, problem.w1_sf)
    w2, w2_sf = mxfp4_as_fp8_blocks(problem.w2, problem.w2_sf)
    shape = dataclasses.replace(problem.shape, weights="fp8")
    converted = dataclasses.replace(problem, shape=shape, w1=w1, w1_sf=w1_sf, w2=w2, w2_sf=w2_sf)
    return converted, "fp4 converted once to fp8 (read as fp8)"


class _Runner(GraphReplay):
    def __init__(self, problem: Problem, group, gemm: str, launch: LaunchConfig, source: Dict[str, Any],
                 graph: bool, note: Optional[str]):
        self.clamp = problem.shape.activation_clamp
        problem, weights_note = fp8_weights_of(problem)
        self.problem = problem
        self.group = group
        self.gemm = gemm
        self.graph = graph
        self.launch = launch
        block_m = launch.block_m
        L = self.layout = self._make_layout(problem, block_m)
        dev = problem.device
        self.kernels = _triton_kernels()[0] if (gemm != "dequant") else None
        self.staged = group is not None and dev.type == "cuda" and _backend(group) == "gloo"
        self.config = {
            "gemm": gemm,
            "block_m": block_m,
            "dispatch": "local" if group is None else "padded_all_to_all",
            "capacity_rows": L.capacity,
            "combine": "triton" if self.kernels is not None else "torch",
            "graph": graph,
        }
        if gemm == "triton":
            self.config.update(launch.to_config())
        self.config.update(source)
        if note:
            self.config["gemm_fallback_reason"] = note
        if weights_note:
            self.config["weights"] = weights_note

        T, K = problem.num_tokens, L.K
        i32, i64 = torch.int32, torch.int64
        # Dispatch buffers; row L.rows is where invalid pairs go (never sent) and, on the receive
        # side, an all-zero row that padding rows of the pool read.
        self.send = torch.zeros(L.rows + 1, L.row_bytes, dtype=torch.uint8, device=dev)
        self.recv = self.send if group is None else torch.zeros_like(self.send)
        self.pair_token = torch.arange(T * K, device=dev) // K
        self.ones = torch.ones(T * K, dtype=i64, device=dev)
        self.pair_index = torch.arange(T * K, device=dev)
        self.pos = torch.empty(T * K, dtype=i64, device=dev)
        # Pool maps.
        self.src_row = (torch.arange(L.R, device=dev).unsqueeze(1) * L.segment + L.header_rows
                        + torch.arange(L.capacity, device=dev).unsqueeze(0)).to(i32)  # [R, capacity]
        self.row_in_src = torch.arange(L.capacity, device=dev).expand(L.R, L.capacity).contiguous()
        self.pool_src = torch.empty(L.pool + 1, dtype=i32, device=dev)
        self.block_starts = torch.arange(0, L.pool, block_m, device=dev)
        self.block_expert = torch.empty(L.pool // block_m, dtype=i32, device=dev)
        # L1 output (FP8 activations with per-128 scales) and the combine buffers.
        self.act = torch.empty(L.pool, L.I, dtype=FP8_DTYPE, device=dev)
        self.act_sf = torch.empty(L.pool, L.I // BLOCK, dtype=torch.float32, device=dev)
        self.cout = torch.zeros(L.rows + 1, L.H, dtype=torch.bfloat16, device=dev)
        self.cback = self.cout if group is None else torch.zeros(L.rows, L.H, dtype=torch.bfloat16, device=dev)
        self.y = torch.empty(T, L.H, dtype=torch.bfloat16, device=dev)
        if gemm == "scaled_grouped_mm":
            self.w1_rw, self.w1_rs = _requantize_rowwise(problem.w1, problem.w1_sf)
            self.w2_rw, self.w2_rs = _requantize_rowwise(problem.w2, problem.w2_sf)
        self._graph: Optional[torch.cuda.CUDAGraph] = None

    def _make_layout(self, problem: Problem, block_m: int) -> _Layout:
        return _Layout(problem, block_m)

    def _segment_rows(self, per_expert: torch.Tensor) -> torch.Tensor:
        """Pool rows each local expert's segment takes: its rows rounded up to ``block_m``."""
        return (per_expert + self.layout.block_m - 1) // self.layout.block_m * self.layout.block_m

    # -- one call ------------------------------------------------------------

    def _eager(self) -> torch.Tensor:
        self._dispatch()
        block_expert, seg_end, counts = self._pool()
        getattr(self, f"_experts_{self.gemm}")(block_expert, seg_end, counts)
        self._combine()
        return self.y

    def _exchange(self, out: torch.Tensor, inp: torch.Tensor) -> None:
        """Equal-split all-to-all of ``inp`` into ``out`` (GPU tensors over a gloo group go through the host)."""
        import torch.distributed as dist

        if self.staged:
            host = inp.cpu()
            got = torch.empty_like(host)
            dist.all_to_all_single(got, host, group=self.group)
            out.copy_(got)
        else:
            dist.all_to_all_single(out, inp, group=self.group)

    def _dispatch(self) -> None:
        p, L = self.problem, self.layout
        flat = p.topk_idx.reshape(-1)
        valid = flat >= 0
        key = torch.where(valid, flat, L.E)            # no expert sorts last
        order = torch.argsort(key, stable=True)
        sorted_key = key[order]
        counts = torch.zeros(L.E + 1, dtype=torch.int64, device=p.device).scatter_add_(0, key, self.ones)
        per_rank = counts[: L.E].view(L.R, L.E_local).sum(1)
        rank_start = per_rank.cumsum(0) - per_rank
        dest = torch.clamp(sorted_key // L.E_local, max=L.R - 1)
        slot = dest * L.segment + L.header_rows + (self.pair_index - rank_start[dest])
        slot = torch.where(sorted_key < L.E, slot, L.rows)
        self.pos.scatter_(0, order, slot)
        self.pair_valid = valid

        send, tokens, H, S = self.send, self.pair_token, L.H, L.sf_bytes
        # Copied as 4-byte words (a row's parts are multiples of 4 bytes): index copies move one
        # element per thread, so byte elements would take four times the work.
        words, h4, s4 = send.view(torch.int32), H // 4, (H + S) // 4
        words[:, :h4].index_copy_(0, self.pos, p.x.view(torch.int32)[tokens])
        words[:, h4:s4].index_copy_(0, self.pos, p.x_sf.view(torch.int32)[tokens])
        words[:, s4:].index_copy_(0, self.pos, p.topk_weights.reshape(-1, 1).view(torch.int32))
        header = send[: L.rows].view(L.R, L.segment, L.row_bytes)[:, : L.header_rows].flatten(1)
        header[:, : 4 * L.E_local].copy_(counts[: L.E].view(L.R, L.E_local).to(torch.int32).view(torch.uint8))
        if self.group is not None:
            self._exchange(self.recv[: L.rows], send[: L.rows])

    def _pool(self):
        """Number the received rows expert-major; returns ``block_expert``, each expert's padded
        segment end in the pool and the rows it received from each source ``[R, E_local]``."""
        L = self.layout
        header = self.recv[: L.rows].view(L.R, L.segment, L.row_bytes)[:, : L.header_rows].flatten(1)
        counts = header[:, : 4 * L.E_local].view(torch.int32).long()          # [R, E_local]
        src_end = counts.cumsum(1)
        expert = torch.searchsorted(src_end, self.row_in_src, right=True)    # [R, capacity]
        valid = expert < L.E_local
        expert = expert.clamp(max=L.E_local - 1)
        within = self.row_in_src - (src_end - counts).gather(1, expert)
        per_expert = counts.sum(0)
        padded = self._segment_rows(per_expert)
        seg_end = padded.cumsum(0)
        before_src = (counts.cumsum(0) - counts).gather(1, expert)           # same expert, earlier sources
        pool_pos = (seg_end - padded)[expert] + before_src + within
        pool_pos = torch.where(valid, pool_pos, L.pool)
        self.pool_pos = pool_pos                                             # [R, capacity]
        self.pool_src.fill_(L.rows)
        self.pool_src.scatter_(0, pool_pos.reshape(-1), self.src_row.reshape(-1))
        block = torch.searchsorted(seg_end, self.block_starts, right=True)
        self.block_expert.copy_(torch.where(block < L.E_local, block, -1))
        return self.block_expert, seg_end, counts

    def _recv_views(self):
        """The received rows as FP8 token rows, FP32 scales and FP32 routing weights (views)."""
        L = self.layout
        words = self.recv.view(torch.float32)
        h4, s4 = L.H // 4, L.sf_bytes // 4
        return self.recv.view(FP8_DTYPE), words[:, h4 : h4 + s4], words[:, h4 + s4]

    def _pool_inputs(self):
        """Token rows, scales and weights gathered into pool order (padding rows read the zero row)."""
        x, x_sf, weight = self._recv_views()
        rows = self.pool_src[: self.layout.pool].long()
        return x[:, : self.layout.H].view(torch.uint8)[rows].view(FP8_DTYPE), x_sf[rows], weight[rows]

    # -- expert GEMMs ----------------------------------------------------------

    def _experts_triton(self, block_expert, seg_end, counts, compile_only: bool = False):
        L, k, p, c = self.layout, self.kernels, self.problem, self.launch
        x, x_sf, weight = self._recv_views()
        l1 = k.grouped_gemm_swiglu(x, x_sf, self.pool_src, weight, p.w1, p.w1_sf, block_expert, self.act,
                                   self.act_sf, block_m=c.block_m, num_warps=c.num_warps, num_stages=c.l1_stages,
                                   group_m=c.group_m, activation_clamp=self.clamp, compile_only=compile_only)
        l2 = k.grouped_gemm(self.act, self.act_sf, p.w2, p.w2_sf, block_expert, self.cout, self.pool_src, L.rows,
                            block_m=c.block_m, block_n=c.l2_block_n, num_warps=c.num_warps,
                            num_stages=c.l2_stages, group_m=c.group_m, compile_only=compile_only)
        return l1, l2

    def compile(self) -> None:
        """Compile and load both Triton GEMMs for this launch config, launching nothing (CUDA only:
        the interpreter compiles nothing)."""
        if self.gemm == "triton" and self.problem.device.type == "cuda":
            self._experts_triton(self.block_expert, None, None, compile_only=True)

    def _experts_scaled_grouped_mm(self, block_expert, seg_end, counts) -> None:
        L, k = self.layout, self.kernels
        xq, x_sf, weight = self._pool_inputs()
        # The row-wise recipe: one scale per token row (from its dequantized values).
        xd = dequantize_per_token(xq, x_sf)
        x_rs = xd.abs().amax(dim=1).clamp_min(1e-4) / FP8_MAX
        xq_rw = (xd / x_rs.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        offs = seg_end.to(torch.int32)
        h = torch._scaled_grouped_mm(xq_rw, self.w1_rw.transpose(1, 2), x_rs, self.w1_rs, offs=offs,
                                     out_dtype=torch.bfloat16)
        act_rs = torch.empty(L.pool, 1, dtype=torch.float32, device=h.device)
        k.swiglu_quant(h, weight, self.act, act_rs, group=L.I, activation_clamp=self.clamp)
        out = torch._scaled_grouped_mm(self.act, self.w2_rw.transpose(1, 2), act_rs.view(-1), self.w2_rs,
                                       offs=offs, out_dtype=torch.bfloat16)
        self.cout.index_copy_(0, self.pool_src[: L.pool].long(), out)

    def _experts_scaled_mm(self, block_expert, seg_end, counts) -> None:
        L, k, p = self.layout, self.kernels, self.problem
        xq, x_sf, weight = self._pool_inputs()
        h = torch.empty(L.pool, 2 * L.I, dtype=torch.float32, device=xq.device)
        bounds = self._expert_rows(seg_end, counts, multiple=16)
        for e, start, end, _ in bounds:
            h[start:end] = _scaled_mm_block(xq[start:end], x_sf[start:end], p.w1[e], p.w1_sf[e], torch.float32)
        k.swiglu_quant(h, weight, self.act, self.act_sf, group=BLOCK, activation_clamp=self.clamp)
        for e, start, end, n in bounds:
            out = _scaled_mm_block(self.act[start:end], self.act_sf[start:end], p.w2[e], p.w2_sf[e], torch.bfloat16)
            self.cout[self.pool_src[start : start + n].long()] = out[:n]

    def _experts_dequant(self, block_expert, seg_end, counts) -> None:
        p = self.problem
        xq, x_sf, weight = self._pool_inputs()
        for e, start, _, n in self._expert_rows(seg_end, counts, multiple=1):
            rows = slice(start, start + n)
            h = dequantize_per_token(xq[rows], x_sf[rows]) @ dequantize_per_block(p.w1[e], p.w1_sf[e]).T
            act = swiglu(h[:, : self.layout.I], h[:, self.layout.I :], self.clamp) * weight[rows].unsqueeze(1)
            aq, a_sf = quantize_per_token(act)
            out = dequantize_per_token(aq, a_sf) @ dequantize_per_block(p.w2[e], p.w2_sf[e]).T
            self.cout[self.pool_src[rows].long()] = out.bfloat16()

    def _expert_rows(self, seg_end, counts, multiple: int):
        """``(expert, first pool row, end row rounded up to ``multiple``, rows)`` of each expert with
        rows, read on the host (the one sync of the GEMMs that need sizes)."""
        per_expert = counts.sum(0).tolist()
        ends = seg_end.tolist()
        out = []
        for e, n in enumerate(per_expert):
            if n:
                start = ends[e] - -(-n // self.layout.block_m) * self.layout.block_m
                out.append((e, start, start + -(-n // multiple) * multiple, n))
        return out

    # -- combine -----------------------------------------------------------------

    def _combine(self) -> None:
        L, p = self.layout, self.problem
        if self.group is not None:
            self._exchange(self.cback, self.cout[: L.rows])
        pos = torch.where(self.pair_valid, self.pos, -1).view(p.num_tokens, L.K)
        if self.kernels is not None:
            self.kernels.combine(self.cback, pos, self.y)
            return
        slots = torch.where((pos >= 0).unsqueeze(2), self.cback[pos.clamp(min=0)], 0).float()
        acc = torch.zeros(p.num_tokens, L.H, dtype=torch.float32, device=slots.device)
        for k in range(L.K):
            acc += slots[:, k]
        self.y.copy_(acc)


def _backend(group) -> str:
    import torch.distributed as dist

    return dist.get_backend(group)


def _int_key(name: str, config: dict, choices: Tuple[int, ...], default: int) -> int:
    value = config.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value not in choices:
        raise MegaMoEError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    return value


class TorchFP8Backend:
    """Backends ``torch`` (eager) and ``torch-graph`` (``graph=True``: the call captured into a CUDA
    graph after one eager call, then replayed); see the module docstring.

    ``config`` may hold ``gemm`` (``auto`` or one of ``GEMMS``) and the Triton GEMMs' launch keys:
    ``block_m`` (16, 32, 64, 128), ``num_warps`` (4, 8), ``num_stages`` (2-6, or ``[L1, L2]``),
    ``l2_block_n`` (64, 128, 256) and ``group_m``; keys left out come from the tuned store or the
    defaults (module docstring).  Every GEMM uses ``block_m`` (the pool's block rows).
    """

    def __init__(self, graph: bool = False):
        self.graph = graph
        self.name = "torch-graph" if graph else "torch"

    def prepare(self, problem: Problem, group=None, config: Optional[dict] = None) -> _Runner:
        config = dict(config or {})
        unknown = sorted(set(config) - set(CONFIG_KEYS))
        if unknown:
            raise MegaMoEError(
                f"backend {self.name!r} takes config keys {', '.join(CONFIG_KEYS)}, got {', '.join(unknown)}"
            )
        try:
            gemm = config.get("gemm", os.environ.get(ENV_GEMM) or "auto")
            if gemm not in GEMMS + ("auto",):
                source = "gemm" if "gemm" in config else f"${ENV_GEMM}"
                raise MegaMoEError(f"{source} must be one of auto, {', '.join(GEMMS)}, got {gemm!r}")
            s = problem.shape
            # Every key is checked, whatever the store then fills in.
            _launch_over(default_launch_config(1, 1, 1, 1), config)
        except MegaMoEError as err:
            raise MegaMoEError(f"backend {self.name!r}: {err}") from None
        problem.validate()
        group = resolve_group(problem, group)
        dev = problem.device
        gemm, note = self._choose_gemm(gemm, dev)
        try:
            launch, source = resolve_launch(problem, config, _gpu_name(dev) if gemm == "triton" else None)
        except MegaMoEError as err:
            raise MegaMoEError(f"backend {self.name!r}: {err}") from None
        if gemm != "triton":
            source = {k: v for k, v in source.items() if k == "config_source"}
            source["config_note"] = f"gemm={gemm} takes block_m only; the tuned store configures the triton GEMMs"
        if self.graph:
            if dev.type != "cuda":
                raise MegaMoEError(f"backend {self.name!r} needs CUDA (CUDA graphs), got device {dev}")
            if gemm not in CAPTURABLE_GEMMS:
                raise MegaMoEError(
                    f"backend {self.name!r}: gemm={gemm!r} reads expert sizes on the host and cannot be "
                    f"captured; use one of {', '.join(CAPTURABLE_GEMMS)}"
                )
            if group is not None and _backend(group) != "nccl":
                raise MegaMoEError(
                    f"backend {self.name!r} captures its all-to-alls, which needs an NCCL group, got "
                    f"{_backend(group)}"
                )
        if s.intermediate % BLOCK or s.hidden % BLOCK:
            raise MegaMoEError(
                f"backend {self.name!r} needs hidden and intermediate multiples of {BLOCK}, got "
                f"{s.hidden} and {s.intermediate}"
            )
        if gemm == "triton":
            why = launch.problem(s.hidden)
            if why:
                raise MegaMoEError(f"backend {self.name!r}: launch config {launch.label} ({source['config_source']}) "
                                   f"cannot run: {why}")
        runner = _Runner(problem, group, gemm, launch, source, self.graph, note)
        try:
            runner.compile()
        except Exception as exc:  # whatever Triton raises for a config this GPU cannot run
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise MegaMoEError(f"backend {self.name!r}: launch config {launch.label} ({source['config_source']}) "
                               f"does not compile or load here: {type(exc).__name__}: {first}") from None
        return runner

    def _choose_gemm(self, gemm: str, device: torch.device) -> Tuple[str, Optional[str]]:
        """The GEMM to run and, when ``auto`` fell back, why."""
        kernels, why_not = _triton_kernels()
        if why_not is None and device.type != "cuda" and not kernels.INTERPRETED:
            why_not = ("its kernels run on CPU tensors only in Triton's interpreter (TRITON_INTERPRET=1 "
                       "set before megamoe_cli.baselines.triton_fp8 is imported)")
        if gemm == "auto":
            if device.type != "cuda":
                return "dequant", None
            if why_not is None:
                return "triton", None
            probe = _probe_scaled_grouped_mm(device)
            if probe is None:
                return "scaled_grouped_mm", f"triton: {why_not}"
            return "dequant", f"triton: {why_not}; scaled_grouped_mm: {probe}"
        if gemm == "dequant":
            return gemm, None
        if why_not is not None:
            # Every GEMM but dequant runs a Triton kernel (the L1 one, or SwiGLU + requant).
            raise MegaMoEError(f"backend {self.name!r}: gemm={gemm!r} needs Triton kernels: {why_not}")
        probe = {"scaled_grouped_mm": _probe_scaled_grouped_mm, "scaled_mm": _probe_scaled_mm}.get(gemm)
        why = probe(device) if probe else None
        if why:
            raise MegaMoEError(f"backend {self.name!r}: gemm={gemm!r} does not work here ({why})")
        return gemm, None

"""Triton kernels of the unfused FP8 baseline (``megamoe_cli.baselines.torch_fp8``).

* :func:`grouped_gemm_swiglu`: L1, a block-scaled FP8 grouped GEMM over rows grouped by expert
  (the kind vLLM runs for DeepSeek-V3 FP8 on Hopper), whose epilogue computes
  ``silu(gate) * up * weight`` and requantizes it to FP8 per token per 128 channels;
* :func:`grouped_gemm`: L2, the same GEMM writing BF16 rows to the rows a map names;
* :func:`swiglu_quant`: SwiGLU x routing weight + requantization as one kernel, for GEMMs that
  write the L1 output to memory (the ``torch._scaled_*`` candidates);
* :func:`combine`: the FP32 sum of a token's top-k rows in slot order, BF16 ``y``.

GEMM operands follow the DeepSeek-V3 recipe: FP8 e4m3 activations with one FP32 scale per row
per 128 columns of K, FP8 weights ``[E, N, K]`` with one FP32 scale per 128x128 block.  The K
loop steps 128 at a time, and each step's tensor-core partial is scaled by ``sfa * sfb`` and
added to the FP32 accumulator (per-128-K promotion, as the fused kernel does).

Rows are grouped by expert in blocks of ``block_m``: ``block_expert[b]`` is the local expert of
rows ``b*block_m ..`` (or -1: the block is unused and its programs return at once), so the grid
has a fixed size and no host ever reads how many rows each expert got.

Every FP8 and BF16 value is rounded to nearest-even explicitly before the conversion
(:func:`_round_e4m3`, :func:`_round_bf16`), so the conversion itself is exact: the result is the
same under the GPU's ``cvt.rn`` and under Triton's CPU interpreter (``TRITON_INTERPRET=1``, used
by the CPU tests), whose conversions neither round ties to even nor carry a rounded-up mantissa
into the exponent.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ..reference.quant import AMAX_FLOOR, BLOCK, FP8_MAX

# The K step and the width of one requantized activation block: the recipe's scale block.
BLOCK_K = BLOCK
# Blocks of rows of one weight tile reuse it while it is in L2 (grouped launch order); the
# default of the ``group_m`` launch knob.
GROUP_M = 8
# Triton decides at decoration time whether a kernel is compiled or interpreted.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _round_e4m3(v):
    """``v`` (FP32, |v| <= 448) rounded to the nearest e4m3 value, ties to even, as FP32."""
    bits = v.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    sign = bits & -0x80000000
    # Normal e4m3 (|v| >= 2^-6): keep 3 mantissa bits; a carry moves into the exponent.
    normal = (mag + 0x7FFFF + ((mag >> 20) & 1)) & 0x7FF00000
    # Subnormal e4m3: multiples of 2^-9 (all products and differences here are exact).
    steps = mag.to(tl.float32, bitcast=True) * 512.0
    whole = steps.to(tl.int32)
    frac = steps - whole.to(tl.float32)
    up = (frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))
    sub = ((whole + up.to(tl.int32)).to(tl.float32) * (1.0 / 512.0)).to(tl.int32, bitcast=True)
    return (tl.where(mag < 0x3C800000, sub, normal) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _round_bf16(v):
    """FP32 ``v`` rounded to the nearest BF16 value, ties to even, as FP32 (finite ``v``)."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_rows(act, FLOOR: tl.constexpr, QMAX: tl.constexpr):
    """Quantize each row of ``act`` [R, C] with one scale (quant.py's operations, correctly
    rounded): returns the FP8 values as exact FP32 and the scales [R]."""
    amax = tl.max(tl.abs(act), axis=1)
    sf = tl.math.div_rn(tl.maximum(amax, FLOOR), tl.full(amax.shape, QMAX, tl.float32))
    inv = tl.math.div_rn(tl.full(sf.shape, 1.0, tl.float32), sf)
    q = _round_e4m3(tl.clamp(act * inv[:, None], -QMAX, QMAX))
    return q, sf


# The pool's block count and the rows dropped change with every problem size: left unspecialized,
# one compiled kernel serves them all (a tune or a sweep compiles once per launch config).
@triton.jit(do_not_specialize=["num_blocks", "out_skip"])
def _grouped_gemm_kernel(
    a_ptr, stride_am,           # FP8 A rows
    a_sf_ptr, stride_asm,       # FP32 A scales, one per row per 128 K
    a_rows_ptr,                 # int32 A row of each pool row (A_INDIRECT), else the pool row
    weight_ptr, stride_wm,      # FP32 routing weight per A row (SWIGLU)
    w_ptr, w_sf_ptr,            # FP8 weights [E, N_W, K], FP32 scales [E, N_W/128, K/128]
    block_expert_ptr,           # int32 local expert per block of BLOCK_M pool rows, -1 = unused
    out_ptr, stride_om,         # SWIGLU: FP8 act [pool, N]; else BF16 rows
    out_sf_ptr,                 # SWIGLU: FP32 act scales [pool, N/128]
    out_rows_ptr, out_skip,     # not SWIGLU: int32 output row of each pool row; rows >= out_skip are dropped
    num_blocks, N, K,
    A_INDIRECT: tl.constexpr,
    SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    CLAMP: tl.constexpr = 0.0,  # the SwiGLU clamp (0: none)
):
    # Grouped launch order: GROUP_M row blocks share one weight tile
    pid = tl.program_id(0)
    num_pid_n = N // BLOCK_N
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    group_m = tl.minimum(num_blocks - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    if A_INDIRECT:
        a_rows = tl.load(a_rows_ptr + offs_m).to(tl.int64)
    else:
        a_rows = offs_m.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    num_k = K // BLOCK_K
    if SWIGLU:
        w_rows = 2 * N
    else:
        w_rows = N
    w_base = expert.to(tl.int64) * w_rows * K
    sf_base = expert.to(tl.int64) * (w_rows // BLOCK_K) * num_k

    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    a_sf_ptrs = a_sf_ptr + a_rows * stride_asm
    # B tiles [BLOCK_K, BLOCK_N] of W[e] ([N_W, K], K contiguous); gate rows, then up rows N below
    b_ptrs = w_ptr + w_base + offs_n[None, :].to(tl.int64) * K + offs_k[:, None]
    b_sf_ptrs = w_sf_ptr + sf_base + (offs_n // BLOCK_K) * num_k
    up_ptrs = b_ptrs + N * K
    up_sf_ptrs = b_sf_ptrs + (N // BLOCK_K) * num_k
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    # K loop, promoted per 128-K block
    for kb in range(0, num_k):
        a = tl.load(a_ptrs)
        a_s = tl.load(a_sf_ptrs + kb)
        b = tl.load(b_ptrs)
        b_s = tl.load(b_sf_ptrs + kb)
        acc += tl.dot(a, b) * (a_s[:, None] * b_s[None, :])
        if SWIGLU:
            u = tl.load(up_ptrs)
            u_s = tl.load(up_sf_ptrs + kb)
            acc_up += tl.dot(a, u) * (a_s[:, None] * u_s[None, :])
            up_ptrs += BLOCK_K
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K

    if SWIGLU:
        # SwiGLU x routing weight, requantized per row per 128 channels (BLOCK_N == 128)
        w = tl.load(weight_ptr + a_rows * stride_wm)
        if CLAMP > 0:
            acc = tl.minimum(acc, CLAMP)
            acc_up = tl.minimum(tl.maximum(acc_up, -CLAMP), CLAMP)
        act = acc / (1.0 + tl.exp(-acc)) * acc_up * w[:, None]
        q, sf = _quantize_rows(act, FLOOR, QMAX)
        rows = offs_m.to(tl.int64)
        tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], q.to(out_ptr.dtype.element_ty))
        tl.store(out_sf_ptr + rows * (N // BLOCK_K) + pid_n, sf)
    else:
        rows = tl.load(out_rows_ptr + offs_m)
        keep = rows < out_skip
        ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(ptrs, _round_bf16(acc).to(out_ptr.dtype.element_ty), mask=keep[:, None])


@triton.jit
def _swiglu_quant_kernel(
    h_ptr, stride_hm,           # L1 output [rows, 2*N] (gate, then up), FP32 or BF16
    weight_ptr,                 # FP32 routing weight per row
    q_ptr, stride_qm,           # FP8 [rows, N]
    sf_ptr, stride_sm,          # FP32 [rows, N / GROUP]
    N,
    GROUP: tl.constexpr,        # channels per scale: 128 (the recipe) or the whole row
    BLOCK: tl.constexpr,        # channels per program, a multiple of GROUP
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
    CLAMP: tl.constexpr = 0.0,  # the SwiGLU clamp (0: none)
    rows_ptr=None,              # int64 row of each program (None: program i does row i)
):
    if rows_ptr is None:
        row = tl.program_id(0).to(tl.int64)
    else:
        row = tl.load(rows_ptr + tl.program_id(0)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    gate = tl.load(h_ptr + row * stride_hm + offs, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * stride_hm + N + offs, mask=valid, other=0.0).to(tl.float32)
    w = tl.load(weight_ptr + row)
    if CLAMP > 0:
        gate = tl.minimum(gate, CLAMP)
        up = tl.minimum(tl.maximum(up, -CLAMP), CLAMP)
    act = gate / (1.0 + tl.exp(-gate)) * up * w
    q, sf = _quantize_rows(tl.reshape(act, (BLOCK // GROUP, GROUP)), FLOOR, QMAX)
    tl.store(q_ptr + row * stride_qm + offs, tl.reshape(q, (BLOCK,)).to(q_ptr.dtype.element_ty), mask=valid)
    blocks = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
    tl.store(sf_ptr + row * stride_sm + blocks, sf, mask=blocks * GROUP < N)


@triton.jit
def _quantize_kernel(
    x_ptr, stride_xm,           # [rows, N], FP32 or BF16
    q_ptr, stride_qm,           # FP8 [rows, N]
    sf_ptr, stride_sm,          # FP32 [rows, N / GROUP]
    N,
    GROUP: tl.constexpr,
    BLOCK: tl.constexpr,
    FLOOR: tl.constexpr,
    QMAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    v = tl.load(x_ptr + row * stride_xm + offs, mask=valid, other=0.0).to(tl.float32)
    q, sf = _quantize_rows(tl.reshape(v, (BLOCK // GROUP, GROUP)), FLOOR, QMAX)
    tl.store(q_ptr + row * stride_qm + offs, tl.reshape(q, (BLOCK,)).to(q_ptr.dtype.element_ty), mask=valid)
    blocks = tl.program_id(1) * (BLOCK // GROUP) + tl.arange(0, BLOCK // GROUP)
    tl.store(sf_ptr + row * stride_sm + blocks, sf, mask=blocks * GROUP < N)


@triton.jit
def _combine_kernel(
    back_ptr, stride_bm,        # BF16 expert output rows
    pos_ptr,                    # int64 [T, TOPK]: row of each (token, slot), -1 = no expert
    y_ptr, H,
    TOPK: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    valid = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOPK):
        # An empty slot adds +0.0, which leaves the FP32 sum as skipping it would
        row = tl.load(pos_ptr + token * TOPK + k) + tl.zeros((BLOCK_H,), dtype=tl.int64)
        acc += tl.load(back_ptr + row * stride_bm + offs, mask=valid & (row >= 0), other=0.0).to(tl.float32)
    tl.store(y_ptr + token * H + offs, _round_bf16(acc).to(y_ptr.dtype.element_ty), mask=valid)


def _grid_size(num_blocks: int, n: int, block_n: int) -> int:
    return num_blocks * (n // block_n)


def _launch(grid: int, args: tuple, compile_only: bool, **options):
    """Launch the GEMM kernel, or with ``compile_only`` compile it for these arguments and load it
    (no launch), so a launch config the GPU cannot run fails here, before any call is timed."""
    if not compile_only:
        _grouped_gemm_kernel[(grid,)](*args, **options)
        return None
    compiled = _grouped_gemm_kernel.warmup(*args, grid=(grid,), **options)
    # Loading checks the shared memory the kernel needs against the device's limit.
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()
    return compiled


def grouped_gemm_swiglu(
    a: torch.Tensor, a_sf: torch.Tensor, a_rows: torch.Tensor, weight: torch.Tensor,
    w1: torch.Tensor, w1_sf: torch.Tensor, block_expert: torch.Tensor,
    act: torch.Tensor, act_sf: torch.Tensor, *, block_m: int, num_warps: int, num_stages: int,
    group_m: int = GROUP_M, activation_clamp: float = 0.0, compile_only: bool = False,
):
    """L1 for every pool row ``p``: A row ``a_rows[p]`` of ``a`` (FP8, row stride ``a.stride(0)``)
    with scales ``a_sf[a_rows[p]]`` and routing weight ``weight[a_rows[p]]`` through expert
    ``block_expert[p // block_m]``'s ``w1`` ([E, 2I, H]); writes ``act [pool, I]`` FP8 and
    ``act_sf [pool, I/128]``.  ``compile_only``: compile and load the kernel, launch nothing."""
    intermediate, hidden = w1.shape[1] // 2, w1.shape[2]
    num_blocks = block_expert.shape[0]
    args = (a, a.stride(0), a_sf, a_sf.stride(0), a_rows, weight, weight.stride(0),
            w1, w1_sf, block_expert, act, act.stride(0), act_sf, a_rows, 0,
            num_blocks, intermediate, hidden)
    return _launch(_grid_size(num_blocks, intermediate, BLOCK_K), args, compile_only,
                   A_INDIRECT=True, SWIGLU=True, BLOCK_M=block_m, BLOCK_N=BLOCK_K, BLOCK_K=BLOCK_K, GROUP_M=group_m,
                   FLOOR=AMAX_FLOOR, QMAX=FP8_MAX, CLAMP=float(activation_clamp), num_warps=num_warps,
                   num_stages=num_stages)


def grouped_gemm(
    a: torch.Tensor, a_sf: torch.Tensor, w: torch.Tensor, w_sf: torch.Tensor, block_expert: torch.Tensor,
    out: torch.Tensor, out_rows: torch.Tensor, out_skip: int, *, block_m: int, block_n: int,
    num_warps: int, num_stages: int, group_m: int = GROUP_M, compile_only: bool = False,
):
    """L2 for every pool row ``p`` (``a [pool, K]`` FP8, ``a_sf [pool, K/128]``) through expert
    ``block_expert[p // block_m]``'s ``w`` ([E, N, K]); writes BF16 row ``out[out_rows[p]]``
    unless ``out_rows[p] >= out_skip``.  ``block_n`` divides N; 64, 128 or 256 (a multiple of
    64 that a 128-channel weight scale block holds whole or in whole blocks)."""
    n, k = w.shape[1], w.shape[2]
    num_blocks = block_expert.shape[0]
    args = (a, a.stride(0), a_sf, a_sf.stride(0), out_rows, a_sf, 0,
            w, w_sf, block_expert, out, out.stride(0), a_sf, out_rows, out_skip,
            num_blocks, n, k)
    return _launch(_grid_size(num_blocks, n, block_n), args, compile_only,
                   A_INDIRECT=False, SWIGLU=False, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
                   GROUP_M=group_m, FLOOR=AMAX_FLOOR, QMAX=FP8_MAX, num_warps=num_warps, num_stages=num_stages)


def swiglu_quant(h: torch.Tensor, weight: torch.Tensor, q: torch.Tensor, sf: torch.Tensor, group: int,
                 activation_clamp: float = 0.0, rows: Optional[torch.Tensor] = None) -> None:
    """``q, sf = quantize(silu(h[:, :N]) * h[:, N:] * weight[:, None])`` with one scale per ``group``
    channels of a row (128: the recipe; N: one per row).  ``rows`` (int64): only these rows, so a
    pool of mostly padding rows costs only its filled ones."""
    n = q.shape[1]
    rows_count = q.shape[0] if rows is None else rows.numel()
    if rows_count == 0:
        return
    if group == n:
        block = triton.next_power_of_2(n)
        group_c = block
    else:
        block, group_c = 4 * group, group
    _swiglu_quant_kernel[(rows_count, triton.cdiv(n, block))](
        h, h.stride(0), weight, q, q.stride(0), sf, sf.stride(0), n,
        GROUP=group_c, BLOCK=block, FLOOR=AMAX_FLOOR, QMAX=FP8_MAX, CLAMP=float(activation_clamp),
        rows_ptr=rows, num_warps=4,
    )


def quantize(x: torch.Tensor, q: torch.Tensor, sf: torch.Tensor, group: int = BLOCK) -> None:
    """``q, sf = quantize(x)`` per row per ``group`` channels, the recipe's rounding (``quant``)."""
    rows, n = q.shape
    if rows == 0:
        return
    block = 4 * group
    _quantize_kernel[(rows, triton.cdiv(n, block))](
        x, x.stride(0), q, q.stride(0), sf, sf.stride(0), n,
        GROUP=group, BLOCK=block, FLOOR=AMAX_FLOOR, QMAX=FP8_MAX, num_warps=4,
    )


def combine(back: torch.Tensor, pos: torch.Tensor, y: torch.Tensor) -> None:
    """``y[t] = bf16(sum over k of float(back[pos[t, k]]))`` in slot order, skipping ``pos < 0``."""
    tokens, hidden = y.shape
    if tokens == 0:
        return
    block_h = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(tokens, triton.cdiv(hidden, block_h))](
        back, back.stride(0), pos, y, hidden, TOPK=pos.shape[1], BLOCK_H=block_h, num_warps=4,
    )

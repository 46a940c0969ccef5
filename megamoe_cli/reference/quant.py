"""FP8 e4m3 quantization with FP32 scales: the SPEC §2 recipe, shared by every backend.

One scale covers a run of 128 values: 1x128 per token for activations, 128x128
blocks for weights.  For a block of values ``v`` (all arithmetic in FP32)::

    amax = max(|v|)
    sf   = max(amax, 1e-4) / 448
    q    = fp8_e4m3(v * (1 / sf))        # dequantized value: q * sf

The kernel's epilogue requantizes activations with exactly these operations, so
the reference and the kernel round the same way.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..errors import MegaMoEError

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4

_FLOAT_INPUTS = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_float_input(op: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise MegaMoEError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _FLOAT_INPUTS:
        raise MegaMoEError(
            f"{op}: {name} must be float32, bfloat16, float16 or float64, got {t.dtype}"
        )


def _check_multiple(op: str, name: str, dim_name: str, value: int) -> None:
    if value % BLOCK:
        raise MegaMoEError(
            f"{op}: {name} {dim_name} must be a multiple of {BLOCK} (the FP8 scale block), got {value}"
        )


def _quantize_blocks(v: torch.Tensor, reduce_dims: Tuple[int, ...]) -> Tuple[torch.Tensor, torch.Tensor]:
    """Quantize FP32 ``v`` with one scale per block spanning ``reduce_dims``."""
    amax = v.abs().amax(dim=reduce_dims, keepdim=True)
    # A tensor divisor: CUDA divides by a Python scalar as a multiplication by its reciprocal, which
    # rounds differently from the CPU's (and the kernel's) division and moves FP8 values across
    # rounding boundaries; tensor by tensor, both devices divide correctly rounded.
    sf = torch.clamp(amax, min=AMAX_FLOOR) / torch.full_like(amax, FP8_MAX)
    inv = torch.reciprocal(sf)
    # v * inv can exceed 448 by an ulp; clamping matches the kernel's saturating convert.
    q = torch.clamp(v * inv, -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, sf


def quantize_per_token(x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x [T, H]`` -> ``(fp8 [T, H], f32 scales [T, H/128])``; one scale per token per 128 channels."""
    _check_float_input("quantize_per_token", "x", x)
    if x.dim() != 2:
        raise MegaMoEError(f"quantize_per_token: x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    num_tokens, hidden = x.shape
    _check_multiple("quantize_per_token", "x", "hidden (dim 1)", hidden)
    v = x.to(torch.float32).reshape(num_tokens, hidden // BLOCK, BLOCK)
    q, sf = _quantize_blocks(v, (2,))
    return q.reshape(num_tokens, hidden), sf.reshape(num_tokens, hidden // BLOCK)


def dequantize_per_token(
    q: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_per_token`: ``q * sf`` computed in FP32, returned as ``dtype``."""
    if not isinstance(q, torch.Tensor) or q.dtype != FP8_DTYPE:
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise MegaMoEError(f"dequantize_per_token: q must be {FP8_DTYPE}, got {got}")
    if q.dim() != 2:
        raise MegaMoEError(f"dequantize_per_token: q must be 2-D [tokens, hidden], got shape {tuple(q.shape)}")
    num_tokens, hidden = q.shape
    _check_multiple("dequantize_per_token", "q", "hidden (dim 1)", hidden)
    expected = (num_tokens, hidden // BLOCK)
    if not isinstance(sf, torch.Tensor) or sf.dtype != torch.float32 or tuple(sf.shape) != expected:
        got = f"{sf.dtype} {tuple(sf.shape)}" if isinstance(sf, torch.Tensor) else type(sf).__name__
        raise MegaMoEError(f"dequantize_per_token: sf must be float32 {expected}, got {got}")
    v = q.to(torch.float32).reshape(num_tokens, hidden // BLOCK, BLOCK) * sf.unsqueeze(-1)
    return v.reshape(num_tokens, hidden).to(dtype)


def quantize_per_block(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(fp8 [..., N, K], f32 scales [..., N/128, K/128])``; one scale per 128x128 block.

    Work happens in FP32 at the size of ``w``: quantize large expert stacks one
    expert at a time.
    """
    _check_float_input("quantize_per_block", "w", w)
    if w.dim() < 2:
        raise MegaMoEError(f"quantize_per_block: w must be at least 2-D [..., N, K], got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    _check_multiple("quantize_per_block", "w", "N (dim -2)", n)
    _check_multiple("quantize_per_block", "w", "K (dim -1)", k)
    v = w.to(torch.float32).reshape(*lead, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    nd = v.dim()
    q, sf = _quantize_blocks(v, (nd - 3, nd - 1))
    return q.reshape(*lead, n, k), sf.reshape(*lead, n // BLOCK, k // BLOCK)


def dequantize_per_block(
    q: torch.Tensor, sf: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of :func:`quantize_per_block`: ``q * sf`` computed in FP32, returned as ``dtype``."""
    if not isinstance(q, torch.Tensor) or q.dtype != FP8_DTYPE:
        got = q.dtype if isinstance(q, torch.Tensor) else type(q).__name__
        raise MegaMoEError(f"dequantize_per_block: q must be {FP8_DTYPE}, got {got}")
    if q.dim() < 2:
        raise MegaMoEError(f"dequantize_per_block: q must be at least 2-D [..., N, K], got shape {tuple(q.shape)}")
    *lead, n, k = q.shape
    _check_multiple("dequantize_per_block", "q", "N (dim -2)", n)
    _check_multiple("dequantize_per_block", "q", "K (dim -1)", k)
    expected = (*lead, n // BLOCK, k // BLOCK)
    if not isinstance(sf, torch.Tensor) or sf.dtype != torch.float32 or tuple(sf.shape) != expected:
        got = f"{sf.dtype} {tuple(sf.shape)}" if isinstance(sf, torch.Tensor) else type(sf).__name__
        raise MegaMoEError(f"dequantize_per_block: sf must be float32 {expected}, got {got}")
    v = q.to(torch.float32).reshape(*lead, n // BLOCK, BLOCK, k // BLOCK, BLOCK)
    v = v * sf.reshape(*lead, n // BLOCK, 1, k // BLOCK, 1)
    return v.reshape(*lead, n, k).to(dtype)


# ---------------------------------------------------------------------------
# MXFP4 expert weights (SPEC §2b): e2m1 values, two per byte, one UE8M0 scale per 32 along K
# ---------------------------------------------------------------------------

MX_BLOCK = 32
E2M1_MAX = 6.0
# Magnitudes of the e2m1 codes 0-7; code 8 + c is -E2M1_VALUES[c].
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
UE8M0_BIAS = 127
UE8M0_NAN = 255
# Rounding to the nearest e2m1 value, ties to the even mantissa: a magnitude rounds up past a
# boundary when it exceeds it, and at the boundary itself when the upper neighbour is even
# (0.75 -> 1, 1.75 -> 2, 3.5 -> 4; 0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4).
_E2M1_UP_ABOVE = (0.25, 1.25, 2.5, 5.0)
_E2M1_UP_AT = (0.75, 1.75, 3.5)


def _check_mx_multiple(op: str, name: str, k: int) -> None:
    if k % MX_BLOCK:
        raise MegaMoEError(f"{op}: {name} K (dim -1) must be a multiple of {MX_BLOCK} (the MXFP4 scale block), got {k}")


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """FP32 values already divided by their block's scale (|v| <= 6) -> e2m1 codes (uint8, 0-15)."""
    mag = v.abs()
    code = torch.zeros(v.shape, dtype=torch.uint8, device=v.device)
    for b in _E2M1_UP_ABOVE:
        code += (mag > b).to(torch.uint8)
    for b in _E2M1_UP_AT:
        code += (mag >= b).to(torch.uint8)
    # -0 is stored as +0: the sign of a zero carries nothing
    return code | torch.where((v < 0) & (code > 0), 8, 0).to(torch.uint8)


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, 0-15) -> FP32 values."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return table[codes.long()]


def quantize_mxfp4(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """``w [..., N, K]`` -> ``(packed uint8 [..., N, K/2], ue8m0 scales uint8 [..., N, K/32])``.

    Each run of 32 values along K gets the power of two ``2^s`` that brings its amax into
    e2m1's range, ``s = ceil(log2(max(amax, 1e-4) / 6))``, stored as the byte ``s + 127``; each
    value becomes the nearest e2m1 value of ``v / 2^s`` (ties to even).  Two values per byte,
    the lower K index in the low nibble.
    """
    _check_float_input("quantize_mxfp4", "w", w)
    if w.dim() < 2:
        raise MegaMoEError(f"quantize_mxfp4: w must be at least 2-D [..., N, K], got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    _check_mx_multiple("quantize_mxfp4", "w", k)
    v = w.to(torch.float32).reshape(*lead, n, k // MX_BLOCK, MX_BLOCK)
    amax = v.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR)
    # frexp: amax / 6 = m * 2^e with m in [0.5, 1): ceil(log2) is e, or e - 1 when m is exactly 0.5
    mant, exp = torch.frexp(amax / torch.full_like(amax, E2M1_MAX))  # a tensor divisor: see _quantize_blocks
    s = torch.where(mant == 0.5, exp - 1, exp)
    if int(s.max()) > UE8M0_NAN - 1 - UE8M0_BIAS:
        raise MegaMoEError(f"quantize_mxfp4: w holds values too large for a UE8M0 scale (amax {float(amax.max())})")
    packed = pack_e2m1(e2m1_codes(torch.ldexp(v, -s)).reshape(*lead, n, k))
    return packed.contiguous(), (s + UE8M0_BIAS).to(torch.uint8).reshape(*lead, n, k // MX_BLOCK).contiguous()


def check_mxfp4(op: str, packed: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise :class:`MegaMoEError` unless ``(packed, scales)`` is an MXFP4 pair: uint8
    ``[..., N, K/2]`` and uint8 ``[..., N, K/32]`` with no NaN scale (255)."""
    for name, t in (("packed weights", packed), ("scales", scales)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
            raise MegaMoEError(f"{op}: MXFP4 {name} must be torch.uint8, got {got}")
    if packed.dim() < 2 or scales.dim() != packed.dim():
        raise MegaMoEError(
            f"{op}: MXFP4 weights must be [..., N, K/2] with scales [..., N, K/32], got {tuple(packed.shape)} "
            f"and {tuple(scales.shape)}"
        )
    *lead, n, half_k = packed.shape
    k = 2 * half_k
    _check_mx_multiple(op, "weights", k)
    expected = (*lead, n, k // MX_BLOCK)
    if tuple(scales.shape) != expected:
        raise MegaMoEError(f"{op}: MXFP4 scales must be {expected} for weights {tuple(packed.shape)}, got {tuple(scales.shape)}")
    if scales.numel() and int(scales.max()) == UE8M0_NAN:
        raise MegaMoEError(f"{op}: MXFP4 scales hold the UE8M0 NaN code {UE8M0_NAN}; expected powers of two (0-254)")


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes ``uint8 [..., K]`` -> ``[..., K/2]``, the lower K index in the low nibble."""
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``uint8 [..., K/2]`` -> e2m1 codes ``uint8 [..., K]`` (low nibble first)."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_mxfp4`: ``e2m1 * 2^(scale - 127)``, exact in FP32 (a product of
    two powers of two and a 2-bit mantissa) unless it leaves FP32's range."""
    check_mxfp4("dequantize_mxfp4", packed, scales)
    *lead, n, half_k = packed.shape
    k = 2 * half_k
    v = e2m1_values(unpack_e2m1(packed)).reshape(*lead, n, k // MX_BLOCK, MX_BLOCK)
    s = scales.to(torch.int32).unsqueeze(-1) - UE8M0_BIAS
    return torch.ldexp(v, s).reshape(*lead, n, k).to(dtype)

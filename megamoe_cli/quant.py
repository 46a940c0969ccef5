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

from .errors import MegaMoEError

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
    sf = torch.clamp(amax, min=AMAX_FLOOR) / FP8_MAX
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

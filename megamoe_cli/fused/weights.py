"""Expert weights in the layout the kernel reads: the one-time re-layout and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from ..errors import MegaMoEError
from ..kernel import weight_layout
from ..kernel.contract import BLOCK_K, BLOCK_N
from ..kernel.kernel_source import FP4_STAGE_BYTES
from ..layout import BufferConfig
from ..reference.quant import check_mxfp4
from .inputs import check_tensor


@dataclass(frozen=True)
class ExpertWeights:
    """Weights in the layout the kernel reads: FP8 tiles, or MXFP4 stages (``weights="fp4"``),
    with the FP32 scale of every 128x128 block."""

    weight: torch.Tensor
    scale: torch.Tensor
    weights: str = "fp8"


def transform_weights_for_mega_moe(
    l1: Tuple[torch.Tensor, torch.Tensor], l2: Tuple[torch.Tensor, torch.Tensor]
) -> Tuple[ExpertWeights, ExpertWeights]:
    """One-time re-layout of FP8 expert weights and their 128x128 scales, or of MXFP4 weights.

    FP8: ``l1 = (w1 fp8 [E, 2I, H], f32 [E, 2I/128, H/128])``, ``l2 = (w2 fp8 [E, H, I], f32
    [E, H/128, I/128])``.  MXFP4 (SPEC §2b): ``l1 = (uint8 [E, 2I, H/2], ue8m0 uint8 [E, 2I, H/32])``,
    ``l2 = (uint8 [E, H, I/2], uint8 [E, H, I/32])``, e2m1 codes two per byte (lower K index in the
    low nibble) and one power-of-two scale per 32 along K (``quant.quantize_mxfp4`` makes them);
    the kernel streams them at half the bytes and expands them to e4m3 on chip
    (``weight_layout``).  Both layers take the same format.

    L1 ``[E, 2I, H]`` (gate rows then up rows) becomes gate/up interleaved by 8 rows, so one
    accumulator fragment holds matching gate and up columns; its scales become
    ``[E, 2I/128, H/128, 2]``: for each interleaved 128-row block, the scale of its 64 gate
    rows and of its 64 up rows.  L2 ``[E, H, I]`` has its output rows permuted inside every
    32-row group (row ``8 t + 2 q + e`` of a group holds output channel ``8 q + 2 t + e``), so
    each lane of the L2 epilogue owns 16 contiguous output bytes and stores them straight from
    its accumulators.  Its K columns are permuted inside every 64-column group the way the L1
    epilogue stores activations (channel ``8 g + 2 q + e`` at column ``16 q + 2 g + e``, so each
    lane stores 16 contiguous FP8 bytes).  Both permutations stay inside one 128-wide scale
    block, so the L2 scales ``[E, H/128, I/128]`` are kept.

    Both weights are then stored tile by tile, ``[E, N/256, K/128, 256, 128]``: the 32 KiB the
    kernel loads per pipeline stage (256 output rows x one 128-wide K block) is contiguous, so
    weight streaming reads whole DRAM pages instead of 128-byte pieces 7 KiB apart.
    """
    for name, pair in (("l1", l1), ("l2", l2)):
        if not isinstance(pair, (tuple, list)) or len(pair) != 2 or not all(isinstance(t, torch.Tensor) for t in pair):
            raise MegaMoEError(f"{name} must be a (weight, scales) pair of tensors, got {type(pair).__name__}")
    w1, w1_sf = l1
    w2, w2_sf = l2
    formats = {name: "fp4" if w.dtype == torch.uint8 else "fp8" for name, w in (("l1", w1), ("l2", w2))}
    if len(set(formats.values())) > 1:
        raise MegaMoEError(
            f"l1 and l2 must be in one weight format, got l1 {formats['l1']} ({w1.dtype}) and l2 {formats['l2']} "
            f"({w2.dtype}); quantize both with quant.quantize_mxfp4, or neither"
        )
    if formats["l1"] == "fp4":
        return _transform_mxfp4(w1, w1_sf, w2, w2_sf)
    if w1.dim() != 3 or w2.dim() != 3:
        raise MegaMoEError(f"expected 3-D expert weights, got w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)}")
    e, two_i, h = w1.shape
    i = two_i // 2
    if two_i % (2 * BLOCK_K) or h % BLOCK_K:
        raise MegaMoEError(f"w1 must be [E, 2*I, H] with I and H multiples of {BLOCK_K}, got {tuple(w1.shape)}")
    if tuple(w2.shape) != (e, h, i):
        raise MegaMoEError(f"w2 must be [E, H, I] = {(e, h, i)}, got {tuple(w2.shape)}")
    if tuple(w1_sf.shape) != (e, two_i // 128, h // 128):
        raise MegaMoEError(f"w1 scales must be {(e, two_i // 128, h // 128)}, got {tuple(w1_sf.shape)}")
    if tuple(w2_sf.shape) != (e, h // 128, i // 128):
        raise MegaMoEError(f"w2 scales must be {(e, h // 128, i // 128)}, got {tuple(w2_sf.shape)}")
    for name, t, dtype in (("w1", w1, torch.float8_e4m3fn), ("w2", w2, torch.float8_e4m3fn),
                           ("w1 scales", w1_sf, torch.float32), ("w2 scales", w2_sf, torch.float32)):
        if t.dtype != dtype:
            raise MegaMoEError(f"{name} must be {dtype}, got {t.dtype}")
    if len({w1.device, w1_sf.device, w2.device, w2_sf.device}) > 1:
        raise MegaMoEError(
            f"expert weights and scales must be on one device, got w1 on {w1.device}, w1 scales on {w1_sf.device}, "
            f"w2 on {w2.device}, w2 scales on {w2_sf.device}"
        )
    if h % BLOCK_N:
        raise MegaMoEError(f"the fused kernel needs hidden to be a multiple of {BLOCK_N}, got {h}")
    w1_t = weight_layout.permute_l1_rows(w1.view(torch.uint8))
    w2_t = weight_layout.permute_l2_columns(weight_layout.permute_l2_rows(w2.view(torch.uint8)))
    return (ExpertWeights(_tile(w1_t), _l1_block_scales(w1_sf)), ExpertWeights(_tile(w2_t), w2_sf.contiguous()))


def _l1_block_scales(w1_sf: torch.Tensor) -> torch.Tensor:
    """``[E, 2I/128, H/128]`` (gate blocks, then up blocks) -> ``[E, 2I/128, H/128, 2]``: for each
    interleaved 128-row block, the scale of its 64 gate rows and of its 64 up rows."""
    i_blocks = w1_sf.shape[1] // 2
    gate_sf = w1_sf[:, :i_blocks].repeat_interleave(2, dim=1)
    up_sf = w1_sf[:, i_blocks:].repeat_interleave(2, dim=1)
    return torch.stack([gate_sf, up_sf], dim=-1).contiguous()


def _transform_mxfp4(w1: torch.Tensor, w1_sf: torch.Tensor, w2: torch.Tensor, w2_sf: torch.Tensor
                     ) -> Tuple[ExpertWeights, ExpertWeights]:
    check_mxfp4("transform_weights_for_mega_moe: l1", w1, w1_sf)
    check_mxfp4("transform_weights_for_mega_moe: l2", w2, w2_sf)
    if w1.dim() != 3 or w2.dim() != 3:
        raise MegaMoEError(f"expected 3-D MXFP4 expert weights, got w1 {tuple(w1.shape)} and w2 {tuple(w2.shape)}")
    e, two_i, half_h = w1.shape
    h, i = 2 * half_h, two_i // 2
    if two_i % (2 * BLOCK_K) or h % BLOCK_N:
        raise MegaMoEError(
            f"w1 must be MXFP4 [E, 2*I, H/2] with I a multiple of {BLOCK_K} and H of {BLOCK_N}, got {tuple(w1.shape)}"
        )
    if tuple(w2.shape) != (e, h, i // 2):
        raise MegaMoEError(f"w2 must be MXFP4 [E, H, I/2] = {(e, h, i // 2)}, got {tuple(w2.shape)}")
    if len({w1.device, w1_sf.device, w2.device, w2_sf.device}) > 1:
        raise MegaMoEError("MXFP4 expert weights and scales must be on one device")
    s1, bsf1 = weight_layout.fp4_layer(w1, w1_sf, "l1")
    s2, bsf2 = weight_layout.fp4_layer(w2, w2_sf, "l2")
    return (ExpertWeights(s1, _l1_block_scales(bsf1), "fp4"), ExpertWeights(s2, bsf2.contiguous(), "fp4"))


def _tile(w: torch.Tensor) -> torch.Tensor:
    """``[E, N, K]`` bytes -> ``[E, N/BLOCK_N, K/BLOCK_K, BLOCK_N, BLOCK_K]`` FP8 (one pipeline stage contiguous)."""
    return weight_layout.tile_stages(w, BLOCK_K).view(torch.float8_e4m3fn)


def check_weights(cfg: BufferConfig, l1: ExpertWeights, l2: ExpertWeights, device: torch.device) -> None:
    """``mega_moe``'s check that ``l1`` and ``l2`` are this rank's experts of the buffer's shape,
    transformed, on its device."""
    if not isinstance(l1, ExpertWeights) or not isinstance(l2, ExpertWeights):
        raise MegaMoEError("mega_moe: l1 and l2 must come from transform_weights_for_mega_moe")
    s, e_local = cfg.shape, cfg.num_experts_per_rank
    if l1.weights != s.weights or l2.weights != s.weights:
        raise MegaMoEError(
            f"mega_moe: the buffer was made for {s.weights} weights (SymmBuffer(weights=...)), got l1 {l1.weights} "
            f"and l2 {l2.weights}"
        )
    if s.weights == "fp4":
        check_tensor("l1 weight", l1.weight, torch.uint8,
                     (e_local, 2 * s.intermediate // BLOCK_N, s.hidden // BLOCK_K, FP4_STAGE_BYTES), device)
        check_tensor("l2 weight", l2.weight, torch.uint8,
                     (e_local, s.hidden // BLOCK_N, s.intermediate // BLOCK_K, FP4_STAGE_BYTES), device)
    else:
        check_tensor("l1 weight", l1.weight, torch.float8_e4m3fn,
                     (e_local, 2 * s.intermediate // BLOCK_N, s.hidden // BLOCK_K, BLOCK_N, BLOCK_K), device)
        check_tensor("l2 weight", l2.weight, torch.float8_e4m3fn,
                     (e_local, s.hidden // BLOCK_N, s.intermediate // BLOCK_K, BLOCK_N, BLOCK_K), device)
    check_tensor("l1 scales", l1.scale, torch.float32,
                 (e_local, 2 * s.intermediate // BLOCK_K, s.hidden // BLOCK_K, 2), device)
    check_tensor("l2 scales", l2.scale, torch.float32, (e_local, s.hidden // BLOCK_K, s.intermediate // BLOCK_K), device)

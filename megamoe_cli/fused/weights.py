"""Expert weights in the layout the kernel reads: the one-time re-layout and its checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

import torch

from ..contract import BLOCK_K, BLOCK_N
from ..errors import MegaMoEError
from ..layout import BufferConfig
from .inputs import check_tensor


@dataclass(frozen=True)
class ExpertWeights:
    """Weights in the layout the kernel reads."""

    weight: torch.Tensor
    scale: torch.Tensor


def transform_weights_for_mega_moe(
    l1: Tuple[torch.Tensor, torch.Tensor], l2: Tuple[torch.Tensor, torch.Tensor]
) -> Tuple[ExpertWeights, ExpertWeights]:
    """One-time re-layout of FP8 expert weights and their 128x128 scales.

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
    w1_t = w1.view(torch.uint8).view(e, 2, i // 8, 8, h).permute(0, 2, 1, 3, 4).reshape(e, two_i, h)
    gate_sf = w1_sf[:, : i // 128].repeat_interleave(2, dim=1)
    up_sf = w1_sf[:, i // 128 :].repeat_interleave(2, dim=1)
    w1_sf_t = torch.stack([gate_sf, up_sf], dim=-1).contiguous()
    # output rows: inside each 32-row group, row 8 t + 2 q + e <- channel 8 q + 2 t + e
    w2_t = w2.view(torch.uint8).view(e, h // 32, 4, 4, 2, i).transpose(2, 3).reshape(e, h, i)
    # K columns: inside each 64-column group, column 16 q + 2 g + e <- channel 8 g + 2 q + e
    w2_t = w2_t.view(e, h, i // 64, 8, 4, 2).transpose(3, 4).reshape(e, h, i)
    return (ExpertWeights(_tile(w1_t), w1_sf_t), ExpertWeights(_tile(w2_t), w2_sf.contiguous()))


def _tile(w: torch.Tensor) -> torch.Tensor:
    """``[E, N, K]`` bytes -> ``[E, N/BLOCK_N, K/BLOCK_K, BLOCK_N, BLOCK_K]`` FP8 (one pipeline stage contiguous)."""
    e, n, k = w.shape
    tiled = w.reshape(e, n // BLOCK_N, BLOCK_N, k // BLOCK_K, BLOCK_K).permute(0, 1, 3, 2, 4).contiguous()
    return tiled.view(torch.float8_e4m3fn)


def check_weights(cfg: BufferConfig, l1: ExpertWeights, l2: ExpertWeights, device: torch.device) -> None:
    """``mega_moe``'s check that ``l1`` and ``l2`` are this rank's experts of the buffer's shape,
    transformed, on its device."""
    if not isinstance(l1, ExpertWeights) or not isinstance(l2, ExpertWeights):
        raise MegaMoEError("mega_moe: l1 and l2 must come from transform_weights_for_mega_moe")
    s, e_local = cfg.shape, cfg.num_experts_per_rank
    check_tensor("l1 weight", l1.weight, torch.float8_e4m3fn,
                 (e_local, 2 * s.intermediate // BLOCK_N, s.hidden // BLOCK_K, BLOCK_N, BLOCK_K), device)
    check_tensor("l1 scales", l1.scale, torch.float32,
                 (e_local, 2 * s.intermediate // BLOCK_K, s.hidden // BLOCK_K, 2), device)
    check_tensor("l2 weight", l2.weight, torch.float8_e4m3fn,
                 (e_local, s.hidden // BLOCK_N, s.intermediate // BLOCK_K, BLOCK_N, BLOCK_K), device)
    check_tensor("l2 scales", l2.scale, torch.float32, (e_local, s.hidden // BLOCK_K, s.intermediate // BLOCK_K), device)

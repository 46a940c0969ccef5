"""How expert weights are laid out for the kernel: the row and column permutations its epilogues
need, and the stage-by-stage tiling its producer streams, for FP8 and MXFP4 weights.

Pure tensor code (no launch): ``fused.transform_weights_for_mega_moe`` checks its inputs and
calls these; CPU tests check them against the kernel's reading rules.

MXFP4 (SPEC §2b) on Hopper: the tensor cores take FP8, so the kernel expands each 128-wide K
block of a weight row to e4m3 in shared memory.  Every e2m1 value times a power of two is an
e4m3 value while the exponent stays in range, so each 128x128 weight block gets one FP32 scale
``2^B`` (what the FP8 recipe's promotion already multiplies by), ``B`` = the largest UE8M0
exponent of the block's 32-wide runs minus 6, and each run keeps its exponent relative to it,
``s - B <= 6`` (so ``6 * 2^(s - B) <= 384 < 448``).  The expansion is exact for ``s - B >= -8``
(0.5 * 2^-8 is e4m3's smallest subnormal); runs 9 to 12 binades below their block's largest
round to e4m3 subnormals, and runs further below flush to zero: values under 2^-14 of the
block's largest, which the FP32 sum of a 128-K block could not resolve much better.
"""

from __future__ import annotations

from typing import Tuple

import torch

from ..reference.quant import MX_BLOCK, UE8M0_BIAS, e2m1_values, unpack_e2m1
from .kernel_source import BLOCK_N, FP4_STAGE_BYTES

BLOCK_K = 128
# MXFP4 stage: 256 rows x 64 bytes of e2m1 codes (fp4_stages: each row's four 32-code runs, their
# words in FP4_RUN_ORDER, regrouped so that 16-byte group t holds word t of every run, group t at
# slot t ^ fp4_group_slot_key(row)), then 256 rows x 4 scale indices
FP4_ROW_BYTES = BLOCK_K // 2
FP4_SCALES_PER_ROW = BLOCK_K // MX_BLOCK
assert FP4_STAGE_BYTES == BLOCK_N * (FP4_ROW_BYTES + FP4_SCALES_PER_ROW)
# A run's scale index is its exponent relative to the block's, s - B, plus this bias, clamped to
# [0, FP4_NUM_SCALES): index 31 is 2^6, index 0 (2^-25) and everything clamped to it flush to zero.
FP4_SCALE_BIAS = 25
FP4_NUM_SCALES = 32
FP4_MAX_REL_EXP = 6
# The kernel's words of 8 codes (K order within the word: code k): nibble k holds code k's
# magnitude in bits 0-2 and, in bit 3, the sign of code FP4_SIGN_SOURCE[k].  Codes 0-3's signs
# then sit at bits 7, 15, 23, 31 and codes 4-7's at bits 3, 11, 19, 27, bit 7 of their e4m3
# bytes as is or after a 4-bit shift (fp4_expand_word).
FP4_SIGN_SOURCE = (4, 0, 5, 1, 6, 2, 7, 3)
# Inside each 32-code run, word t holds codes 4t..4t+3 and 16+4t..16+4t+3: the bytes one thread's
# two A-fragment registers of a WGMMA K step hold (rows g, K 4t.. and 16 + 4t..), so weights can be
# expanded straight into register operands; a stored e4m3 tile takes the words' low halves as the
# run's first 16 bytes and their high halves as its last 16.  A row stores word t of runs 0-3
# together (group t): the thread of quad lane t loads its fragments of all four K steps at once.
FP4_RUN_ORDER = tuple(k for t in range(4) for k in (*range(4 * t, 4 * t + 4), *range(16 + 4 * t, 20 + 4 * t)))


def fp4_group_slot_key(row: int) -> int:
    """Row ``row`` of a stage keeps group ``t`` at 16-byte slot ``t ^ fp4_group_slot_key(row)``:
    eight consecutive rows' loads of one group (the stored-tile expansion, a row a thread) then hit
    eight different 16-byte bank groups."""
    return (row >> 1) & 3


def permute_l1_rows(w: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, K]`` (gate rows, then up rows) -> gate/up interleaved by 8 rows."""
    e, two_i, k = w.shape
    return w.view(e, 2, two_i // 16, 8, k).permute(0, 2, 1, 3, 4).reshape(e, two_i, k)


def permute_l2_rows(w: torch.Tensor) -> torch.Tensor:
    """``[E, H, X]``: inside each 32-row group, row ``8 t + 2 q + e`` <- output channel ``8 q + 2 t + e``."""
    e, h, x = w.shape
    return w.view(e, h // 32, 4, 4, 2, x).transpose(2, 3).reshape(e, h, x)


def permute_l2_columns(w: torch.Tensor) -> torch.Tensor:
    """``[E, H, I]``: inside each 64-column group, column ``16 q + 2 g + e`` <- channel ``8 g + 2 q + e``
    (the order the L1 epilogue stores activations in)."""
    e, h, i = w.shape
    return w.view(e, h, i // 64, 8, 4, 2).transpose(3, 4).reshape(e, h, i)


def tile_stages(w: torch.Tensor, row_bytes: int) -> torch.Tensor:
    """``[E, N, K_bytes]`` -> ``[E, N/256, K_bytes/row_bytes, 256, row_bytes]``: one pipeline stage
    (256 output rows x one 128-wide K block) contiguous, so weight streaming reads whole DRAM pages."""
    e, n, kb = w.shape
    return w.reshape(e, n // BLOCK_N, BLOCK_N, kb // row_bytes, row_bytes).permute(0, 1, 3, 2, 4).contiguous()


def fp4_block_exponents(scales: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales ``uint8 [E, N, K/32]`` -> each 128x128 block's exponent ``B`` ``int32 [E, N/128, K/128]``."""
    e, n, kr = scales.shape
    s = scales.to(torch.int32).view(e, n // BLOCK_K, BLOCK_K, kr // FP4_SCALES_PER_ROW, FP4_SCALES_PER_ROW)
    return s.amax(dim=(2, 4)) - UE8M0_BIAS - FP4_MAX_REL_EXP


def fp4_scale_indices(scales: torch.Tensor, block_exp: torch.Tensor) -> torch.Tensor:
    """Each run's index into the kernel's expansion table: ``s - B + FP4_SCALE_BIAS``, clamped."""
    e, n, kr = scales.shape
    s = scales.to(torch.int32) - UE8M0_BIAS
    b = block_exp.repeat_interleave(BLOCK_K, dim=1).repeat_interleave(FP4_SCALES_PER_ROW, dim=2)
    return (s - b + FP4_SCALE_BIAS).clamp(0, FP4_NUM_SCALES - 1).to(torch.uint8)


def fp4_words(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes ``uint8 [..., K]`` (K a multiple of 8) -> ``uint8 [..., K/2]``: little-endian
    32-bit words of 8 codes each, magnitudes and signs placed as FP4_SIGN_SOURCE says."""
    c = codes.reshape(*codes.shape[:-1], -1, 8)
    nibbles = (c & 7) | ((c[..., list(FP4_SIGN_SOURCE)] >> 3) << 3)
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).reshape(*codes.shape[:-1], -1)


def fp4_run_order(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes ``[..., K]`` -> the same with each 32-code run in FP4_RUN_ORDER."""
    runs = codes.reshape(*codes.shape[:-1], -1, MX_BLOCK)
    return runs[..., list(FP4_RUN_ORDER)].reshape(codes.shape)


def fp4_stages(codes: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Permuted e2m1 codes ``[E, N, K]`` and their runs' scale indices ``[E, N, K/32]`` ->
    ``uint8 [E, N/256, K/128, FP4_STAGE_BYTES]``: per stage the rows' words (fp4_words of the codes
    in FP4_RUN_ORDER; group ``t`` of row ``r``, word ``t`` of runs 0-3, at slot
    ``t ^ fp4_group_slot_key(r)``), then the indices."""
    data = tile_stages(fp4_words(fp4_run_order(codes)), FP4_ROW_BYTES)
    words = FP4_ROW_BYTES // FP4_SCALES_PER_ROW // 4  # words per run
    runs = data.view(*data.shape[:-1], FP4_SCALES_PER_ROW, words, 4)
    groups = runs.transpose(-3, -2).contiguous().view(*data.shape[:-1], words, FP4_SCALES_PER_ROW * 4)
    slots = torch.tensor([[t ^ fp4_group_slot_key(r) for t in range(words)] for r in range(BLOCK_N)],
                         device=data.device)
    # slot j of row r holds group j ^ key(r): gather by the inverse, which is the same XOR
    data = torch.gather(groups, -2, slots.view(BLOCK_N, words, 1).expand(groups.shape)).view(data.shape)
    idx = tile_stages(indices.contiguous(), FP4_SCALES_PER_ROW)
    e, nt, kt = data.shape[:3]
    return torch.cat([data.reshape(e, nt, kt, -1), idx.reshape(e, nt, kt, -1)], dim=-1).contiguous()


def fp4_layer(
    packed: torch.Tensor, scales: torch.Tensor, layer: str
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One layer's MXFP4 weights (``[E, N, K/2]``, ``[E, N, K/32]``, unpermuted) -> (stages as
    :func:`fp4_stages` lays them out, FP32 block scales ``2^B`` ``[E, N/128, K/128]`` in the
    unpermuted order the FP8 recipe's scales have).

    The permutations move whole rows (with their scale runs) and, for L2, columns inside a
    64-column group; a run keeps the index of the 32 channels it was quantized over, and the
    kernel reads the L2 index of a column by that permutation (``fp4_expand`` in consumer.cuh).
    """
    block_exp = fp4_block_exponents(scales)
    indices = fp4_scale_indices(scales, block_exp)
    codes = unpack_e2m1(packed)
    if layer == "l1":
        codes, indices = permute_l1_rows(codes), permute_l1_rows(indices)
    else:
        codes, indices = permute_l2_rows(codes), permute_l2_rows(indices)
        codes = permute_l2_columns(codes)
    block_sf = torch.ldexp(torch.ones_like(block_exp, dtype=torch.float32), block_exp)
    return fp4_stages(codes, indices), block_sf


def mxfp4_as_fp8_blocks(packed: torch.Tensor, scales: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 weights ``[E, N, K/2]`` with their UE8M0 scales -> the FP8 weights and 128x128 FP32
    block scales the kernel's expansion computes with: ``e4m3(e2m1 * 2^(s - B))`` times ``2^B``.

    Exact where the kernel's expansion is (runs at most 8 binades below their block's largest) and
    rounded the same way below, so an FP8 pipeline given these computes what the fused MXFP4
    kernel does; the unfused baseline reads MXFP4 weights this way (converted once, read as FP8)."""
    block_exp = fp4_block_exponents(scales)
    rel = fp4_scale_indices(scales, block_exp).to(torch.int32) - FP4_SCALE_BIAS
    e, n, half_k = packed.shape
    out = torch.empty(e, n, 2 * half_k, dtype=torch.float8_e4m3fn, device=packed.device)
    for i in range(e):  # one expert at a time: the FP32 intermediate of a whole layer can exceed the GPU
        values = torch.ldexp(e2m1_values(unpack_e2m1(packed[i])), rel[i].repeat_interleave(MX_BLOCK, dim=-1))
        out[i] = values.to(torch.float8_e4m3fn)
    block_sf = torch.ldexp(torch.ones_like(block_exp, dtype=torch.float32), block_exp)
    return out, block_sf


"""Kernel config choice: an analytic default, overridden by a measured (tuned) config when one exists.

Pure policy: no launch code, no GPU.  A config is a plain dict; the kernel's launcher reads the
keys it knows.  ``DEFAULT_KNOBS`` holds every key with its fixed default, so a new knob is one
entry there (and, if it depends on the problem, one rule in ``default_config``).  Tuned entries
written before a knob existed still work: ``choose_config`` lays them over the default.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

from ..errors import MegaMoEError
from ..gpus import gpu_spec
from ..layout import BufferConfig, MoEShape
from . import tuned
from .contract import check_block_m
from .kernel_source import FP4_CONFIGS, MAX_SMEM_BYTES, SUPPORTED_BLOCK_M, SUPPORTED_STAGES, Variant, smem_bytes

DEFAULT_KNOBS = {
    # Rows per pool block (the GEMM's M tile); see _block_m().
    "block_m": SUPPORTED_BLOCK_M[0],
    # Shared-memory pipeline depth of the TMA -> WGMMA loop; see _num_stages().
    "num_stages": 4,
    # SMs the persistent kernel occupies; None = every SM of the device.
    "num_sms": None,
    # CTAs per cluster sharing each B stage by TMA multicast (1 = no clusters).
    "cluster_m": 1,
}


def expected_tokens_per_expert(shape: MoEShape, world_size: int, num_tokens_per_rank: int) -> float:
    """Rows one expert receives under uniform routing: every rank's tokens times top-k over all experts."""
    return world_size * num_tokens_per_rank * shape.num_topk / shape.num_experts


def _block_m(expected_rows: float, supported: Tuple[int, ...] = SUPPORTED_BLOCK_M) -> int:
    """The smallest block only while half of it holds an expert's expected rows; otherwise the
    smallest larger block that holds them, else the largest.

    Regimes: decode-sized calls (deepseek-v3 on 8 ranks x 8 tokens: 2 rows per expert) waste the
    least padding with the smallest block; from about half a small block per expert on, block_m
    128 wins, because a block_m 128 block with at most 64 valid rows runs as two 64-row column
    halves (narrow tiles) while fuller blocks share each weight tile between twice the rows
    (one H200, DeepSeek-V3, block_m 64 vs 128: 32 rows per expert 2787-2791 vs 2854-2900 us,
    64 rows 3443-3500 vs 3034-3052 us, 128 rows 4761-4861 vs 4078-4240 us); prefill-sized calls
    (8 ranks x 8192 tokens: 2048 rows per expert) want the largest block.
    """
    smallest = supported[0]
    if expected_rows <= smallest / 2:
        return smallest
    for block_m in supported[1:]:
        if expected_rows <= block_m:
            return block_m
    return supported[-1]


# MXFP4: the smallest block while an expert's expected rows are at most this many, block_m 128
# above.
FP4_SMALL_BLOCK_UNTIL_ROWS = 8.0
# MXFP4's smallest block runs this many stages where they fit.
FP4_SMALL_BLOCK_STAGES = 5


def _block_m_fp4(expected_rows: float, supported: Tuple[int, ...] = SUPPORTED_BLOCK_M) -> int:
    """MXFP4's block_m: the smallest block up to FP4_SMALL_BLOCK_UNTIL_ROWS expected rows per
    expert, the largest MXFP4 builds above.
    Regimes: decode blocks of at most 16 valid rows run with the weights as register operands
    (one 16-token group per stage whatever the block), so the smaller block only saves A's load
    and runs a stage deeper (FP4_SMALL_BLOCK_STAGES); once blocks fill past a token group, a wide
    block_m 128 tile shares each expanded stage between twice the rows.  One H200, DeepSeek-V3,
    world size 1, block_m 64 with 5 stages against 128 with 4, kernel medians of two passes
    (docs/PERF_NOTES.md entry 112): 0 to -14% from 0.03 to 8 rows per expert (1-256 tokens), +1
    to +3% at 16 and 32 rows, +6 to +11% at 64.
    """
    built = [b for b in supported if (b, 1) in FP4_CONFIGS]  # the block_m values MXFP4 builds
    if not built:
        raise MegaMoEError(f"MXFP4 weights run with block_m in {[b for b, _ in FP4_CONFIGS]}, none of "
                           f"{list(supported)} allowed here")
    return built[0] if expected_rows <= FP4_SMALL_BLOCK_UNTIL_ROWS else built[-1]


# Deeper than this measured no faster for FP8 weights (one H200, DeepSeek-V3, 64 tokens: 5 stages
# of block_m 64 2436 us vs 4 stages 2443 us); 5 stays a candidate for `megamoe tune`.  (MXFP4's
# block_m 64: FP4_SMALL_BLOCK_STAGES.)
MAX_DEFAULT_STAGES = 4


def _num_stages(shape: MoEShape, world_size: int, block_m: int, max_stages: int = MAX_DEFAULT_STAGES) -> int:
    """The deepest pipeline (up to ``max_stages``) whose stages fit shared memory: deeper
    hides more load latency.

    Regimes: block_m 64 stages are 40 KiB, block_m 128 stages 48 KiB; both epilogues store from
    registers, so 4 fit for every preset shape.
    """
    for stages in sorted((s for s in SUPPORTED_STAGES if s <= max_stages), reverse=True):
        if smem_bytes(Variant(shape, world_size, 1, block_m, stages)) <= MAX_SMEM_BYTES:
            return stages
    return min(SUPPORTED_STAGES)


def default_config(shape: MoEShape, world_size: int, num_tokens_per_rank: int, gpu: str,
                   max_block_m: Optional[int] = None) -> dict:
    """The analytic config for one call shape on one GPU model (no measurement); ``max_block_m``
    limits the block_m it may choose (a buffer's largest)."""
    gpu_spec(gpu)  # an unknown GPU name is an error here, not a silent default
    config = dict(DEFAULT_KNOBS)
    if max_block_m is not None:
        check_block_m(max_block_m)
    supported = tuple(b for b in SUPPORTED_BLOCK_M if max_block_m is None or b <= max_block_m)
    expected_rows = expected_tokens_per_expert(shape, world_size, num_tokens_per_rank)
    if shape.weights == "fp4":  # MXFP4 builds have no clusters
        config["block_m"] = _block_m_fp4(expected_rows, supported)
        config["cluster_m"] = 1
    else:
        config["block_m"] = _block_m(expected_rows, supported)
    deeper = shape.weights == "fp4" and config["block_m"] == SUPPORTED_BLOCK_M[0]
    config["num_stages"] = _num_stages(shape, world_size, config["block_m"],
                                       FP4_SMALL_BLOCK_STAGES if deeper else MAX_DEFAULT_STAGES)
    return config


def choose_config(
    shape: MoEShape,
    world_size: int,
    num_tokens_per_rank: int,
    gpu: str,
    dtype: str = tuned.DEFAULT_DTYPE,
    path: Optional[os.PathLike] = None,
    max_block_m: Optional[int] = None,
) -> Tuple[dict, str]:
    """``(config, source)``: the tuned config of this exact token bucket (source ``"tuned"``),
    else the analytic default (source ``"default"``).  With ``max_block_m`` (a buffer's largest),
    a tuned config with a larger block_m does not apply and the default chooses within it."""
    config = default_config(shape, world_size, num_tokens_per_rank, gpu, max_block_m)
    key = tuned.make_key(gpu, world_size, shape, num_tokens_per_rank, dtype)
    found = tuned.lookup(key, path)
    if found is None or (max_block_m is not None and found.get("block_m", config["block_m"]) > max_block_m):
        return config, "default"
    return {**config, **found}, "tuned"


def config_for_bound(buffer: BufferConfig, num_tokens_bound: int, gpu: str,
                     path: Optional[os.PathLike] = None) -> Tuple[dict, str]:
    """``(config, source)`` for calls of at most ``num_tokens_bound`` tokens per rank on a buffer
    laid out by ``buffer``: ``choose_config`` at the bound's token bucket (the next power of two,
    the tuned store's key; at most the buffer's capacity), within the block_m the buffer serves.
    Every bound of one bucket gets the same config, so a caller may cache it per bucket."""
    tokens = min(tuned.token_bucket(num_tokens_bound), buffer.num_max_tokens_per_rank)
    return choose_config(buffer.shape, buffer.num_ranks, tokens, gpu, path=path, max_block_m=buffer.block_m)

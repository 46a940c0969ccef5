"""The symmetric-buffer layout: pool capacity by hand, segment geometry, every validation error."""

import pytest

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.layout import (
    PRESETS,
    SEGMENT_ALIGN_BYTES,
    BufferConfig,
    MoEShape,
    build_layout,
)


def _config(preset_name, ranks, tokens, block_m=64):
    return BufferConfig(num_ranks=ranks, num_max_tokens_per_rank=tokens, shape=PRESETS[preset_name], block_m=block_m)


# P = max(align(R*T*min(topk, E_local) + E_local*(block_m - 1), block_m), E_local*block_m) (at least one
# block per local expert: the direct pool of small calls), worked by hand:
#   seed-default 8 x 8192, block 128: E_local = 384/8 = 48; 8*8192*6 = 393216; + 48*127 = 6096
#     -> 399312 = 3119.625 blocks -> 3120 blocks = 399360 rows.
#   deepseek-v3 2 x 8192, block 64: E_local = 128; 2*8192*8 = 131072; + 128*63 = 8064 -> 139136 = 2174 blocks.
#   deepseek-v3 8 x 1, block 64: E_local = 32; 8*1*8 = 64; + 32*63 = 2016 -> 2080 -> 33 blocks = 2112.
#   small 8 x 100, block 64: E_local = 8/8 = 1, so min(topk=2, 1) = 1; 800 + 63 = 863 -> 14 blocks = 896.
#   deepseek-v3 2 x 1, block 64: E_local = 128; 2*1*8 = 16; + 8064 = 8080 -> 127 blocks, under the
#     floor of 128 blocks (one per local expert) = 8192 rows.
@pytest.mark.parametrize(
    "preset_name, ranks, tokens, block_m, pool_tokens, pool_blocks",
    [
        ("seed-default", 8, 8192, 128, 399360, 3120),
        ("deepseek-v3", 2, 8192, 64, 139136, 2174),
        ("deepseek-v3", 8, 1, 64, 2112, 33),
        ("small", 8, 100, 64, 896, 14),
        ("deepseek-v3", 2, 1, 64, 8192, 128),
    ],
)
def test_pool_capacity_by_hand(preset_name, ranks, tokens, block_m, pool_tokens, pool_blocks):
    cfg = _config(preset_name, ranks, tokens, block_m)
    assert cfg.num_max_pool_tokens == pool_tokens
    assert cfg.num_max_pool_blocks == pool_blocks


def test_segment_sizes_follow_their_shapes():
    # deepseek-v3, 2 ranks x 8192 tokens: P = 139136 (above), T = 8192, H = 7168, I = 2048, topk = 8.
    layout = build_layout(_config("deepseek-v3", 2, 8192))
    assert layout.segment("x").nbytes == 8192 * 7168
    assert layout.segment("x_sf").nbytes == 8192 * (7168 // 128) * 4
    assert layout.segment("topk_idx").nbytes == 8192 * 8 * 8
    assert layout.segment("l1_pool").nbytes == 139136 * 7168
    assert layout.segment("l2_pool").nbytes == 139136 * 2048
    assert layout.segment("combine").nbytes == 8 * 8192 * 7168 * 2
    assert layout.segment("combine").shape == (8, 8192, 7168)


@pytest.mark.parametrize(
    "preset_name, ranks, tokens, block_m",
    [("deepseek-v3", 8, 8192, 64), ("seed-default", 8, 8192, 128), ("small", 2, 3, 64), ("qwen3-235b", 4, 129, 128)],
)
def test_segments_are_aligned_increasing_and_disjoint(preset_name, ranks, tokens, block_m):
    layout = build_layout(_config(preset_name, ranks, tokens, block_m))
    segs = layout.segments
    assert segs[0].offset == 0
    for seg in segs:
        assert seg.offset % SEGMENT_ALIGN_BYTES == 0
        assert seg.nbytes > 0
    for prev, nxt in zip(segs, segs[1:]):
        assert prev.end <= nxt.offset
        # Packed: the next segment starts at the first aligned byte after the previous one.
        assert nxt.offset - prev.end < SEGMENT_ALIGN_BYTES
    assert layout.total_bytes == segs[-1].end
    padding = layout.total_bytes - sum(seg.nbytes for seg in segs)
    assert 0 <= padding < SEGMENT_ALIGN_BYTES * len(segs)
    shares = [seg.nbytes / layout.total_bytes for seg in segs]
    assert sum(shares) == pytest.approx(1 - padding / layout.total_bytes)


def test_to_dict_matches_layout():
    layout = build_layout(_config("deepseek-v3", 2, 8192))
    d = layout.to_dict()
    assert d["total_bytes"] == layout.total_bytes
    assert d["num_max_pool_tokens"] == 139136
    assert [s["name"] for s in d["segments"]] == [s.name for s in layout.segments]
    assert [s["offset"] for s in d["segments"]] == [s.offset for s in layout.segments]


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(hidden=100), "hidden must be a multiple of 128"),
        (dict(hidden=7200), "hidden must be a multiple of 128"),
        (dict(intermediate=2000), "intermediate must be a multiple of 128"),
        (dict(num_topk=0), "num_topk must be a positive integer"),
        (dict(num_topk=257), "num_topk must be between 1 and num_experts=256"),
        (dict(hidden=0), "hidden must be a positive integer"),
        (dict(intermediate=-128), "intermediate must be a positive integer"),
        (dict(num_experts=0), "num_experts must be a positive integer"),
        (dict(hidden=True), "hidden must be a positive integer"),
    ],
)
def test_shape_validation(fields, message):
    base = dict(hidden=7168, intermediate=2048, num_experts=256, num_topk=8)
    with pytest.raises(MegaMoEError, match=message):
        MoEShape(**{**base, **fields})


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(num_ranks=3), "num_experts=256 must be divisible by num_ranks=3"),
        (dict(num_ranks=0), "num_ranks must be a positive integer"),
        (dict(num_ranks=-2), "num_ranks must be a positive integer"),
        (dict(num_max_tokens_per_rank=0), "num_max_tokens_per_rank must be a positive integer"),
        (dict(num_max_tokens_per_rank=-8), "num_max_tokens_per_rank must be a positive integer"),
        (dict(block_m=0), r"^block_m=0 is not supported by the fused kernel; expected one of \(64, 128\)$"),
        (dict(block_m=72), r"^block_m=72 is not supported"),
        (dict(block_m=32), r"^block_m=32 is not supported"),
        (dict(block_m=256), r"^block_m=256 is not supported"),
    ],
)
def test_buffer_config_validation(fields, message):
    base = dict(num_ranks=8, num_max_tokens_per_rank=4096, shape=PRESETS["deepseek-v3"], block_m=64)
    with pytest.raises(MegaMoEError, match=message):
        BufferConfig(**{**base, **fields})

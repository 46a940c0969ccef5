"""Work/traffic model and roofline floor, checked on cases computed by hand."""

import math

import pytest

from megamoe_cli.bench.metrics import (
    activation_bytes,
    expert_weight_bytes,
    metric_columns,
    pulled_bytes_per_pair,
    pushed_bytes_per_pair,
    roofline_floor,
    traffic,
)
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.gpus import GpuSpec, gpu_spec
from megamoe_cli.layout import PRESETS, MoEShape

# hidden 256, intermediate 128, 4 experts, top-2; on 2 ranks expert e lives on rank e // 2.
SHAPE = MoEShape(hidden=256, intermediate=128, num_experts=4, num_topk=2)
# rank 0 (2 tokens): 3 pairs -> expert 0 (local), 1 pair -> expert 2 (rank 1)
# rank 1 (1 token):  2 pairs -> expert 1 (rank 0)
COUNTS = [[3, 0, 1, 0], [0, 2, 0, 0]]
TOKENS = [2, 1]
# Round numbers so the expected rates are easy to write down.
SPEC = GpuSpec("test", 0, hbm_bytes_per_s=1e9, fp8_flops=1e12, bf16_flops=5e11, nvlink_bytes_per_s=1e6, num_sms=1)


def test_per_item_byte_counts():
    # w1: 2*128*256 FP8 + (256/128)*(256/128) f32 scales; w2: 256*128 FP8 + (256/128)*(128/128) scales.
    assert expert_weight_bytes(SHAPE) == (65536 + 2 * 2 * 4) + (32768 + 2 * 1 * 4) == 98328
    # FP8 row + 2 f32 scales + the f32 routing weight.
    assert pulled_bytes_per_pair(SHAPE) == 256 + 8 + 4
    assert pushed_bytes_per_pair(SHAPE) == 512
    # per token: x 256 + x_sf 8 + topk_idx 2*8 + topk_weights 2*4 in, y 512 out.
    assert activation_bytes(SHAPE, 2) == 2 * (256 + 8 + 16 + 8) + 2 * 512 == 1600


def test_traffic_two_ranks_by_hand():
    t = traffic(SHAPE, COUNTS, TOKENS)
    assert t.num_pairs == 6
    assert t.recv_pairs == [5, 1]
    assert t.remote_pairs_in == [2, 1]
    assert t.remote_pairs_out == [1, 2]
    assert t.flops == [5 * 196608, 196608]  # 2*256*128*3 per pair
    assert t.weight_bytes == [2 * 98328, 98328]  # rank 0 touches experts 0 and 1, rank 1 only expert 2
    assert t.hbm_bytes == [2 * 98328 + 1600, 98328 + 800]
    # rank 0 pulls 2 rows (268 B) and receives 1 pushed row (512 B); sends 1 row and pushes 2.
    assert t.link_in_bytes == [2 * 268 + 512, 268 + 2 * 512]
    assert t.link_out_bytes == [268 + 2 * 512, 2 * 268 + 512]
    assert t.nvlink_bytes == 3 * (268 + 512)


def test_metric_columns_by_hand():
    cols = metric_columns(traffic(SHAPE, COUNTS, TOKENS), time_us=1000.0, spec=SPEC)
    assert cols["num_pairs"] == 6
    assert cols["recv_pairs_max"] == 5
    # per GPU: totals / 2 ranks / 1 ms
    assert cols["tflops"] == pytest.approx(6 * 196608 / 2 / 1e-3 / 1e12)
    assert cols["hbm_gbps"] == pytest.approx((3 * 98328 + 2400) / 2 / 1e-3 / 1e9)
    assert cols["nvlink_gbps"] == pytest.approx(2340 / 2 / 1e-3 / 1e9)
    # floor terms (max over ranks): HBM 196656 B / 1e9 = 196.656 us; compute 983040 / 1e12 = 0.98 us;
    # NVLink busier direction 1292 B / 1e6 B/s = 1292 us.
    assert cols["floor_us"] == pytest.approx(1292.0)
    assert cols["floor_bound"] == "nvlink"
    assert cols["floor_fraction"] == pytest.approx(1.292)


def test_floor_picks_hbm_when_links_are_fast():
    fast_links = GpuSpec("t", 0, 1e9, 1e12, 5e11, 1e12, 1)
    floor = roofline_floor(traffic(SHAPE, COUNTS, TOKENS), fast_links)
    assert floor.bound == "hbm"
    assert floor.seconds == pytest.approx(2 * 98328 / 1e9)


def test_spec_numbers_for_deepseek_v3_at_8192_tokens_on_two_h200():
    """SPEC §1/§8: ~1.3 ms to read the FP8 weights, ~3 ms at FP8 peak, 7247 us ~ 798 TFLOPS."""
    shape = PRESETS["deepseek-v3"]
    tokens = 8192
    per_expert = tokens * shape.num_topk // shape.num_experts  # uniform routing: 256 pairs per expert per rank
    counts = [[per_expert] * shape.num_experts for _ in range(2)]
    t = traffic(shape, counts, [tokens, tokens])
    assert t.recv_pairs == [65536, 65536]
    h200 = gpu_spec("NVIDIA H200")
    assert max(t.weight_bytes) / h200.hbm_bytes_per_s == pytest.approx(1.31e-3, rel=0.01)
    assert max(t.flops) / h200.fp8_flops == pytest.approx(2.92e-3, rel=0.01)
    cols = metric_columns(t, time_us=7247.0, spec=h200)
    assert cols["tflops"] == pytest.approx(796, rel=0.01)
    # Half the pairs cross the link: 32768 * (7396 + 14336) B / 370 GB/s = 1.92 ms < 2.92 ms of compute.
    assert max(t.link_in_bytes) / h200.nvlink_bytes_per_s == pytest.approx(1.92e-3, rel=0.01)
    assert cols["floor_bound"] == "compute"
    assert cols["floor_us"] == pytest.approx(2920, rel=0.01)


def test_single_rank_moves_nothing_over_nvlink():
    t = traffic(SHAPE, [[1, 1, 0, 0]], [1])
    assert t.remote_pairs_in == [0] and t.nvlink_bytes == 0
    assert roofline_floor(t, SPEC).bound == "hbm"


def test_no_tokens_touch_no_weights():
    t = traffic(SHAPE, [[0] * 4, [0] * 4], [0, 0])
    assert t.num_pairs == 0 and t.weight_bytes == [0, 0] and t.hbm_bytes == [0, 0]
    cols = metric_columns(t, time_us=10.0, spec=SPEC)
    assert cols["tflops"] == 0.0 and cols["floor_us"] == 0.0 and cols["floor_fraction"] == 0.0


def test_missing_time_or_gpu_leaves_nan():
    t = traffic(SHAPE, COUNTS, TOKENS)
    no_gpu = metric_columns(t, time_us=1000.0, spec=None)
    assert no_gpu["tflops"] > 0
    assert math.isnan(no_gpu["floor_us"]) and math.isnan(no_gpu["floor_fraction"]) and no_gpu["floor_bound"] == ""
    no_time = metric_columns(t, time_us=float("nan"), spec=SPEC)
    assert math.isnan(no_time["tflops"]) and math.isnan(no_time["floor_fraction"])
    assert no_time["floor_us"] == pytest.approx(1292.0)


@pytest.mark.parametrize(
    "counts, tokens, match",
    [
        ([[1, 0, 0, 0]], [1, 1], "cover 1 ranks and num_tokens 2"),
        ([[1, 0, 0], [0, 0, 0]], [1, 1], "rank 0 have 3 experts; expected num_experts=4"),
        ([[0] * 4] * 3, [0] * 3, "num_experts=4 must be divisible by world_size=3"),
    ],
)
def test_inconsistent_routing_is_refused(counts, tokens, match):
    with pytest.raises(MegaMoEError, match=match):
        traffic(SHAPE, counts, tokens)

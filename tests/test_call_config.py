"""CPU tier: mega_moe's kernel config per call, and one buffer serving every config it can choose.

The choice (``fused.call_config``): the tuned store's config for the bound's token bucket, else
the analytic default (``heuristics``), within the block_m values the buffer serves, remembered per
buffer; an explicit ``config=`` wins.  The buffer: laid out for its largest block_m, it holds the
rows and the block counters of every smaller one, and a plan for any of them takes the pool
capacity from the buffer.
"""

from types import SimpleNamespace

import pytest
import torch

from megamoe_cli import fused
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.fused import launch
from megamoe_cli.kernel import heuristics
from megamoe_cli.kernel import tuned
from megamoe_cli.kernel.contract import SUPPORTED_BLOCK_M
from megamoe_cli.kernel.kernel_source import TAIL_FIELDS, TMAP_FIELDS, KernelConfig, variant_for
from megamoe_cli.layout import PRESETS, BufferConfig, align, build_layout, ceil_div

DSV3 = PRESETS["deepseek-v3"]
SMALL = PRESETS["small"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty tuned store of this test's own."""
    path = tmp_path / "tuned.json"
    monkeypatch.setenv(tuned.ENV_VAR, str(path))
    return path


def stand_in_buffer(config: BufferConfig, gpu_name="NVIDIA H200"):
    """A SymmBuffer without device memory: what config choice and planning read of it."""
    buf = object.__new__(fused.SymmBuffer)
    buf.config, buf.gpu_name, buf.closed = config, gpu_name, False
    buf.call_configs, buf.bucket_configs, buf.plans = {}, {}, {}
    return buf


def save_tuned(shape, world_size, tokens, config):
    key = tuned.make_key("H200", world_size, shape, tokens)
    tuned.merge_and_save([tuned.make_entry(key, config, 100.0, 150.0, date="2026-01-01T00:00:00+00:00", commit="c")])


# ----------------------------------------------------------------------------- one buffer, every block_m


def test_a_buffer_for_the_largest_block_holds_every_smaller_blocks_segments():
    """Everything a block_m-64 kernel indexes on a buffer of its own fits the default buffer."""
    for shape, ranks, tokens in ((DSV3, 2, 8192), (DSV3, 8, 1), (SMALL, 2, 3), (PRESETS["seed-default"], 8, 129)):
        wide = build_layout(BufferConfig(ranks, tokens, shape))
        assert wide.config.block_m == max(SUPPORTED_BLOCK_M) and wide.config.served_block_m == SUPPORTED_BLOCK_M
        for block_m in SUPPORTED_BLOCK_M:
            own = build_layout(BufferConfig(ranks, tokens, shape, block_m))
            for seg in own.segments:
                there = wide.segment(seg.name)
                assert len(there.shape) == len(seg.shape) and all(a >= b for a, b in zip(there.shape, seg.shape)), (
                    shape, ranks, tokens, block_m, seg.name)
            assert own.config.num_max_pool_blocks <= wide.config.num_arrival_blocks


def test_pool_and_block_counters_by_hand():
    # deepseek-v3, 2 ranks x 8192 tokens, laid out for block_m 128: E_local = 128, 2*8192*8 = 131072
    # pairs; + 128*127 = 147328 rows = 1151 blocks of 128.  Its block counters are sized for block_m
    # 64: 147328 / 64 = 2302 blocks, more than the 2174 a buffer of block_m 64 has (139136 / 64).
    cfg = BufferConfig(2, 8192, DSV3)
    assert (cfg.num_max_pool_tokens, cfg.num_max_pool_blocks, cfg.num_arrival_blocks) == (147328, 1151, 2302)
    layout = build_layout(cfg)
    assert layout.segment("l1_arrival").shape == (2302,)
    assert layout.segment("l2_arrival").shape == (2302, 1)
    assert layout.segment("l1_pool").shape == (147328, 7168)
    assert BufferConfig(2, 8192, DSV3, 64).num_arrival_blocks == 2174
    assert layout.to_dict()["served_block_m"] == [64, 128] and layout.to_dict()["num_arrival_blocks"] == 2302


@pytest.mark.parametrize("seed", range(20))
def test_the_smallest_blocks_worst_case_fits_the_pool_of_the_largest(seed):
    """Pair counts per expert that pad worst for block_m 64 (each one past a block boundary), within
    the buffer's capacity: their blocks fit the block counters and their rows the pool."""
    g = torch.Generator().manual_seed(seed)
    ranks, tokens = (1, 2, 4, 8)[seed % 4], int(torch.randint(1, 300, (1,), generator=g))
    cfg = BufferConfig(ranks, tokens, SMALL if seed % 2 else DSV3)
    e_local = cfg.num_experts_per_rank
    pairs = ranks * tokens * min(cfg.shape.num_topk, e_local)
    counts = [0] * e_local
    for e in range(e_local):  # 64k + 1 rows each while the pairs last, then the rest anywhere
        take = min(pairs, 1 + 64 * int(torch.randint(0, 3, (1,), generator=g)))
        counts[e], pairs = take, pairs - take
    counts[0] += pairs
    small = min(cfg.served_block_m)
    blocks = sum(ceil_div(c, small) for c in counts)
    assert blocks <= cfg.num_arrival_blocks
    assert blocks * small <= cfg.num_max_pool_tokens
    assert align(sum(counts), small) <= cfg.num_max_pool_tokens


def test_a_plan_takes_the_pool_from_the_buffer_and_the_tile_from_its_config(monkeypatch):
    """On one buffer (block_m 128), a block_m-64 plan and a block_m-128 plan: the same pool
    capacity in the launch parameters, each config's block in the tensor maps' A boxes."""
    cfg = BufferConfig(2, 64, SMALL)
    buf = stand_in_buffer(cfg)
    buf.rank, buf.device, buf.peer_deltas = 0, torch.device("cpu"), [0, 0]
    buf.layout = build_layout(cfg)
    buf.buffer, buf.diag = torch.empty(0, dtype=torch.uint8), torch.zeros(8, dtype=torch.int64)
    seen = []

    class Prepared:
        def __init__(self, nbytes):
            self.params = bytearray(nbytes)

    kernel = SimpleNamespace(smem_bytes=1, function=SimpleNamespace(prepare=lambda *a: Prepared(a[3])))
    monkeypatch.setattr(launch, "get_kernel", lambda variant, device: seen.append(("variant", variant)) or kernel)
    monkeypatch.setattr(launch, "check_weights", lambda *a: None)
    monkeypatch.setattr(launch, "tensor_maps", lambda b, l1, l2, block_m, cluster_m: seen.append(("maps", block_m))
                        or {name: bytes(128) for name in TMAP_FIELDS})
    monkeypatch.setattr(launch, "launch_tail", lambda b, l1, l2: seen.append(("pool", b.config.num_max_pool_tokens))
                        or {name: 0 for name in TAIL_FIELDS})
    weights = SimpleNamespace(scale=torch.zeros(1))
    for block_m in SUPPORTED_BLOCK_M:
        launch.build_plan(buf, weights, weights, KernelConfig(block_m=block_m, num_sms=8))
    variants = [v for what, v in seen if what == "variant"]
    assert [v.block_m for v in variants] == list(SUPPORTED_BLOCK_M)
    assert [b for what, b in seen if what == "maps"] == list(SUPPORTED_BLOCK_M)
    assert [p for what, p in seen if what == "pool"] == [cfg.num_max_pool_tokens] * 2
    # A buffer laid out for block_m 64 runs no block_m-128 kernel
    with pytest.raises(MegaMoEError, match=r"^the buffer serves block_m \[64\]"):
        variant_for(BufferConfig(2, 64, SMALL, 64), KernelConfig(block_m=128))


# ----------------------------------------------------------------------------- config per call


def test_the_config_follows_the_bound(store):
    # deepseek-v3 at 2 ranks: block_m 64 up to 512 tokens per rank (32 rows per expert), 128 above
    buf = stand_in_buffer(BufferConfig(2, 8192, DSV3))
    assert fused.call_config(buf, 1).block_m == 64
    assert fused.call_config(buf, 512).block_m == 64
    assert fused.call_config(buf, 513).block_m == 128
    assert fused.call_config(buf) == fused.call_config(buf, 8192)
    assert fused.call_config(buf).block_m == 128
    # The choice megamoe bench makes at the bucket's token count
    for bound in (1, 100, 1000, 8192):
        knobs, source = heuristics.choose_config(DSV3, 2, tuned.token_bucket(bound), "H200")
        assert fused.call_config(buf, bound) == KernelConfig.from_knobs(knobs) and source == "default"
    assert {source for _, source in buf.bucket_configs.values()} == {"default"}


def test_the_bucket_is_capped_at_the_capacity():
    # 3000 tokens of capacity: a bound of 2500 is in bucket 4096, chosen at 3000 tokens
    cfg = BufferConfig(8, 3000, PRESETS["qwen3-235b"])
    assert heuristics.config_for_bound(cfg, 2500, "H200") == heuristics.choose_config(cfg.shape, 8, 3000, "H200",
                                                                                     max_block_m=128)


def test_the_choice_is_made_once_per_bucket_and_remembered_per_bound(store, monkeypatch):
    chosen = []
    real = heuristics.config_for_bound
    monkeypatch.setattr(heuristics, "config_for_bound", lambda *a, **k: chosen.append(a[1]) or real(*a, **k))
    buf = stand_in_buffer(BufferConfig(2, 8192, DSV3))
    first = fused.call_config(buf, 3)
    assert fused.call_config(buf, 4) is first  # bucket 4 again: not chosen again
    assert fused.call_config(buf, 3) is first
    assert chosen == [3]
    assert set(buf.call_configs) == {3, 4} and set(buf.bucket_configs) == {4}
    fused.call_config(buf, None)
    fused.call_config(buf, None)
    assert chosen == [3, 8192]
    # The hot path: a remembered bound is one dictionary lookup, nothing else runs
    monkeypatch.setattr(heuristics, "config_for_bound", None)
    monkeypatch.setattr(tuned, "token_bucket", None)
    assert fused.call_config(buf, 4) is first and fused.call_config(buf, None).block_m == 128


def test_the_tuned_store_comes_first(store):
    save_tuned(DSV3, 2, 16, {"block_m": 128, "num_stages": 3, "num_sms": 120, "cluster_m": 1})
    buf = stand_in_buffer(BufferConfig(2, 8192, DSV3))
    assert fused.call_config(buf, 9) == KernelConfig(block_m=128, num_stages=3, num_sms=120, cluster_m=1)
    assert buf.bucket_configs[16][1] == "tuned"
    # Another bucket has no tuned entry: the analytic default, block_m 64 at 32 tokens
    assert fused.call_config(buf, 32) == KernelConfig.from_knobs(heuristics.default_config(DSV3, 2, 32, "H200"))
    assert buf.bucket_configs[32][1] == "default"
    # A tuned block_m the buffer does not serve: the default within what it serves
    narrow = stand_in_buffer(BufferConfig(2, 8192, DSV3, 64))
    assert fused.call_config(narrow, 16).block_m == 64 and narrow.bucket_configs[16][1] == "default"
    assert fused.call_config(narrow, 8192).block_m == 64


@pytest.mark.parametrize("bound", [-1, 8193, 2.0, True, "8"])
def test_a_bad_bound_is_refused(store, bound):
    buf = stand_in_buffer(BufferConfig(2, 8192, DSV3))
    with pytest.raises(MegaMoEError, match=rf"^mega_moe: num_tokens_bound must be an integer in \[0, 8192\] \(the "
                                           rf"buffer's num_max_tokens_per_rank\), got {bound!r}$"):
        fused.call_config(buf, bound)
    assert buf.call_configs == {}


def test_mega_moe_runs_the_chosen_config_and_an_explicit_one_wins(store, monkeypatch):
    buf = stand_in_buffer(BufferConfig(2, 8192, DSV3))
    planned = []

    class Stop(Exception):
        pass

    def plan(b, l1, l2, config):
        planned.append(config)
        raise Stop

    monkeypatch.setattr(fused, "build_plan", plan)
    weights = fused.ExpertWeights(torch.zeros(1), torch.zeros(1))
    y = torch.empty(4, DSV3.hidden, dtype=torch.bfloat16)
    for kwargs in ({"num_tokens_bound": 4}, {}, {"config": KernelConfig(block_m=128, num_stages=2)},
                   {"config": KernelConfig(block_m=64, num_stages=3), "num_tokens_bound": 8192}):
        with pytest.raises(Stop):
            fused.mega_moe(y, weights, weights, buf, **kwargs)
    assert planned == [fused.call_config(buf, 4), fused.call_config(buf), KernelConfig(block_m=128, num_stages=2),
                       KernelConfig(block_m=64, num_stages=3)]
    assert planned[0].block_m == 64 and planned[1].block_m == 128


def test_more_tokens_than_the_bound_are_refused(store, monkeypatch):
    buf = stand_in_buffer(BufferConfig(2, 8192, DSV3))
    buf.device = torch.device("cpu")
    monkeypatch.setattr(fused, "build_plan", lambda *a: SimpleNamespace(launch=None, bind=lambda l1, l2: None))
    weights = fused.ExpertWeights(torch.zeros(1), torch.zeros(1))
    y = torch.empty(5, DSV3.hidden, dtype=torch.bfloat16)
    with pytest.raises(MegaMoEError, match=r"^mega_moe: num_tokens=5 exceeds num_tokens_bound=4$"):
        fused.mega_moe(y, weights, weights, buf, num_tokens_bound=4)
    with pytest.raises(MegaMoEError, match=r"^mega_moe: num_tokens=5 exceeds num_tokens_bound=4$"):
        fused.mega_moe(y, weights, weights, buf, num_tokens_bound=4, config=KernelConfig())
    with pytest.raises(MegaMoEError, match=r"num_tokens_bound must be an integer in \[0, 8192\]"):
        fused.mega_moe(y, weights, weights, buf, num_tokens_bound=9000, config=KernelConfig())

"""The main-loop attribution's arithmetic and tables (``bench.attribution``) on made-up numbers
whose expected values are worked out by hand, and ``scripts/mainloop_attribution.py``'s refusals."""

import ctypes
import importlib.util
import json
import os
from pathlib import Path

import pytest

from megamoe_cli.bench import attribution as A

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------
# Counting


def test_k_blocks_and_padding():
    assert A.k_blocks(7168) == 56
    assert A.k_blocks(2048) == 16
    with pytest.raises(ValueError, match="multiple of 128"):
        A.k_blocks(100)
    # 0 rows take no block; 1 row takes a whole one; 128 exactly one; 129 two
    assert A.padded_rows([0, 1, 128, 129], 128) == 0 + 128 + 128 + 256
    assert A.padded_rows([5, 70], 64) == 64 + 128


def test_grouped_tiles():
    # blocks per expert 1 + 2 + 0 = 3, times ceil(4096 / 256) = 16 N tiles
    assert A.grouped_tiles([100, 200, 0], 128, 4096, 256) == 48
    # an N that is not a multiple of block_n still takes its partial tile
    assert A.grouped_tiles([128], 128, 7168, 160) == 45


def test_waves_and_last_wave_use():
    assert A.waves(300, 132) == pytest.approx((300 / 132, 36 / 132))
    assert A.waves(264, 132) == pytest.approx((2.0, 1.0))
    assert A.waves(1, 132) == pytest.approx((1 / 132, 1 / 132))
    assert A.waves(0, 132) == (0.0, 0.0)


def test_cycles_per_k_block_from_time_clock_and_tiles():
    # 1000 us at 1500 MHz on 132 SMs = 1.98e8 SM cycles, over 264 tiles x 56 K blocks = 14784
    assert A.derived_cycles_per_k_block(1000.0, 1500.0, 132, 264, 7168) == pytest.approx(1.98e8 / 14784)
    assert A.derived_cycles_per_k_block(1000.0, 1500.0, 132, 300, 7168) == pytest.approx(1.98e8 / (300 * 56))
    # the critical path: 1.5e6 cycles over whole waves (3 of them for 300 tiles) of 56 K blocks
    assert A.critical_path_cycles_per_k_block(1000.0, 1500.0, 132, 300, 7168) == pytest.approx(1.5e6 / 168)
    assert A.critical_path_cycles_per_k_block(1000.0, 1500.0, 132, 264, 7168) == pytest.approx(1.5e6 / 112)


def test_per_area_and_tflops():
    assert A.per_unit_area(1000.0, 128, 256) == pytest.approx(500.0)
    assert A.per_unit_area(1000.0, 64, 128) == pytest.approx(2000.0)
    # 2 * 1000 * 4096 * 7168 flops in 100 us
    assert A.tflops(1000, 4096, 7168, 100.0) == pytest.approx(587.20256)


def test_deepgemm_row_walks_the_padded_pool():
    config = {"block_m": 128, "block_n": 160, "num_sms": 132, "num_stages": 5, "multicast": 2}
    row = A.deepgemm_row("L1", [100, 300], A.padded_rows([100, 300], 128), 4096, 7168, config, 1000.0, 1500.0)
    assert (row.m_useful, row.m_padded) == (400, 128 + 384)
    assert row.tiles == 4 * 26  # 512 / 128 row blocks, ceil(4096 / 160) N tiles
    assert row.cycles_per_k_block == pytest.approx(1000 * 1500 * 132 / (104 * 56))
    assert row.cycles_per_unit_area == pytest.approx(row.cycles_per_k_block * 16384 / (128 * 160))
    assert (row.stages, row.multicast) == (5, 2)
    assert row.notes["critical_path_cycles_per_k_block"] == pytest.approx(1.5e6 / 56)


def _breakdown():
    """``profile.cycle_breakdown`` of raw counters summed over 264 consumer warpgroups (132 CTAs),
    each of which spent the per-warpgroup cycles below."""
    from megamoe_cli.bench.profile import cycle_breakdown

    n = 264
    per_wg = {"consumer_start": 10000, "tile_wait": 20000, "mainloop": 500000, "stage_wait": 50000,
              "epilogue_l1": 30000, "epilogue_l2": 20000, "combine_barrier": 5000, "reduce": 15000,
              "consumer_total": 620000, "tiles_l1": 4, "tiles_l2": 2, "mainloop_l1": 300000}
    return cycle_breakdown({"samplers": n, **{k: v * n for k, v in per_wg.items()}}, 7168, 2048)


def _layers():
    b = _breakdown()
    l1 = A.megamoe_row("L1", [1000, 2000], 128, 4096, 7168, 132, b, 1000.0, 4, 1)
    l2 = A.megamoe_row("L2", [1000, 2000], 128, 7168, 2048, 132, b, 1000.0, 4, 1)
    # DeepGEMM at 128x128 tiles: 400 and 500 cycles per K block, i.e. per 128x128
    peer1 = A.GemmRow("L1", "deepgemm", 3000, 3072, 4096, 7168, 128, 128, 768, 132, 900.0, 400.0)
    peer2 = A.GemmRow("L2", "deepgemm", 3000, 3072, 7168, 2048, 128, 128, 1344, 132, 500.0, 500.0)
    return [(l1, peer1), (l2, peer2)]


def test_megamoe_row_from_counters():
    (l1, _), (l2, _) = _layers()
    assert (l1.m_useful, l1.m_padded) == (3000, 1024 + 2048)
    assert l1.tiles == (8 + 16) * 16  # ceil(1000/128) + ceil(2000/128) row blocks, 4096 / 256 N tiles
    assert l1.time_us == pytest.approx(300.0)  # 300000 loop cycles at 1000 MHz
    assert l2.time_us == pytest.approx(200.0)  # mainloop - mainloop_l1
    assert l1.cycles_per_k_block == pytest.approx(300000 / 224)
    assert l1.notes["tiles_counted"] == 4 * 132


def test_split_adds_up_to_the_call():
    rows = A.split_call(_breakdown(), 700.0, 1000.0, _layers())
    got = dict(rows)
    # L1: 4 tiles x 56 K blocks at 400 per 128x128 x 2 (a 128x256 tile) = 179200 cycles, 3/4 of rows useful
    assert got["L1 main loop at DeepGEMM's rate, useful rows"] == pytest.approx(179.2 * 3000 / 3072)
    assert got["L1 main loop at DeepGEMM's rate, padding rows"] == pytest.approx(179.2 * 72 / 3072)
    # L2: 2 tiles x 16 K blocks at 500 x 2 = 32000 cycles
    assert got["L2 main loop at DeepGEMM's rate, useful rows"] == pytest.approx(32.0 * 3000 / 3072)
    # 500000 loop - 50000 stage waits - 211200 at DeepGEMM's rate
    assert got["main loop beyond DeepGEMM's rate"] == pytest.approx(238.8)
    assert got["stage waits"] == pytest.approx(50.0)
    assert got["start: dispatch, count exchange, schedule"] == pytest.approx(10.0)
    assert got[A.RESIDUAL_ROWS[0]] == pytest.approx(20.0)  # 620000 total - 600000 counted
    assert got[A.RESIDUAL_ROWS[1]] == pytest.approx(80.0)  # 700 us - 620 us
    assert sum(v for _, v in rows) == pytest.approx(700.0)
    assert A.residual_us(rows) == pytest.approx(100.0)


def test_tables_and_files(tmp_path):
    layers = _layers()
    rows = A.split_call(_breakdown(), 700.0, 1000.0, layers)
    table = A.gemm_table(layers)
    lines = table.splitlines()
    assert len(lines) == 2 + 4
    assert len({line.count("|") for line in lines}) == 1
    # L1: megamoe 300000 / 224 per 128x256 = 669.6 per 128x128, DeepGEMM 400
    assert f"| {300000 / 224 / 2 / 400:.3f} |" in lines[2]
    assert "| 128x256 |" in lines[2] and "| 128x128 |" in lines[3]
    split = A.split_table(rows, 700.0)
    assert "| **sum** | **700.0** | 100.0% |" in split
    out = A.write_report(tmp_path / "attrib", "t", {"gpu": "H200"}, layers, rows, 700.0)
    doc = json.loads((out / "attribution.json").read_text())
    assert sum(r["us"] for r in doc["split"]) == pytest.approx(700.0)
    assert doc["residual_us"] == pytest.approx(100.0)
    assert [g["side"] for g in doc["gemms"]] == ["megamoe", "deepgemm", "megamoe", "deepgemm"]
    assert doc["gemms"][0]["waves"] == pytest.approx(384 / 132)
    text = (out / "attribution.md").read_text()
    assert text.startswith("# t\n") and "- gpu: H200" in text and "Residual (rows no counter covers): 100.0 us" in text


# ---------------------------------------------------------------------------
# DeepGEMM's printed configs

# As sgl-deep-gemm's GemmDesc and GemmConfig print themselves (``desc << ": " << config``).
NEW = ("GemmDesc(gemm_type=1, kernel_type=1, m=29056, n=4096, k=7168, num_groups=256, major_a=0, major_b=0, "
       "mma_kind=1, a_dtype=Float8_e4m3fn, b_dtype=Float8_e4m3fn, cd_dtype=BFloat16, with_accumulation=0, "
       "num_sms=132, tc_util=100, compiled_dims=nk, ensure_zero_padding=1, expected_m=0, expected_n=0, "
       "expected_k=0, expected_num_groups=0): GemmConfig(layout=Layout(swap_ab=0, block_m=128, block_n=160, "
       "block_k=128, cluster_m=1, cluster_n=2), storage_config=StorageConfig(load_block_m=128, load_block_n=160, "
       "store_block_m=128, store_block_n=160, swizzle_a_mode=128, swizzle_b_mode=128, swizzle_cd_mode=64), "
       "pipeline_config=PipelineConfig(smem_size=220000, num_stages=5), launch_config=LaunchConfig(num_sms=132, "
       "num_sms_per_cluster=2, num_threads=384, num_tma_threads=128, num_math_threads=256, "
       "num_non_epilogue_threads=128, num_epilogue_threads=256), split_k=1)")
OLD = ("GEMM type: 1, kernel type: 0, M: 29056, N: 7168, K: 2048, groups: 1, A major: 0, B major: 0, "
       "SM limit: 132 -> block M: 128, block N: 112, block K: 128, stages: 8, last stages: 0, SMs: 128, "
       "multicast: 2, multicast on A: 1, swizzle A: 128")


def test_parse_both_spellings():
    configs = A.parse_deepgemm_configs("compiling...\n" + NEW + "\nnoise block_m=3\n" + OLD + "\n")
    assert len(configs) == 2
    new, old = configs
    assert (new["m"], new["n"], new["k"], new["block_m"], new["block_n"]) == (29056, 4096, 7168, 128, 160)
    assert (new["num_stages"], new["num_sms"], new["multicast"], new["multicast_on"]) == (5, 132, 2, "A")
    assert new["swap_ab"] == 0 and new["a_dtype"] == "Float8_e4m3fn"
    assert (old["m"], old["n"], old["k"], old["block_m"], old["block_n"]) == (29056, 7168, 2048, 128, 112)
    assert (old["num_stages"], old["num_sms"], old["multicast"], old["multicast_on"]) == (8, 128, 2, "A")


def test_config_for_picks_the_last_of_its_n_and_k():
    later = NEW.replace("block_n=160", "block_n=192")
    configs = A.parse_deepgemm_configs("\n".join([NEW, OLD, later]))
    assert A.config_for(configs, 4096, 7168)["block_n"] == 192
    assert A.config_for(configs, 7168, 2048)["block_n"] == 112
    assert A.config_for(configs, 1, 1) is None


def test_captured_stdout_takes_c_output(capfd):
    libc = ctypes.CDLL(None)
    with A.captured_stdout(echo=False) as got:
        os.write(1, b"from the fd\n")
        libc.printf(b"block M: %d\n", 128)  # buffered by C stdio until the block ends
    assert got.text == "from the fd\nblock M: 128\n"
    assert capfd.readouterr().out == ""


# ---------------------------------------------------------------------------
# The script's refusals


def _script():
    spec = importlib.util.spec_from_file_location("mainloop_attribution", ROOT / "scripts" / "mainloop_attribution.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_refuses_without_a_gpu(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _script().main(["--tokens", "8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mainloop_attribution.py: no CUDA GPU here (the fused kernel and DeepGEMM's GEMMs need a "
                   "Hopper GPU)"]


def test_refuses_without_deep_gemm(monkeypatch, capsys):
    torch = pytest.importorskip("torch")
    import megamoe_cli.baselines.peers as peers

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(peers.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delitem(peers.sys.modules, "deep_gemm", raising=False)
    assert _script().main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sgl-deep-gemm, which is not installed here" in err[0]


def test_script_report_from_measurements(tmp_path, capsys):
    """The script's last step on measurements as its GPU steps hand them over."""
    script = _script()
    args = script.parse_args(["--tokens", "3000", "--out", str(tmp_path / "out")])
    config = A.parse_deepgemm_configs(NEW)[0]
    gemm = lambda n, k, us: {"n": n, "k": k, "config": config, "graph_us": us + 5, "kernel_us": us,  # noqa: E731
                             "kernel": "sm90_fp8_gemm_1d2d_impl", "clock_mhz": 1500.0}
    deepgemm = ({"L1": gemm(4096, 7168, 900.0), "L2": gemm(7168, 2048, 500.0)}, 3072, 128, True)
    fused = {"config": {"block_m": 128, "num_stages": 4, "num_sms": 0, "cluster_m": 1}, "num_sms": 132,
             "release_us": 650.0, "release_mhz": 1600.0, "profile_us": 700.0, "profile_mhz": 1000.0,
             "breakdown": _breakdown(), "gaps": {1: 1.0, 2: 3.0}}
    script.report(args, "fused point", [1000, 2000], deepgemm, fused, "H200", "sgl-deep-gemm 0.1.5.post1")
    printed = capsys.readouterr().out
    doc = json.loads((tmp_path / "out" / "attribution.json").read_text())
    assert printed.strip() == (tmp_path / "out" / "attribution.md").read_text().strip()
    assert sum(r["us"] for r in doc["split"]) == pytest.approx(700.0)
    peer_l1 = doc["gemms"][1]
    # 3072 padded rows / 128 = 24 row blocks x ceil(4096 / 160) = 26 N tiles; 900 us at 1500 MHz on 132 SMs
    assert peer_l1["tiles"] == 24 * 26
    assert peer_l1["cycles_per_k_block"] == pytest.approx(900 * 1500 * 132 / (624 * 56))
    assert doc["facts"]["megamoe release call us"] == "650.0 at 1600 MHz"
    # 900 us x 1500 MHz over ceil(624 / 132) = 5 waves of 56 K blocks
    assert f"L1: DeepGEMM on the busiest SM (whole waves, idle SMs left out): {900 * 1500 / (5 * 56):,.0f}" in printed
    assert "counters cost +50.0 us" in doc["facts"]["megamoe profiling-build call us"]
    waits = {r["row"]: r["us"] for r in doc["split"]}
    assert waits["tile starts before L2 tiles (L1 -> L2 waits)"] == pytest.approx(15.0)  # 3/4 of 20 us


def _event(cta, kind, clock, layer, epoch=1):
    return {"time_ns": clock, "clock": clock, "cta": cta, "kind": kind, "epoch": epoch, "layer": layer,
            "expert": 0, "n": 0, "block": 0}


def test_tile_gaps_by_the_next_tiles_layer():
    events = [_event(0, "cta_start", 0, 1), _event(1, "cta_start", 0, 1),
              # CTA 0: L1 tile 10-100, gap 20, L2 tile 120-200, gap 5, L1 tile 205-300
              _event(0, "tile_start", 10, 1), _event(0, "tile_end", 100, 1), _event(0, "tile_start", 120, 2),
              _event(0, "tile_end", 200, 2), _event(0, "tile_start", 205, 1), _event(0, "tile_end", 300, 1),
              # CTA 1 (events out of order): L1 tile 0-50, gap 30 before an L2 tile
              _event(1, "tile_end", 50, 1), _event(1, "tile_start", 0, 1), _event(1, "tile_start", 80, 2),
              _event(1, "tile_end", 150, 2),
              _event(0, "cta_end", 310, 1), _event(1, "cta_end", 160, 1)]
    assert A.tile_gaps(events) == {1: 5.0, 2: 50.0}
    # an older, complete call is ignored when a newer one is complete too
    older = [dict(e, epoch=0, clock=e["clock"] * 7) for e in events]
    assert A.tile_gaps(older + events) == {1: 5.0, 2: 50.0}


def test_split_shares_the_tile_wait_by_the_gaps():
    rows = A.split_call(_breakdown(), 700.0, 1000.0, _layers(), gaps={1: 5.0, 2: 15.0})
    got = dict(rows)
    assert got["tile starts before L1 tiles (dispatch arrivals)"] == pytest.approx(5.0)
    assert got["tile starts before L2 tiles (L1 -> L2 waits)"] == pytest.approx(15.0)
    assert sum(v for _, v in rows) == pytest.approx(700.0)
    assert "tile starts (first-stage waits, L1 -> L2 and arrivals)" in dict(A.split_call(
        _breakdown(), 700.0, 1000.0, _layers(), gaps={1: 0.0, 2: 0.0}))

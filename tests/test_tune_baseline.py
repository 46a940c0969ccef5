"""``megamoe tune --backend torch|torch-graph``: the baseline's candidates, its tuned store entries
(nearest bucket, GPU match), the baseline reading them at prepare and recording where its config
came from, and the command end to end on two gloo CPU ranks with the real baseline (its Triton
GEMMs under Triton's interpreter, so the shapes are tiny)."""

import json
from pathlib import Path

import triton_interpreter  # noqa: F401  (sets TRITON_INTERPRET before the kernels are imported)

import pytest
import torch

from megamoe_cli.baselines import torch_fp8 as baseline_fp8
from megamoe_cli.baselines.torch_fp8 import MAX_SMEM_BYTES, TorchFP8Backend, default_launch_config
from megamoe_cli.bench import tune as lib
from megamoe_cli.bench import tune_baseline as tb
from megamoe_cli.bench.tune import EXCLUDED, OK, CandidateResult
from megamoe_cli.bench.tune_baseline import BaselineCandidate
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.kernel import tuned
from megamoe_cli.layout import PRESETS, MoEShape
from megamoe_cli.problem import make_problem
from megamoe_cli.reference.layer import moe_reference
from cli_checks import assert_one_line_error, run_cli

REPO = Path(__file__).resolve().parents[1]
DSV3 = PRESETS["deepseek-v3"]
SHAPE = MoEShape(hidden=256, intermediate=128, num_experts=8, num_topk=3)
REAL_GPU_NAME = baseline_fp8._gpu_name
needs_triton = pytest.mark.skipif(not triton_interpreter.have_triton(), reason="needs triton (pip install triton)")


@pytest.fixture
def store(tmp_path, monkeypatch):
    """An empty user store, and the shipped store moved aside, so no entry but a test's is found."""
    path = tmp_path / "cache" / "tuned.json"
    monkeypatch.setenv(tuned.ENV_VAR, str(path))
    monkeypatch.setattr(tuned, "SHIPPED_BASELINE_PATH", tmp_path / "shipped" / "tuned_baseline.json")
    return path


def sweep(doc, backend="torch-graph"):
    return tb.validate_tune_sweep({"name": "t", **doc}, "test", backend=backend)


def _args(p):
    return (p.x, p.x_sf, p.topk_idx, p.topk_weights, p.w1, p.w1_sf, p.w2, p.w2_sf)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


# ---------------------------------------------------------------------------- candidates


def test_block_m_candidates_bracket_the_expected_rows_per_expert():
    assert tb.plausible_block_ms(0.03) == (16, 32)   # decode: 1 token x top-8 over 256 experts
    assert tb.plausible_block_ms(16) == (16, 32)
    assert tb.plausible_block_ms(17) == (16, 32, 64)
    assert tb.plausible_block_ms(32) == (16, 32, 64)  # 1024 tokens x top-8 over 256 experts
    assert tb.plausible_block_ms(33) == (32, 64, 128)
    assert tb.plausible_block_ms(100) == (64, 128)
    assert tb.plausible_block_ms(256) == (64, 128)  # prefill: 8192 tokens x top-8 over 256 experts


def test_candidates_are_the_default_plus_valid_grid_configs_and_exclusions_say_why():
    s = sweep({"shape": {"preset": "deepseek-v3"}, "num_tokens": [8192],
               "candidates": {"num_stages": [4, 6], "l2_block_n": [128, 256]}})
    (plan,) = lib.plan_tune(s, 1, "NVIDIA H200")
    default = BaselineCandidate.of(default_launch_config(1, 8192, 8, 256), is_default=True)
    assert plan.default == default and default in plan.candidates
    assert plan.key == tuned.make_key("H200", 1, DSV3, 8192, kernel="baseline")
    assert str(plan.key).startswith("baseline/H200/ws1/h7168/")
    # 2 block_m (64, 128) x warps (4, 8) x 2 depths x 2 L2 tile widths, and the default.
    assert len(plan.candidates) + len(plan.excluded) == 2 * 2 * 2 * 2 + 1
    assert {c.block_m for c in plan.candidates} == {64, 128}
    for c in plan.candidates:
        assert c.launch.problem(DSV3.hidden) == ""
        assert c.launch.smem_floor_bytes() <= MAX_SMEM_BYTES
    orders = [c.order for c in plan.candidates]
    assert orders == sorted(orders)
    # Six stages of 128-row L1 tiles cannot fit; of 64-row ones they may.
    assert len(plan.excluded) == 4
    for too_deep in plan.excluded:
        assert too_deep.status == EXCLUDED and too_deep.stage == "config"
        assert (too_deep.candidate.block_m, too_deep.candidate.num_stages) == (128, (6, 6))
        assert f"at least {5 * (128 * 128 + 2 * 128 * 128)} bytes of shared memory" in too_deep.reason

    narrow = sweep({"shape": {"hidden": 384, "intermediate": 128, "num_experts": 8, "num_topk": 2},
                    "num_tokens": [4], "block_m": [16], "candidates": {"num_warps": [4], "num_stages": [3],
                                                                        "l2_block_n": [128, 256]}})
    (plan,) = lib.plan_tune(narrow, 1, "H200")
    (wide,) = plan.excluded
    assert wide.candidate.l2_block_n == 256 and wide.reason == "l2_block_n=256 does not divide hidden=384"


def test_decode_points_time_few_warps_and_the_shipped_sweep_fits_its_budget():
    sweep_file = tb.load_tune_sweep(REPO / "sweeps" / "tune_baseline.yaml", backend="torch-graph")
    plans = lib.plan_tune(sweep_file, 1, "H200")
    # Each shape tuned once: MXFP4 points run the FP8 GEMMs of their FP8 twin.
    assert len(plans) == 15 and len({p.key for p in plans}) == 15
    assert {p.key.weights for p in plans} == {"fp8"}
    assert sum("converted once: tuned once" in note for note in sweep_file.notes) == 15
    assert {p.point.backend for p in plans} == {"torch-graph"}
    counts = {(p.point.shape_label(), p.key.token_bucket): len(p.candidates) for p in plans}
    assert counts[("deepseek-v3", 1)] == 9 and counts[("deepseek-v3", 8192)] == 17
    assert counts[("deepseek-v3", 1024)] == 17  # 16 and 32 x 4 stages, 64 x 2 warps x 4 stages, the default
    assert counts[("seed-default", 1024)] == 9  # 16 expected rows: 16 fits them
    assert sum(counts.values()) == 175  # the count sweeps/tune_baseline.yaml states
    for plan in plans:
        if plan.key.token_bucket <= 128:
            assert {c.num_warps for c in plan.candidates} == {4}
            assert {c.block_m for c in plan.candidates} == {16, 32}
    assert "(175 over the 15 points)" in " ".join(sweep_file.description.split())


def test_baseline_candidates_round_trip_and_ask_for_every_knob():
    c = BaselineCandidate(64, 8, (3, 4), 256, 16, is_default=True)
    back = BaselineCandidate.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back == c and isinstance(back, BaselineCandidate)
    assert c.backend_config() == {"gemm": "triton", "block_m": 64, "num_warps": 8, "num_stages": [3, 4],
                                  "l2_block_n": 256, "group_m": 16}
    r = CandidateResult(c, OK, time_us=5.0, rank_times_us=(5.0,))
    assert CandidateResult.from_dict(json.loads(json.dumps(r.to_dict())), BaselineCandidate).candidate == c
    # What the ranks are told to read the candidates back with.
    from megamoe_cli.bench.session import load_attribute

    assert load_attribute(f"{BaselineCandidate.__module__}:{BaselineCandidate.__qualname__}") is BaselineCandidate


@pytest.mark.parametrize(
    "body, fragments",
    [
        ("num_tokens: [8]\nbackends: [fused]\n", ["t.yaml:4", "give backends: [torch-graph]"]),
        ("num_tokens: [8]\ncandidates: {num_warps: [4, 6]}\n", ["t.yaml:4", "num_warps must be one of 4, 8, got 6"]),
        ("num_tokens: [8]\ncandidates: {cluster_m: [1]}\n", ["t.yaml:4", "unknown key 'cluster_m'"]),
        ("num_tokens: [8]\nblock_m: [16, 16]\n", ["t.yaml:4", "16 is listed twice"]),
        ("num_tokens: [8]\ncheck: false\n", ["t.yaml:4", "every candidate is checked"]),
    ],
)
def test_bad_baseline_tune_sweeps_name_the_line(body, fragments):
    with pytest.raises(MegaMoEError) as err:
        tb.load_tune_sweep_text("name: t\nshape: {preset: small}\n" + body, "t.yaml", backend="torch-graph")
    for fragment in fragments:
        assert fragment in str(err.value)


def test_a_baseline_sweep_tuned_as_the_fused_kernel_says_how_to_tune_it():
    with pytest.raises(MegaMoEError, match="tune with --backend naming it"):
        lib.load_tune_sweep(REPO / "sweeps" / "tune_baseline.yaml")


# ---------------------------------------------------------------------------- store


def entry(gpu, bucket, config, world_size=1, shape=DSV3, kernel="baseline"):
    key = tuned.make_key(gpu, world_size, shape, bucket, kernel=kernel)
    return tuned.make_entry(key, config, 1.0, 2.0, date="d", commit="c")


def test_lookup_takes_the_nearest_bucket_of_the_same_gpu_kernel_and_shape(tmp_path):
    path = tmp_path / "tuned.json"
    tuned.merge_and_save([entry("H200", 8, {"block_m": 16}), entry("H200", 1024, {"block_m": 64}),
                          entry("H100", 128, {"block_m": 32}), entry("H200", 128, {"block_m": 128}, kernel="fused"),
                          entry("H200", 128, {"block_m": 32}, world_size=2)], path)
    stored = json.loads(path.read_text())["entries"]
    assert "baseline/H200/ws1/h7168/i2048/e256/k8/fp8_e4m3/t8" in stored
    assert "H200/ws1/h7168/i2048/e256/k8/fp8_e4m3/t128" in stored  # fused keys read as before

    def nearest(tokens, gpu="NVIDIA H200", world_size=1):
        hit = tuned.lookup_nearest(tuned.make_key(gpu, world_size, DSV3, tokens, kernel="baseline"), path)
        return None if hit is None else (hit[0].token_bucket, hit[1]["block_m"])

    assert nearest(8) == (8, 16)
    assert nearest(1) == (8, 16)
    assert nearest(16) == (8, 16)
    assert nearest(96) == (1024, 64)    # 128: 16x from 8, 8x from 1024
    assert nearest(8192) == (1024, 64)
    assert nearest(90, gpu="H100") == (128, 32)
    assert nearest(128, world_size=2) == (128, 32)
    assert nearest(8, world_size=4) is None
    tuned.merge_and_save([entry("H200", 64, {"block_m": 32})], path)
    assert nearest(256) == (1024, 64)  # 4x either way: the larger bucket
    assert tuned.lookup_nearest(tuned.make_key("H200", 1, PRESETS["seed-default"], 8, kernel="baseline"),
                                path) is None


# ---------------------------------------------------------------------------- the baseline reads it


def _runner(monkeypatch, config, num_max_tokens=32, shape=SHAPE, gpu="NVIDIA H200", num_tokens=16):
    monkeypatch.setattr(baseline_fp8, "_gpu_name", lambda device: gpu)
    p = make_problem(shape, 0, 1, num_tokens, num_max_tokens, "cpu", seed=5)
    return p, TorchFP8Backend().prepare(p, None, config)


@needs_triton
@pytest.mark.slow
def test_the_baseline_runs_a_stored_config_and_says_where_it_came_from(store, monkeypatch):
    stored = {"block_m": 32, "num_warps": 8, "num_stages": [2, 5], "l2_block_n": 64, "group_m": 1}
    tuned.merge_and_save([entry("H200", 32, stored, shape=SHAPE)])
    p, runner = _runner(monkeypatch, {"gemm": "triton"}, num_max_tokens=20)  # bucket 32
    assert {k: runner.config[k] for k in stored} == stored
    assert runner.config["config_source"] == "tuned" and runner.config["tuned_store"] == str(store)
    assert runner.config["tuned_entry"].startswith("baseline/H200/ws1/h256/i128/e8/k3/") and "t32" in \
        runner.config["tuned_entry"]
    assert runner.layout.block_m == 32
    assert _rel(runner(), moe_reference(*_args(p))) < 1e-3

    # A key the config gives wins over the entry's; the rest still come from it.
    _, runner = _runner(monkeypatch, {"gemm": "triton", "block_m": 16}, num_max_tokens=20)
    assert runner.config["config_source"] == "tuned+given"
    assert (runner.config["block_m"], runner.config["num_warps"], runner.config["l2_block_n"]) == (16, 8, 64)

    # No entry for this GPU: today's defaults, and the row says why.
    _, runner = _runner(monkeypatch, {"gemm": "triton"}, num_max_tokens=20, gpu="NVIDIA H100")
    default = default_launch_config(1, 20, SHAPE.num_topk, SHAPE.num_experts)
    assert runner.config["config_source"] == "default"
    assert {k: runner.config[k] for k in stored} == default.to_config()
    assert runner.config["config_note"].startswith("no tuned entry for baseline/H100/ws1/h256/")
    assert str(store) in runner.config["config_note"]

    # Off CUDA there is no GPU to key by (the CPU ranks' own case).
    monkeypatch.setattr(baseline_fp8, "_gpu_name", REAL_GPU_NAME)
    p = make_problem(SHAPE, 0, 1, 4, 8, "cpu", seed=5)
    runner = TorchFP8Backend().prepare(p, None, {"gemm": "triton"})
    assert runner.config["config_source"] == "default"
    assert runner.config["config_note"] == "no GPU to key a tuned entry by"


@needs_triton
@pytest.mark.slow
def test_every_l2_tile_width_and_launch_grouping_matches_the_reference(monkeypatch, store):
    p = make_problem(SHAPE, 0, 1, 24, 32, "cpu", seed=21, routing="imbalanced")
    ref = moe_reference(*_args(p))
    for l2_block_n, group_m in ((64, 1), (256, 4), (128, 32)):
        runner = TorchFP8Backend().prepare(p, None, {"gemm": "triton", "block_m": 16, "num_warps": 4,
                                                     "num_stages": 3, "l2_block_n": l2_block_n, "group_m": group_m})
        assert runner.config["config_source"] == "given"
        assert _rel(runner(), ref) < 1e-3, (l2_block_n, group_m)


@needs_triton
@pytest.mark.slow
def test_the_user_store_wins_over_the_shipped_one_and_mxfp4_reads_the_fp8_key(store, monkeypatch):
    shipped = tuned.SHIPPED_BASELINE_PATH
    tuned.merge_and_save([entry("H200", 32, {"block_m": 64, "num_warps": 4, "num_stages": 4}, shape=SHAPE)], shipped)
    fp4 = MoEShape(hidden=256, intermediate=128, num_experts=8, num_topk=3, weights="fp4")
    _, runner = _runner(monkeypatch, {"gemm": "triton"}, shape=fp4)
    assert runner.config["config_source"] == "tuned"
    assert runner.config["tuned_store"] == "megamoe_cli/data/tuned_baseline.json"  # the same on every machine
    assert runner.config["block_m"] == 64 and runner.config["weights"].startswith("fp4 converted once")
    tuned.merge_and_save([entry("H200", 32, {"block_m": 16, "num_warps": 8, "num_stages": 2}, shape=SHAPE)])
    _, runner = _runner(monkeypatch, {"gemm": "triton"}, shape=fp4)
    assert (runner.config["tuned_store"], runner.config["block_m"], runner.config["num_warps"]) == (str(store), 16, 8)


def test_a_broken_stored_config_is_refused_naming_the_store(store, monkeypatch):
    tuned.merge_and_save([entry("H200", 32, {"block_m": 48}, shape=SHAPE)])
    monkeypatch.setattr(baseline_fp8, "_gpu_name", lambda device: "NVIDIA H200")
    p = make_problem(SHAPE, 0, 1, 4, 32, "cpu", seed=5)
    with pytest.raises(MegaMoEError, match=rf"tuned config {store}, entry baseline/H200/.*: block_m must be one of "
                                           r"16, 32, 64, 128, got 48"):
        baseline_fp8.resolve_launch(p, {}, "H200")


@needs_triton
def test_a_config_the_gpu_cannot_load_is_refused_at_prepare_and_excluded_not_fatal(monkeypatch, store):
    from triton.runtime.errors import OutOfResources

    def compile_fails(runner):
        if runner.launch.l1_stages == 5:
            raise OutOfResources(245760, MAX_SMEM_BYTES, "shared memory")

    monkeypatch.setattr(baseline_fp8._Runner, "compile", compile_fails)
    p = make_problem(SHAPE, 0, 1, 8, 8, "cpu", seed=5)
    deep = BaselineCandidate(16, 4, (5, 5))
    with pytest.raises(MegaMoEError) as err:
        TorchFP8Backend().prepare(p, None, deep.backend_config())
    assert str(err.value) == (f"backend 'torch': launch config {deep.label} (given) does not compile or load here: "
                              f"OutOfResources: out of resource: shared memory, Required: 245760, Hardware limit: "
                              f"{MAX_SMEM_BYTES}. Reducing block sizes or `num_stages` may help.")
    ok = BaselineCandidate(16, 4, (3, 3))
    backend = TorchFP8Backend()
    results = lib.measure_candidates([deep, ok], prepare=lambda c: backend.prepare(p, None, c.backend_config()),
                                     measure=lambda runner: (1.0, 0.0, 1.0), gather=lambda v: [v])
    assert [r.status for r in results] == [EXCLUDED, OK]
    assert results[0].stage == "prepare" and "OutOfResources" in results[0].reason


def test_prepare_refuses_a_launch_that_cannot_fit_before_building_anything(store):
    p = make_problem(SHAPE, 0, 1, 8, 8, "cpu", seed=5)
    pytest.importorskip("triton")
    with pytest.raises(MegaMoEError, match=r"'torch': launch config block_m=128 num_warps=8 num_stages=6 .* cannot "
                                           r"run: its pipelines need at least 245760 bytes"):
        TorchFP8Backend().prepare(p, None, {"gemm": "triton", "block_m": 128, "num_warps": 8, "num_stages": 6})


# ---------------------------------------------------------------------------- command line


def test_dry_run_of_the_shipped_sweep_lists_baseline_candidates(store):
    result = run_cli("tune", "--backend", "torch-graph", "--sweep", str(REPO / "sweeps" / "tune_baseline.yaml"),
                     "--stages", "4", "--dry-run", "--gpu", "H200", "--ranks", "1", "--json")
    assert result.exit_code == 0, result.output
    points = json.loads(result.stdout)
    assert len(points) == 15 and points[0]["key"]["kernel"] == "baseline"
    first = points[0]["candidates"]
    assert [(c["config"]["block_m"], c["config"]["num_stages"]) for c in first] == [(16, [3, 4]), (16, [4, 4]),
                                                                                    (32, [4, 4])]
    # 10 points below 17 rows per expert: the default, 16 and 32 at depth 4; DeepSeek-V3 and V4-Flash at 1024
    # tokens: those and 64 x 4 and 8 warps; 3 prefill ones: the default, 64 and 128 x 4 and 8 warps.
    assert "dry run: 55 candidate(s) over 15 point(s)" in result.stderr
    assert "warps" in result.stderr and "cluster" not in result.stderr


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--backend", "torch", "--preset", "small", "--tokens", "16", "--sms", "all", "--dry-run", "--gpu", "H200",
          "--ranks", "2"], ["the baseline's GEMMs have no num_sms"]),
        (["--backend", "torch", "--preset", "small", "--tokens", "16", "--stages", "7", "--dry-run", "--gpu",
          "H200", "--ranks", "2"], ["num_stages must be one of 2, 3, 4, 5, 6, got 7"]),
        (["--backend", "torch", "--preset", "small", "--tokens", "16", "--ranks", "3", "--dry-run", "--gpu",
          "H200"], ["num_experts=8 must be divisible by num_ranks=3"]),
    ],
)
def test_bad_baseline_tune_invocations_are_one_line(store, args, fragments):
    assert_one_line_error(run_cli("tune", *args), *fragments)


@needs_triton
@pytest.mark.slow
def test_cli_tunes_the_real_baseline_on_two_gloo_cpu_ranks_and_the_runtime_reads_the_winner(store, tmp_path,
                                                                                            monkeypatch):
    """The whole path: flags -> plan -> torchrun ranks timing the real torch backend's candidates
    in lockstep (Triton's interpreter) -> the winner saved -> the baseline's prepare picks it."""
    real = lib.run_tune

    def on_cpu_ranks(sweep, **kwargs):
        kwargs.update(device="cpu", gpu="H200", run_root=tmp_path)
        return real(sweep, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(lib, "run_tune", on_cpu_ranks)
    target = tmp_path / "baseline.json"
    result = run_cli("tune", "--backend", "torch", "--preset", "small", "--tokens", "16", "--block-m", "16,32",
                     "--stages", "3", "--warmup", "1", "--iters", "2", "--ranks", "2", "--config-file", str(target),
                     "--json")
    assert result.exit_code == 0, result.output
    (saved,) = json.loads(result.stdout)
    assert saved["key"]["kernel"] == "baseline" and saved["key"]["world_size"] == 2
    assert saved["key"]["token_bucket"] == 16 and saved["key"]["gpu"] == "H200"
    assert set(saved["config"]) == set(baseline_fp8.LAUNCH_KEYS)
    assert saved["config"]["block_m"] in (16, 32) and saved["default_time_us"] > 0
    # The default (block_m 16, stages 3/4) timed beside the grid, every candidate checked and passed.
    assert f"default {saved['default_time_us']:,.1f} us" in result.stderr
    assert "3/4" in result.stderr and "wrong" not in result.stderr and "excluded" not in result.stderr
    assert "3 candidate(s)" in result.stderr
    assert list(tuned.load(target)) == ["baseline/H200/ws2/h512/i256/e8/k2/fp8_e4m3/t16"]

    stored = tuned.lookup_nearest(tuned.make_key("H200", 2, PRESETS["small"], 16, kernel="baseline"), target)[1]
    monkeypatch.setenv(tuned.ENV_VAR, str(target))
    monkeypatch.setattr(baseline_fp8, "_gpu_name", lambda device: "NVIDIA H200")
    p = make_problem(PRESETS["small"], 0, 2, 16, 16, "cpu", seed=0)
    config, source = baseline_fp8.resolve_launch(p, {"gemm": "triton"}, "NVIDIA H200")
    assert config.to_config() == stored and source["config_source"] == "tuned"


# ---------------------------------------------------------------------------- compiling ahead


def small_plans(**doc):
    s = sweep({"shape": {"preset": "small"}, "num_tokens": [16, 1024], "block_m": [16, 32],
               "candidates": {"num_stages": [3]}, **doc}, backend="torch")
    return lib.plan_tune(s, 1, "H200")


def test_each_distinct_config_is_compiled_once_ahead_and_failures_are_reported():
    import concurrent.futures

    plans = small_plans()
    jobs = tb.compile_jobs(plans)
    # The default at 16 tokens (16 x 4 x 3/4) and at 1024 (128 x 8 x 3/4), and 16 and 32 at depth 3: the
    # grid's configs are shared by both points and compiled once.
    launches = sorted(job[1] for job in jobs)
    assert launches == [(16, 4, 3, 3, 128, 8), (16, 4, 3, 4, 128, 8), (32, 4, 3, 3, 128, 8), (128, 8, 3, 4, 128, 8)]
    assert {job[0] for job in jobs} == {(512, 256, 2, 2, "fp8", 0.0)}
    seen, said = [], []

    def compile_fn(shape, launch):
        seen.append(launch)
        return "OutOfResources: shared memory" if launch[0] == 128 else ""

    failed = tb.precompile(plans, said.append, compile_fn=compile_fn, executor=concurrent.futures.ThreadPoolExecutor,
                           workers=2)
    assert sorted(seen) == launches
    assert list(failed.values()) == ["OutOfResources: shared memory"]
    assert said[0] == "compiling 4 Triton GEMM config(s) on 2 process(es) (cached ones are reused)"
    assert said[-1].endswith("1 config(s) failed (their candidates are excluded by the ranks, with the reason)")


@pytest.mark.slow
def test_compiling_ahead_runs_in_spawned_processes_and_never_raises(monkeypatch):
    """The real worker function in real processes: without a GPU every job fails, reported."""
    plans = small_plans(block_m=[16])
    said = []
    failed = tb.precompile(plans, said.append, workers=2)
    assert len(failed) == len(tb.compile_jobs(plans)) == 3
    assert all("CUDA" in reason or "cuda" in reason for reason in failed.values()), failed

    def broken_pool(workers):
        raise OSError("cannot start processes")

    said.clear()
    assert tb.precompile(plans, said.append, executor=broken_pool) == {}
    assert said[-1] == ("compiling ahead stopped (OSError: cannot start processes); the ranks compile each config "
                        "themselves")


def test_run_tune_compiles_ahead_on_gpus_only_and_tells_the_ranks_the_candidate_class(store, monkeypatch, tmp_path):
    from megamoe_cli.bench.launcher import BenchResult

    compiled, launched = [], []
    monkeypatch.setattr(tb, "precompile", lambda plans, say: compiled.append([p.key.token_bucket for p in plans]))
    monkeypatch.setattr(lib, "_target", lambda device, world_size, gpu, dry_run: (device, 1, "H200"))

    def launch(points, nproc, out_path, *, device, timeout_s, on_event, env, plan_extra, run_root):
        launched.append((device, plan_extra["tune"]["candidate_type"], len(plan_extra["tune"]["candidates"])))
        return BenchResult("ok", "done", [], device, nproc, "run", None)

    plans_sweep = sweep({"shape": {"preset": "small"}, "num_tokens": [16, 1024], "candidates": {"num_stages": [3]}})
    for device in ("cuda", "cpu"):
        lib.run_tune(plans_sweep, device=device, path=store, launch=launch, run_root=tmp_path)
    assert compiled == [[16, 1024]]  # once, on the GPU machine, before the ranks start
    kind = "megamoe_cli.bench.tune_baseline:BaselineCandidate"
    assert launched == [("cuda", kind, 2), ("cpu", kind, 2)]

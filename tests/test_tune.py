"""``megamoe tune``: tune sweeps, candidate generation and filtering, parallel builds, lockstep
selection, the store round trip into the runtime's config choice, and the command line.

GPU-free: the lockstep loop runs with simulated ranks (threads sharing an all-gather), the run
with a simulated launch, and once end to end under torchrun on 2 gloo CPU ranks with a stand-in
backend whose per-rank times, wrong outputs and a GPU fault are set by the test.
"""

import concurrent.futures
import json
import shutil
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from megamoe_cli.bench import tune as lib
from megamoe_cli.bench.launcher import BenchEvent, BenchResult, run_bench
from megamoe_cli.bench.sweep import load_sweep_text
from megamoe_cli.bench.tune import (
    EXCLUDED,
    FAULT,
    NOT_RUN,
    OK,
    WRONG,
    Candidate,
    CandidateFault,
    CandidateGrid,
    CandidateResult,
)
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.kernel import heuristics, tuned
from megamoe_cli.kernel.jit import BuildError
from megamoe_cli.kernel.kernel_source import Variant, kernel_build_source
from megamoe_cli.layout import PRESETS
from cli_checks import assert_one_line_error, run_cli

REPO = Path(__file__).resolve().parents[1]
DSV3 = PRESETS["deepseek-v3"]
SMALL = PRESETS["small"]


@pytest.fixture
def store(tmp_path, monkeypatch):
    path = tmp_path / "cache" / "tuned.json"
    monkeypatch.setenv(tuned.ENV_VAR, str(path))
    return path


def small_sweep(tokens=(16,), **candidates):
    grid = {"num_stages": [2, 3, 4], "cluster_m": [1], "num_sms": ["all", 112], **candidates}
    return lib.validate_tune_sweep(
        {"name": "t", "shape": {"preset": "small"}, "num_tokens": list(tokens), "block_m": [64],
         "candidates": grid, "warmup": 1, "iters": 3, "timeout_s": 120},
        "test",
    )


# ---------------------------------------------------------------------------- tune sweeps


def test_shipped_tune_sweeps_cover_both_shapes_at_decode_and_prefill_and_are_bench_sweeps_too():
    from megamoe_cli.bench.sweep import load_sweep

    seen = {}
    for name in ("tune_decode", "tune_prefill"):
        path = REPO / "sweeps" / f"{name}.yaml"
        sweep = lib.load_tune_sweep(path)
        bench_points = load_sweep(path).points
        assert [(p.shape, p.num_tokens) for p in bench_points] == [(p.shape, p.num_tokens) for p in sweep.points]
        assert {p.backend for p in bench_points} == {"fused"}
        for plan in lib.plan_tune(sweep, 2, "H200"):
            assert plan.point.num_tokens == plan.point.num_max_tokens_per_rank == plan.key.token_bucket
            assert plan.point.iters <= 10 and plan.point.backend == "fused"
            assert [c.is_default for c in plan.candidates].count(True) == 1
            seen[(plan.point.preset, plan.point.num_tokens)] = (len(plan.candidates), len(plan.excluded))
    assert seen == {("deepseek-v3", 128): (16, 0), ("seed-default", 128): (16, 0),
                    ("deepseek-v3", 8192): (12, 4), ("seed-default", 8192): (12, 4)}


def test_token_counts_are_tuned_at_their_bucket_upper_edge():
    sweep = lib.validate_tune_sweep(
        {"name": "t", "shapes": [{"preset": "deepseek-v3"}, {"preset": "small"}], "num_tokens": [100, 8192]}, "x"
    )
    assert [(p.preset, p.num_tokens, p.num_max_tokens_per_rank) for p in sweep.points] == [
        ("deepseek-v3", 128, 128), ("deepseek-v3", 8192, 8192), ("small", 128, 128), ("small", 8192, 8192)]
    assert sweep.notes == ["num_tokens 100 is tuned at 128, the upper edge of its bucket "
                           "(calls with 65..128 tokens per rank use the result)"]
    assert sweep.grid == CandidateGrid()


@pytest.mark.parametrize(
    "body, fragments",
    [
        ("num_tokens: [128]\ncandidates: {block_m: [64]}\n", ["t.yaml:4", "block_m at the top level"]),
        ("num_tokens: [128]\nbackends: [fused, torch]\n", ["t.yaml:4", "give backends: [fused] or leave it out"]),
        ("num_tokens: [128]\ncheck: false\n", ["t.yaml:4", "every candidate is checked"]),
        ("num_tokens: [128]\ncalls_per_sample: 20\n",
         ["t.yaml:4", "calls_per_sample", "one call per sample", "give calls_per_sample: 1 or leave it out, got 20"]),
        ("num_tokens: [128]\ncalls_per_sample: 1.0\n", ["t.yaml:4", "calls_per_sample: expected an integer >= 1"]),
        ("num_tokens: [128]\nnum_max_tokens_per_rank: 256\n", ["t.yaml:4", "bucket's upper edge"]),
        ("num_tokens: [128]\nblock_m: [64, sixty]\n", ["t.yaml:4", "block_m[1]", "expected an integer"]),
        ("num_tokens: [[0, 8]]\n", ["t.yaml:3", "one token count for every rank"]),
        ("num_tokens: [100, 128]\n", ["t.yaml:3", "same token bucket (<= 128) as 100"]),
        ("num_tokens: [128]\ncandidates: {num_sms: [all, 0]}\n", ["t.yaml:4", "num_sms[1]", "'all' or a positive"]),
        ("num_tokens: [128]\ncandidates: {stages: [3]}\n", ["t.yaml:4", "unknown key 'stages'"]),
        ("num_tokens: [128]\nfrobnicate: 1\n", ["t.yaml:4", "unknown key 'frobnicate'"]),
        ("candidates: {num_stages: [4]}\n", ["missing required key 'num_tokens'"]),
    ],
)
def test_bad_tune_sweeps_name_file_line_and_fix(body, fragments):
    with pytest.raises(MegaMoEError) as err:
        lib.load_tune_sweep_text("name: t\nshape: {preset: small}\n" + body, "t.yaml")
    for fragment in fragments:
        assert fragment in str(err.value)


def test_a_tune_sweep_times_one_call_per_sample():
    head = "name: t\nshape: {preset: small}\nnum_tokens: [128]\n"
    for body in ("", "calls_per_sample: 1\n"):
        assert {p.calls_per_sample for p in lib.load_tune_sweep_text(head + body, "t.yaml").points} == {1}


def test_flags_build_the_same_sweep_as_a_file():
    from_flags = lib.tune_sweep_from_flags(num_tokens=[128], preset="small", block_m=[64], num_sms=["all", 120],
                                           iters=10)
    from_file = lib.load_tune_sweep_text(
        "name: cli\nshape: {preset: small}\nnum_tokens: [128]\nblock_m: [64]\ncandidates: {num_sms: [all, 120]}\n"
        "iters: 10\n")
    assert from_flags.points == from_file.points
    assert from_flags.grid == from_file.grid == CandidateGrid(block_m=(64,), num_sms=(0, 120))
    narrowed = lib.with_grid(from_file, num_stages=[4], num_sms=None)
    assert narrowed.grid == CandidateGrid(block_m=(64,), num_stages=(4,), num_sms=(0, 120))
    with pytest.raises(MegaMoEError, match="num_sms"):
        lib.with_grid(from_file, num_sms=["most"])


# ---------------------------------------------------------------------------- candidates


def test_candidates_always_include_the_default_and_record_every_exclusion():
    sweep = lib.validate_tune_sweep({
        "name": "t", "shape": {"preset": "deepseek-v3"}, "num_tokens": [8192], "block_m": [32, 128],
        "candidates": {"num_stages": [4, 5], "cluster_m": [1], "num_sms": ["all", 132, 200]},
    }, "x")
    (plan,) = lib.plan_tune(sweep, 2, "NVIDIA H200")
    chosen = heuristics.default_config(DSV3, 2, 8192, "H200")
    assert plan.default.config() == chosen and plan.default.is_default
    assert plan.key == tuned.make_key("H200", 2, DSV3, 8192)
    assert [c.label for c in plan.candidates] == ["block_m=128 num_stages=4 cluster_m=1 num_sms=all"]
    reasons = {(r.candidate.block_m, r.candidate.num_stages, r.candidate.num_sms): r.reason for r in plan.excluded}
    assert all(r.status == EXCLUDED and r.stage == "config" for r in plan.excluded)
    assert "block_m=32 is not supported" in reasons[(32, 4, 0)]
    from megamoe_cli.kernel.kernel_source import MAX_SMEM_BYTES, Variant, smem_bytes

    needed = smem_bytes(Variant(DSV3, 2, 8192, 128, 5, 1))
    assert needed > MAX_SMEM_BYTES
    assert "shared memory" in reasons[(128, 5, 0)] and str(needed) in reasons[(128, 5, 0)]
    assert "the same launch as num_sms=all (H200 has 132 SMs)" == reasons[(128, 4, 132)]
    assert "num_sms=200 is more than the 132 SMs of an H200" == reasons[(128, 4, 200)]
    # 2 block_m x 2 stages x 3 SM counts, the default among them: every one is accounted for.
    assert len(plan.candidates) + len(plan.excluded) == 12


def test_default_outside_the_grid_is_added_and_candidates_are_grouped_by_block_m():
    sweep = lib.validate_tune_sweep({
        "name": "t", "shape": {"preset": "deepseek-v3"}, "num_tokens": [128], "block_m": [128, 64],
        "candidates": {"num_stages": [2], "cluster_m": [2, 1], "num_sms": [120, "all"]},
    }, "x")
    (plan,) = lib.plan_tune(sweep, 8, "H200")
    assert plan.default == plan.candidates[[c.block_m for c in plan.candidates].index(64) + 4]
    assert (plan.default.block_m, plan.default.num_stages) == (64, 4)
    orders = [c.order for c in plan.candidates]
    assert orders == sorted(orders) and len(plan.candidates) == 9 and not plan.excluded
    assert [c.block_m for c in plan.candidates] == [64] * 5 + [128] * 4


def test_a_point_whose_default_cannot_run_is_refused_before_anything_starts():
    sweep = lib.validate_tune_sweep({"name": "t", "shape": {"preset": "deepseek-v3"}, "num_tokens": [128]}, "x")
    with pytest.raises(MegaMoEError, match="num_experts=256 must be divisible by num_ranks=3"):
        lib.plan_tune(sweep, 3, "H200")
    with pytest.raises(MegaMoEError, match="unknown GPU"):
        lib.plan_tune(sweep, 2, "A100")


def test_candidate_configs_round_trip_and_ask_the_backend_for_every_knob():
    c = Candidate(64, 3, 0, 2, is_default=True, fixed=(("future_knob", 7),))
    assert Candidate.from_dict(json.loads(json.dumps(c.to_dict()))) == c
    assert c.config() == {"future_knob": 7, "block_m": 64, "num_stages": 3, "num_sms": None, "cluster_m": 2}
    assert c.backend_config()["num_sms"] == 0  # explicit: a stored entry cannot fill it in
    r = CandidateResult(c, WRONG, "check", "off", 10.0, (9.0, 10.0), 1, float("nan"), float("inf"))
    back = CandidateResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.candidate == c and back.rank_times_us == (9.0, 10.0) and back.rel_err != back.rel_err
    assert back.rel_err_layer == float("inf")


# ---------------------------------------------------------------------------- building


def fake_kernel(spills=False, serialized=False):
    summary = "megamoe_kernel: 255 regs, SPILLS" if spills else "megamoe_kernel: 168 regs; WGMMAs SERIALIZED by ptxas"
    report = SimpleNamespace(has_spills=spills, serialized_wgmma=["(C7511) ... serialized ..."] if serialized else [],
                             summary=lambda: summary)
    return SimpleNamespace(report=report)


def test_build_failures_spills_and_serialized_wgmma_are_excluded_with_their_own_reasons():
    variants = [Variant(SMALL, 2, 16, 64, s, c) for s in (2, 3, 4) for c in (1, 2)]
    broken = {variants[1].name: "kernel.cu(12): error: identifier \"x\" is undefined",
              variants[4].name: "ptxas fatal   : out of registers"}
    spilling = variants[2].name
    calls = []

    def build(sources):
        names = [s.name for s in sources]
        calls.append(names)
        failed = [n for n in names if n in broken]
        if failed:
            raise BuildError(failed[0], "nvcc ...", f"note: compiling\n{broken[failed[0]]}\n", failed[1:])
        return [fake_kernel(spills=n == spilling, serialized=n == serialized) for n in names]

    serialized = variants[3].name
    reasons = lib.build_variants(variants, build)
    assert reasons == {
        variants[1]: "nvcc failed: kernel.cu(12): error: identifier \"x\" is undefined",
        variants[4]: "nvcc failed: ptxas fatal   : out of registers",
        variants[2]: "spills registers: megamoe_kernel: 255 regs, SPILLS",
        variants[3]: "WGMMAs serialized by ptxas: megamoe_kernel: 168 regs; WGMMAs SERIALIZED by ptxas",
    }
    assert calls[0] == [v.name for v in variants]  # one parallel build of everything first
    assert [variants[4].name] in calls  # the second failure compiled alone for its own log
    assert calls[-1] == [v.name for v in variants if v.name not in broken]

    sweep = small_sweep(num_stages=[2, 3, 4], cluster_m=[1, 2], num_sms=["all"])
    (plan,) = lib.plan_tune(sweep, 2, "H200")
    before = len(plan.candidates) + len(plan.excluded)
    lib.exclude_unbuilt([plan], reasons)
    assert len(plan.candidates) + len(plan.excluded) == before
    built_out = {(r.candidate.num_stages, r.candidate.cluster_m): r for r in plan.excluded}
    assert set(built_out) == {(2, 2), (4, 1), (3, 1), (3, 2)}
    assert all(r.stage == "build" and r.status == EXCLUDED for r in built_out.values())


def test_prebuilt_sources_are_the_ones_the_fused_runner_loads(monkeypatch):
    import torch

    from megamoe_cli.fused import launch
    from megamoe_cli.kernel import jit

    variant = Variant(DSV3, 2, 128, 64, 4)
    seen = []

    def capture(sources):
        seen.extend(sources)
        raise RuntimeError("captured")

    monkeypatch.setattr(jit, "build", capture)
    with pytest.raises(RuntimeError, match="captured"):
        launch.Kernel(variant, torch.device("cpu"))
    assert seen == [kernel_build_source(variant)]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.slow
def test_real_parallel_build_of_planned_variants(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path / "jit"))
    variants = [Variant(SMALL, 2, 16, 64, 4), Variant(SMALL, 2, 16, 64, 3)]
    assert lib.build_variants(variants) == {}
    assert len(list((tmp_path / "jit").glob("megamoe_h512_*/kernel.cubin"))) == 2


# ---------------------------------------------------------------------------- lockstep selection


class ThreadRanks:
    """Simulated ranks: one thread each, sharing an all-gather."""

    def __init__(self, n):
        self.n = n
        self.barrier = threading.Barrier(n, timeout=10)
        self.slots = [None] * n

    def gather(self, rank, value):
        self.slots[rank] = value
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def run(self, body):
        with concurrent.futures.ThreadPoolExecutor(self.n) as pool:
            return list(pool.map(body, range(self.n)))


A = Candidate(64, 3, 0)
B = Candidate(64, 4, 0, is_default=True)
C = Candidate(64, 4, 120)
D = Candidate(128, 3, 0)


def test_every_rank_picks_the_same_winner_by_the_slowest_rank():
    # Rank 0 alone would pick A (10 us); the layer waits for rank 1, where A takes 30 us.
    times = {A: (10.0, 30.0), B: (25.0, 24.0), C: (20.0, 21.0), D: (5.0, 5.0)}
    wrong = {D}
    ranks = ThreadRanks(2)

    def rank_main(rank):
        phases = []
        results = lib.measure_candidates(
            [A, B, C, D],
            prepare=lambda c: c,
            measure=lambda c: (times[c][rank], (0.5 if c in wrong else 1e-3 * (rank + 1)) ** 2, 1.0),
            gather=lambda v: ranks.gather(rank, v),
            on_phase=phases.append,
        )
        return results, lib.select_winner(results), phases

    (r0, w0, phases), (r1, w1, _) = ranks.run(rank_main)
    assert [r.to_dict() for r in r0] == [r.to_dict() for r in r1]
    assert w0.candidate == w1.candidate == C
    by = {r.candidate: r for r in r0}
    assert (by[A].time_us, by[A].slowest_rank, by[A].rank_times_us) == (30.0, 1, (10.0, 30.0))
    assert by[C].time_us == 21.0 and by[C].rel_err == pytest.approx(2e-3)
    assert by[C].rel_err_layer == pytest.approx((5e-6 / 2) ** 0.5)  # 1e-3 and 2e-3 pooled
    assert by[D].status == WRONG and "the layer's relative error 0.5, the worst rank's 0.5 on rank 0" in by[D].reason
    assert phases[:2] == [f"prepare {A.label}", f"time {A.label}"]


def test_a_failure_on_one_rank_excludes_the_candidate_on_all_ranks():
    ranks = ThreadRanks(2)

    def prepare(rank, c):
        if c == A and rank == 1:
            raise torch_oom()
        return c

    def measure(rank, c):
        if c == C and rank == 0:
            raise MegaMoEError("kernel variant spills registers")
        return 7.0, 0.0, 1.0

    def rank_main(rank):
        return lib.measure_candidates([A, B, C], prepare=lambda c: prepare(rank, c),
                                      measure=lambda c: measure(rank, c), gather=lambda v: ranks.gather(rank, v))

    for results in ranks.run(rank_main):
        assert [r.status for r in results] == [EXCLUDED, OK, EXCLUDED]
        assert (results[0].stage, results[0].reason) == ("prepare", "rank 1: RuntimeError: CUDA out of memory")
        assert results[2].reason == "rank 0: MegaMoEError: kernel variant spills registers"


def torch_oom():
    return RuntimeError("CUDA out of memory")


def test_ties_go_to_the_default_then_to_the_smaller_config():
    def ok(c, t):
        return CandidateResult(c, OK, time_us=t)

    assert lib.select_winner([ok(A, 5.0), ok(B, 5.0), ok(C, 5.0)]).candidate == B
    assert lib.select_winner([ok(D, 5.0), ok(C, 5.0), ok(A, 5.0)]).candidate == A
    assert lib.select_winner([ok(D, 4.0), ok(B, 5.0)]).candidate == D
    assert lib.select_winner([CandidateResult(A, WRONG, time_us=1.0)]) is None


def rank_entry(median_us, rel_err, ref_sq=1.0):
    """A rank whose output is off by ``rel_err`` of a reference with squared norm ``ref_sq``."""
    diff_sq = rel_err**2 * ref_sq if ref_sq else (0.0 if rel_err == 0 else rel_err)
    return {"median_us": median_us, "diff_sq": diff_sq, "ref_sq": ref_sq}


def test_combine_takes_the_slowest_rank_and_treats_nan_as_wrong():
    r = lib.combine_ranks(A, [rank_entry(3.0, 0.001), rank_entry(9.0, float("nan")), rank_entry(4.0, 0.0)])
    assert (r.status, r.time_us, r.slowest_rank) == (WRONG, 9.0, 1)
    assert "the layer's relative error inf, the worst rank's inf on rank 1 (limit 0.02)" in r.reason
    r = lib.combine_ranks(A, [rank_entry(3.0, 0.0199), rank_entry(2.0, 0.0)])
    assert (r.status, r.time_us) == (OK, 3.0) and r.rel_err == pytest.approx(0.0199)
    assert r.rel_err_layer == pytest.approx(0.0199 / 2**0.5)


def test_the_layers_pooled_error_decides_not_one_scattered_rank():
    # A rank holding one token at 2.5e-2 beside seven that hold 128 each at 4e-3: the layer is right.
    ranks = [rank_entry(5.0, 2.5e-2, ref_sq=1.0)] + [rank_entry(5.0, 4e-3, ref_sq=128.0)] * 7
    r = lib.combine_ranks(A, ranks)
    assert r.status == OK and r.rel_err == pytest.approx(2.5e-2)
    assert r.rel_err_layer == pytest.approx(((2.5e-2**2 + 7 * 128 * 4e-3**2) / (1 + 7 * 128)) ** 0.5)
    # A rank whose rows are all wrong makes the layer wrong, whatever the others hold.
    r = lib.combine_ranks(A, [rank_entry(5.0, 1.0, ref_sq=1.0)] + [rank_entry(5.0, 0.0, ref_sq=128.0)] * 7)
    assert r.status == WRONG and r.rel_err_layer == pytest.approx((1 / 897) ** 0.5)
    # Nothing to compare anywhere (no tokens on any rank): right when every output matched.
    assert lib.combine_ranks(A, [rank_entry(5.0, 0.0, ref_sq=0.0)] * 2).status == OK
    assert lib.combine_ranks(A, [rank_entry(5.0, 0.0, 0.0), rank_entry(5.0, float("inf"), 0.0)]).status == WRONG


def test_a_gpu_fault_stops_the_point_naming_the_candidate():
    def measure(c):
        if c == B:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return 5.0, 0.0, 1.0

    with pytest.raises(CandidateFault) as err:
        lib.measure_candidates([A, B, C], prepare=lambda c: c, measure=measure, gather=lambda v: [v])
    assert B.label in str(err.value) and "illegal memory access" in str(err.value)
    assert "tune stops here" in str(err.value)
    assert [r.status for r in err.value.results] == [OK, FAULT, NOT_RUN]


# ---------------------------------------------------------------------------- store round trip


def finished(plan, times, wrong=()):
    measured = [CandidateResult(c, WRONG if c in wrong else OK, time_us=times[c], rel_err=0.0)
                for c in plan.candidates]
    return lib.finish_point(plan, measured, date="2026-01-01T00:00:00+00:00", commit="abc")


def test_tuned_entry_wins_its_bucket_in_the_runtime_and_the_default_rules_elsewhere(store, monkeypatch):
    import torch

    from megamoe_cli import fused

    sweep = lib.validate_tune_sweep({"name": "t", "shape": {"preset": "deepseek-v3"}, "num_tokens": [128],
                                     "block_m": [64], "candidates": {"num_stages": [3, 4], "cluster_m": [1],
                                                                     "num_sms": ["all", 120]}}, "x")
    (plan,) = lib.plan_tune(sweep, 2, "H200")
    fast = Candidate(64, 3, 120, 1, fixed=plan.default.fixed)
    times = {c: 100.0 for c in plan.candidates}
    times[fast] = 80.0
    outcome = finished(plan, times)
    assert outcome.status == "tuned" and outcome.winner.candidate == fast
    entry = outcome.entry
    assert (entry["time_us"], entry["default_time_us"], entry["speedup"]) == (80.0, 100.0, 1.25)
    assert (entry["date"], entry["commit"]) == ("2026-01-01T00:00:00+00:00", "abc")
    tuned.merge_and_save([entry])

    config, source = heuristics.choose_config(DSV3, 2, 100, "NVIDIA H200")
    assert source == "tuned" and config == {"block_m": 64, "num_stages": 3, "num_sms": 120, "cluster_m": 1}
    assert heuristics.choose_config(DSV3, 2, 129, "H200")[1] == "default"
    assert heuristics.choose_config(DSV3, 4, 128, "H200")[1] == "default"

    # The fused runner (what `megamoe bench` runs) resolves its config through choose_config.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "NVIDIA H200")
    kernel_cfg, source = fused.resolve_config(DSV3, 2, 128, {})
    assert source == "tuned" and (kernel_cfg.block_m, kernel_cfg.num_stages, kernel_cfg.num_sms) == (64, 3, 120)
    kernel_cfg, source = fused.resolve_config(DSV3, 2, 8192, {})
    assert source == "default" and kernel_cfg.block_m == 128


def test_a_point_whose_default_did_not_pass_saves_nothing():
    sweep = small_sweep()
    (plan,) = lib.plan_tune(sweep, 2, "H200")
    outcome = finished(plan, {c: 10.0 for c in plan.candidates}, wrong={plan.default})
    assert outcome.status == "failed" and outcome.entry is None and outcome.winner is not None
    assert "the analytic default" in outcome.message and "nothing saved" in outcome.message


# ---------------------------------------------------------------------------- run_tune, simulated launch


def fake_build(sources):
    return [fake_kernel() for _ in sources]


def simulated_launch(delay, *, wrong=(), fault=(), log=None):
    """A ``launch`` for run_tune: each rank a thread running the real lockstep loop with stand-in
    runners; ``delay(point, candidate, rank)`` is a rank's median, candidates keyed by
    (num_tokens, num_stages, num_sms) are ``wrong`` or ``fault``."""

    def launch(points, nproc, out_path, *, device, timeout_s, on_event, env, plan_extra, run_root):
        if log is not None:
            log.append({"nproc": nproc, "device": device, "env": env, "plan_extra": plan_extra})
        section = plan_extra["tune"]
        rows = []
        for index, point in enumerate(points):
            on_event(BenchEvent("start", len(points), index=index, point=point))
            candidates = [Candidate.from_dict(d) for d in section["candidates"][index]]
            ranks = ThreadRanks(nproc)

            def rank_main(rank):
                def measure(c):
                    key = (point.num_tokens, c.num_stages, c.num_sms)
                    if key in fault:
                        raise RuntimeError("CUDA error: unspecified launch failure")
                    return delay(point, c, rank), (1.0 if key in wrong else 0.0), 1.0

                try:
                    return lib.measure_candidates(candidates, prepare=lambda c: c, measure=measure,
                                                  gather=lambda v: ranks.gather(rank, v))
                except CandidateFault as exc:
                    return exc

            first = ranks.run(rank_main)[0]
            if isinstance(first, CandidateFault):
                lib.append_record(section["records"], lib.point_record(index, 0, first.results))
                row = {"status": "failed", "error": f"rank 0: CandidateFault: {first}"}
                rows.append(row)
                on_event(BenchEvent("row", len(points), index=index, point=point, row=row))
                return BenchResult("failed", f"run stopped at point {index}: {row['error']}", rows, device, nproc,
                                   "run", None)
            lib.append_record(section["records"], lib.point_record(index, 0, first))
            row = {"status": "ok" if lib.select_winner(first) else "failed", "error": ""}
            rows.append(row)
            on_event(BenchEvent("row", len(points), index=index, point=point, row=row))
        return BenchResult("ok", "done", rows, device, nproc, "run", None)

    return launch


def by_stages_and_sms(table):
    return lambda point, c, rank: table.get((point.num_tokens, c.num_stages, c.num_sms), 50.0) + rank


def test_run_tune_saves_each_winner_through_merge_and_save_as_its_point_finishes(store, monkeypatch, tmp_path):
    saves = []
    real_merge = tuned.merge_and_save

    def spy(entries, path=None):
        saves.append((list(entries), Path(path)))
        assert len(saves) == 1 or path is not None
        return real_merge(entries, path)

    monkeypatch.setattr(tuned, "merge_and_save", spy)
    log = []
    delays = by_stages_and_sms({(16, 4, 0): 40.0, (16, 3, 112): 20.0, (32, 4, 0): 40.0})
    progress = []
    result = lib.run_tune(small_sweep(tokens=(16, 32)), world_size=2, device="cpu", gpu="H200", path=store,
                          build=fake_build, launch=simulated_launch(delays, wrong={(16, 2, 0), (16, 2, 112)}, log=log),
                          progress=progress.append, run_root=tmp_path)
    assert result.ok, result.message
    assert [len(e) for e, _ in saves] == [1, 1] and {p for _, p in saves} == {store}
    first, second = result.outcomes
    assert first.winner.candidate.label == "block_m=64 num_stages=3 cluster_m=1 num_sms=112"
    assert first.entry["speedup"] == pytest.approx(41.0 / 21.0)
    assert second.winner.candidate == second.plan.default and second.entry["speedup"] == 1.0
    assert {r.status for r in first.results if r.candidate.num_stages == 2} == {WRONG}
    stored = tuned.load(store)
    assert sorted(stored) == sorted(str(o.plan.key) for o in result.outcomes)
    assert stored[str(first.plan.key)]["config"]["num_sms"] == 112
    assert log[0]["env"] == {tuned.ENV_VAR: str(store.absolute())} and log[0]["nproc"] == 2
    assert [len(c) for c in log[0]["plan_extra"]["tune"]["candidates"]] == [6, 6]
    assert any("building 6 kernel variant(s)" in line for line in progress)
    assert not list(tmp_path.glob("megamoe-tune-*"))


def test_an_interrupted_store_write_keeps_the_old_store(store, monkeypatch):
    old = tuned.make_entry(tuned.make_key("H200", 2, SMALL, 16), {"block_m": 64}, 1.0, 2.0, date="d", commit="c")
    tuned.merge_and_save([old])
    before = store.read_bytes()

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(tuned.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        lib.run_tune(small_sweep(), world_size=2, device="cpu", gpu="H200", path=store, build=fake_build,
                     launch=simulated_launch(by_stages_and_sms({})))
    assert store.read_bytes() == before
    assert not [p for p in store.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_fault_stops_the_run_naming_the_candidate_and_earlier_entries_survive(store):
    result = lib.run_tune(small_sweep(tokens=(16, 32, 64)), world_size=2, device="cpu", gpu="H200", path=store,
                          build=fake_build, launch=simulated_launch(by_stages_and_sms({}), fault={(32, 3, 0)}))
    assert not result.ok
    assert "candidate block_m=64 num_stages=3 cluster_m=1 num_sms=all" in result.message
    assert "1 entry saved" in result.message
    assert [o.status for o in result.outcomes] == ["tuned", "failed", NOT_RUN]
    statuses = [r.status for r in result.outcomes[1].results]
    assert statuses == [OK, OK, FAULT, NOT_RUN, NOT_RUN, NOT_RUN]
    assert list(tuned.load(store)) == [str(result.outcomes[0].plan.key)]


def test_a_default_that_does_not_build_skips_its_point_and_a_bad_store_stops_before_building(store):
    def build(sources):
        names = [s.name for s in sources]
        if any("_s4_" in n for n in names):
            bad = [n for n in names if "_s4_" in n]
            raise BuildError(bad[0], "nvcc", "error: broken\n", bad[1:])
        return fake_build(sources)

    result = lib.run_tune(small_sweep(), world_size=2, device="cpu", gpu="H200", path=store, build=build,
                          launch=simulated_launch(by_stages_and_sms({})))
    (outcome,) = result.outcomes
    assert outcome.status == "failed" and "cannot be built (nvcc failed: error: broken)" in outcome.message
    assert not store.exists()

    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text("{not json")
    built = []
    with pytest.raises(MegaMoEError, match="not valid JSON"):
        lib.run_tune(small_sweep(), world_size=2, device="cpu", gpu="H200", path=store,
                     build=lambda s: built.append(s), launch=simulated_launch(by_stages_and_sms({})))
    assert built == []


def test_a_point_where_every_candidate_is_wrong_saves_nothing_and_the_run_goes_on(store):
    everything = {(16, stages, sms) for stages in (2, 3, 4) for sms in (0, 112)}
    result = lib.run_tune(small_sweep(tokens=(16, 32)), world_size=2, device="cpu", gpu="H200", path=store,
                          build=fake_build, launch=simulated_launch(by_stages_and_sms({}), wrong=everything))
    assert result.ok and "2 point(s) measured, 1 entry saved" in result.message
    assert [o.status for o in result.outcomes] == ["failed", "tuned"]
    assert result.outcomes[0].message == "no candidate passed; nothing saved"
    assert {r.status for r in result.outcomes[0].results} == {WRONG}
    assert list(tuned.load(store)) == [str(result.outcomes[1].plan.key)]


def test_launcher_plan_extra_cannot_replace_the_plan(tmp_path):
    points = load_sweep_text("name: t\nshape: {preset: small}\nnum_tokens: [4]\nbackends: [reference]\n").points
    with pytest.raises(MegaMoEError, match="only add sections"):
        run_bench(points, 2, None, device="cpu", plan_extra={"points": []}, run_root=tmp_path)


# ---------------------------------------------------------------------------- end to end under torchrun

STAND_IN_BACKEND = textwrap.dedent(
    """
    import megamoe_cli.bench.session as session
    from megamoe_cli.reference.layer import moe_reference_distributed


    class VirtualClock:
        \"\"\"The session's clock in these ranks: it moves only by what a stand-in call says it took,
        so which candidate wins does not depend on how loaded the machine is.\"\"\"

        def __init__(self):
            self.now = 0.0

        def perf_counter(self):
            return self.now


    CLOCK = VirtualClock()
    session.time = CLOCK

    # (num_tokens, num_stages, num_sms) -> seconds per call on rank 0 and rank 1
    DELAYS = {(16, 4, 0): (0.012, 0.012), (16, 3, 112): (0.001, 0.030), (16, 4, 112): (0.004, 0.004)}
    FAULT = (32, 3, 0)


    class _Runner:
        def __init__(self, problem, group, config):
            self.config = {**config, "config_source": "given"}
            self.key = (problem.num_tokens, config["num_stages"], config["num_sms"])
            self.rank = problem.rank
            self.y = moe_reference_distributed(problem, group)
            if config["num_stages"] == 2:
                self.y = self.y * 2

        def __call__(self):
            if self.key == FAULT:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            CLOCK.now += DELAYS.get(self.key, (0.020, 0.020))[self.rank]
            return self.y


    class Backend:
        def prepare(self, problem, group, config):
            return _Runner(problem, group, config)
    """
)


@pytest.mark.slow
def test_tune_under_torchrun_on_two_cpu_ranks(store, tmp_path, monkeypatch):
    (tmp_path / "stand_in_backend.py").write_text(STAND_IN_BACKEND)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    result = lib.run_tune(small_sweep(tokens=(16, 32)), world_size=2, device="cpu", gpu="H200", path=store,
                          backend="stand_in_backend:Backend", build=fake_build, run_root=tmp_path)

    assert not result.ok
    assert "candidate block_m=64 num_stages=3 cluster_m=1 num_sms=all" in result.message
    assert "illegal memory access" in result.message
    first, second = result.outcomes
    assert first.status == "tuned", first.message
    by = {(r.candidate.num_stages, r.candidate.num_sms): r for r in first.results}
    assert first.winner is by[(4, 112)]
    assert by[(3, 112)].slowest_rank == 1 and by[(3, 112)].time_us == max(by[(3, 112)].rank_times_us)
    # rank 0 alone would have picked it (the stand-in's calls advance the ranks' clocks by exactly DELAYS)
    assert by[(3, 112)].rank_times_us == pytest.approx([1e3, 30e3])
    assert by[(2, 0)].status == by[(2, 112)].status == WRONG
    assert by[(4, 0)].candidate.is_default and first.entry["speedup"] > 2
    assert second.status == "failed" and "stopped: candidate" in second.message
    assert [r.status for r in second.results] == [WRONG, WRONG, FAULT, NOT_RUN, NOT_RUN, NOT_RUN]
    stored = tuned.load(store)
    assert list(stored) == [str(first.plan.key)]
    assert stored[str(first.plan.key)]["config"] == {"block_m": 64, "num_stages": 4, "num_sms": 112, "cluster_m": 1}


# ---------------------------------------------------------------------------- command line


def test_dry_run_lists_candidates_and_exclusions_without_a_gpu(store):
    result = run_cli("tune", "--sweep", str(REPO / "sweeps" / "tune_prefill.yaml"), "--dry-run", "--gpu", "H200",
                     "--ranks", "2", "--json")
    assert result.exit_code == 0, result.output
    points = json.loads(result.stdout)
    assert [p["point"] for p in points] == ["deepseek-v3 ws2 tokens<=8192 (H200)",
                                            "seed-default ws2 tokens<=8192 (H200)"]
    statuses = [c["status"] for c in points[0]["candidates"]]
    assert statuses.count("planned") == 12 and statuses.count("excluded") == 4
    assert "shared memory" in result.stderr and "dry run: 24 candidate(s) over 2 point(s)" in result.stderr
    assert not store.exists()


def test_points_and_saved_keys_name_the_weight_format(store):
    """FP8 and MXFP4 points of one shape are different kernels with different winners: their
    labels (dry run) and the saved entries' table say which is which."""
    result = run_cli("tune", "--preset", "deepseek-v3", "--weights", "fp8,fp4", "--tokens", "128", "--block-m", "128",
                     "--stages", "4", "--cluster-m", "1", "--sms", "all", "--ranks", "1", "--dry-run", "--gpu", "H200",
                     "--json")
    assert result.exit_code == 0, result.output
    assert [p["point"] for p in json.loads(result.stdout)] == [
        "deepseek-v3 ws1 tokens<=128 (H200)", "7168/2048/256/top-8 weights=fp4 ws1 tokens<=128 (H200)"]
    from megamoe_cli.cli.tune import _entry_table
    from rich.console import Console

    key = {"gpu": "H200", "world_size": 1, "hidden": 7168, "intermediate": 2048, "num_experts": 256, "num_topk": 8,
           "dtype": "fp8_e4m3", "token_bucket": 128}
    entries = [{"key": dict(key, weights=w), "config": {"block_m": 128}, "time_us": 1.0, "default_time_us": 1.0,
                "speedup": 1.0} for w in ("fp8", "fp4")]
    console = Console(width=400, record=True)
    console.print(_entry_table(entries, "tuned.json"))
    text = console.export_text()
    assert "k8 tokens<=128" in text and "k8 wfp4 tokens<=128" in text


def test_candidate_flags_narrow_a_sweep(store):
    result = run_cli("tune", "--sweep", str(REPO / "sweeps" / "tune_decode.yaml"), "--stages", "4", "--sms", "all",
                     "--dry-run", "--gpu", "H200", "--ranks", "8", "--json")
    assert result.exit_code == 0, result.output
    for point in json.loads(result.stdout):
        assert [(c["config"]["num_stages"], c["config"]["cluster_m"], c["config"]["num_sms"])
                for c in point["candidates"]] == [(4, 1, None), (4, 2, None)]


def test_flags_dry_run_and_rounding_note(store):
    result = run_cli("tune", "--preset", "small", "--tokens", "100", "--block-m", "64", "--stages", "4",
                     "--cluster-m", "1", "--sms", "all,120,140", "--dry-run", "--gpu", "H200", "--ranks", "2")
    assert result.exit_code == 0, result.output
    assert "num_tokens 100 is tuned at 128" in result.stderr
    assert "num_sms=140 is more than the 132 SMs" in result.stderr


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--sweep", "sweeps/tune_decode.yaml", "--tokens", "128"], ["--sweep replaces the point flags", "--tokens"]),
        (["--gpu", "H200"], ["--gpu only plans (--dry-run)"]),
        (["--sms", "all,many"], ["expected 'all' or SM counts"]),
        (["--tokens", "128", "--sms", "0", "--dry-run", "--gpu", "H200", "--ranks", "2"], ["'all' or a positive"]),
        (["--dry-run", "--gpu", "V100", "--ranks", "2"], ["unknown GPU 'V100'"]),
        (["--dry-run", "--ranks", "3", "--gpu", "H200"], ["divisible by num_ranks=3"]),
        (["--preset", "small", "--tokens", "16"], ["needs a CUDA GPU with the fused kernel", "--dry-run"]),
    ],
)
def test_bad_tune_invocations_are_one_line(store, args, fragments):
    assert_one_line_error(run_cli("tune", *args), *fragments)
    assert not store.exists()


def test_bad_tune_sweep_file_names_the_line(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("name: t\nshape: {preset: small}\nnum_tokens: [16]\nbackends: [torch]\n")
    assert_one_line_error(run_cli("tune", "--sweep", str(path), "--dry-run", "--gpu", "H200", "--ranks", "2"),
                          f"{path}:4", "tuning measures the fused kernel")


def test_dry_run_without_a_gpu_asks_for_one(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_one_line_error(run_cli("tune", "--dry-run", "--ranks", "2"), "name the GPU model")


def with_simulated_gpu(monkeypatch, launch):
    import torch

    real = lib.run_tune

    def run_tune(sweep, **kwargs):
        kwargs.update(device="cpu", gpu="H200", build=fake_build, launch=launch)
        return real(sweep, **kwargs)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(lib, "run_tune", run_tune)


def test_cli_run_prints_every_candidate_and_the_entries_as_json(store, monkeypatch, tmp_path):
    target = tmp_path / "elsewhere.json"
    with_simulated_gpu(monkeypatch, simulated_launch(by_stages_and_sms({(16, 4, 112): 10.0}), wrong={(16, 2, 0)}))
    result = run_cli("tune", "--preset", "small", "--tokens", "16", "--block-m", "64", "--cluster-m", "1",
                     "--sms", "all,112", "--ranks", "2", "--config-file", str(target), "--json")
    assert result.exit_code == 0, result.output
    entries = json.loads(result.stdout)
    assert entries == list(tuned.load(target).values())
    assert entries[0]["config"]["num_sms"] == 112 and entries[0]["speedup"] == pytest.approx(51.0 / 11.0)
    assert "wrong result: the layer's relative error 1" in result.stderr and "winner" in result.stderr
    assert f"tuned configs saved to {target}" in result.stderr.replace("\n", "")
    assert not store.exists()


def test_cli_run_that_faults_shows_what_it_measured_then_one_error_line(store, monkeypatch):
    with_simulated_gpu(monkeypatch, simulated_launch(by_stages_and_sms({}), fault={(16, 3, 112)}))
    result = run_cli("tune", "--preset", "small", "--tokens", "16,32", "--block-m", "64", "--cluster-m", "1",
                     "--sms", "all,112", "--ranks", "2")
    assert result.exit_code == 2, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: tune stopped (candidate block_m=64 num_stages=3 cluster_m=1 num_sms=112)")
    assert "fault" in result.stderr and "not run" in result.stderr
    assert not store.exists()


def test_a_candidate_timer_measures_its_median_error_and_reference_norm():
    import torch

    from megamoe_cli.bench.session import RankSession, Reference
    from megamoe_cli.bench.tune import CandidateTimer

    calls = []
    session = RankSession(rank=0, world_size=1, device="cpu", barrier=lambda: calls.append("barrier"))
    point = SimpleNamespace(warmup=1, iters=3, flush_l2=False, calls_per_sample=20)
    timer = CandidateTimer(session, point, backend=None)
    timer.reference = Reference.__new__(Reference)  # what make_reference computes once per point
    timer.reference.y = torch.tensor([[3.0, 4.0]], dtype=torch.bfloat16)
    timer.reference.norm_sq = 25.0

    def runner():
        calls.append("call")
        return torch.tensor([[3.0, 4.5]], dtype=torch.bfloat16)

    median_us, diff_sq, ref_sq = timer.measure(runner)
    assert calls == ["call"] + ["barrier", "call"] * 3  # one call per sample, whatever the point says
    assert median_us >= 0
    assert (diff_sq, ref_sq) == (0.25, 25.0)

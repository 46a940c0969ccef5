"""``megamoe profile`` on the CPU: configs and options, the cycle breakdown, combining the ranks,
the whole run on two gloo ranks under torchrun with a stand-in kernel, and the command line."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megamoe_cli.bench import profile as lib
from megamoe_cli.bench.metrics import traffic
from megamoe_cli.bench.sweep import sweep_from_flags
from megamoe_cli.errors import MegaMoEError
from megamoe_cli.gpus import gpu_spec
from megamoe_cli.layout import PRESETS
from cli_checks import assert_one_line_error, interrupt, interruptible, run_cli

REPO = Path(__file__).resolve().parents[1]


def small_points(tokens=(16, 32), **flags):
    flags = {"warmup": 1, "iters": 3, "check": False, **flags}
    return sweep_from_flags(name="profile", preset="small", num_tokens=list(tokens), backends=["fused"],
                            **flags).points


# ---------------------------------------------------------------------------- configs and options


def test_configs_parse_check_and_spell_back():
    assert lib.parse_config("auto") == {} and lib.parse_config(" AUTO ") == {}
    assert lib.parse_config("128:4") == {"block_m": 128, "num_stages": 4}
    assert lib.parse_config("64:3:120:2") == {"block_m": 64, "num_stages": 3, "num_sms": 120, "cluster_m": 2}
    for text in ("auto", "128:4", "64:3:0", "64:3:120:2"):
        assert lib.config_label(lib.parse_config(text)) == text
    with pytest.raises(MegaMoEError, match=r"block_m:num_stages\[:num_sms\[:cluster_m\]\] \(e.g. 128:4\) or auto, "
                                           r"got '128'"):
        lib.parse_config("128")
    with pytest.raises(MegaMoEError, match="got '128:4:1:1:1'"):
        lib.parse_config("128:4:1:1:1")
    with pytest.raises(MegaMoEError, match="kernel config 96:4: block_m=96 is not supported"):
        lib.parse_config("96:4")
    with pytest.raises(MegaMoEError, match="kernel config 64:3:0:3: cluster_m=3"):
        lib.parse_config("64:3:0:3")


def test_options_refuse_what_does_not_fit_together_and_round_trip():
    options = lib.ProfileOptions.make([{}, {"num_stages": 4, "block_m": 128}], cycles=True, cycle_calls=20,
                                      trace_dir="t", back_to_back=20, given=True)
    assert options.config_dicts == [{}, {"block_m": 128, "num_stages": 4}]
    assert lib.ProfileOptions.from_dict({**options.to_dict(), "records": "r.jsonl"}) == options
    for configs, fields, message in (
        ([{}, {}], {}, "kernel config auto is listed twice"),
        ([], {}, "at least one kernel config"),
        ([{}], {"cycle_calls": 2}, "it needs cycles"),
        ([{}], {"trace_dir": "t"}, "a trace folder needs cycles"),
        ([{}], {"back_to_back": -1}, "back_to_back must be an integer >= 0"),
        ([{}], {"cycles": True, "cycle_calls": 0}, "cycle_calls must be an integer >= 1"),
    ):
        with pytest.raises(MegaMoEError, match=message):
            lib.ProfileOptions.make(configs, **fields)


def test_a_config_that_cannot_build_at_a_point_is_refused_before_anything_starts():
    points = sweep_from_flags(name="p", preset="deepseek-v3", num_tokens=[64], backends=["fused"]).points
    lib.check_configs(points, lib.ProfileOptions.make([{}, {"block_m": 128, "num_stages": 4}]), 1)
    with pytest.raises(MegaMoEError, match=r"^kernel config 128:5 at fused deepseek-v3 num_tokens=64 on 1 rank\(s\): "
                                           r"variant .* needs \d+ bytes of shared memory"):
        lib.check_configs(points, lib.ProfileOptions.make([{"block_m": 128, "num_stages": 5}]), 1)


# ---------------------------------------------------------------------------- what the ranks' numbers become


def counters(scale=1):
    """Counters of 4 consumer warpgroups (2 CTAs) summed, as the profiling build leaves them; ``scale``
    multiplies the cycles, not the warpgroups."""
    c = {"samplers": 4, "consumer_total": 4000, "consumer_start": 400, "tile_wait": 200, "mainloop": 2400,
         "stage_wait": 800, "epilogue_l1": 300, "epilogue_l1_math": 200, "epilogue_l1_release": 100, "epilogue_l2": 100,
         "combine_barrier": 400, "reduce": 200, "tiles_l1": 8, "tiles_l2": 4, "mainloop_l1": 1600, "mainloop_head": 480,
         "mainloop_head_l2": 80, "producer_arrival": 60, "producer_empty": 40, "producer_total": 1000,
         "dispatch_start": 20, "dispatch_schedule": 300, "dispatch_count": 100, "dispatch_exchange": 120,
         "dispatch_pull": 500}
    return {k: v if k == "samplers" else v * scale for k, v in c.items()}


def test_the_cycle_breakdown_is_per_warpgroup_and_per_cta_and_per_k_block():
    b = lib.cycle_breakdown(counters(), hidden=512, intermediate=256)
    assert b["consumer_warpgroups"] == 4
    assert b["consumer"]["total"] == 1000 and b["consumer"]["mainloop"] == 600 and b["consumer"]["tiles_l1"] == 2
    # L1: 1600 cycles over 8 tiles x 4 K blocks (512 / 128); L2: 800 over 4 tiles x 2 (256 / 128)
    assert b["per_k_block"]["l1"] == 50 and b["per_k_block"]["l2"] == 100
    assert b["per_k_block"]["first_two"] == 480 / 24 and b["per_k_block"]["first_two_l2"] == 80 / 8
    assert b["producer"] == {"arrival_waits": 30, "empty_waits": 20, "loop": 500}  # per CTA: 2 CTAs
    assert b["dispatch"]["pull"] == 250
    empty = lib.cycle_breakdown({}, hidden=512, intermediate=256)
    assert empty["per_k_block"]["l1"] is None and empty["consumer"]["total"] == 0
    # over all 8 x 4 + 4 x 2 = 40 K blocks: the main loop's 2400 cycles and its stage waits' 800
    assert b["per_k_block"]["all"] == 60 and b["per_k_block"]["stage_wait"] == 20
    assert b["per_k_block"]["fp4_expand"] == 0 and empty["per_k_block"]["all"] is None


def test_the_mxfp4_counters_are_shown_only_when_the_build_counted_them():
    from megamoe_cli.cli.profile import cycle_text

    fp8 = cycle_text(lib.cycle_breakdown(counters(), hidden=512, intermediate=256), "fp8")
    assert "MXFP4" not in fp8
    c = {**counters(), "fp4_expand": 800, "fp4_expand_barrier": 200, "mma_wait": 400}
    b = lib.cycle_breakdown(c, hidden=512, intermediate=256)
    assert (b["consumer"]["fp4_expand"], b["consumer"]["fp4_expand_barrier"], b["consumer"]["mma_wait"]) == (200, 50, 100)
    lines = cycle_text(b, "fp4").splitlines()
    at = [i for i, l in enumerate(lines) if "MXFP4" in l]
    assert [lines[i] for i in at] == [
        "        of it (MXFP4): expansion 200 =  20.0%, its barrier 50 =   5.0%, WGMMA waits 100 =  10.0%"]
    # the same counters over the 40 K blocks (8 L1 tiles x 4, 4 L2 tiles x 2)
    assert lines[at[0] + 1] == ("        a K block of both layers: 60 cycles, of it the expansion 20 cycles, its "
                                "barrier 5 cycles, WGMMA waits 10 cycles, stage waits 20 cycles")
    assert "a K block of both layers" not in fp8


def test_the_slowest_rank_counts_and_the_metrics_and_floors_come_from_the_model():
    shape = PRESETS["small"]
    counts = [[2] * 8, [1] * 8]  # rank 0 sends 2 pairs to every expert, rank 1 one
    model = traffic(shape, counts, [16, 16])
    per_rank = [{"error": None, "kernel_us": 10.0, "layer_us": 14.0, "back_to_back_us": 8.0, "counters": counters()},
                {"error": None, "kernel_us": 12.0, "layer_us": 13.0, "back_to_back_us": 9.0, "counters": counters(2),
                 "trace": {"rank": 1, "path": "t.csv", "summary": "s"}}]
    spec = gpu_spec("H200")
    result = lib.combine_ranks({"block_m": 64, "num_stages": 4}, {"block_m": 64}, per_rank, model, spec, shape)
    assert (result.status, result.kernel_us, result.slowest_rank, result.rank_kernel_us) == ("ok", 12.0, 1, [10.0, 12.0])
    assert (result.layer_us, result.back_to_back_us) == (14.0, 9.0)
    assert result.metrics["num_pairs"] == 24 and result.metrics["recv_pairs_max"] == 12
    assert result.metrics["tflops"] == pytest.approx(24 * shape.flops_per_pair() / 2 / 12e-6 / 1e12)
    assert result.metrics["floor_hbm_us"] == pytest.approx(max(model.weight_bytes) / spec.hbm_bytes_per_s * 1e6)
    assert result.metrics["floor_compute_us"] == pytest.approx(max(model.flops) / spec.fp8_flops * 1e6)
    assert result.metrics["weight_gbps"] == pytest.approx(max(model.weight_bytes) / 12.0 / 1e3)
    assert [c["consumer"]["total"] for c in result.cycles] == [1000, 2000]
    assert result.traces == [{"rank": 1, "path": "t.csv", "summary": "s"}]
    on_cpu = lib.combine_ranks({}, {}, per_rank, model, None, shape)
    assert "floor_hbm_us" not in on_cpu.metrics and on_cpu.metrics["floor_us"] is None

    failed = lib.combine_ranks({}, {}, [{"error": None}, {"error": "time: MegaMoEError: no"}], model, spec, shape)
    assert (failed.status, failed.stage, failed.reason) == ("failed", "time", "rank 1: time: MegaMoEError: no")


# ---------------------------------------------------------------------------- the whole run, on two CPU ranks

STAND_IN = textwrap.dedent(
    """
    import os
    import time

    import torch

    import megamoe_cli.bench.session as session
    from megamoe_cli.errors import MegaMoEError


    class VirtualClock:
        \"\"\"The session's clock in these ranks: it moves only by what a stand-in call says it took,
        so the times the run reports are exact however loaded the machine is.\"\"\"

        def __init__(self):
            self.now = 0.0

        def perf_counter(self):
            return self.now

        def advance(self, seconds):
            self.now += seconds


    CLOCK = VirtualClock()
    session.time = CLOCK

    # (num_tokens, block_m, num_stages) whose kernel call fails the way a trapped kernel does
    FAULT = (32, 64, 4)
    # kernel seconds per call on rank 0 and rank 1 (rank 1 is the slowest)
    KERNEL_S = (0.001, 0.003)
    HANG_AT = int(os.environ.get("STAND_IN_HANG_AT_TOKENS", "-1"))


    class Runner:
        def __init__(self, problem, group, config):
            if config.get("block_m") == 128 and problem.rank == 1:
                raise MegaMoEError("stand-in: rank 1 cannot run block_m 128")
            if problem.num_tokens == HANG_AT:
                while True:
                    time.sleep(1)
            self.problem = problem
            self.config = {"block_m": config.get("block_m", 64), "num_stages": config.get("num_stages", 3),
                           "config_source": "given" if config else "default"}
            self.fault = (problem.num_tokens, self.config["block_m"], self.config["num_stages"]) == FAULT
            self.y = torch.zeros(problem.num_tokens, problem.shape.hidden)

        def __call__(self):
            CLOCK.advance(0.002)
            return self.y


    class Backend:
        def prepare(self, problem, group, config):
            return Runner(problem, group, config)


    class Probe:
        def __init__(self, runner, given):
            self.runner = runner
            self.given = given

        def kernel(self):
            if self.runner.fault:
                raise RuntimeError("CUDA error: an illegal memory access was encountered")
            CLOCK.advance(KERNEL_S[self.runner.problem.rank] + (0.001 if self.given else 0.0))

        def sync(self):
            pass

        def counters(self, calls):
            c = {"samplers": 4, "consumer_total": 4000 * calls, "mainloop": 2400 * calls, "tiles_l1": 8 * calls}
            trace = [{"time_ns": 1000 + 1000 * i, "clock": 2000 + 2000 * i, "cta": 0, "kind": kind, "epoch": 1,
                      "layer": 1, "expert": 0, "n": 0, "block": 0}
                     for i, kind in enumerate(("cta_start", "schedule_done", "tiles_done", "barrier_done", "cta_end"))]
            return c, trace
    """
)


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    (tmp_path / "stand_in.py").write_text(STAND_IN)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return {"backend": "stand_in:Backend", "probe": "stand_in:Probe"}


@pytest.mark.slow
def test_a_run_on_two_cpu_ranks_profiles_every_config_and_stops_at_a_fault(tmp_path, stand_in):
    options = lib.ProfileOptions.make([{}, {"block_m": 128, "num_stages": 3}, {"block_m": 64, "num_stages": 4}],
                                      cycles=True, cycle_calls=2, trace_dir=str(tmp_path / "traces"),
                                      back_to_back=3, **stand_in)
    lines = []
    run = lib.run_profile(small_points((16, 32)), options, world_size=2, device="cpu", progress=lines.append,
                          run_root=tmp_path)

    assert not run.ok
    assert run.message.startswith("profile stopped (kernel config 64:4: RuntimeError: CUDA error: an illegal memory "
                                  "access was encountered): run stopped at point 1 of 2")
    first, second = run.points
    assert first.status == "failed" and "config 128:3: prepare: rank 1: prepare 128:3: MegaMoEError: stand-in" \
        in first.message
    auto, refused, fast = first.results
    assert [r.status for r in first.results] == ["ok", "failed", "ok"]
    assert refused.reason == "rank 1: prepare 128:3: MegaMoEError: stand-in: rank 1 cannot run block_m 128"
    for result in (auto, fast):
        # the stand-in's calls advance the ranks' clocks by exactly KERNEL_S and 2 ms
        assert result.slowest_rank == 1 and result.rank_kernel_us == pytest.approx([1000.0, 3000.0])
        assert result.layer_us == pytest.approx(2000.0) and result.back_to_back_us == pytest.approx(3000.0)
        assert result.metrics["num_pairs"] == 2 * 16 * PRESETS["small"].num_topk
        assert [c["consumer"]["total"] for c in result.cycles] == [2000, 2000]  # 2 calls summed, per warpgroup
        assert [Path(t["path"]).name for t in result.traces] == [
            f"trace_16_{'auto' if result is auto else 'block_m64_num_stages4'}_ws2_r{r}.csv" for r in (0, 1)]
        assert all(Path(t["path"]).is_file() and "cta_start" in t["summary"] for t in result.traces)
    assert auto.used["config_source"] == "default" and fast.used == {"block_m": 64, "num_stages": 4,
                                                                      "config_source": "given"}
    assert [r.status for r in second.results] == ["ok", "failed", "fault"]
    assert second.status == "failed" and "illegal memory access" in second.message
    assert run.env["python"] and run.world_size == 2 and run.device == "cpu"
    assert any(line.startswith("point 1/2: fused small num_tokens=16, 3 config(s)") for line in lines)
    data = json.loads(json.dumps(run.to_dict()))
    assert data["points"][0]["configs"][0]["label"] == "auto" and data["cycle_calls"] == 2
    assert not list(tmp_path.glob("megamoe-profile-*"))  # the records folder goes with the run


@pytest.mark.slow
def test_the_kernel_time_is_on_given_inputs_when_asked(tmp_path, stand_in):
    plain, given = (lib.run_profile(small_points((8,), iters=5), lib.ProfileOptions.make([{}], given=g, **stand_in),
                                    world_size=2, device="cpu", run_root=tmp_path) for g in (False, True))
    assert plain.ok and given.ok, (plain.message, given.message)
    # the stand-in's given call takes 1 ms longer on every rank
    assert given.points[0].results[0].kernel_us - plain.points[0].results[0].kernel_us == pytest.approx(1000.0)


# ---------------------------------------------------------------------------- command line


def test_help_names_every_option_and_the_exit_statuses():
    text = " ".join(run_cli("profile", "--help").stdout.split())
    for fragment in ("--tokens", "--configs", "--ranks", "--given", "--back-to-back", "--cycles", "--cycle-calls",
                     "--trace", "--json", "0 every config measured; 3 some configs failed",
                     "SIGINT 130, SIGTERM 143, SIGHUP 129"):
        assert fragment in text
    assert "profile" in run_cli("--help").stdout


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--configs", "128:x"], ["'--configs'", "block_m:num_stages[:num_sms[:cluster_m]]", "got '128:x'"]),
        (["--configs", "96:4"], ["block_m=96 is not supported"]),
        (["--configs", "128:4,128:4"], ["kernel config 128:4 is listed twice"]),
        (["--configs", "128:5"], ["kernel config 128:5 at fused deepseek-v3 num_tokens=64", "shared memory"]),
        (["--ranks", "3"], ["num_experts=256 must be divisible by num_ranks=3"]),
        (["--ranks", "0"], ["'--ranks'", "0 is not in the range x>=1"]),
        (["--iters", "0"], ["--iters", "expected an integer >= 1, got 0"]),
        (["--tokens", "1,x"], ["comma-separated integers"]),
        (["--cycle-calls", "20"], ["--cycle-calls needs --cycles"]),
        (["--trace", "t"], ["--trace needs --cycles"]),
        (["--weights", "fp8,fp4"], ["--weights takes one format here, got fp8,fp4"]),
        (["--preset", "small", "--hidden", "100"], ["hidden must be a multiple of 128"]),
    ],
)
def test_bad_input_is_one_line_naming_what_was_expected(args, fragments):
    assert_one_line_error(run_cli("profile", *args), *fragments)


def test_without_a_gpu_it_refuses_up_front(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_one_line_error(run_cli("profile", "--preset", "small", "--tokens", "16"),
                          "megamoe profile times the fused kernel, which runs on Hopper GPUs (sm_90a) only; "
                          "torch sees no CUDA device here")


def test_a_gpu_that_is_not_hopper_is_named(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "NVIDIA A100-SXM4-80GB")
    assert_one_line_error(run_cli("profile", "--tokens", "16"),
                          "only; GPU 0 is NVIDIA A100-SXM4-80GB (sm_80)")


def fake_run(outcome_of, stop=None):
    """Stands in for run_profile: every config measured (or as ``outcome_of(point, config)`` says)."""
    calls = []

    def run_profile(points, options, **kwargs):
        calls.append({"points": points, "options": options, **kwargs})
        profiles = []
        for point in points:
            results = [outcome_of(point, config) for config in options.config_dicts]
            ok = all(r.status == "ok" for r in results)
            profiles.append(lib.PointProfile(point, "ok" if ok else "failed", "" if ok else "some failed", results))
        if stop:
            return lib.ProfileRun("failed", stop, profiles, kwargs["world_size"], "cuda", options, {"gpu": "H200"})
        return lib.ProfileRun("ok", "profiled", profiles, kwargs["world_size"], "cuda", options, {"gpu": "H200"})

    run_profile.calls = calls
    return run_profile


def measured(point, config, kernel_us=100.0):
    breakdown = lib.cycle_breakdown(counters(), point.hidden, point.intermediate)
    return lib.ConfigResult(config, "ok", used={"block_m": 64, "num_stages": 4, "num_sms": 0, "cluster_m": 1},
                            kernel_us=kernel_us, layer_us=kernel_us + 10, back_to_back_us=kernel_us - 5,
                            rank_kernel_us=[kernel_us], slowest_rank=0,
                            metrics={"tflops": 123.4, "weight_gbps": 4567.0, "floor_hbm_us": 50.0,
                                     "floor_compute_us": 20.0, "floor_nvlink_us": 0.0},
                            cycles=[breakdown], counters=[counters()],
                            traces=[{"rank": 0, "path": "traces/t.csv", "summary": "phase (us)\n  cta_start 0"}])


@pytest.fixture
def simulated_gpu(monkeypatch):
    from megamoe_cli.cli import profile as command

    monkeypatch.setattr(command, "require_hopper", lambda ranks, what: None)

    def install(run):
        monkeypatch.setattr(lib, "run_profile", run)
        return run

    return install


def test_json_is_one_document_with_every_point_and_config(simulated_gpu):
    run = simulated_gpu(fake_run(measured))
    result = run_cli("profile", "--preset", "small", "--tokens", "16,32", "--configs", "auto,64:4",
                     "--cycles", "--back-to-back", "5", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"status", "message", "world_size", "device", "shape", "warmup", "iters", "given",
                         "back_to_back", "cycles", "cycle_calls", "env", "points"}
    assert (data["status"], data["world_size"], data["back_to_back"], data["cycles"]) == ("ok", 1, 5, True)
    assert data["shape"]["preset"] == "small" and (data["warmup"], data["iters"]) == (3, 20)
    assert [p["num_tokens"] for p in data["points"]] == [16, 32]
    config = data["points"][0]["configs"][1]
    assert config["label"] == "64:4" and config["config"] == {"block_m": 64, "num_stages": 4}
    for key in ("status", "used", "kernel_us", "layer_us", "back_to_back_us", "rank_kernel_us", "slowest_rank",
                "metrics", "cycles", "counters", "traces"):
        assert key in config
    (call,) = run.calls
    assert call["world_size"] == 1 and [p.num_tokens for p in call["points"]] == [16, 32]
    assert {(p.warmup, p.iters, p.check, p.backend) for p in call["points"]} == {(3, 20, False, "fused")}
    # the human view goes to stderr: the table, the cycles and the timeline
    assert "kernel us" in result.stderr and "123.4" in result.stderr and "50.0 / 20.0 / 0.0" in result.stderr
    assert "mainloop" in result.stderr and "per K block" in result.stderr
    # the times are the profiling build's, and the table says so
    assert "times and rates of the profiling build (--cycles)" in " ".join(result.stderr.split())
    assert "timeline of 64:4 on rank 0 (traces/t.csv)" in result.stderr


def test_failed_configs_exit_3_and_a_stopped_run_exits_2_after_showing_what_it_measured(simulated_gpu):
    def some_fail(point, config):
        if config:
            return lib.ConfigResult(config, "failed", "prepare", "rank 0: prepare 64:4: MegaMoEError: no")
        return measured(point, config)

    simulated_gpu(fake_run(some_fail))
    result = run_cli("profile", "--preset", "small", "--tokens", "16", "--configs", "auto,64:4")
    assert result.exit_code == 3, result.output
    assert result.stderr.strip().splitlines()[-1] == "error: 1 of 2 config(s) failed; their lines say why"
    assert "failed: prepare: rank 0: prepare 64:4" in " ".join(result.stderr.split())
    assert "profiling build" not in result.stderr  # release timings carry no caption

    simulated_gpu(fake_run(measured, stop="profile stopped (kernel config 64:4: trap): run stopped at point 0"))
    result = run_cli("profile", "--preset", "small", "--tokens", "16", "--configs", "auto,64:4", "--json")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == \
        "error: profile stopped (kernel config 64:4: trap): run stopped at point 0"
    assert json.loads(result.stdout)["status"] == "failed"  # what was measured is still printed


PROFILE_ON_CPU = textwrap.dedent(
    """
    import dataclasses, sys
    from megamoe_cli.bench import profile as library
    from megamoe_cli.cli import main, profile as command

    command.require_hopper = lambda ranks, what: None
    real = library.run_profile

    def on_cpu_ranks(points, options, **kwargs):
        options = dataclasses.replace(options, backend="stand_in:Backend", probe="stand_in:Probe")
        return real(points, options, device="cpu", **{**kwargs, "world_size": 2})

    library.run_profile = on_cpu_ranks
    main(sys.argv[1:], prog_name="megamoe")
    """
)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
@pytest.mark.slow
def test_a_stop_signal_ends_every_rank_of_a_profile_run(tmp_path, sig):
    from megamoe_cli.bench import launcher
    from megamoe_cli.bench.launcher import worker_pids

    (tmp_path / "stand_in.py").write_text(STAND_IN)
    env = launcher.run_environment({"PYTHONPATH": f"{tmp_path}{os.pathsep}{REPO}", "TMPDIR": str(tmp_path),
                                    "STAND_IN_HANG_AT_TOKENS": "32"})
    proc = subprocess.Popen([sys.executable, "-c", PROFILE_ON_CPU, "profile", "--preset", "small", "--tokens", "16,32",
                             "--iters", "2", "--warmup", "0", "--point-timeout", "120"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=interruptible)
    try:
        deadline = time.monotonic() + 120
        while True:
            runs = list(tmp_path.glob("megamoe-bench-*"))
            progress = runs[0] / "progress.jsonl" if runs else None
            if progress is not None and progress.exists() and len(progress.read_text().splitlines()) >= 2:
                break  # the second point (the one that hangs) has started
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the second point never started"
            time.sleep(0.1)
        (run_dir,) = runs
        ranks = list(worker_pids(run_dir).values())
        assert len(ranks) == 2
        stderr = interrupt(proc, sig, timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert "Traceback" not in stderr
    deadline = time.monotonic() + 10
    while any(launcher._alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(launcher._alive(pid) for pid in ranks), "a rank outlived the command"
    assert not list(tmp_path.glob("megamoe-profile-*"))

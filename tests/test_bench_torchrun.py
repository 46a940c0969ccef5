"""The bench path end to end: torchrun, 2 gloo CPU ranks, the worker, the results file.

Three real torchrun launches (a clean run; a failing point then a dying rank;
a stuck point) plus launcher-only tests that stand a small fake process tree
in for torchrun, so the kill and deadline paths are checked without torch
start-up costs.
"""

import json
import os
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megamoe_cli.bench import launcher
from megamoe_cli.bench.launcher import run_bench, terminate_run, worker_pids
from megamoe_cli.bench.results import COLUMNS, append_rows, make_row, read_results
from megamoe_cli.bench.sweep import load_sweep_text
from megamoe_cli.errors import MegaMoEError
from cli_checks import CRASH_ENV, FAIL_ENV, HANG_ENV, fault_env, processes_mentioning

SWEEP = """\
name: torchrun_test
shape: {preset: small}
num_tokens: [1, [0, 4]]
backends: [reference, torch]
warmup: 1
iters: 2
check: true
timeout_s: 60
"""


def sweep_points(text=SWEEP):
    return load_sweep_text(text).points


def no_survivors(run_dir, wait_s=5.0):
    deadline = time.monotonic() + wait_s
    pids = list(worker_pids(run_dir).values())
    while time.monotonic() < deadline:
        if not any(launcher._alive(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_clean_cpu_run_writes_every_column(tmp_path):
    points = sweep_points()  # reference@1, torch@1, reference@[0,4], torch@[0,4]
    events = []
    out = tmp_path / "results.csv"
    result = run_bench(points, 2, out, device="cpu", on_event=events.append, run_root=tmp_path)

    assert result.ok, result.message
    assert (result.device, result.nproc, result.num_points) == ("cpu", 2, 4)
    assert result.run_dir is None and not list(tmp_path.glob("megamoe-bench-*"))

    info = [e.message for e in events if e.kind == "info"]
    assert info and "CPU" in info[0] and "gloo" in info[0]
    assert [e.index for e in events if e.kind == "start"] == [0, 1, 2, 3]
    assert [e.index for e in events if e.kind == "row"] == [0, 1, 2, 3]

    frame = read_results(out)
    assert list(frame.columns) == list(COLUMNS)
    assert len(frame) == 4 and len(result.rows) == 4
    assert set(frame["status"]) == {"ok"}
    assert list(frame["backend"]) == ["reference", "torch", "reference", "torch"]
    assert list(frame["num_tokens_min"]) == [1, 1, 0, 0]
    assert list(frame["num_tokens_max"]) == [1, 1, 4, 4]
    assert set(frame["world_size"]) == {2} and set(frame["device"]) == {"cpu"}
    assert set(frame["run_id"]) == {result.run_id}
    assert (frame["time_us_min"] > 0).all()
    assert (frame["time_us_min"] <= frame["time_us_median"]).all()
    assert (frame["time_us_median"] <= frame["time_us_max"]).all()
    assert set(frame["slowest_rank"]) <= {0, 1}
    # small preset, top-2: 1 token per rank -> 4 pairs; [0, 4] tokens -> 8 pairs.
    assert list(frame["num_pairs"]) == [4, 4, 8, 8]
    assert (frame["tflops"] > 0).all() and (frame["hbm_gbps"] > 0).all()
    assert frame["floor_us"].isna().all()  # no GPU facts on CPU
    assert (frame["rel_err"][frame["backend"] == "reference"] == 0).all()
    assert (frame["rel_err"][frame["backend"] == "torch"] < 1e-2).all()
    # the layer's error pools both ranks' rows: never above the worst rank's, and 0 where that is
    assert (frame["rel_err_layer"][frame["backend"] == "reference"] == 0).all()
    assert (frame["rel_err_layer"][frame["backend"] == "torch"] < 1e-2).all()
    assert (frame["rel_err_layer"] <= frame["rel_err"]).all()
    assert frame["inputs_copy_timed"].all()
    assert set(frame["gpu"]) == {"cpu"} and frame["git_commit"].str.len().min() == 40
    torch_configs = [json.loads(c) for c in frame["config"][frame["backend"] == "torch"]]
    assert all(c["gemm"] == "dequant" and c["dispatch"] == "padded_all_to_all" for c in torch_configs)


@pytest.mark.slow
def test_failed_point_continues_and_a_dying_rank_stops_the_run(tmp_path):
    out = tmp_path / "results.csv"
    old_point = sweep_points()[0]
    append_rows(out, [make_row(old_point, run_id="earlier", world_size=2, device="cpu", env={}, status="ok")])
    old_bytes = out.read_bytes()

    points = sweep_points()
    env = fault_env({FAIL_ENV: 1, CRASH_ENV: 3})
    started = time.monotonic()
    result = run_bench(points, 2, out, device="cpu", env=env, run_root=tmp_path)
    elapsed = time.monotonic() - started

    assert not result.ok
    assert elapsed < 60, f"a dead rank took {elapsed:.0f} s to bring the run down"
    assert f"run stopped at point 3 of 4 ({points[3].describe()})" in result.message
    # The rank that died is named first, from torchrun's failure records, with its cause once; rank 0,
    # which only lost contact with it (gloo's socket error), is counted, not quoted.
    assert ("rank 1 failed first (exit code 1): test hook MEGAMOE_TEST_CRASH_AT_POINT=3: exiting at point 3; "
            "1 other rank(s) stopped after it") in result.message
    assert result.message.count("exiting at point 3") == 1
    assert "gloo" not in result.message and "lost contact" not in result.message
    assert f"run files kept in {result.run_dir}" in result.message
    assert result.run_dir is not None and (result.run_dir / "torchrun.log").exists()
    assert no_survivors(result.run_dir)
    # Those records are torch.distributed.elastic's: each rank's @record error file, in the run folder.
    records = {r["rank"]: r for r in launcher.rank_failures(result.run_dir)}
    assert records[1]["exitcode"] == 1
    assert records[1]["message"] == "RankFailed: rank 1: test hook MEGAMOE_TEST_CRASH_AT_POINT=3: exiting at point 3"
    assert all(r["error_file"] is None or r["error_file"].startswith(str(result.run_dir / launcher.ELASTIC_DIR))
               for r in records.values())

    assert out.read_bytes().startswith(old_bytes)
    frame = read_results(out)
    assert list(frame["run_id"][:1]) == ["earlier"]
    mine = frame[frame["run_id"] == result.run_id]
    assert list(mine["status"]) == ["ok", "failed", "ok", "failed"]
    assert "rank 1: prepare: RuntimeError: injected failure" in mine["error"].iloc[1]
    assert mine["time_us_median"].iloc[1] != mine["time_us_median"].iloc[1]  # NaN: nothing was timed
    assert "exiting at point 3" in mine["error"].iloc[3]
    assert [r["status"] for r in result.rows] == ["ok", "failed", "ok", "failed"]


@pytest.mark.slow
def test_stuck_point_fails_within_its_timeout(tmp_path):
    points = sweep_points(SWEEP.replace("timeout_s: 60", "timeout_s: 4"))[:2]
    out = tmp_path / "results.jsonl"
    started = time.monotonic()
    result = run_bench(points, 2, out, device="cpu", env=fault_env({HANG_ENV: 0}), run_root=tmp_path)
    elapsed = time.monotonic() - started

    assert not result.ok
    assert elapsed < 45, f"a stuck point held the run for {elapsed:.0f} s"
    assert "run stopped at point 0 of 2" in result.message
    assert "did not finish within 4 s" in result.message
    assert "1 later point(s) not run" in result.message
    assert no_survivors(result.run_dir)
    frame = read_results(out)
    assert list(frame["status"]) == ["failed"]
    assert "did not finish within 4 s" in frame["error"][0]


def test_points_are_checked_against_the_world_size_before_launch(tmp_path):
    uneven = sweep_points()[2]  # num_tokens [0, 4]
    with pytest.raises(MegaMoEError, match=r"point 0 \(reference small num_tokens=\[0, 4\]\): num_tokens gives 2"):
        run_bench([uneven], 4, tmp_path / "r.csv", device="cpu")
    three = sweep_points()[:1]
    with pytest.raises(MegaMoEError, match="num_experts=8 must be divisible by num_ranks=3"):
        run_bench(three, 3, tmp_path / "r.csv", device="cpu")
    with pytest.raises(MegaMoEError, match="nothing to run"):
        run_bench([], 2, tmp_path / "r.csv", device="cpu")
    with pytest.raises(MegaMoEError, match="unknown results format"):
        run_bench(three, 2, tmp_path / "r.txt", device="cpu")
    with pytest.raises(MegaMoEError, match="device must be auto, cuda or cpu"):
        run_bench(three, 2, None, device="tpu")
    assert not list(tmp_path.glob("megamoe-bench-*"))


def test_run_environment_sets_the_multicast_switches_and_package_path(monkeypatch):
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "1")
    env = launcher.run_environment({"EXTRA": "x"})
    assert env["NCCL_NVLS_ENABLE"] == "0"
    assert env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    assert env["NVSHMEM_DISABLE_NVLS"] == "1"
    assert env["EXTRA"] == "x"
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(launcher.PACKAGE_ROOT)
    cmd = launcher.torchrun_command(2, "plan.json", "rows.jsonl", "dir")
    assert cmd[:4] == [sys.executable, "-m", "megamoe_cli.bench.torchrun", str(Path("dir") / launcher.FAILURES_FILE)]
    # torchrun's per-rank error files go into the run folder (and away with it), not into a
    # torchelastic_* folder of their own in the temporary folder.
    assert cmd[cmd.index("--log-dir") + 1] == str(Path("dir") / launcher.ELASTIC_DIR)
    assert cmd[cmd.index("-m", 3) + 1] == "megamoe_cli.bench.worker"


# A stand-in for torchrun: starts "ranks" in their own sessions (as torchrun does)
# that record their PIDs the way the worker does, and ignore SIGTERM.
FAKE_TORCHRUN = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    run_dir, mode = sys.argv[1], sys.argv[2]
    rank_code = '''
    import json, os, signal, subprocess, sys, time
    run_dir, rank, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "grandchild":  # a process the rank started (a compiler, say), in the rank's group
        subprocess.Popen([sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, "
                          "signal.SIG_IGN); time.sleep(600)", run_dir])
    if mode != "no_pid_files":
        with open(os.path.join(run_dir, "rank%d.pid" % rank), "w") as f:
            json.dump({"pid": os.getpid(), "rank": rank}, f)
    if mode == "one_dies" and rank == 1:
        time.sleep(0.5)
        os._exit(1)
    time.sleep(600)
    '''
    children = [subprocess.Popen([sys.executable, "-c", rank_code, run_dir, str(r), mode], start_new_session=True)
                for r in range(2)]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "one_dies":
        children[1].wait()
    if mode == "rows":  # rank 0 finished the rows prepared by the test
        with open(os.environ["FAKE_ROWS"]) as src, open(os.path.join(run_dir, "rows.jsonl"), "a") as dst:
            dst.write(src.read())
    time.sleep(600)
    """
)


@pytest.fixture
def fake_torchrun(tmp_path, monkeypatch):
    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)

    def use(mode):
        monkeypatch.setattr(
            launcher, "torchrun_command",
            lambda nproc, plan, rows, run_dir: [sys.executable, str(script), str(run_dir), mode],
        )

    return use


@pytest.mark.slow
def test_ranks_that_never_start_are_stopped_at_the_startup_deadline(tmp_path, fake_torchrun):
    fake_torchrun("hang")
    started = time.monotonic()
    result = run_bench(
        sweep_points()[:1], 2, tmp_path / "r.csv", device="cpu",
        startup_timeout_s=2, grace_s=1, run_root=tmp_path,
    )
    assert time.monotonic() - started < 20
    assert not result.ok
    assert "the ranks did not start within 2 s" in result.message
    assert len(worker_pids(result.run_dir)) == 2
    assert no_survivors(result.run_dir)
    assert [r["status"] for r in read_results(tmp_path / "r.csv").to_dict("records")] == ["failed"]


@pytest.mark.slow
def test_a_rank_that_vanishes_brings_the_run_down(tmp_path, fake_torchrun):
    fake_torchrun("one_dies")
    started = time.monotonic()
    result = run_bench(sweep_points()[:2], 2, None, device="cpu", grace_s=1, run_root=tmp_path)
    assert time.monotonic() - started < 20
    assert not result.ok
    assert "run stopped at point 0 of 2" in result.message
    assert "a rank stopped and the others did not finish" in result.message
    assert no_survivors(result.run_dir)


@pytest.mark.slow
def test_overall_timeout(tmp_path, fake_torchrun):
    fake_torchrun("hang")
    result = run_bench(sweep_points()[:1], 2, None, device="cpu", timeout_s=1.5, grace_s=1, run_root=tmp_path)
    assert "the run exceeded its timeout of 1.5 s" in result.message
    assert no_survivors(result.run_dir)


def wait_for(condition, wait_s=10.0):
    deadline = time.monotonic() + wait_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("mode", ["no_pid_files", "grandchild"])
def test_terminate_run_finds_ranks_through_torchrun_and_ends_their_process_groups(tmp_path, mode):
    """Ranks that have not written their PID files yet are found as torchrun's children; what a
    rank started goes with the rank's process group.  Nothing that names the run survives."""
    import subprocess

    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    proc = subprocess.Popen([sys.executable, str(script), str(run_dir), mode], start_new_session=True)
    try:
        expected = 3 if mode == "no_pid_files" else 5  # torchrun, 2 ranks (+ one child each)
        wait_for(lambda: len(processes_mentioning(str(run_dir))) == expected)
        processes = launcher.RunProcesses(proc, run_dir, 2)
        processes.record()
        assert len(processes.ranks) == 2 and processes.complete
        assert worker_pids(run_dir) == ({} if mode == "no_pid_files" else worker_pids(run_dir))
        everything = processes_mentioning(str(run_dir))
        terminate_run(proc, run_dir, grace_s=0.5, processes=processes)
        assert proc.poll() is not None
        wait_for(lambda: not any(launcher._alive(pid) for pid in everything), wait_s=5)
        assert not processes_mentioning(str(run_dir))
    finally:
        for pid in processes_mentioning(str(run_dir)):
            os.kill(pid, 9)


def test_terminate_run_kills_processes_that_ignore_sigterm(tmp_path):
    import subprocess

    script = tmp_path / "fake_torchrun.py"
    script.write_text(FAKE_TORCHRUN)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), "hang"], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(worker_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = list(worker_pids(tmp_path).values())
    assert len(pids) == 2 and all(launcher._alive(p) for p in pids)
    terminate_run(proc, tmp_path, grace_s=0.5)
    assert proc.poll() is not None
    assert no_survivors(tmp_path)


# Pieces of the worker that need no process group.


def test_time_calls_barrier_precedes_every_timed_call_and_flush_stays_outside():
    from megamoe_cli.bench.session import Stats, time_calls

    log = []
    results = []

    def call():
        log.append("call")
        time.sleep(0.002)
        return len(log)

    times = time_calls(
        call, warmup=2, iters=3, device="cpu",
        barrier=lambda: log.append("barrier"), flush=lambda: log.append("flush"), on_result=results.append,
    )
    assert log == ["call", "call"] + ["flush", "barrier", "call"] * 3
    assert len(times) == 3 and all(t >= 2000 for t in times)
    assert results == [len(log)]
    stats = Stats.of([5.0, 1.0, 3.0])
    assert (stats.median_us, stats.min_us, stats.max_us) == (3.0, 1.0, 5.0)


def test_time_calls_times_calls_per_sample_back_to_back_and_reports_per_call(monkeypatch):
    from megamoe_cli.bench import session
    from megamoe_cli.bench.session import time_calls

    clock = [0.0]  # a fake perf_counter: only a call advances it, by 3 ms + 1 ms per log entry so far
    monkeypatch.setattr(session, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    log = []
    results = []

    def call():
        log.append("call")
        clock[0] += 0.003 + 0.001 * len(log)
        return len(log)

    times = time_calls(
        call, warmup=1, iters=2, device="cpu", calls_per_sample=3,
        barrier=lambda: log.append("barrier"), flush=lambda: log.append("flush"), on_result=results.append,
    )
    assert log == ["call"] + ["flush", "barrier", "call", "call", "call"] * 2
    # Sample 1 holds calls 2..4 of the log (entries 4, 5, 6: 7+8+9 ms); sample 2 entries 9..11 (12+13+14 ms).
    assert times == pytest.approx([(7 + 8 + 9) * 1e3 / 3, (12 + 13 + 14) * 1e3 / 3], rel=1e-12)
    assert results == [len(log)]  # the last call's result


def test_time_calls_default_is_one_call_per_sample(monkeypatch):
    from megamoe_cli.bench import session
    from megamoe_cli.bench.session import time_calls

    clock = [0.0]
    monkeypatch.setattr(session, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    log = []

    def call():
        log.append("call")
        clock[0] += 0.005
        return None

    times = time_calls(call, warmup=0, iters=2, device="cpu", barrier=lambda: log.append("barrier"))
    assert log == ["barrier", "call"] * 2
    assert times == pytest.approx([5000.0, 5000.0], rel=1e-12)


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_time_calls_refuses_calls_per_sample_below_one(bad):
    from megamoe_cli.bench.session import time_calls

    calls = []
    with pytest.raises(ValueError) as info:
        time_calls(lambda: calls.append(1), warmup=1, iters=1, device="cpu", barrier=lambda: None,
                   calls_per_sample=bad)
    assert str(info.value) == f"calls_per_sample must be an integer >= 1, got {bad!r}"
    assert calls == []  # refused before any call


def test_a_rank_session_times_each_sample_as_the_points_calls_per_sample_calls():
    from megamoe_cli.bench.session import RankSession

    point = load_sweep_text(
        "name: t\nshape: {preset: small}\nnum_tokens: [4]\nbackends: [torch]\n"
        "warmup: 1\niters: 2\ncalls_per_sample: 3\n"
    ).points[0]
    log = []

    def runner():
        log.append("call")
        return len(log)

    session = RankSession(rank=0, world_size=1, device="cpu", barrier=lambda: log.append("barrier"))
    timed = session.time(runner, point)
    assert log == ["call"] + ["barrier", "call", "call", "call"] * 2
    assert timed.output == len(log)
    assert timed.stats.min_us <= timed.stats.median_us <= timed.stats.max_us
    log.clear()
    session.time(runner, point, calls_per_sample=1)  # a tune candidate: one call per sample
    assert log == ["call"] + ["barrier", "call"] * 2


def test_a_rank_session_makes_one_l2_flusher_and_only_for_points_that_flush():
    from megamoe_cli.bench.session import L2Flusher, RankSession

    plain, flushed = (load_sweep_text("name: t\nshape: {preset: small}\nnum_tokens: [4]\nbackends: [torch]\n"
                                      f"flush_l2: {flag}\n").points[0] for flag in ("false", "true"))
    session = RankSession(rank=0, world_size=1, device="cpu")
    assert session.flusher(plain) is None
    first = session.flusher(flushed)
    assert isinstance(first, L2Flusher) and session.flusher(flushed) is first


def test_time_alternating_takes_one_sample_of_each_call_in_turn():
    from megamoe_cli.bench.session import time_alternating

    log = []
    samples = time_alternating([lambda: log.append("a"), lambda: log.append("b")], warmup=1, iters=3,
                               barrier=lambda: log.append("|"), device="cpu", calls_per_sample=2)
    assert log == ["a", "b"] + ["|", "a", "a", "|", "b", "b"] * 3
    assert [len(s) for s in samples] == [3, 3]


def test_per_rank_errors_are_merged_naming_the_ranks():
    from megamoe_cli.bench.session import merge_errors

    assert merge_errors([None, "prepare: X"]) == "rank 1: prepare: X"
    assert merge_errors(["prepare: X", "prepare: X"]) == "all ranks: prepare: X"
    assert merge_errors(["timing: A", None, "timing: A", "check: B"]) == "rank 0,2: timing: A; rank 3: check: B"


def test_auto_device_without_a_gpu_says_it_runs_two_cpu_ranks():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    kind, ranks, note = launcher.resolve_device("auto", None)
    assert (kind, ranks) == ("cpu", 2)
    assert note.startswith("no CUDA device found, so running 2 CPU rank(s) with gloo")
    with pytest.raises(MegaMoEError, match="torch sees no CUDA device"):
        launcher.resolve_device("cuda", None)
    with pytest.raises(MegaMoEError, match="^the number of ranks must be a positive integer, got 0$"):
        launcher.resolve_device("cpu", 0)


# Which rank failed first, from torch.distributed.elastic's records (not torchrun's log text).


def record(rank, exitcode, message="", time_ns=0, signal_name=None):
    return {"rank": rank, "local_rank": rank, "pid": 100 + rank, "exitcode": exitcode, "signal": signal_name,
            "message": message, "traceback": "", "error_file": None, "time_ns": time_ns}


def test_the_first_failure_is_the_rank_that_failed_on_its_own_account():
    died = record(1, 1, "RankFailed: rank 1: point 3 (torch small num_tokens=4): prepare: RuntimeError: boom", 2_000)
    lost = record(0, 1, "LostPeerError: rank 0: point 3 (...): lost contact with the other ranks in phase "
                        "prepare: RuntimeError: [gloo] Connection closed by peer", 1_000)
    stopped = record(2, -15, "", 500, "SIGTERM")
    # The rank that lost contact wrote its record first, and torchrun stopped another earlier still:
    # neither is the cause.
    assert launcher.first_failure([lost, stopped, died]) is died
    assert launcher.describe_failure(died, 2) == (
        "rank 1 failed first (exit code 1): point 3 (torch small num_tokens=4): prepare: RuntimeError: boom; "
        "2 other rank(s) stopped after it")
    # Among ranks that failed on their own, the earliest; with only consequences, the earliest of those.
    early = record(3, 3, "RankTimeout: rank 3: point 0 did not finish within 4 s", 1_500)
    assert launcher.first_failure([died, early]) is early
    assert launcher.first_failure([lost, stopped]) is stopped
    assert launcher.first_failure([]) is None


def test_a_rank_killed_without_a_record_is_named_by_its_signal():
    killed = record(1, -9, "", 5, "SIGKILL")  # the OOM killer, kill -9: no Python left to write a record
    lost = record(0, 1, "LostPeerError: rank 0: lost contact with the other ranks in phase timing", 1)
    assert launcher.first_failure([lost, killed]) is killed
    assert launcher.describe_failure(killed, 1) == ("rank 1 failed first (killed by SIGKILL, no error record); "
                                                    "1 other rank(s) stopped after it")
    assert launcher.describe_failure(record(0, 2), 0) == "rank 0 failed (exit code 2, no error record)"


def test_bench_torchrun_turns_elastic_failures_into_records(tmp_path, monkeypatch):
    """What bench.torchrun writes for the launcher, from the ProcessFailure objects torchrun's agent
    builds: the @record error file's message and traceback, or the signal; the time the file was
    written (nanoseconds), else the agent's time stamp."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure

    from megamoe_cli.bench.torchrun import failure_records

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    try:
        raise RuntimeError("injected")
    except RuntimeError as exc:
        ErrorHandler().record_exception(exc)
    failures = {1: ProcessFailure(local_rank=1, pid=11, exitcode=1, error_file=str(error_file)),
                0: ProcessFailure(local_rank=0, pid=10, exitcode=-15, error_file=str(tmp_path / "none.json"))}
    by_rank = {r["rank"]: r for r in json.loads(json.dumps(failure_records(failures)))}
    assert by_rank[1]["message"] == "RuntimeError: injected"
    assert "raise RuntimeError(\"injected\")" in by_rank[1]["traceback"]
    assert by_rank[1]["time_ns"] == error_file.stat().st_mtime_ns and by_rank[1]["signal"] is None
    assert (by_rank[0]["signal"], by_rank[0]["message"], by_rank[0]["error_file"]) == ("SIGTERM", "", None)
    assert by_rank[0]["time_ns"] % 1_000_000_000 == 0  # the agent's whole-second stamp


@pytest.mark.slow
def test_a_worker_that_fails_leaves_its_elastic_error_record(tmp_path):
    """The worker's entry point runs under @record: an exception that ends it is written to the
    file torchrun names in TORCHELASTIC_ERROR_FILE, with the rank's own account as the message."""
    import subprocess

    error_file = tmp_path / "error.json"
    env = launcher.run_environment({"TORCHELASTIC_ERROR_FILE": str(error_file), "RANK": "1"})
    out = subprocess.run([sys.executable, "-m", "megamoe_cli.bench.worker", "--plan", str(tmp_path / "none.json"),
                          "--rows", str(tmp_path / "rows.jsonl"), "--run-dir", str(tmp_path)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    message = json.loads(error_file.read_text())["message"]
    assert message["message"].startswith("RankFailed: rank 1: FileNotFoundError: ")
    assert "none.json" in message["message"]
    assert "FileNotFoundError" in message["extraInfo"]["py_callstack"]
    assert (tmp_path / "fatal.rank1.txt").read_text().startswith("rank 1: FileNotFoundError: ")


@pytest.mark.slow
def test_a_clean_run_leaves_no_folder_behind(tmp_path):
    """Neither the run folder nor a torchelastic_* folder of torchrun's own in the temporary folder."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    result = run_bench(sweep_points()[:1], 2, None, device="cpu", run_root=scratch, env={"TMPDIR": str(scratch)})
    assert result.ok, result.message
    assert result.run_dir is None
    assert list(scratch.iterdir()) == []


def test_a_stop_signal_while_rows_are_recorded_loses_none_of_them(tmp_path, fake_torchrun, monkeypatch):
    """A signal that lands between appending a row to out_path and counting it, or between reading
    rows and appending them, waits until they are recorded; then the run stops as usual."""
    import signal

    fake_torchrun("rows")
    points = sweep_points()
    prepared = tmp_path / "prepared.jsonl"
    append_rows(prepared, [make_row(p, run_id="fake", world_size=2, device="cpu", env={}, status="ok")
                           for p in points[:2]])
    out = tmp_path / "r.csv"
    original = launcher.append_rows

    def append_then_signal(path, rows):
        original(path, rows)
        os.kill(os.getpid(), signal.SIGTERM)  # its handler raises at the next bytecode, unless held

    def stop(signum, frame):
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "append_rows", append_then_signal)
    saved = signal.signal(signal.SIGTERM, stop)
    events = []
    try:
        with pytest.raises(KeyboardInterrupt):
            run_bench(points, 2, out, device="cpu", on_event=events.append, grace_s=0.5, run_root=tmp_path,
                      env={"FAKE_ROWS": str(prepared)})
    finally:
        signal.signal(signal.SIGTERM, saved)
    assert [e.index for e in events if e.kind == "row"] == [0, 1]
    (stopped,) = [e.message for e in events if e.kind == "stopped"]
    assert stopped == f"stopped: every rank ended; 2 of {len(points)} point(s) measured, in {out}"
    assert list(read_results(out)["num_tokens"]) == [points[0].num_tokens, points[1].num_tokens]
    assert not processes_mentioning(str(tmp_path / "megamoe-bench-"))

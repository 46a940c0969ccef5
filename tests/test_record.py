"""``megamoe record`` on the CPU: a real record of the CPU smoke sweep on two gloo ranks, the folder
and sweep checks made before any rank starts, how a run that fails, stops or is interrupted is
recorded, and the exit statuses."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megamoe_cli.bench import launcher, results
from megamoe_cli.bench import record as lib
from cli_checks import HANG_ENV, assert_one_line_error, fault_env, run_cli

REPO = Path(__file__).resolve().parents[1]
SMOKE = REPO / "sweeps" / "cpu_smoke.yaml"
METADATA_KEYS = {"record", "sweep", "command", "run_id", "started", "finished", "world_size", "device", "status",
                 "message", "points_measured", "points_failed", "env", "files"}


@pytest.mark.slow
def test_a_record_of_the_cpu_smoke_sweep_is_a_folder_with_its_rows_metadata_table_and_plot(tmp_path):
    pytest.importorskip("matplotlib")
    folder = tmp_path / "results" / "cpu"
    result = run_cli("record", "--sweep", str(SMOKE), "--device", "cpu", "--out-dir", str(folder), "--json")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in folder.iterdir()) == ["cpu_smoke.csv", "cpu_smoke.json", "cpu_smoke.md",
                                                        "cpu_smoke.png"]
    meta = json.loads((folder / "cpu_smoke.json").read_text())
    assert set(meta) == METADATA_KEYS
    printed = json.loads(result.stdout)
    assert {k: v for k, v in printed.items() if k != "rows"} == meta
    assert (meta["status"], meta["points_measured"], meta["points_failed"]) == ("ok", 6, 0)
    assert meta["sweep"]["sha256"] == __import__("hashlib").sha256(SMOKE.read_bytes()).hexdigest()
    assert meta["sweep"]["name"] == "cpu_smoke" and meta["sweep"]["points"] == 6
    assert meta["command"][:2] == ["megamoe", "record"] and meta["world_size"] == 2 and meta["device"] == "cpu"
    assert meta["env"]["gpu"] == "cpu" and meta["env"]["python"] and meta["env"]["torch"]
    assert meta["files"] == ["cpu_smoke.csv", "cpu_smoke.json", "cpu_smoke.md", "cpu_smoke.png"]
    frame = results.read_results(folder / "cpu_smoke.csv")
    assert len(frame) == 6 and set(frame["run_id"]) == {meta["run_id"]} == {r["run_id"] for r in printed["rows"]}
    assert all(isinstance(r["config"], dict) for r in printed["rows"])  # objects, not JSON text
    md = (folder / "cpu_smoke.md").read_text()
    assert md.startswith("# cpu_smoke\n") and "`megamoe record --sweep cpu_smoke.yaml` (ok: 6 point(s) measured)" in md
    assert "| backend | shape | tokens/rank |" in md and md.count("| ok |") == 6
    assert (folder / "cpu_smoke.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    again = run_cli("record", "--sweep", str(SMOKE), "--device", "cpu", "--out-dir", str(folder))
    assert_one_line_error(again, f"{folder} already holds a record named cpu_smoke (cpu_smoke.csv, cpu_smoke.json, "
                                 "cpu_smoke.md, cpu_smoke.png); a record is written once")


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--device", "cpu"], ["record.yaml: backend fused and fused-graph runs on Hopper GPUs (sm_90a) only, and "
                               "this run is on CPU ranks"]),
        (["--sweep", "missing.yaml", "--device", "cpu"], ["missing.yaml: sweep file not found"]),
        (["--sweep", str(SMOKE), "--device", "cpu", "--ranks", "4"], ["point 4 (reference small num_tokens=[0, 8]): "
                                                                      "num_tokens gives 2 per-rank counts; the run "
                                                                      "has 4 ranks"]),
        (["--sweep", str(SMOKE), "--device", "cpu", "--ranks", "0"], ["'--ranks'", "0 is not in the range x>=1"]),
    ],
)
def test_what_cannot_run_here_is_refused_before_any_rank_starts_and_leaves_no_folder(tmp_path, args, fragments):
    folder = tmp_path / "out"
    assert_one_line_error(run_cli("record", "--out-dir", str(folder), *args), *fragments)
    assert not folder.exists()


def test_a_sweep_past_the_ranks_memory_is_refused_before_any_folder_is_made(tmp_path, monkeypatch):
    from megamoe_cli.bench import launcher

    monkeypatch.setattr(launcher, "_available_cpu_bytes", lambda: 24 * 2 ** 30)
    big = tmp_path / "big.yaml"
    big.write_text("name: big\nshape: {preset: small}\nnum_tokens: [4, 3000000]\nbackends: [torch]\n")
    folder = tmp_path / "out"
    assert_one_line_error(run_cli("record", "--sweep", str(big), "--device", "cpu", "--out-dir", str(folder)),
                          f"{big}: num_tokens 3000000: point 1 (torch small num_tokens=3000000) needs about",
                          "available (MemAvailable)")
    assert not folder.exists()


def test_a_folder_that_is_a_file_or_a_broken_sweep_is_one_line(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("")
    assert_one_line_error(run_cli("record", "--sweep", str(SMOKE), "--device", "cpu", "--out-dir", str(a_file)),
                          "'--out-dir'")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nshape: {preset: small}\nnum_tokens: [1]\nbackends: [torch]\nwarmup: -1\n")
    assert_one_line_error(run_cli("record", "--sweep", str(bad), "--device", "cpu", "--out-dir", str(tmp_path / "o")),
                          f"{bad}:5: warmup: expected an integer >= 0, got -1")
    assert_one_line_error(run_cli("record", "--sweep", str(SMOKE)), "Missing option '--out-dir'")


class FakeRun:
    """Stands in for run_bench: appends a row per point to the results file, as the launcher does."""

    def __init__(self, fail=(), stop_after=None, interrupt_after=None):
        self.fail, self.stop_after, self.interrupt_after = set(fail), stop_after, interrupt_after

    def __call__(self, points, nproc=None, out_path=None, **kwargs):
        rows = []
        for index, point in enumerate(points):
            if index == self.interrupt_after:
                raise KeyboardInterrupt
            failed = index in self.fail
            row = results.make_row(point, run_id="fake", world_size=nproc, device="cpu",
                                   env={"gpu": "cpu", "git_commit": "abc", "python": "3"},
                                   status=results.STATUS_FAILED if failed else results.STATUS_OK,
                                   error="rank 1: prepare: boom" if failed else "",
                                   timing=None if failed else {"time_us_median": 10.0 + index})
            results.append_rows(out_path, [row])
            rows.append(row)
            if index == self.stop_after:
                return launcher.BenchResult("failed", f"run stopped at point {index + 1} of {len(points)}", rows,
                                            "cpu", nproc, "fake", out_path, num_points=len(points), returncode=1)
        return launcher.BenchResult("ok", f"{len(rows)} point(s) measured", rows, "cpu", nproc, "fake", out_path,
                                    num_points=len(points), returncode=0)


@pytest.mark.parametrize(
    "fake, code, status, last_line",
    [
        (FakeRun(fail=[1]), 3, "points failed", "error: 1 of 6 points failed; the error column of their rows in "),
        (FakeRun(stop_after=2), 2, "stopped", "error: run stopped at point 3 of 6"),
    ],
    ids=["points failed", "stopped"],
)
def test_failed_points_exit_3_a_stopped_run_exits_2_and_the_metadata_says_which(tmp_path, monkeypatch, fake, code,
                                                                             status, last_line):
    monkeypatch.setattr(launcher, "run_bench", fake)
    folder = tmp_path / "rec"
    result = run_cli("record", "--sweep", str(SMOKE), "--device", "cpu", "--out-dir", str(folder))
    assert result.exit_code == code, result.output
    assert result.stderr.strip().splitlines()[-1].startswith(last_line)
    meta = json.loads((folder / "cpu_smoke.json").read_text())
    assert meta["status"] == status and meta["run_id"] == "fake" and meta["env"]["git_commit"] == "abc"
    assert f"({status}: " in (folder / "cpu_smoke.md").read_text()


def test_an_interrupted_record_keeps_its_rows_and_says_it_stopped(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "run_bench", FakeRun(interrupt_after=2))
    folder = tmp_path / "rec"
    result = run_cli("record", "--sweep", str(SMOKE), "--device", "cpu", "--out-dir", str(folder))
    assert result.exit_code == 130, result.output
    meta = json.loads((folder / "cpu_smoke.json").read_text())
    assert meta["status"] == "stopped" and meta["message"].startswith("interrupted; the rows measured before it are "
                                                                        "in cpu_smoke.csv")
    assert (meta["points_measured"], meta["run_id"], meta["env"]["gpu"]) == (2, "fake", "cpu")
    assert len(results.read_results(folder / "cpu_smoke.csv")) == 2


def test_help_says_what_it_writes_and_its_exit_statuses():
    text = " ".join(run_cli("record", "--help").stdout.split())
    for fragment in ("DIR/<name>.csv", "DIR/<name>.json", "DIR/<name>.md", "DIR/<name>.png", "--json",
                     "0 every point measured; 3 some points failed", "SIGINT 130, SIGTERM 143, SIGHUP 129"):
        assert fragment in text
    assert "record" in run_cli("--help").stdout


@pytest.mark.slow
def test_sigterm_stops_every_rank_and_the_metadata_says_the_record_stopped(tmp_path):
    folder = tmp_path / "rec"
    env = launcher.run_environment({**fault_env({HANG_ENV: 1}), "TMPDIR": str(tmp_path)})
    proc = subprocess.Popen([sys.executable, "-m", "megamoe_cli", "record", "--sweep", str(SMOKE), "--device", "cpu",
                             "--out-dir", str(folder)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        csv = folder / "cpu_smoke.csv"
        while not (csv.exists() and len(csv.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the first point never finished"
            time.sleep(0.1)
        (run_dir,) = tmp_path.glob("megamoe-bench-*")
        while len(launcher.worker_pids(run_dir)) < 2:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks never recorded their process ids"
            time.sleep(0.1)
        ranks = list(launcher.worker_pids(run_dir).values())
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 143, stderr
    assert stderr.strip().splitlines()[-1] == "error: interrupted by SIGTERM"
    deadline = time.monotonic() + 10
    while any(launcher._alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(launcher._alive(pid) for pid in ranks), "a rank outlived the command"
    meta = json.loads((folder / "cpu_smoke.json").read_text())
    assert meta["status"] == "stopped" and meta["points_measured"] == 1


def test_the_library_plans_the_default_sweep_from_this_tree():
    assert lib.DEFAULT_SWEEP == REPO / "sweeps" / "record.yaml" and lib.DEFAULT_SWEEP.is_file()

"""``megamoe ab`` on the CPU: arms, the rounds' order, medians and ratios, the child processes
(stand-in trees whose ``megamoe profile`` prints what a real one would), stop signals, and the
command line."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megamoe_cli.bench import ab as lib
from megamoe_cli.errors import MegaMoEError
from cli_checks import assert_one_line_error, interrupt, interruptible, run_cli


@pytest.fixture(autouse=True)
def logs_under_tmp_path(tmp_path, monkeypatch):
    """An A/B that fails keeps its logs (and names them): here, under the test's own folder."""
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))

REPO = Path(__file__).resolve().parents[1]


def profile_json(kernel_us, tokens=(64, 16384), labels=("auto",), failed=(), back_to_back=0):
    """What `megamoe profile --json` prints, reduced to what ab reads."""
    points = []
    for t in tokens:
        configs = []
        for label in labels:
            ok = (t, label) not in failed
            configs.append({"label": label, "status": "ok" if ok else "failed",
                            "kernel_us": kernel_us * t / 64 if ok else None,
                            "layer_us": kernel_us * t / 64 + 5 if ok else None,
                            "back_to_back_us": kernel_us * t / 64 - 5 if ok and back_to_back else None,
                            "used": {"block_m": 64 if t < 1000 else 128, "num_stages": 4, "num_sms": 0, "cluster_m": 1}})
        points.append({"num_tokens": t, "status": "ok", "configs": configs})
    return {"status": "ok", "back_to_back": back_to_back, "points": points}


class FakeArms:
    """Stands in for run_child: each arm's kernel time per round, in the order the arms ran."""

    def __init__(self, times, failed=None, stop_at=None):
        self.times = times  # arm name -> kernel us, one per round
        self.failed = failed or {}
        self.stop_at = stop_at
        self.order = []

    def __call__(self, arm, args, log_path, timeout_s):
        self.order.append(arm.name)
        round_index = sum(1 for name in self.order if name == arm.name) - 1
        log_path.write_text(f"{arm.name} round {round_index + 1}\n")
        if self.stop_at == (arm.name, round_index + 1):
            log_path.write_text("error: run stopped at point 0 of 2: rank 0 failed first\n")
            return lib.ArmRun(2, None, "error: run stopped at point 0 of 2: rank 0 failed first", 1.0)
        failed = self.failed.get(arm.name, ())
        data = profile_json(self.times[arm.name][round_index], failed=failed)
        return lib.ArmRun(3 if failed else 0, data, "", 2.0)


def arms(*names):
    return [lib.Arm(name, REPO) for name in names]


# ---------------------------------------------------------------------------- arms


def test_knobs_parse_into_one_arm_per_value():
    assert lib.parse_knob("MEGAMOE_TUNED_CONFIG=a.json, b.json,c.json") == ("MEGAMOE_TUNED_CONFIG",
                                                                           ["a.json", "b.json", "c.json"])
    made = lib.knob_arms("X=1,2", here=REPO)
    assert [(a.name, a.env, a.root) for a in made] == [("X=1", (("X", "1"),), REPO), ("X=2", (("X", "2"),), REPO)]
    for spec, message in (("X", "NAME=VALUE,VALUE"), ("1X=1,2", "NAME=VALUE,VALUE"), ("X=1", "at least two values"),
                          ("X=1,,2", "every value must be non-empty"), ("X=1,2,1", "value '1' is listed twice")):
        with pytest.raises(MegaMoEError, match=message):
            lib.parse_knob(spec)


def stand_in_tree(root, main_source="print('fake')\n"):
    (root / "megamoe_cli" / "cli").mkdir(parents=True)
    (root / "megamoe_cli" / "__init__.py").write_text("")
    (root / "megamoe_cli" / "cli" / "profile.py").write_text("")
    (root / "megamoe_cli" / "__main__.py").write_text(main_source)
    return root


def test_a_base_tree_must_be_another_megamoe_tree_with_profile(tmp_path):
    base = stand_in_tree(tmp_path / "base")
    made = lib.tree_arms(base, here=REPO)
    assert [(a.name, a.root) for a in made] == [("base", base.resolve()), ("new", REPO)]
    (tmp_path / "file").write_text("")
    (tmp_path / "old" / "megamoe_cli").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    for path, message in ((tmp_path / "none", "no such folder"), (tmp_path / "file", "not a folder"),
                          (tmp_path / "old", "found no megamoe_cli/cli/profile.py"),
                          (tmp_path / "other", "found no a megamoe_cli package"), (REPO, "is this tree")):
        with pytest.raises(MegaMoEError, match=message):
            lib.check_tree(path, here=REPO)


def test_several_base_trees_are_named_by_their_folders_the_first_the_reference(tmp_path):
    main, early = stand_in_tree(tmp_path / "main"), stand_in_tree(tmp_path / "early")
    made = lib.tree_arms([main, early], here=REPO)
    assert [(a.name, a.root) for a in made] == [("main", main.resolve()), ("early", early.resolve()), ("new", REPO)]
    assert all(a.drop_env == (lib.ENV_GIT_COMMIT,) for a in made[:2]) and made[2].drop_env == ()
    assert [a.name for a in lib.tree_arms([main], here=REPO)] == ["base", "new"]  # one base keeps its name
    clash = stand_in_tree(tmp_path / "other" / "main")
    named_new = stand_in_tree(tmp_path / "new")
    for paths, message in (([main, main], "is given twice"), ([main, clash], "folder name 'main' names .*main already"),
                           ([main, named_new], "folder name 'new' names this tree's arm"), ([], "at least one")):
        with pytest.raises(MegaMoEError, match=message):
            lib.tree_arms(paths, here=REPO)


def test_a_child_runs_its_arms_tree_first_on_the_path_with_its_environment(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("MEGAMOE_GIT_COMMIT", "abc123")
    base, new = lib.Arm("base", Path("/b"), drop_env=("MEGAMOE_GIT_COMMIT",)), lib.Arm("X=2", Path("/n"), (("X", "2"),))
    assert lib.child_environment(base)["PYTHONPATH"] == os.pathsep.join(["/b", "/elsewhere"])
    assert "MEGAMOE_GIT_COMMIT" not in lib.child_environment(base)  # the base tree's commit is its own
    assert lib.child_environment(new)["X"] == "2" and lib.child_environment(new)["MEGAMOE_GIT_COMMIT"] == "abc123"
    assert lib.child_command(["--tokens", "64"])[1:] == ["-m", "megamoe_cli", "profile", "--tokens", "64", "--json"]


# ---------------------------------------------------------------------------- rounds, medians, ratios


def test_rounds_take_turns_in_reversed_order_and_ratios_are_against_the_first_arm(tmp_path):
    fake = FakeArms({"base": [100.0, 110.0, 90.0], "new": [80.0, 90.0, 85.0]})
    lines = []
    result = lib.run_ab(arms("base", "new"), ["--tokens", "64,16384"], rounds=3, run_arm=fake,
                        progress=lines.append)
    assert result.ok and result.rounds_done == 3
    assert fake.order == ["base", "new", "new", "base", "base", "new"]
    kernel = next(c for c in result.comparisons if (c.num_tokens, c.config, c.measure) == (64, "auto", "kernel_us"))
    data = kernel.to_dict(result.arm_names)
    assert data["values"] == {"base": [100.0, 110.0, 90.0], "new": [80.0, 90.0, 85.0]}
    assert data["median"] == {"base": 100.0, "new": 85.0}
    assert data["time_ratio"] == {"base": 1.0, "new": 0.85}
    assert data["used"]["new"]["block_m"] == 64
    assert {(c.num_tokens, c.measure) for c in result.comparisons} == {
        (t, m) for t in (64, 16384) for m in ("kernel_us", "layer_us")}  # no back-to-back asked
    assert [r["round"] for r in result.runs] == [1, 1, 2, 2, 3, 3]
    assert result.log_dir is None  # a clean run leaves no logs behind
    assert lines[0].startswith("round 1/3: base (")


def test_three_arms_take_turns_and_each_is_measured_against_the_first():
    fake = FakeArms({"main": [100.0, 100.0], "early": [90.0, 92.0], "new": [70.0, 74.0]})
    result = lib.run_ab(arms("main", "early", "new"), ["--tokens", "64"], rounds=2, run_arm=fake)
    assert result.ok and fake.order == ["main", "early", "new", "new", "early", "main"]
    kernel = next(c for c in result.comparisons if c.measure == "kernel_us")
    assert kernel.to_dict(result.arm_names)["time_ratio"] == {"main": 1.0, "early": 0.91, "new": 0.72}


def test_a_config_that_failed_in_one_arm_leaves_its_value_missing_and_keeps_the_logs(tmp_path):
    fake = FakeArms({"X=1": [100.0, 100.0], "X=2": [50.0, 50.0]}, failed={"X=2": [(16384, "auto")]})
    result = lib.run_ab(arms("X=1", "X=2"), [], rounds=2, run_arm=fake)
    assert result.ok
    missing = result.incomplete
    assert {(c.num_tokens, c.measure) for c in missing} == {(16384, "kernel_us"), (16384, "layer_us")}
    assert missing[0].to_dict(result.arm_names)["values"]["X=2"] == [None, None]
    assert missing[0].to_dict(result.arm_names)["time_ratio"]["X=2"] is None
    assert result.log_dir is not None and sorted(p.name for p in result.log_dir.iterdir()) == [
        "round1_X=1.log", "round1_X=2.log", "round2_X=1.log", "round2_X=2.log"]
    assert "without a value in every round" in result.message


def test_an_arm_that_stops_ends_the_run_naming_it_and_its_round(tmp_path):
    fake = FakeArms({"base": [100.0, 100.0], "new": [90.0, 90.0]}, stop_at=("new", 2))
    result = lib.run_ab(arms("base", "new"), [], rounds=2, run_arm=fake, log_dir=tmp_path / "logs")
    assert not result.ok and result.rounds_done == 1
    assert result.message == ("arm new, round 2: megamoe profile stopped: error: run stopped at point 0 of 2: rank 0 "
                              f"failed first (logs in {tmp_path / 'logs'})")
    assert result.comparisons and result.log_dir == tmp_path / "logs"


def test_bad_runs_are_refused_before_any_child_starts():
    fake = FakeArms({})
    for given, message in (({"arms": arms("a")}, "at least two arms"), ({"arms": arms("a", "a")}, "must differ"),
                           ({"arms": arms("a", "b"), "rounds": 0}, "rounds must be an integer >= 1")):
        with pytest.raises(MegaMoEError, match=message):
            lib.run_ab(given["arms"], [], rounds=given.get("rounds", 1), run_arm=fake)
    assert fake.order == []


# ---------------------------------------------------------------------------- real children

CHILD = textwrap.dedent(
    """
    import json, os, signal, sys, time

    print("stand-in " + " ".join(sys.argv[1:]), file=sys.stderr, flush=True)
    mode = os.environ.get("STAND_IN_MODE", "ok")
    if mode == "hang":
        def stop(signum, frame):
            with open(os.environ["STAND_IN_STOPPED"], "w") as f:
                f.write(str(signum))
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, stop)
        with open(os.environ["STAND_IN_STARTED"], "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(0.05)
    if mode == "refuse":
        print("error: kernel config 128:9: num_stages=9", file=sys.stderr)
        sys.exit(2)
    us = float(os.environ.get("STAND_IN_US", "100"))
    json.dump({"status": "ok", "back_to_back": 0, "points": [{"num_tokens": 64, "configs": [
        {"label": "auto", "status": "ok", "kernel_us": us, "layer_us": us + 1, "used": {"block_m": 64}}]}]},
        sys.stdout)
    """
)


def test_children_run_in_their_trees_and_environments(tmp_path):
    root = stand_in_tree(tmp_path / "tree", CHILD)
    a = lib.Arm("STAND_IN_US=10", root, (("STAND_IN_US", "10"),))
    b = lib.Arm("STAND_IN_US=20", root, (("STAND_IN_US", "20"),))
    result = lib.run_ab([a, b], ["--tokens", "64"], rounds=2, log_dir=tmp_path / "logs")
    assert result.ok, result.message
    (kernel,) = [c for c in result.comparisons if c.measure == "kernel_us"]
    assert kernel.to_dict(result.arm_names)["time_ratio"]["STAND_IN_US=20"] == 2.0
    assert (tmp_path / "logs" / "round1_STAND_IN_US=10.log").read_text().strip() == \
        "stand-in profile --tokens 64 --json"

    refused = lib.run_ab([a, lib.Arm("refuses", root, (("STAND_IN_MODE", "refuse"),))], [], rounds=1)
    assert not refused.ok
    assert refused.message.startswith("arm refuses, round 1: megamoe profile stopped: error: kernel config 128:9: "
                                      "num_stages=9 (logs in ")
    assert refused.log_dir.is_dir()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_a_stop_signal_stops_the_running_arm_and_exits_with_128_plus_it(tmp_path, sig):
    base = stand_in_tree(tmp_path / "base", CHILD)
    started, stopped = tmp_path / "started", tmp_path / "stopped"
    code = ("import sys\nfrom megamoe_cli.cli import main, profile\n"
            "profile.require_hopper = lambda ranks, what: None\nmain(sys.argv[1:], prog_name='megamoe')\n")
    env = dict(os.environ, PYTHONPATH=str(REPO), STAND_IN_MODE="hang", STAND_IN_STARTED=str(started),
               STAND_IN_STOPPED=str(stopped))
    proc = subprocess.Popen([sys.executable, "-c", code, "ab", "--base", str(base), "--preset", "small",
                             "--tokens", "16", "--logs", str(tmp_path / "logs")],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=interruptible)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the first arm never started"
            time.sleep(0.05)
        child = int(started.read_text())
        interrupt(proc, sig, timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert stopped.read_text() == str(int(signal.SIGTERM))  # the arm was told to stop, and stopped
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


# ---------------------------------------------------------------------------- command line


def test_help_names_the_arms_the_rounds_and_the_exit_statuses():
    text = " ".join(run_cli("ab", "--help").stdout.split())
    for fragment in ("--base PATH", "--knob NAME=V1,V2[,...]", "--rounds", "--configs", "--json", "--logs",
                     "0 every arm measured every config in every round", "SIGINT 130, SIGTERM 143, SIGHUP 129"):
        assert fragment in text
    assert "ab" in run_cli("--help").stdout


@pytest.mark.parametrize(
    "args, fragments",
    [
        ([], ["give one of --base PATH", "--knob NAME=V1,V2"]),
        (["--base", ".", "--knob", "X=1,2"], ["give one of --base PATH"]),
        (["--base", "/no/such/tree"], ["base tree /no/such/tree: no such folder"]),
        (["--base", str(REPO)], ["is this tree"]),
        (["--base", "/no/such/tree", "--base", "/no/such/tree"], ["base tree /no/such/tree: no such folder"]),
        (["--knob", "X=1"], ["knob X: give at least two values to compare, got '1'"]),
        (["--knob", "X=1,2", "--rounds", "0"], ["'--rounds'", "0 is not in the range x>=1"]),
        (["--knob", "X=1,2", "--configs", "128:x"], ["block_m:num_stages[:num_sms[:cluster_m]]", "got '128:x'"]),
        (["--knob", "X=1,2", "--configs", "128:5"], ["kernel config 128:5 at fused deepseek-v3", "shared memory"]),
        (["--knob", "X=1,2", "--ranks", "3"], ["divisible by num_ranks=3"]),
    ],
)
def test_bad_input_is_one_line(args, fragments):
    assert_one_line_error(run_cli("ab", *args), *fragments)


def test_the_same_base_tree_twice_is_one_line(tmp_path):
    base = stand_in_tree(tmp_path / "main")
    assert_one_line_error(run_cli("ab", "--base", str(base), "--base", str(base)), f"base tree {base} is given twice")


def test_without_a_gpu_it_refuses_up_front(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert_one_line_error(run_cli("ab", "--knob", "X=1,2", "--preset", "small", "--tokens", "16"),
                          "megamoe ab times the fused kernel, which runs on Hopper GPUs (sm_90a) only; torch sees no "
                          "CUDA device")


@pytest.fixture
def simulated(monkeypatch):
    from megamoe_cli.cli import profile as profile_command

    monkeypatch.setattr(profile_command, "require_hopper", lambda ranks, what: None)
    real = lib.run_ab
    seen = []

    def install(fake):
        def run_ab(arms_, args, **kwargs):
            seen.append({"arms": arms_, "args": args, **kwargs})
            return real(arms_, args, run_arm=fake, **kwargs)

        monkeypatch.setattr(lib, "run_ab", run_ab)
        return seen

    return install


def test_json_holds_the_arms_the_rounds_and_every_comparison(simulated):
    seen = simulated(FakeArms({"X=1": [100.0, 100.0], "X=2": [80.0, 80.0]}))
    result = run_cli("ab", "--knob", "X=1,2", "--preset", "small", "--tokens", "64,16384", "--configs", "auto,64:4",
                     "--iters", "5", "--given", "--back-to-back", "20", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"status", "message", "arms", "reference", "rounds", "rounds_done", "runs", "log_dir",
                         "comparisons"}
    assert [a["name"] for a in data["arms"]] == ["X=1", "X=2"] and data["reference"] == "X=1"
    assert data["arms"][1]["env"] == {"X": "2"} and data["rounds"] == data["rounds_done"] == 2
    first = data["comparisons"][0]
    assert set(first) == {"num_tokens", "config", "measure", "values", "median", "time_ratio", "used"}
    assert first["time_ratio"]["X=2"] == pytest.approx(0.8)
    (call,) = seen
    assert call["args"] == ["--preset", "small", "--iters", "5", "--tokens", "64,16384", "--configs", "auto,64:4",
                            "--ranks", "1", "--given", "--back-to-back", "20"]
    assert call["rounds"] == 2
    assert "X=2 / X=1" in result.stderr and "0.800" in result.stderr


def test_missing_values_exit_3_and_a_stopped_arm_exits_2(simulated):
    simulated(FakeArms({"X=1": [100.0, 100.0], "X=2": [80.0, 80.0]}, failed={"X=2": [(64, "auto")]}))
    result = run_cli("ab", "--knob", "X=1,2", "--preset", "small")
    assert result.exit_code == 3, result.output
    assert "comparison(s) lack a value in some round; the logs in" in result.stderr.strip().splitlines()[-1]

    simulated(FakeArms({"X=1": [100.0, 100.0], "X=2": [80.0, 80.0]}, stop_at=("X=2", 1)))
    result = run_cli("ab", "--knob", "X=1,2", "--preset", "small")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: arm X=2, round 1: megamoe profile stopped: error: run stopped at point 0 of 2")

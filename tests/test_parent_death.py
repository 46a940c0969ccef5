"""Whatever ends `megamoe`, the processes of its run end with it, and the rows its ranks finished
are not lost: a launcher killed by a signal it cannot handle leaves them in its run folder, and the
next command that reads or writes that results file adds them and says where they came from."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from cli_checks import HANG_ENV, fault_env, processes_mentioning
from megamoe_cli.bench import launcher, rundir
from megamoe_cli.bench.launcher import recover_rows, worker_pids
from megamoe_cli.bench.results import read_results

REPO = Path(__file__).resolve().parents[1]

# A child that asks to die with its parent, then says so and waits: ``argv[1]`` is where it writes.
CHILD = textwrap.dedent("""
    import os, sys, time
    from megamoe_cli.bench.rundir import die_with_parent
    if sys.argv[2] == "leave":  # arm only once the parent is gone
        deadline = time.monotonic() + 30
        while os.getppid() == int(os.environ["MEGAMOE_PARENT_PID"]) and time.monotonic() < deadline:
            time.sleep(0.01)
    armed = die_with_parent()
    open(sys.argv[1], "w").write("armed" if armed else "unsupported")
    time.sleep(120)
""")
# A parent that starts CHILD, says its pid, and then waits for its own end or leaves at once.
PARENT = textwrap.dedent("""
    import os, subprocess, sys, time
    env = dict(os.environ, MEGAMOE_PARENT_PID=str(os.getpid()))
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], sys.argv[3]], env=env,
                             start_new_session=True)
    print(child.pid, flush=True)
    if sys.argv[3] == "wait":
        time.sleep(120)
""")


def wait_until(condition, wait_s, what):
    deadline = time.monotonic() + wait_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def gone(pid):
    return not launcher._alive(pid)


@pytest.fixture
def started(tmp_path):
    procs = []

    def start(mode):
        marker = tmp_path / f"child-{mode}"
        parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(marker), mode], stdout=subprocess.PIPE,
                                  text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
        procs.append(parent)
        child = int(parent.stdout.readline())
        procs.append(child)
        return parent, child, marker

    yield start
    for proc in procs:
        pid = proc if isinstance(proc, int) else proc.pid
        if launcher._alive(pid):
            os.kill(pid, signal.SIGKILL)
        if not isinstance(proc, int):
            proc.wait()


def test_a_child_dies_with_its_parent_killed_by_sigkill(started):
    parent, child, marker = started("wait")
    wait_until(marker.exists, 30, "the child never armed the parent-death signal")
    assert marker.read_text() == "armed" and launcher._alive(child)
    parent.kill()
    parent.wait()
    wait_until(lambda: gone(child), 10, "the child outlived its parent")


def test_a_child_whose_parent_died_before_it_asked_ends_at_once(started):
    """The race the pid check closes: the parent is gone before the child asks the kernel."""
    parent, child, marker = started("leave")
    parent.wait()
    wait_until(lambda: gone(child), 60, "a child that lost its parent before arming went on running")
    assert not marker.exists()


# A parent that starts a plain sleeping child the way `megamoe ab` starts its arms (the child's
# own code asks for nothing), says its pid, and waits.
PREEXEC_PARENT = textwrap.dedent("""
    import signal, subprocess, sys, time
    from megamoe_cli.bench.rundir import die_with_this_process
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                             preexec_fn=die_with_this_process(signal.SIGTERM))
    print(child.pid, flush=True)
    time.sleep(120)
""")


def test_a_child_that_asks_nothing_dies_with_the_process_that_started_it(tmp_path):
    """megamoe ab's arms run other trees' code: the signal is asked for between fork and exec."""
    parent = subprocess.Popen([sys.executable, "-c", PREEXEC_PARENT], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, start_new_session=True)
    child = int(parent.stdout.readline())
    try:
        assert launcher._alive(child)
        parent.kill()
        parent.wait()
        wait_until(lambda: gone(child), 10, "the child outlived the process that started it")
    finally:
        if launcher._alive(child):
            os.kill(child, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def run_dir_of(tmp_path):
    found = list(tmp_path.glob("megamoe-bench-*"))
    return found[0] if len(found) == 1 else None


def rows_in(run_dir):
    try:
        return len((run_dir / rundir.ROWS_FILE).read_text().splitlines())
    except OSError:
        return 0


@pytest.fixture
def bench_run(tmp_path):
    """`megamoe bench` on two CPU ranks over three points, the third of which hangs on the last
    rank; returns (process, run folder, results file) once the ranks have started, the launcher
    stopped (SIGSTOP) so that it saves nothing the ranks finish from then on."""
    out = tmp_path / "r.csv"
    env = launcher.run_environment({**fault_env({HANG_ENV: 2}), "TMPDIR": str(tmp_path)})
    proc = subprocess.Popen(
        [sys.executable, "-m", "megamoe_cli", "bench", "--device", "cpu", "--preset", "small", "--tokens", "4,8,16",
         "--backend", "reference", "--warmup", "0", "--iters", "1", "--point-timeout", "120", "--out", str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        wait_until(lambda: run_dir_of(tmp_path) is not None and len(worker_pids(run_dir_of(tmp_path))) == 2, 120,
                   "the ranks never started")
        proc.send_signal(signal.SIGSTOP)
        run_dir = run_dir_of(tmp_path)
        wait_until(lambda: rows_in(run_dir) == 2, 120, "the ranks never finished two points")
        yield proc, run_dir, out
    finally:
        for pid in processes_mentioning(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGUSR1], ids=lambda s: s.name)
@pytest.mark.slow
def test_a_launcher_killed_outright_takes_its_run_along_and_the_next_command_saves_its_rows(bench_run, sig):
    """SIGKILL (the OOM killer, `timeout -s KILL`) and a signal the command does not handle end
    the `megamoe` process with no chance to clean up: torchrun and the ranks must end too, and
    the rows the ranks finished, which it never appended, reach --out the next time it is read."""
    proc, run_dir, out = bench_run
    run = processes_mentioning(str(run_dir))
    ranks = set(worker_pids(run_dir).values())
    assert ranks < set(run) and len(run) == 3, "expected torchrun and two ranks"
    assert not out.exists() or read_results(out).empty

    proc.send_signal(sig)
    proc.send_signal(signal.SIGCONT)
    proc.wait(timeout=30)
    assert proc.returncode == -sig
    wait_until(lambda: not any(launcher._alive(pid) for pid in run), 30, "a process of the run outlived `megamoe`")

    result = subprocess.run([sys.executable, "-m", "megamoe_cli", "report", str(out)], capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(run_dir.parent)}, timeout=120)
    assert result.returncode == 0, result.stderr
    run_id = json.loads((run_dir / rundir.LAUNCHER_FILE).read_text())["run_id"]
    assert (f"recovered 2 row(s) of run {run_id} into {out}: its megamoe process (pid {proc.pid}) ended before "
            f"saving them (run files kept in {run_dir})") in " ".join(result.stderr.split())
    frame = read_results(out)
    assert list(frame["num_tokens"]) == [4, 8] and list(frame["status"]) == ["ok", "ok"]
    assert set(frame["run_id"]) == {run_id}
    # Recovered once: a later command adds nothing.
    assert recover_rows(out, run_dir.parent) == []
    assert len(read_results(out)) == 2


@pytest.mark.slow
def test_ranks_die_with_torchrun_killed_outright(bench_run):
    """The ranks' own parent-death signal: torchrun killed by SIGKILL cannot stop them, and the
    launcher, stopped here, does not either; on its return it reports the run as failed."""
    proc, run_dir, out = bench_run
    ranks = list(worker_pids(run_dir).values())
    (torchrun,) = set(processes_mentioning(str(run_dir))) - set(ranks)
    os.kill(torchrun, signal.SIGKILL)
    wait_until(lambda: not any(launcher._alive(pid) for pid in ranks), 30, "a rank outlived torchrun")
    proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 2, stderr
    assert "run stopped at point 2 of 3" in stderr
    assert list(read_results(out)["num_tokens"]) == [4, 8, 16]
    assert list(read_results(out)["status"]) == ["ok", "ok", "failed"]


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid, None


def _folder(root, name, run_id, out, rows, pid, start, done=False):
    from megamoe_cli.bench.results import row_to_json

    folder = root / f"megamoe-bench-{name}"
    folder.mkdir()
    (folder / rundir.LAUNCHER_FILE).write_text(json.dumps(
        {"pid": pid, "start": start, "run_id": run_id, "out": str(out.resolve()), "done": done}))
    (folder / rundir.ROWS_FILE).write_text("".join(row_to_json(r) + "\n" for r in rows))
    return folder


def test_recovery_appends_only_what_a_dead_launcher_did_not_save(tmp_path):
    from megamoe_cli.bench.results import append_rows, make_row
    from megamoe_cli.bench.sweep import sweep_from_flags

    points = sweep_from_flags(num_tokens=[1, 2, 4], backends=["torch"], preset="small").points

    def rows(run_id):
        return [make_row(p, run_id=run_id, world_size=2, device="cpu", env={}, status="ok") for p in points]

    out, other = tmp_path / "r.csv", tmp_path / "other.csv"
    append_rows(out, rows("dead")[:1])  # the launcher saved the first row, then was killed
    dead, _ = _dead_pid()
    me = os.getpid()
    killed = _folder(tmp_path, "killed", "dead", out, rows("dead"), dead, None)
    _folder(tmp_path, "running", "alive", out, rows("alive"), me, rundir.process_start_time(me))
    _folder(tmp_path, "finished", "done", out, rows("done"), dead, None, done=True)
    _folder(tmp_path, "elsewhere", "other", other, rows("other"), dead, None)

    (message,) = recover_rows(out, tmp_path)
    assert message == (f"recovered 2 row(s) of run dead into {out}: its megamoe process (pid {dead}) ended before "
                       f"saving them (run files kept in {killed})")
    frame = read_results(out)
    assert list(frame["run_id"]) == ["dead"] * 3 and list(frame["num_tokens"]) == [1, 2, 4]
    assert recover_rows(out, tmp_path) == []  # once
    assert not other.exists()  # each run's rows go to its own file only
    # A launcher whose pid now names another process (a reused pid) is dead too.
    reused = _folder(tmp_path, "reused", "reused", out, rows("reused"), me, -1)
    (message,) = recover_rows(out, tmp_path)
    assert message.startswith("recovered 3 row(s) of run reused") and str(reused) in message

"""What the CLI tests share: running the click entry point in-process, the check that a bad
input ends in one `error: ...` line (exit status 2 unless said otherwise) with nothing on stdout,
the environment that makes a run's last worker rank fail at a point (tests/fault_hooks), and the
stop of a CLI process by a signal with the processes its run started."""

import os
import signal
from pathlib import Path

from click.testing import CliRunner
from fault_hooks.sitecustomize import CRASH_ENV, FAIL_ENV, HANG_ENV

__all__ = ["CRASH_ENV", "FAIL_ENV", "HANG_ENV", "assert_one_line_error", "fault_env", "interrupt", "processes_mentioning",
           "run_cli"]

from megamoe_cli.cli import main


def run_cli(*args, **kwargs):
    return CliRunner().invoke(main, list(args), **kwargs)


def assert_one_line_error(result, *fragments, code=2):
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "Traceback" not in result.output
    assert result.stdout == ""
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


FAULT_HOOKS = Path(__file__).resolve().parent / "fault_hooks"


def fault_env(hooks):
    """``{hook variable: point index}`` -> the environment entries for a run whose workers take the
    hooks: the variables, and PYTHONPATH led by tests/fault_hooks (its sitecustomize installs them)."""
    path = [str(FAULT_HOOKS)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**{name: str(index) for name, index in hooks.items()}, "PYTHONPATH": os.pathsep.join(path)}


def processes_mentioning(text):
    """PIDs of the live processes whose command line holds ``text`` (torchrun and the ranks name the
    run folder on theirs), this test's own process aside."""
    from megamoe_cli.bench import launcher

    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmdline = f.read()
            except OSError:
                continue
            if text.encode() in cmdline and launcher._alive(int(entry)):
                found.append(int(entry))
    return found


def interruptible():
    """preexec_fn: SIGINT and SIGHUP back to their defaults in the child.  A test run started in
    the background by a non-interactive shell (`cmd &`) inherits SIGINT ignored, and one under
    `nohup` SIGHUP; the CLI leaves an ignored signal ignored (as a command run under nohup should),
    so a signal sent by the test would be lost and the child never stop."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def interrupt(proc, sig, timeout):
    """Send ``sig`` to a CLI process started in a session of its own (``preexec_fn=interruptible``,
    so that it can receive the signal however the test run was started): it must exit with 128 + the
    signal within ``timeout`` seconds, its last stderr line ``error: interrupted by <SIG>``.  Its
    process group is killed if it is still there; returns its stderr."""
    try:
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + sig, stderr
    assert stderr.strip().splitlines()[-1] == f"error: interrupted by {sig.name}"
    return stderr

"""What the CLI tests share: running the click entry point in-process, the check that a bad
input ends in one `error: ...` line (exit status 2 unless said otherwise) with nothing on stdout,
and the environment that makes a run's last worker rank fail at a point (tests/fault_hooks)."""

import os
from pathlib import Path

from click.testing import CliRunner
from fault_hooks.sitecustomize import CRASH_ENV, FAIL_ENV, HANG_ENV

__all__ = ["CRASH_ENV", "FAIL_ENV", "HANG_ENV", "assert_one_line_error", "fault_env", "run_cli"]

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

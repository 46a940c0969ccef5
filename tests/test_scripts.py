"""The shell scripts under scripts/: they parse, and refuse bad use with a usage line before
touching a GPU."""

import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_every_shell_script_parses(script):
    done = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize(
    "command, usage",
    [
        (["gpu_tests.sh", "fastest"], "usage: scripts/gpu_tests.sh [quick|full] [pytest arguments]"),
        (["gpu_power.sh"], "usage: scripts/gpu_power.sh [-i GPU] -- COMMAND..."),
        (["baseline_gpu.sh", "everything", "{tmp}"], "usage: scripts/baseline_gpu.sh [all|tests|bench] [OUTDIR]"),
    ],
)
def test_bad_use_is_one_usage_line_and_exit_2(tmp_path, command, usage):
    argv = [str(SCRIPTS / command[0])] + [a.format(tmp=tmp_path) for a in command[1:]]
    done = subprocess.run(["bash", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines()[-1] == usage

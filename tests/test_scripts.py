"""The shell scripts under scripts/: they parse, and refuse bad use with a usage line before
touching a GPU."""

import shutil
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
        (["kernel_mutants.sh", "--everything"], "usage: scripts/kernel_mutants.sh [--build] [NAME...]"),
        (["kernel_mutants.sh", "no_such_mutant"],
         "scripts/kernel_mutants.sh: no mutant no_such_mutant (expected tests/gpu/mutants/no_such_mutant.patch)"),
    ],
)
def test_bad_use_is_one_usage_line_and_exit_2(tmp_path, command, usage):
    argv = [str(SCRIPTS / command[0])] + [a.format(tmp=tmp_path) for a in command[1:]]
    done = subprocess.run(["bash", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stderr.strip().splitlines()[-1] == usage


MUTANTS = sorted((SCRIPTS.parent / "tests" / "gpu" / "mutants").glob("*.patch"))


def test_there_are_kernel_mutants():
    assert len(MUTANTS) >= 5, MUTANTS


@pytest.mark.parametrize("patch", MUTANTS, ids=lambda p: p.stem)
def test_kernel_mutant_applies_and_names_its_tests(tmp_path, patch):
    """Each planted bug still applies to csrc/ as it is (scripts/kernel_mutants.sh copies the tree
    and applies it), changes csrc/ only, and names the GPU tests that must catch it and the
    variants they launch."""
    text = patch.read_text()
    fields = {}
    for line in text.splitlines():
        if line.startswith("diff --git"):
            break
        key, _, value = line.removeprefix("# ").partition(": ")
        fields.setdefault(key, []).append(value)
    assert set(fields) <= {"bug", "tests", "ranks", "build"}, fields
    assert fields.get("bug") and len(fields.get("tests", [])) == 1 and fields.get("build"), fields
    assert fields["tests"][0].startswith(("quick tests/gpu/", "full tests/gpu/")), fields["tests"]
    touched = [line.split()[-1] for line in text.splitlines() if line.startswith("+++ ")]
    assert touched and all(t.startswith("b/csrc/") for t in touched), touched
    shutil.copytree(SCRIPTS.parent / "csrc", tmp_path / "csrc")
    done = subprocess.run(["git", "apply", str(patch)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    changed = subprocess.run(["diff", "-r", str(SCRIPTS.parent / "csrc"), str(tmp_path / "csrc")],
                             capture_output=True, text=True, timeout=60)
    assert changed.returncode == 1 and changed.stdout, "the patch changed nothing"

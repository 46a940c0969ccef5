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


README = SCRIPTS.parent / "tests" / "gpu" / "mutants" / "README.md"
# The parts of the kernel a planted bug must exist for (README.md's part column)
KERNEL_PARTS = {"fp8-mainloop", "dispatch", "combine-push", "combine-reduce", "barrier-reset", "scheduler",
                "l1-l2-ready", "mxfp4"}


def readme_rows():
    rows = {}
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 3 and cells[0] not in ("mutant", "---"):
            rows[cells[0]] = cells[1]
    return rows


def test_the_mutant_list_names_every_patch_and_every_part_has_one():
    rows = readme_rows()
    assert sorted(rows) == sorted(p.stem for p in MUTANTS), "tests/gpu/mutants/README.md and the patches disagree"
    assert set(rows.values()) == KERNEL_PARTS, set(rows.values()) ^ KERNEL_PARTS


def test_mutant_run_prints_the_table_of_failed_tests(tmp_path):
    """kernel_mutants.sh against a stand-in gpu_tests.sh: a mutant whose tests fail lists them by
    world size, one whose tests pass is SURVIVED and makes the exit status 1."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    (root / "tests" / "gpu" / "mutants").mkdir(parents=True)
    (root / "megamoe_cli").mkdir()
    (root / "csrc").mkdir()
    (root / "csrc" / "k.cuh").write_text("int a = 1;\n")
    shutil.copy(SCRIPTS / "kernel_mutants.sh", root / "scripts")
    (root / "scripts" / "gpu_tests.sh").write_text(
        "#!/usr/bin/env bash\n"
        "echo '=== world size 1'\n"
        "if grep -q 'a = 2' csrc/k.cuh; then\n"
        "  echo 'FAILED tests/gpu/test_fused.py::test_x[small-1] - AssertionError: far - off'\n"
        "  echo '1 failed, 2 passed'; echo '=== world size 1: exit status 1'\n"
        "  echo \"=== world size 2 on 1 GPU(s)\"\n"
        "  echo 'FAILED tests/gpu/test_fused.py::test_y - RuntimeError'; echo '1 failed'; exit 1\n"
        "fi\n"
        "echo '3 passed'; echo '=== world size 1: exit status 0'\n")
    diff = "diff --git a/csrc/k.cuh b/csrc/k.cuh\n--- a/csrc/k.cuh\n+++ b/csrc/k.cuh\n@@ -1 +1 @@\n-int a = 1;\n+int a = {}; \n"
    for name, value in (("caught", 2), ("missed", 3)):
        (root / "tests" / "gpu" / "mutants" / f"{name}.patch").write_text(
            f"# bug: a is {value}\n# tests: quick tests/gpu\n# build: --preset small\n" + diff.format(value))
    done = subprocess.run(["bash", str(root / "scripts" / "kernel_mutants.sh")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, (done.stdout, done.stderr)
    table = done.stdout[done.stdout.index("=== mutant -> tests that failed"):].splitlines()[1:]
    assert [line.split() for line in table] == [
        ["caught", "ws1:test_x[small-1]", "ws2:test_y"],
        ["missed", "SURVIVED"],
    ], done.stdout

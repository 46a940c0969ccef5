"""Test tiers: `pytest -m "not slow"` is the fast tier, plain `pytest` (what .ci/run runs) is everything.

The fast tier must still reach every module, so each CPU test file keeps at least one test that is
not marked slow, unless it is listed below as slow by nature.  Marks are read from the source, not
from a collection run: collecting the suite imports torch and every test module, which would cost
the fast tier the seconds it exists to save."""

import ast
import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"

# Files whose every test is inherently slow (each one starts torchrun ranks or nvcc builds, and a
# smaller input would not test the same thing), so the whole file may be marked slow: file name ->
# why.  None is today: even test_parent_death.py and test_bench_torchrun.py have in-process tests.
ALL_SLOW_ALLOWED: dict[str, str] = {}


def _is_slow_mark(node: ast.expr) -> bool:
    """`pytest.mark.slow`, also when called or given in a list (`pytestmark = [..]`)."""
    if isinstance(node, (ast.List, ast.Tuple)):
        return any(_is_slow_mark(element) for element in node.elts)
    if isinstance(node, ast.Call):
        node = node.func
    return (isinstance(node, ast.Attribute) and node.attr == "slow"
            and isinstance(node.value, ast.Attribute) and node.value.attr == "mark")


def _param_is_slow(node: ast.expr) -> bool:
    """A `pytest.param(..., marks=...slow...)` entry of a parametrize list."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "param"
            and any(k.arg == "marks" and _is_slow_mark(k.value) for k in node.keywords))


def _every_case_is_slow(decorator: ast.expr) -> bool:
    """A parametrize whose written-out list has only slow `pytest.param` entries: no fast case is left."""
    if not (isinstance(decorator, ast.Call) and isinstance(decorator.func, ast.Attribute)
            and decorator.func.attr == "parametrize" and len(decorator.args) >= 2):
        return False
    cases = decorator.args[1]
    return isinstance(cases, (ast.List, ast.Tuple)) and bool(cases.elts) and all(map(_param_is_slow, cases.elts))


def fast_tests(source: str) -> list[str]:
    """Names of the test functions in a test file's source that `-m "not slow"` still runs."""
    tree = ast.parse(source)
    for statement in tree.body:
        if (isinstance(statement, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                     for t in statement.targets)
                and _is_slow_mark(statement.value)):
            return []
    functions = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            if any(_is_slow_mark(d) for d in node.decorator_list):
                continue
            functions += [f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return [f.name for f in functions
            if f.name.startswith("test") and not any(_is_slow_mark(d) or _every_case_is_slow(d)
                                                     for d in f.decorator_list)]


def cpu_test_files() -> list[Path]:
    return sorted(path for path in TESTS.rglob("test_*.py") if "gpu" not in path.relative_to(TESTS).parts)


def test_the_slow_marker_is_registered_with_a_description():
    ini = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    described = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
                 for line in ini["markers"] if ":" in line}
    assert described.get("slow"), f"pyproject.toml's pytest markers do not describe 'slow': {ini['markers']}"
    assert "--strict-markers" in ini["addopts"], "without --strict-markers a misspelt slow mark selects nothing"
    assert not re.search(r"(^|\s)-m(\s|$)", ini["addopts"]), "addopts must not deselect tests: .ci/run runs all"


def test_ci_runs_the_full_tier():
    ci = (REPO / ".ci" / "run").read_text()
    runs = [line.strip() for line in ci.splitlines() if "-m pytest" in line and not line.lstrip().startswith("#")]
    assert runs, ".ci/run runs no pytest"
    assert all("slow" not in line and not re.search(r"\s-m\s", line.split("-m pytest", 1)[1]) for line in runs), runs


def test_every_cpu_test_file_keeps_a_fast_test():
    files = cpu_test_files()
    assert len(files) > 40, f"found only {len(files)} test files under {TESTS}"
    without = [str(path.relative_to(REPO)) for path in files
               if not fast_tests(path.read_text()) and path.name not in ALL_SLOW_ALLOWED]
    assert not without, (f"{', '.join(without)}: every test is marked slow, so `pytest -m 'not slow'` skips "
                         "the file; keep a fast test or list it, with the reason, in ALL_SLOW_ALLOWED")


def test_every_allowed_all_slow_file_exists_and_is_all_slow():
    names = {path.name: path for path in cpu_test_files()}
    for name in ALL_SLOW_ALLOWED:
        assert name in names, f"ALL_SLOW_ALLOWED names {name}, which is not a CPU test file"
        assert not fast_tests(names[name].read_text()), f"{name} has fast tests: drop it from ALL_SLOW_ALLOWED"


@pytest.mark.parametrize("source, expected", [
    ("def test_a(): pass\n@pytest.mark.slow\ndef test_b(): pass\ndef helper(): pass\n", ["test_a"]),
    ("@pytest.mark.slow\ndef test_a(): pass\n@pytest.mark.parametrize('x', [1])\n@pytest.mark.slow\n"
     "def test_b(x): pass\n", []),
    ("import pytest\npytestmark = pytest.mark.slow\ndef test_a(): pass\n", []),
    ("pytestmark = [pytest.mark.gpu, pytest.mark.slow]\ndef test_a(): pass\n", []),
    ("pytestmark = pytest.mark.gpu\ndef test_a(): pass\n", ["test_a"]),
    ("@pytest.mark.parametrize('x', [pytest.param(1, marks=pytest.mark.slow)])\ndef test_a(x): pass\n", []),
    ("@pytest.mark.parametrize('x', [1, pytest.param(2, marks=pytest.mark.slow)])\ndef test_a(x): pass\n",
     ["test_a"]),
    ("@pytest.mark.skipif(True, reason='x')\ndef test_a(): pass\n", ["test_a"]),
    ("@pytest.mark.slow\nclass TestA:\n    def test_a(self): pass\nclass TestB:\n    def test_b(self): pass\n",
     ["test_b"]),
], ids=["one-slow-decorator", "every-test-slow", "pytestmark", "pytestmark-list", "other-pytestmark",
        "every-case-slow", "one-case-fast", "other-mark", "slow-class"])
def test_fast_tests_reads_the_slow_marks(source, expected):
    assert fast_tests(source) == expected

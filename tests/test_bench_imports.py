"""The import graph of ``megamoe_cli.bench``, read from the source: no cycles among its modules, no
module reaching into a sibling's private names, and each module's docstring naming the siblings
it imports."""

import ast
from pathlib import Path

import pytest
from graph_checks import find_cycle

PACKAGE = Path(__file__).resolve().parents[1] / "megamoe_cli" / "bench"
PREFIX = "megamoe_cli.bench"
MODULES = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")


def _sibling(module, level):
    """The sibling a ``from X import`` names (None when X is outside the package)."""
    if level == 1:
        return module.split(".")[0] if module else None
    if level == 0 and module and module.startswith(PREFIX + "."):
        return module[len(PREFIX) + 1:].split(".")[0]
    return None


class _Imports(ast.NodeVisitor):
    """Every sibling import of one module: (sibling, module level?, names taken, line)."""

    def __init__(self):
        self.found = []
        self.aliases = {}  # local name -> sibling module bound to it
        self.depth = 0

    def _nested(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _nested

    def visit_ImportFrom(self, node):
        target = _sibling(node.module, node.level)
        if target is not None:
            self.found.append((target, self.depth == 0, [a.name for a in node.names], node.lineno))
            return
        if node.level == 1 and not node.module or node.level == 0 and node.module == PREFIX:
            for alias in node.names:  # from . import results
                if alias.name in MODULES:
                    self.found.append((alias.name, self.depth == 0, [], node.lineno))
                    self.aliases[alias.asname or alias.name] = alias.name

    def visit_Import(self, node):
        for alias in node.names:
            target = _sibling(alias.name, 0)
            if target is not None:
                self.found.append((target, self.depth == 0, [], node.lineno))


def _scan(source):
    """(sibling imports, private attributes read from sibling modules, docstring) of one module."""
    tree = ast.parse(source)
    visitor = _Imports()
    visitor.visit(tree)
    private_attributes = [
        (visitor.aliases[node.value.id], node.attr, node.lineno)
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
        and node.value.id in visitor.aliases and node.attr.startswith("_") and not node.attr.startswith("__")
    ]
    return visitor.found, private_attributes, ast.get_docstring(tree) or ""


GRAPH = {name: _scan((PACKAGE / f"{name}.py").read_text()) for name in MODULES}


def _edges(module_level_only):
    return {name: sorted({target for target, top, _, _ in found if top or not module_level_only} - {name})
            for name, (found, _, _) in GRAPH.items()}


def test_the_reader_sees_the_imports_it_must():
    # A check that finds nothing proves nothing: the graph holds the imports known to be there.
    edges = _edges(module_level_only=False)
    assert "session" in edges["worker"] and "rundir" in edges["worker"]
    assert "launcher" in edges["tune"] and "session" in edges["tune"]
    assert "results" in _edges(module_level_only=True)["launcher"]
    assert "tune" not in _edges(module_level_only=True)["worker"]  # the worker takes it inside a function
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": []}) is None


def test_no_cycle_among_the_bench_modules_at_module_level():
    assert find_cycle(_edges(module_level_only=True)) is None


def test_no_cycle_among_the_bench_modules_counting_imports_inside_functions():
    # A cycle closed by an import inside a function still ties the modules into one: neither can
    # change or be tested without the other.
    assert find_cycle(_edges(module_level_only=False)) is None


def test_the_launcher_and_the_worker_meet_only_through_the_run_folder():
    edges = _edges(module_level_only=False)
    assert "worker" not in edges["launcher"] and "launcher" not in edges["worker"]


def test_no_bench_module_takes_a_private_name_from_a_sibling():
    taken = []
    for name, (found, attributes, _) in GRAPH.items():
        taken += [f"{name}.py:{line}: {target}.{n}" for target, _, names, line in found for n in names
                  if n.startswith("_")]
        taken += [f"{name}.py:{line}: {target}.{attr}" for target, attr, line in attributes]
    assert taken == []


def test_the_private_name_check_catches_both_spellings():
    source = ('"""Doc."""\nfrom .sweep import _Hidden\nfrom megamoe_cli.bench import results as r\n\n'
              'def f():\n    from .launcher import run_bench\n    return r._load, r.__name__\n')
    found, attributes, doc = _scan(source)
    assert [(t, top, names) for t, top, names, _ in found] == [("sweep", True, ["_Hidden"]), ("results", True, []),
                                                              ("launcher", False, ["run_bench"])]
    assert attributes == [("results", "_load", 7)]
    assert doc == "Doc."


@pytest.mark.parametrize("name", MODULES)
def test_each_module_docstring_names_the_siblings_it_imports(name):
    found, _, doc = GRAPH[name]
    assert "Imports:" in doc, f"{name}.py: its docstring has no 'Imports:' paragraph"
    paragraph = doc[doc.index("Imports:"):].split("\n\n")[0]
    missing = sorted({target for target, _, _, _ in found} - {name}
                     - {t for t in MODULES if f"``{t}``" in paragraph})
    assert missing == [], f"{name}.py imports {missing} without naming them in its 'Imports:' paragraph"

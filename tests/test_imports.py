"""The import graph of the whole ``megamoe_cli`` package, read from the source with ``ast``: no
circle among its modules.

An edge is an import that runs when the module is imported, or that a type checker reads: every
import outside a function body, including those under ``if TYPE_CHECKING:`` (a circle of
annotations still means neither module can be read or changed alone).  Imports inside functions
are left out: they are how a command keeps its heavy modules off ``--help``'s path.  ``from . import
x`` and ``from .x import y`` both lead to the module ``x``; importing a module first runs the
``__init__`` of every package above it, so those packages are edges too (except the importer's
own packages, which are already running: ``from . import x`` inside a package leads to ``x`` alone)."""

import ast
from pathlib import Path

from graph_checks import find_cycle

ROOT = Path(__file__).resolve().parents[1] / "megamoe_cli"


def modules_of(root):
    """{dotted module name: path} of every ``.py`` under ``root`` (a package directory)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _top_level_imports(tree):
    """Import statements that are not inside a function or lambda body."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        pending.extend(ast.iter_child_nodes(node))


def _ancestors(name):
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph(root):
    """{module: sorted modules of the package it imports outside functions} for the package at ``root``."""
    modules = modules_of(root)
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        targets = set()
        for node in _top_level_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
                continue
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets.add(source)
            targets |= {f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in modules}
        for target in list(targets):
            targets |= _ancestors(target)
        graph[name] = sorted(t for t in targets - _ancestors(name) - {name} if t in modules)
    return graph


def cycle_message(graph):
    """None, or one circle as ``a -> b -> a``."""
    cycle = find_cycle(graph)
    return None if cycle is None else "import circle: " + " -> ".join(cycle)


def _package(tmp_path, files):
    root = tmp_path / "pkg"
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)
    return root


def test_the_checker_reports_a_planted_circle(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "",
        "sub/__init__.py": "from .buffer import Buffer\n",
        "sub/buffer.py": "from .inputs import copy\nclass Buffer: ...\n",
        "sub/inputs.py": "from . import launch\ndef copy(): ...\n",
        "sub/launch.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .buffer import Buffer\n",
        "other.py": "def f():\n    from .sub import buffer\n",
    })
    graph = import_graph(root)
    assert graph["pkg.sub.inputs"] == ["pkg.sub.launch"]
    assert graph["pkg.other"] == []  # an import inside a function is no edge
    assert cycle_message(graph) == "import circle: pkg.sub.buffer -> pkg.sub.inputs -> pkg.sub.launch -> pkg.sub.buffer"


def test_the_checker_counts_the_package_a_submodule_import_runs(tmp_path):
    # problem imports ref.quant, so ref/__init__ runs first; if that imports ref.layer, which
    # imports problem, the three form a circle although no two files name each other.
    root = _package(tmp_path, {
        "__init__.py": "",
        "problem.py": "from .ref.quant import BLOCK\n",
        "ref/__init__.py": "from .layer import reference\n",
        "ref/quant.py": "BLOCK = 128\n",
        "ref/layer.py": "from ..problem import Problem\n",
    })
    assert cycle_message(import_graph(root)) == "import circle: pkg.problem -> pkg.ref -> pkg.ref.layer -> pkg.problem"
    (root / "ref" / "__init__.py").write_text('"""Nothing imported on entry."""\n')
    assert cycle_message(import_graph(root)) is None


def test_the_graph_holds_the_imports_known_to_be_there():
    graph = import_graph(ROOT)
    assert len(graph) > 60
    assert "megamoe_cli.kernel.contract" in graph["megamoe_cli.kernel.kernel_source"]
    assert "megamoe_cli.fused.buffer" in graph["megamoe_cli.fused.launch"]
    assert "megamoe_cli.reference.quant" in graph["megamoe_cli.problem"]
    assert "megamoe_cli.reference" in graph["megamoe_cli.problem"]


def test_no_import_circle_in_the_package():
    assert cycle_message(import_graph(ROOT)) is None

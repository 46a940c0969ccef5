"""Code that runs only on a GPU, checked where it cannot run: every global name a function uses is
defined.  Without a GPU the GPU tier's tests are skipped, and the device scripts and the library's
GPU paths are not run, so a name lost in an edit would surface only as a NameError on the device."""

import builtins
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted((ROOT / "tests" / "gpu").glob("*.py")) + sorted((ROOT / "scripts").glob("*.py")) + sorted(
    (ROOT / "megamoe_cli").rglob("*.py"))


def _module_names(table: symtable.SymbolTable) -> set:
    return {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}


def _undefined(table: symtable.SymbolTable, defined: set, where: str):
    for sym in table.get_symbols():
        if sym.is_referenced() and sym.is_global() and not sym.is_assigned():
            name = sym.get_name()
            if name not in defined and not hasattr(builtins, name):
                yield f"{where}: {name}"
    for child in table.get_children():
        yield from _undefined(child, defined, f"{where}.{child.get_name()}")


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_global_name_is_defined(path):
    top = symtable.symtable(path.read_text(), str(path), "exec")
    defined = _module_names(top) | {"__file__", "__name__"}
    missing = [m for child in top.get_children() for m in _undefined(child, defined, child.get_name())]
    assert not missing, f"{path.name} uses names it never defines: {missing}"


def test_the_check_finds_a_missing_name(tmp_path):
    top = symtable.symtable("import os\ndef f():\n    return os.sep + run_fused()\n", "m.py", "exec")
    missing = [m for child in top.get_children() for m in _undefined(child, _module_names(top), child.get_name())]
    assert missing == ["f: run_fused"]

"""CPU tier: how the kernel's headers hang together.

One header per role or concern (``kernel.cuh``'s top comment names the ones it includes), each
including what it uses: the include graph has no cycle, and every header compiles on its own
after the generated prologue (the constants, ``struct Params`` and the contract), in a release
and a profiling build, with FP8 and MXFP4 weights.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from megamoe_cli.kernel_source import Variant, csrc_dir, generate_source
from megamoe_cli.layout import PRESETS

KERNEL_DIR = csrc_dir() / "megamoe"
HEADERS = {path.name: path.read_text() for path in sorted(KERNEL_DIR.glob("*.cuh"))}
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def local_includes(text: str):
    return _LOCAL_INCLUDE.findall(text)


def include_cycle(graph):
    """A cycle of the include graph as a list of headers, or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for child in graph.get(node, ()):
            if state.get(child) == "open":
                return path[path.index(child):] + [child]
            if child not in state:
                found = visit(child, path + [child])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def test_the_cycle_check_finds_a_cycle():
    assert include_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert include_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


def test_the_include_graph_is_acyclic_and_names_only_kernel_headers():
    graph = {name: local_includes(text) for name, text in HEADERS.items()}
    for name, includes in graph.items():
        for target in includes:
            assert target in HEADERS, f"{name} includes {target}, which is not a header of {KERNEL_DIR}"
    assert include_cycle(graph) is None, f"include cycle: {' -> '.join(include_cycle(graph))}"
    missing_pragma = [name for name, text in HEADERS.items() if "#pragma once" not in text]
    assert not missing_pragma, f"headers without #pragma once: {missing_pragma}"


def test_kernel_cuh_names_every_header_it_includes_in_its_top_comment():
    text = HEADERS["kernel.cuh"]
    top = text[:text.index("#pragma once")]
    for target in local_includes(text):
        assert target in top, f"kernel.cuh includes {target} but its top comment does not name it"


# The variants each header is compiled for, alone: FP8 with clusters in a profiling build (the
# MEGAMOE_PROF members and lines), MXFP4 in a release build (the Fp4Storage members)
STANDALONE_VARIANTS = {
    "fp8_cluster2_profile": (Variant(PRESETS["deepseek-v3"], 2, 256, 128, 4, 2), True),
    "fp4_release": (Variant(PRESETS["deepseek-v4-pro"], 2, 256, 64, 4, 1), False),
}


@needs_nvcc
@pytest.mark.parametrize("variant_name", sorted(STANDALONE_VARIANTS))
def test_every_header_compiles_on_its_own(tmp_path, variant_name):
    from megamoe_cli.jit.build import find_nvcc

    variant, profile = STANDALONE_VARIANTS[variant_name]
    source = generate_source(variant, profile)
    kernel_include = '#include "megamoe/kernel.cuh"'
    assert kernel_include in source
    failures = []
    for name in sorted(HEADERS):
        unit = tmp_path / f"{name}.cu"
        unit.write_text(source.replace(kernel_include, f'#include "megamoe/{name}"'))
        result = subprocess.run(
            [find_nvcc(), "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr", "-ptx",
             "-O0", f"-I{csrc_dir()}", str(unit), "-o", str(tmp_path / f"{name}.ptx")],
            capture_output=True, text=True)
        if result.returncode != 0:
            errors = [line for line in result.stderr.splitlines() if "error" in line]
            failures.append(f"{name}: " + "\n".join(errors[:10] or [result.stderr[-1500:]]))
    assert not failures, "headers that do not compile on their own:\n" + "\n".join(failures)

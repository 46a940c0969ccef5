"""CPU tier: how the kernel's headers hang together.

One header per role or concern (``kernel.cuh``'s top comment names the ones it includes), each
including what it uses: the include graph has no cycle, and every header compiles on its own
after the generated prologue (the constants, ``struct Params`` and the contract), in a release
and a profiling build, with FP8 and MXFP4 weights.  The fault-injection switches (``MEGAMOE_EXP_*``,
the GPU fault tests' builds) appear only inside the publisher's test-only hook, so the release
path carries none.
"""

import re
import shutil
import subprocess

import pytest

from megamoe_cli.kernel.kernel_source import Variant, csrc_dir, generate_source
from megamoe_cli.layout import PRESETS
from graph_checks import find_cycle

KERNEL_DIR = csrc_dir() / "megamoe"
HEADERS = {path.name: path.read_text() for path in sorted(KERNEL_DIR.glob("*.cuh"))}
_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")


def local_includes(text: str):
    return _LOCAL_INCLUDE.findall(text)


def test_the_cycle_check_finds_a_cycle():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"]}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b", "c"], "b": ["c"], "c": []}) is None


def test_the_include_graph_is_acyclic_and_names_only_kernel_headers():
    graph = {name: local_includes(text) for name, text in HEADERS.items()}
    for name, includes in graph.items():
        for target in includes:
            assert target in HEADERS, f"{name} includes {target}, which is not a header of {KERNEL_DIR}"
    assert find_cycle(graph) is None, f"include cycle: {' -> '.join(find_cycle(graph))}"
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
@pytest.mark.slow
def test_every_header_compiles_on_its_own(tmp_path, variant_name):
    from megamoe_cli.kernel.jit.build import find_nvcc

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


# Fault injection: the MEGAMOE_EXP_ switches live in the publisher's test-only hook and nowhere else

_EXP_DIRECTIVE = re.compile(r"^\s*#\s*(?:if|ifdef|ifndef|elif|elifdef|elifndef)\b[^\n]*\bMEGAMOE_EXP_[^\n]*", re.M)


def function_span(text: str, name: str):
    """(start, end) of a top-level function's definition: its signature's line to its closing brace."""
    match = re.search(rf"^[^\n]*\b{name}\([^)]*\)\s*\{{", text, re.M)
    assert match, f"{name} not found"
    end = text.index("\n}\n", match.end())
    return match.start(), end + 2


def exp_switches_outside(text: str, allowed=None):
    """Lines of text's MEGAMOE_EXP_ preprocessor switches that lie outside the span ``allowed``."""
    return [m.group(0).strip() for m in _EXP_DIRECTIVE.finditer(text)
            if allowed is None or not allowed[0] <= m.start() < allowed[1]]


def test_the_switch_scan_finds_what_it_looks_for():
    text = ("void publisher_fault_hook(uint32_t lane) {\n#if defined(MEGAMOE_EXP_SLOW_PUBLISHER)\n#endif\n}\n"
            "void run_tile() {\n  #ifdef MEGAMOE_EXP_FAST\n#endif\n#if 1 && defined(MEGAMOE_EXP_X)\n#endif\n}\n")
    span = function_span(text, "publisher_fault_hook")
    assert exp_switches_outside(text, span) == ["#ifdef MEGAMOE_EXP_FAST", "#if 1 && defined(MEGAMOE_EXP_X)"]
    assert exp_switches_outside("#ifdef MEGAMOE_PROFILE\n#endif\n// MEGAMOE_EXP_SLOW_PUBLISHER in a comment\n") == []


def test_fault_injection_switches_only_in_the_publisher_fault_hook():
    kernel_sources = {**HEADERS, **{p.name: p.read_text() for p in sorted((csrc_dir() / "microbench").glob("*"))}}
    hook = function_span(HEADERS["publisher.cuh"], "publisher_fault_hook")
    misplaced = []
    for name, text in kernel_sources.items():
        misplaced += [f"{name}: {line}" for line in exp_switches_outside(text, hook if name == "publisher.cuh" else None)]
    assert not misplaced, ("MEGAMOE_EXP_ switches outside publisher_fault_hook (publisher.cuh), the kernel's one "
                           "test-only hook: " + "; ".join(misplaced))
    inside = HEADERS["publisher.cuh"][hook[0]:hook[1]]
    assert _EXP_DIRECTIVE.search(inside), "the fault hook no longer holds the fault-injection switches"
    # Called once, by the publisher warp
    calls = [name for name, text in HEADERS.items() for _ in re.finditer(r"\bpublisher_fault_hook\(lane\);", text)]
    assert calls == ["publisher.cuh"]

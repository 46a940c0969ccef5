"""CPU tier: every fused-kernel variant the heuristics can choose compiles for sm_90a without spills
and without serialized WGMMAs.

Variants differ by shape, rank count, block_m and pipeline depth (the token capacity only enters
index arithmetic, so one capacity stands for all).  Builds go through the JIT (ninja, parallel,
content-hashed cache), so a rerun only pays for what changed.
"""

import re
import shutil
from pathlib import Path

import pytest

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.kernel.heuristics import default_config
from megamoe_cli.kernel.jit import build
from megamoe_cli.kernel.kernel_source import (
    KERNEL_NAME,
    MAX_SMEM_BYTES,
    SUPPORTED_BLOCK_M,
    SUPPORTED_CLUSTER_M,
    SUPPORTED_STAGES,
    Variant,
    csrc_dir,
    generate_source,
    kernel_build_source,
    smem_bytes,
)
from megamoe_cli.layout import PRESETS

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")

RANKS = (1, 2, 4, 8)
TOKENS = (1, 128, 1024, 8192)


def chosen_variants():
    """The variants `default_config` picks for every preset, rank count and token regime."""
    seen = {}
    for shape in PRESETS.values():
        for ranks in RANKS:
            if shape.num_experts % ranks:
                continue
            for tokens in TOKENS:
                config = default_config(shape, ranks, tokens, "H200")
                v = Variant(shape, ranks, 4096, config["block_m"], config["num_stages"], config["cluster_m"])
                seen[v.name] = v
    return list(seen.values())


def test_default_choices_cover_every_block_m_and_fit_shared_memory():
    variants = chosen_variants()
    assert {v.block_m for v in variants} == set(SUPPORTED_BLOCK_M)
    for v in variants:
        v.validate()
        assert smem_bytes(v) <= MAX_SMEM_BYTES


@pytest.mark.timeout(1200)  # ~40 variants through nvcc on a 2-core machine
@pytest.mark.slow
def test_every_chosen_variant_compiles_without_spills(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path))  # ~40 cubins: never into the user's own cache
    variants = chosen_variants()
    # Every supported depth of one shape too, so a tuner's candidates are covered.
    shape = PRESETS["deepseek-v3"]
    for block_m in SUPPORTED_BLOCK_M:
        for stages in SUPPORTED_STAGES:
            for cluster_m in SUPPORTED_CLUSTER_M:
                v = Variant(shape, 2, 4096, block_m, stages, cluster_m)
                if smem_bytes(v) <= MAX_SMEM_BYTES:
                    variants.append(v)
    built = build([kernel_build_source(v) for v in variants])
    assert len(built) == len(variants)
    for v, kernel in zip(variants, built):
        entry = kernel.report[KERNEL_NAME]
        assert not entry.has_spills, f"{v.name}: {kernel.report.summary()}"
        assert not kernel.report.serialized_wgmma, f"{v.name}: {kernel.report.serialized_wgmma}"
        assert entry.stack_frame_bytes == 0, f"{v.name}: {kernel.report.summary()}"
        assert 0 < entry.registers <= 168, f"{v.name}: {entry.registers} registers"
        assert kernel.cubin_path.stat().st_size > 0


@pytest.mark.slow
def test_cluster_variants_compile_without_spills_at_every_rank_count(tmp_path, monkeypatch):
    """Clusters at block_m 128 for every preset and rank count: their producer and dispatch warps
    (56 registers) carry the most state, and a 4-byte spill there made the runtime refuse the
    world-size-8 and seed-default cluster variants once, which no default choice covered."""
    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path))
    variants = []
    for shape in PRESETS.values():
        for ranks in RANKS:
            if shape.num_experts % ranks:
                continue
            v = Variant(shape, ranks, 4096, 128, 3, 2)
            try:
                v.validate()
            except MegaMoEError:  # a shape that clusters refuse (odd 256-column tiles) is not built
                continue
            variants.append(v)
    assert len(variants) >= 8
    for v, kernel in zip(variants, build([kernel_build_source(v) for v in variants])):
        entry = kernel.report[KERNEL_NAME]
        assert not entry.has_spills and entry.stack_frame_bytes == 0, f"{v.name}: {kernel.report.summary()}"
        assert not kernel.report.serialized_wgmma, f"{v.name}: {kernel.report.serialized_wgmma}"


@pytest.mark.slow
def test_the_profiling_build_compiles(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path))
    v = Variant(PRESETS["small"], 2, 64, 64, 4, 1)
    source = generate_source(v, profile=True)
    assert "#define MEGAMOE_PROFILE 1" in source and "MEGAMOE_PROFILE" not in generate_source(v)
    built_source = kernel_build_source(v, profile=True)
    assert built_source.name == v.name + "_profile" and built_source.source == source
    (built,) = build([built_source])
    assert b"megamoe_profile" in built.cubin_path.read_bytes()


def test_the_report_catches_serialized_wgmma():
    from megamoe_cli.kernel.jit.build import PtxasReport

    line = ("ptxas info    : (C7514) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
            "non wgmma instructions reading accumulator registers of  a wgmma between start and end of the pipeline "
            "stage in the function 'megamoe_kernel'")
    assert PtxasReport.parse(line).serialized_wgmma == [line.strip()]
    assert PtxasReport.parse("ptxas info    : Used 168 registers, used 4 barriers").serialized_wgmma == []


def test_diagnostic_builds_are_named_by_the_environment_and_checked(monkeypatch):
    from megamoe_cli.errors import MegaMoEError
    from megamoe_cli.kernel.kernel_source import ENV_EXPERIMENT, EXPERIMENTS

    v = Variant(PRESETS["small"], 2, 64, 64, 4, 1)
    monkeypatch.delenv(ENV_EXPERIMENT, raising=False)
    assert "MEGAMOE_EXP_" not in generate_source(v)
    monkeypatch.setenv(ENV_EXPERIMENT, "slow_Publisher, ")
    source = generate_source(v)
    assert "#define MEGAMOE_EXP_SLOW_PUBLISHER 1" in source
    assert "MEGAMOE_EXP_STUCK_PUBLISHER" not in source
    monkeypatch.setenv(ENV_EXPERIMENT, "nopromo,fast")
    with pytest.raises(MegaMoEError) as err:
        generate_source(v)
    assert "FAST" in str(err.value) and all(name in str(err.value) for name in EXPERIMENTS)
    # Every experiment the generator accepts is one the kernel source knows.
    text = "".join(p.read_text() for p in (csrc_dir() / "megamoe").glob("*.cuh"))
    for name in EXPERIMENTS:
        assert f"MEGAMOE_EXP_{name}" in text
    # ... and the kernel switches on no other: the release path carries no experiment of the past.
    assert set(re.findall(r"MEGAMOE_EXP_([A-Z0-9_]+)", text)) == set(EXPERIMENTS)


@pytest.mark.slow
def test_the_publisher_fault_builds_compile_without_spills(tmp_path, monkeypatch):
    """The fault-injection builds the GPU tier's publisher probes run (scripts/fault_probe.py) are
    kernels like the others: no spills (the runtime would refuse them) and no serialized WGMMAs."""
    import importlib.util

    from megamoe_cli.kernel.kernel_source import ENV_EXPERIMENT

    monkeypatch.setenv("MEGAMOE_CACHE_DIR", str(tmp_path))
    spec = importlib.util.spec_from_file_location(
        "fault_probe", Path(__file__).resolve().parents[1] / "scripts" / "fault_probe.py")
    probe = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe)
    config = probe.PUBLISHER_CONFIG  # the probe's variant: its shape, tokens and config, one rank
    v = Variant(probe.SHAPE, 1, probe.PUBLISHER_TOKENS, config["block_m"], config["num_stages"], 1)
    for name in ("SLOW_PUBLISHER", "STUCK_PUBLISHER"):
        monkeypatch.setenv(ENV_EXPERIMENT, name)
        source = kernel_build_source(v)
        assert f"#define MEGAMOE_EXP_{name} 1" in source.source
        (kernel,) = build([source])
        entry = kernel.report[KERNEL_NAME]
        assert not entry.has_spills and entry.stack_frame_bytes == 0, f"{name}: {kernel.report.summary()}"
        assert not kernel.report.serialized_wgmma, f"{name}: {kernel.report.serialized_wgmma}"


@pytest.mark.parametrize("name, min_modes", [("mainloop", 2), ("fp4_expand", 10)])
@pytest.mark.slow
def test_the_microbenchmarks_compile_without_spills_or_serialized_wgmma(tmp_path, name, min_modes):
    import subprocess

    from megamoe_cli.kernel.jit.build import PtxasReport, find_nvcc

    source = csrc_dir() / "microbench" / f"{name}.cu"
    result = subprocess.run(
        [find_nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
         "-o", str(tmp_path / f"{name}.cubin"), str(source)],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = PtxasReport.parse(result.stderr + result.stdout)
    kernels = [k for k in report.entries if f"{name}_kernel" in k]
    names = re.search(r"kModeNames\[kNumModes\] = \{(.*?)\};", source.read_text(), re.S)
    assert names, f"kModeNames not found in {name}.cu"
    assert len(kernels) == names.group(1).count('"') // 2 >= min_modes, report.summary()  # one per mode
    assert not report.has_spills, report.summary()
    assert not report.serialized_wgmma, report.serialized_wgmma



@pytest.mark.parametrize("full, dec, inc, fits", [(0, 56, 224, True), (0, 24, 240, True), (1, 56, 224, False),
                                                  (1, 24, 240, False)])
def test_the_ping_pong_register_budget_is_what_the_notes_say(tmp_path, full, dec, inc, fits):
    """csrc/microbench/pingpong_regs.cu (PERF_NOTES entry 80): a 64x256 accumulator with half-width
    partials fits the consumers' setmaxnreg budget without spills or serialized WGMMAs; a full-width
    partial does not, even at 240."""
    import subprocess

    from megamoe_cli.kernel.jit.build import PtxasReport, find_nvcc

    source = csrc_dir() / "microbench" / "pingpong_regs.cu"
    result = subprocess.run(
        [find_nvcc(), "-cubin", "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-Xptxas", "-v",
         f"-DFULL={full}", f"-DDEC={dec}", f"-DINC={inc}", "-o", str(tmp_path / "pp.cubin"), str(source)],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    report = PtxasReport.parse(result.stderr + result.stdout)
    clean = not report.has_spills and not report.serialized_wgmma
    assert clean == fits, report.summary()

# A signalling write (a relaxed red, or a relaxed system-scope store; the combine barrier's
# counter reset, st.relaxed.gpu, publishes nothing) must follow a fence of at least its scope on
# the same straight-line path (no label, branch, call or barrier between): the fence and the write
# then form a PTX release pattern.
_SIGNAL = re.compile(r"^\s*(?:red\.relaxed\.(sys|gpu)|st\.relaxed\.(sys))\.")
_FENCES = {
    "sys": re.compile(r"^\s*(?:membar\.sys|fence\.(?:sc|acq_rel)\.sys)\s*;"),
    "gpu": re.compile(r"^\s*(?:membar\.(?:sys|gl)|fence\.(?:sc|acq_rel)\.(?:sys|gpu))\s*;"),
}
_PATH_BREAK = re.compile(r"^\s*(?:\$?[\w.]+:|(?:@!?%\w+\s+)?(?:bra|ret|call|exit|bar|barrier)\b)")
# Release writes and RMWs compile to their own MEMBAR each; the combine barrier's one acq_rel add
# per CTA is the exception (it also acquires the earlier adds).
_RELEASE = re.compile(r"^\s*(?:st|red|atom)(?:\.\w+)*?\.(?:release|acq_rel)(?:\.\w+)*?\.(?:sys|gpu)\b[^\n]*", re.MULTILINE)
_ALLOWED_RELEASE = ("atom.add.acq_rel.gpu.global.u64",)


def unfenced_signals(ptx: str):
    """(line number, text) of every signalling write with no fence of its scope before it."""
    lines = ptx.splitlines()
    bad = []
    for i, line in enumerate(lines):
        m = _SIGNAL.match(line)
        if not m:
            continue
        scope = m.group(1) or m.group(2)
        j = i - 1
        while j >= 0 and not _FENCES[scope].match(lines[j]) and not _PATH_BREAK.match(lines[j]):
            j -= 1
        if j < 0 or not _FENCES[scope].match(lines[j]):
            bad.append((i + 1, line.strip()))
    return bad


def release_writes(ptx: str):
    return [m.group(0).strip() for m in _RELEASE.finditer(ptx)
            if not m.group(0).strip().startswith(_ALLOWED_RELEASE)]


def test_the_signal_checks_catch_a_missing_fence_and_a_release_write():
    fenced = "\tmembar.sys;\n\tld.param.u64 \t%rd1, [%rd2+8];\n\t// begin inline asm\n" \
             "\tred.relaxed.sys.global.add.u64 [%rd1], %rd3;\n\t// end inline asm\n" \
             "\tred.relaxed.sys.global.add.u64 [%rd4], %rd3;\n"
    assert unfenced_signals(fenced) == []
    assert len(unfenced_signals(fenced.replace("membar.sys", "membar.gl"))) == 2  # a GPU fence is not enough
    assert len(unfenced_signals(fenced.replace("\tmembar.sys;\n", ""))) == 2
    assert len(unfenced_signals(fenced.replace("\t// end inline asm\n", "$L__BB0_7:\n"))) == 1  # a label between
    assert len(unfenced_signals(fenced.replace("\t// begin inline asm\n", "\t@%p3 bra \t$L__BB0_9;\n"))) == 2
    assert unfenced_signals("\tmembar.gl;\n\tred.relaxed.gpu.global.or.b32 [%rd1], %r2;\n") == []
    assert unfenced_signals("$L__BB0_1:\n\tst.relaxed.sys.global.u64 [%rd1], %rd2;\n") != []
    assert unfenced_signals("\tst.relaxed.gpu.global.u64 [%rd1], %rd2;\n") == []  # a reset, not a signal
    assert release_writes("\tred.add.release.sys.global.u64 [%rd1], %rd2;\n") != []
    assert release_writes("\tst.release.gpu.global.u32 [%rd1], %r2;\n") != []
    assert release_writes("\tatom.acq_rel.sys.global.add.u64 %rd0, [%rd1], %rd2;\n") != []
    assert release_writes("\tatom.add.acq_rel.gpu.global.u64 %rd0, [%rd1], %rd2;\n") == []
    assert release_writes("\tld.acquire.sys.global.u64 %rd0, [%rd1];\n") == []
    assert release_writes("\tmembar.sys;\n\t// begin inline asm\n\tred.or.release.gpu.global.b32 [%rd1], %r2;\n") != []


@pytest.mark.slow
def test_cross_rank_signals_fence_once_then_write_relaxed(tmp_path):
    """Every system- and GPU-scope signal is a fence followed by relaxed writes (PTX release patterns).

    A ``.release`` write compiles to its own MEMBAR, so a thread signalling every rank waited a
    full NVLink round trip for its write to a peer before writing to its own rank (notes entry
    56: 2-4 us per call at 1-128 tokens/rank, back to back).
    """
    import subprocess

    from megamoe_cli.kernel.jit.build import find_nvcc

    variant = Variant(PRESETS["deepseek-v3"], 2, 4096, 64, 4, 1)
    source = tmp_path / "kernel.cu"
    source.write_text(generate_source(variant))
    ptx = tmp_path / "kernel.ptx"
    result = subprocess.run(
        [find_nvcc(), "-ptx", "-O3", "-std=c++17", "-arch=sm_90a", "-I", str(csrc_dir()), "-o", str(ptx), str(source)],
        capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    text = ptx.read_text()
    assert release_writes(text) == []
    assert unfenced_signals(text) == []
    # the count exchange's adds, the combine barrier's signals, the ready bits and arrivals
    for op in ("red.relaxed.sys.global.add.u64", "st.relaxed.sys.global.u64", "red.relaxed.gpu.global.or.b32",
               "red.relaxed.gpu.global.add.u32"):
        assert op in text, op

"""CPU tier: the host <-> device contract (megamoe_cli/kernel/contract.py) and the kernel agree.

The kernel headers use the names the generated contract defines and define none of them, and
every name in the contract's enums is one the kernel uses; compiled by nvcc, the generated header
holds the values of the Python tables (checked against values written out here), and the
shared-memory budget check fires when the budget is too small or too large.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from megamoe_cli.kernel import contract
from megamoe_cli.kernel.contract import (
    BLOCK_K,
    BLOCK_N,
    DIAGNOSTIC_FIELDS,
    GRID_SYNC_WORDS,
    NUM_THREADS,
    GridSyncWord,
    Phase,
    ProfileSlot,
    TraceKind,
    contract_header,
)
from megamoe_cli.kernel.kernel_source import Variant, csrc_dir, generate_source, smem_bytes
from megamoe_cli.layout import PRESETS

HEADERS = {path.name: path.read_text() for path in sorted((csrc_dir() / "megamoe").glob("*.cuh"))}
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
ENUM_PREFIXES = {"Phase": "kPhase", "ProfileSlot": "kProf", "TraceKind": "kTrace", "GridSyncWord": "kGridSync"}


def generated_names():
    return set(re.findall(r"\b(k[A-Z]\w*) =", contract_header()))


def _strip_comments(text: str) -> str:
    return re.sub(r"//[^\n]*", "", text)


# A name the contract owns, defined again in a kernel header (enum member, constant, type)
_REDEFINED = re.compile(
    r"\benum\s+(?:Phase|ProfileSlot|TraceKind|GridSyncWord)\b|\bstruct\s+Diagnostic\s*\{"
    r"|\b(?:kBlockN|kBlockK|kNumThreads|kDiagMagic|kTraceEvents|kPhase\w+|kProf[A-Z]\w*|kTrace[A-Z]\w*"
    r"|kGridSync\w+)\s*=[^=]"
)
# A grid_sync word by bare number: `grid_sync + 2`, `grid_sync[4]`, `...off_grid_sync) + 5`, `...)[4]`
_BARE_GRID_SYNC = re.compile(r"grid_sync\)?\s*(?:\+\s*\d|\[\s*\d)")


def test_the_scans_catch_what_they_look_for():
    assert _REDEFINED.search("enum Phase : uint32_t {")
    assert _REDEFINED.search("    kPhasePipeline = 7,")
    assert _REDEFINED.search("constexpr uint32_t kBlockN = 256;")
    assert _REDEFINED.search("struct Diagnostic {")
    assert not _REDEFINED.search("if (phase == kPhasePipeline) fail(p, kPhasePipeline, 0, 0, 0);")
    assert not _REDEFINED.search("static_assert(kHidden % kBlockN == 0);")
    for bare in ("grid_sync + 2", "grid_sync[5] = 0;", "at<uint64_t>(p, p.off_grid_sync) + 5", "p.off_grid_sync)[4]"):
        assert _BARE_GRID_SYNC.search(bare), bare
    assert not _BARE_GRID_SYNC.search("grid_sync + kGridSyncCombineArrivals")
    assert not _BARE_GRID_SYNC.search("grid_sync[kGridSyncCountExchange + (epoch & 1)]")


def test_kernel_headers_define_no_contract_name_and_name_every_grid_sync_word():
    for name, text in HEADERS.items():
        code = _strip_comments(text)
        assert not _REDEFINED.search(code), f"{name}: {_REDEFINED.search(code).group(0)!r} belongs to contract.py"
        assert not _BARE_GRID_SYNC.search(code), f"{name}: {_BARE_GRID_SYNC.search(code).group(0)!r}: use GridSyncWord"


def test_the_kernel_uses_only_generated_names_and_every_member_of_the_contracts_enums():
    used = set()
    for text in HEADERS.values():
        used |= set(re.findall(r"\b(k(?:Phase|Prof|Trace|GridSync)[A-Z]\w*)", _strip_comments(text)))
    generated = generated_names()
    assert used - generated == set(), "names the kernel uses that contract.py does not generate"
    for enum, prefix in ((Phase, "kPhase"), (ProfileSlot, "kProf"), (TraceKind, "kTrace"), (GridSyncWord, "kGridSync")):
        unused = {contract.cpp_name(prefix, m) for m in enum} - used
        assert unused == set(), f"{enum.__name__} members no kernel header uses (the host would decode dead names)"


def test_profile_and_trace_names_follow_the_generated_members():
    header = contract_header()
    for enum_name, prefix in ENUM_PREFIXES.items():
        body = header[header.index(f"enum {enum_name} : uint32_t {{"):]
        members = re.findall(rf"\b{prefix}(\w+) = (\d+),", body[: body.index("};")])
        enum = getattr(contract, enum_name)
        assert [int(v) for _, v in members] == [m.value for m in enum]
        for (camel, _), member in zip(members, enum):
            # kProfEpilogueL1Math <-> EPILOGUE_L1_MATH <-> "epilogue_l1_math"
            assert re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", camel).upper() == member.name
    assert contract.PROFILE_SLOTS[ProfileSlot.MAINLOOP_HEAD_L2] == "mainloop_head_l2"
    assert [s.value for s in ProfileSlot] == list(range(len(ProfileSlot)))
    assert len(ProfileSlot) <= contract.PROFILE_CAPACITY


def test_trace_tile_packing_in_the_kernel_matches_the_table():
    """``trace_tile`` (scheduler.cuh) writes the info word by hand: its shifts and masks must be the table's."""
    body = re.search(r"uint32_t trace_tile\(const Tile& tile\) \{(.*?)\n\}", HEADERS["scheduler.cuh"], re.S).group(1)
    fields = {f.name: f for f in contract.TRACE_TILE_FIELDS}
    is_l2, expert, n = fields["is_l2"], fields["expert"], fields["n"]
    assert is_l2.bits == 1 and f"tile.is_l2 ? 1u << {is_l2.shift} : 0u" in body
    assert f"((tile.expert & {expert.mask:#x}u) << {expert.shift})" in body
    assert n.shift == 0 and f"(tile.n & {n.mask:#x}u)" in body
    spans = sorted((f.shift, f.shift + f.bits) for f in contract.TRACE_TILE_FIELDS)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= 32
    words = sorted((f.word, f.shift, f.shift + f.bits) for f in contract.TRACE_FIELDS)
    assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(words, words[1:])) and all(w[2] <= 64 for w in words)


def test_the_grid_sync_segment_holds_every_word():
    from megamoe_cli.layout import BufferConfig, build_layout

    seg = build_layout(BufferConfig(2, 64, PRESETS["small"], 64)).segment("grid_sync")
    assert seg.shape == (GRID_SYNC_WORDS,) and seg.dtype == "u64"
    assert max(GridSyncWord) + 1 < GRID_SYNC_WORDS  # COUNT_EXCHANGE takes two words
    for word in GridSyncWord:
        assert f"[{word.value}" in seg.reset or f", {word.value}]" in seg.reset, word


def _expected_asserts() -> str:
    """static_asserts of every generated value, written from values spelled out here."""
    values = {
        "kBlockN": 256, "kBlockK": 128, "kNumThreads": 384,
        "kPhaseCountExchange": 2, "kPhasePipeline": 7, "kPhaseBadTopkIdx": 8, "kPhasePublishSlot": 12,
        "kProfTileWait": 0, "kProfEpilogueL1Math": 18, "kProfMainloopHeadL2": 25,
        "kTraceCtaStart": 1, "kTraceScheduleDone": 10,
        "kTraceKindShift": 0, "kTraceBlockShift": 8, "kTraceCtaShift": 40, "kTraceEpochShift": 32,
        "kGridSyncCountExchange": 0, "kGridSyncCombineArrivals": 2, "kGridSyncEpoch": 4, "kGridSyncTileCounter": 5,
        "kGridSyncWords": 8, "kDiagMagic": 0x4D4F4521,
    }
    assert (BLOCK_N, BLOCK_K, NUM_THREADS) == (256, 128, 384)
    lines = [f'static_assert(megamoe::{name} == {value}u, "{name}");' for name, value in values.items()]
    offset, host = 0, contract.diagnostic_offsets()
    for name, kind in DIAGNOSTIC_FIELDS:  # natural C layout of the fields as listed
        size = {"u32": 4, "u64": 8}[kind]
        offset = (offset + size - 1) // size * size
        lines.append(f'static_assert(offsetof(megamoe::Diagnostic, {name}) == {offset}, "Diagnostic.{name}");')
        assert host[name] == offset, f"the host decoder reads {name} at {host[name]}, the device writes it at {offset}"
        offset += size
    lines += ['static_assert(megamoe::supported_block_m(64) && megamoe::supported_block_m(128), "block_m");',
              'static_assert(!megamoe::supported_block_m(32) && !megamoe::supported_block_m(256), "block_m");']
    return "\n".join(lines) + "\n"


def _compile(tmp_path: Path, text: str, *flags: str) -> subprocess.CompletedProcess:
    from megamoe_cli.kernel.jit.build import find_nvcc

    source = tmp_path / "contract_check.cu"
    source.write_text(text)
    return subprocess.run(
        [find_nvcc(), "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", *flags, f"-I{csrc_dir()}",
         str(source), "-o", str(tmp_path / "out")],
        capture_output=True, text=True)


@needs_nvcc
def test_the_generated_header_compiles_to_the_values_written_here(tmp_path):
    checks = _expected_asserts()
    result = _compile(tmp_path, contract_header() + checks, "-c")
    assert result.returncode == 0, result.stderr[-3000:]
    # The same check fails when the two sides differ: one value off
    wrong = checks.replace("megamoe::kPhasePipeline == 7u", "megamoe::kPhasePipeline == 8u")
    assert wrong != checks
    result = _compile(tmp_path, contract_header() + wrong, "-c")
    assert result.returncode != 0 and "kPhasePipeline" in result.stderr


@needs_nvcc
def test_the_shared_memory_budget_is_checked_both_ways(tmp_path):
    """kernel.cuh's static_asserts against SharedStorage: the real budget compiles, one below what
    SharedStorage needs or more than kSmemSpareBytes above it does not."""
    v = Variant(PRESETS["small"], 2, 64, 64, 4, 1)
    source = generate_source(v)
    budget = smem_bytes(v)
    define = f"#define MEGAMOE_SMEM_BYTES {budget}u"
    assert define in source
    result = _compile(tmp_path, source, "-ptx", "-O0")
    assert result.returncode == 0, result.stderr[-3000:]
    # (release builds hold no profile counters, whose bytes the budget reserves all the same)
    reserved = contract.smem_budget(v.shape.num_experts, v.num_ranks, v.block_m, v.num_stages)["prof"]
    for wrong, message in ((budget - reserved - 600, "smaller than SharedStorage needs"),
                           (budget + contract.SMEM_SPARE_BYTES + 1, "by more than kSmemSpareBytes")):
        result = _compile(tmp_path, source.replace(define, f"#define MEGAMOE_SMEM_BYTES {wrong}u"), "-ptx", "-O0")
        assert result.returncode != 0 and message in result.stderr, (wrong, result.stderr[-2000:])


def test_the_budget_is_the_sum_of_its_terms_and_grows_with_what_it_holds():
    terms = contract.smem_budget(256, 2, 128, 4)
    assert sum(terms.values()) == contract.smem_bytes(256, 2, 128, 4)
    assert terms["a, sfa, sfb (per stage)"] + terms["b"] == 4 * (128 * 128 + 256 * 128 + 128 * 4 + 16)
    assert terms["b_raw (MXFP4 stages), fp4_table"] == 0
    # MXFP4: each stage holds the stored tile instead of an e4m3 one; two e4m3 tiles and the table besides
    fp4 = contract.smem_budget(256, 2, 64, 4, "fp4")
    assert fp4["b"] == 2 * 256 * 128
    assert fp4["b_raw (MXFP4 stages), fp4_table"] == 4 * contract.FP4_STAGE_BYTES + contract.FP4_TABLE_BYTES
    assert contract.smem_bytes(256, 2, 64, 5, "fp4") - contract.smem_bytes(256, 2, 64, 4, "fp4") == \
        64 * 128 + contract.FP4_STAGE_BYTES + 64 * 4 + 16 + 32 + 8
    assert contract.smem_bytes(256, 2, 128, 5) - contract.smem_bytes(256, 2, 128, 4) == \
        128 * 128 + 256 * 128 + 128 * 4 + 16 + 32 + 8
    assert contract.smem_bytes(384, 2, 64, 4) > contract.smem_bytes(256, 2, 64, 4)


def test_block_m_has_one_rule():
    from megamoe_cli.errors import MegaMoEError

    for good in contract.SUPPORTED_BLOCK_M:
        assert contract.check_block_m(good) == good
    for bad in (0, 32, 72, 256, 64.0, True, "64", None):
        with pytest.raises(MegaMoEError, match=rf"^block_m={re.escape(repr(bad))} is not supported by the fused "
                                                rf"kernel; expected one of \(64, 128\)$"):
            contract.check_block_m(bad)

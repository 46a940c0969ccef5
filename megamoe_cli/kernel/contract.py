"""The host <-> device contract: every fact that both the Python side and the CUDA kernel rely on.

Each fact is written once, here.  ``contract_header()`` turns them into C++ (the text of
``contract.cuh``), which the generated translation unit of every kernel variant places ahead of
``csrc/megamoe/kernel.cuh`` (``kernel_source.generate_source``); the kernel headers use those
names and define none of them.  The host's decoders (the failure record, the profile counters,
the trace) read the same tables, and the compiler checks the generated struct offsets and, in
every build, that ``smem_budget`` covers ``SharedStorage`` closely (``kernel.cuh``).

What lives here:

- tile shape and thread count (``BLOCK_N``, ``BLOCK_K``, ``NUM_THREADS``), the supported
  ``block_m`` values and their one check (``check_block_m``), rank and top-k limits;
- ``Phase``: the phases a timeout or bad-input diagnostic names, with the text the host prints;
- ``Diagnostic``: the failure record the first failing thread writes into host memory;
- ``ProfileSlot``: the cycle counters of profiling builds;
- ``TraceKind`` and the bit packing of a trace event (``TRACE_FIELDS``, ``TRACE_TILE_FIELDS``);
- ``GridSyncWord``: the words of the buffer's ``grid_sync`` segment;
- ``smem_budget``: the dynamic shared memory a variant launches with.

Pure Python, no torch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Dict, Iterable, List, Mapping, Tuple, Type

from ..errors import MegaMoEError

# ----------------------------------------------------------------------------- tile shape, limits

BLOCK_N = 256  # output columns of a tile, both GEMMs (and the rows of one weight stage)
BLOCK_K = 128  # K step: one FP8 scale block
SUPPORTED_BLOCK_M = (64, 128)  # pool rows per block: the kernel's two consumer layouts
NUM_THREADS = 384  # producer warpgroup (TMA warp + dispatch warps) and two consumer warpgroups
MAX_RANKS = 8  # Params.peer_delta holds this many
MAX_TOPK = 32  # the reduce gives each top-k slot one lane


def check_block_m(block_m: object) -> int:
    """The one rule for ``block_m`` (buffers, kernel configs, sweeps and tuning all ask here)."""
    if isinstance(block_m, bool) or not isinstance(block_m, int) or block_m not in SUPPORTED_BLOCK_M:
        raise MegaMoEError(
            f"block_m={block_m!r} is not supported by the fused kernel; expected one of {SUPPORTED_BLOCK_M}"
        )
    return block_m


# ----------------------------------------------------------------------------- diagnostics


class Phase(IntEnum):
    """Where a kernel gave up: the ``phase`` of its failure record (``fail(p, kPhase..., ...)``)."""

    COUNT_EXCHANGE = 2
    L1_ARRIVAL = 3
    L2_ARRIVAL = 4
    COMBINE_BARRIER = 5
    COMBINE_RANK_BARRIER = 6
    PIPELINE = 7
    BAD_TOPK_IDX = 8
    TOO_MANY_PAIRS = 9
    CLUSTER_TILE = 10
    PUBLISH = 11  # consumers: the publisher warp did not take their L1 tiles in time
    PUBLISH_SLOT = 12  # publisher: a slot out of sequence (cannot happen while the consumers wait)


# What the host's message says for each phase (index, expected and observed follow it).
PHASE_TEXT: Dict[Phase, str] = {
    Phase.COUNT_EXCHANGE: "count exchange (index 0: ranks announced; index 1: CTAs of every rank arrived)",
    Phase.L1_ARRIVAL: "L1 arrival (rows pulled into the pool)",
    Phase.L2_ARRIVAL: "L2 arrival (the L1 tile that writes an L2 K block's columns; index: pool block, expected: "
                      "that K block, observed: the block's ready bits of its word)",
    Phase.COMBINE_BARRIER: "combine barrier (this rank's CTAs; expected/observed: its flag)",
    Phase.COMBINE_RANK_BARRIER: "combine barrier (ranks)",
    Phase.PIPELINE: "TMA/WGMMA pipeline",
    Phase.BAD_TOPK_IDX: "topk_idx out of range",
    Phase.TOO_MANY_PAIRS: "too many pairs for one expert (a token repeats an expert)",
    Phase.CLUSTER_TILE: "cluster tile forward (the leader CTA's next tile)",
    Phase.PUBLISH: "L1-tile publication (the CTA's publisher warp fell behind its consumers; expected: L1 tiles "
                   "it should have taken, observed: L1 tiles it took, index: the consumers' next L1 tile)",
    Phase.PUBLISH_SLOT: "L1-tile publication slot out of sequence (expected: the publisher warp's tile, observed: "
                        "the slot's; index: its ready word)",
}

# The failure record in host-pinned memory: fields in order, each "u32" or "u64".
DIAGNOSTIC_FIELDS: Tuple[Tuple[str, str], ...] = (
    ("magic", "u32"),  # DIAGNOSTIC_MAGIC once complete (1 while a thread is filling it)
    ("rank", "u32"),
    ("phase", "u32"),  # a Phase
    ("cta", "u32"),
    ("thread", "u32"),
    ("index", "u32"),
    ("expected", "u64"),
    ("observed", "u64"),
)
DIAGNOSTIC_MAGIC = 0x4D4F4521
DIAGNOSTIC_RECORD_BYTES = 64  # what SymmBuffer allocates for it
_STRUCT_CODES = {"u32": ("I", "uint32_t"), "u64": ("Q", "uint64_t")}
# Little-endian without padding: the C++ struct's natural offsets are checked against these
# by static_asserts in the generated header.
DIAGNOSTIC = struct.Struct("<" + "".join(_STRUCT_CODES[t][0] for _, t in DIAGNOSTIC_FIELDS))


def diagnostic_offsets() -> Dict[str, int]:
    offsets, at = {}, 0
    for name, kind in DIAGNOSTIC_FIELDS:
        offsets[name] = at
        at += struct.calcsize("<" + _STRUCT_CODES[kind][0])
    return offsets


# ----------------------------------------------------------------------------- profiling builds


class ProfileSlot(IntEnum):
    """Counters of profiling builds (``megamoe_profile``): cycles unless said, per sampling thread,
    summed over CTAs."""

    TILE_WAIT = 0
    STAGE_WAIT = 1
    MAINLOOP = 2
    EPILOGUE_L1 = 3
    EPILOGUE_L2 = 4
    TILES_L1 = 5
    TILES_L2 = 6
    PRODUCER_ARRIVAL = 7
    PRODUCER_EMPTY = 8
    PRODUCER_TOTAL = 9
    CONSUMER_LOOP = 10
    CONSUMER_START = 11
    COMBINE_BARRIER = 12
    REDUCE = 13
    CONSUMER_TOTAL = 14
    SAMPLERS = 15
    DISPATCH_PULL = 16
    DISPATCH_SCHEDULE = 17
    EPILOGUE_L1_MATH = 18
    EPILOGUE_L1_RELEASE = 19
    MAINLOOP_L1 = 20
    MAINLOOP_HEAD = 21
    DISPATCH_START = 22
    DISPATCH_COUNT = 23
    DISPATCH_EXCHANGE = 24
    MAINLOOP_HEAD_L2 = 25
    MMA_WAIT = 26
    FP4_EXPAND = 27
    FP4_EXPAND_BARRIER = 28


PROFILE_SLOT_DOCS: Dict[ProfileSlot, str] = {
    ProfileSlot.TILE_WAIT: "consumer: waiting for the first stage of a tile",
    ProfileSlot.STAGE_WAIT: "consumer: waiting for the other stages of a tile",
    ProfileSlot.MAINLOOP: "consumer: k loop of a tile (includes STAGE_WAIT)",
    ProfileSlot.TILES_L1: "count",
    ProfileSlot.TILES_L2: "count",
    ProfileSlot.PRODUCER_ARRIVAL: "producer: waiting for a tile's A rows",
    ProfileSlot.PRODUCER_EMPTY: "producer: waiting for a free stage",
    ProfileSlot.CONSUMER_START: "consumer: kernel start -> schedule ready",
    ProfileSlot.SAMPLERS: "count of consumer sampling threads",
    ProfileSlot.DISPATCH_SCHEDULE: "dispatch: count, exchange, schedule",
    ProfileSlot.EPILOGUE_L1_MATH: "L1 epilogue up to its stores",
    ProfileSlot.EPILOGUE_L1_RELEASE: "L1 epilogue: proxy fence, barrier, release",
    ProfileSlot.MAINLOOP_L1: "consumer: k loops of L1 tiles (MAINLOOP - this = L2 tiles)",
    ProfileSlot.MAINLOOP_HEAD: "consumer: the first two K blocks of every tile",
    ProfileSlot.DISPATCH_START: "dispatch: CTA start (thread 0's first instruction) -> roles split",
    ProfileSlot.DISPATCH_COUNT: "dispatch: count phase (its atomics and stores issued)",
    ProfileSlot.DISPATCH_EXCHANGE: "dispatch: count exchange (fence, adds, wait for every CTA)",
    ProfileSlot.MAINLOOP_HEAD_L2: "consumer: the first two K blocks of L2 tiles (part of MAINLOOP_HEAD)",
    ProfileSlot.MMA_WAIT: "consumer, MXFP4 builds: waiting for its WGMMAs in the k loop (part of MAINLOOP)",
    ProfileSlot.FP4_EXPAND: "consumer, MXFP4: expanding its B half to e4m3 (part of MAINLOOP)",
    ProfileSlot.FP4_EXPAND_BARRIER: "consumer, MXFP4: the warpgroup barrier after the expansion (part of MAINLOOP)",
}
PROFILE_CAPACITY = 32  # words of megamoe_profile
PROFILE_SLOTS: Tuple[str, ...] = tuple(slot.name.lower() for slot in ProfileSlot)


class TraceKind(IntEnum):
    """Timeline events of profiling builds (``MEGAMOE_TRACE(kTrace..., ...)``)."""

    CTA_START = 1
    TAKE = 2
    FIRST_ISSUE = 3
    LAST_ISSUE = 4
    TILE_START = 5
    TILE_END = 6
    TILES_DONE = 7
    BARRIER_DONE = 8
    CTA_END = 9
    SCHEDULE_DONE = 10


TRACE_KIND_DOCS: Dict[TraceKind, str] = {
    TraceKind.CTA_START: "thread 0's first instruction",
    TraceKind.TAKE: "producer: took a tile",
    TraceKind.FIRST_ISSUE: "producer: the tile's first stage issued (its first A rows were ready)",
    TraceKind.LAST_ISSUE: "producer: the tile's last stage issued",
    TraceKind.TILE_START: "consumer warpgroup 0: the tile's first stage full",
    TraceKind.TILE_END: "consumer warpgroup 0: the tile's epilogue done",
    TraceKind.TILES_DONE: "consumers: no tile left, entering the combine barrier",
    TraceKind.BARRIER_DONE: "consumers: past the combine barrier",
    TraceKind.CTA_END: "consumers: reduce done",
    TraceKind.SCHEDULE_DONE: "dispatch: schedule built",
}
TRACE_KINDS: Dict[int, str] = {kind.value: kind.name.lower() for kind in TraceKind}
TRACE_CAPACITY = 262144  # events megamoe_trace holds


@dataclass(frozen=True)
class BitField:
    name: str
    word: int  # which 64-bit word of the event (trace fields) or bit offset base (tile info: 0)
    shift: int
    bits: int

    @property
    def mask(self) -> int:
        return (1 << self.bits) - 1

    def get(self, value: int) -> int:
        return (value >> self.shift) & self.mask


# A trace event is four 64-bit words: globaltimer ns, clock64, "place" and "when".
TRACE_EVENT_WORDS = 4
TRACE_FIELDS: Tuple[BitField, ...] = (
    BitField("kind", 2, 0, 8),
    BitField("block", 2, 8, 32),  # the pool block of a tile event
    BitField("cta", 2, 40, 24),
    BitField("info", 3, 0, 32),  # a tile (TRACE_TILE_FIELDS) or 0
    BitField("epoch", 3, 32, 32),  # the call
)
# The info word of a tile event (trace_tile in scheduler.cuh)
TRACE_TILE_FIELDS: Tuple[BitField, ...] = (
    BitField("n", 0, 0, 16),
    BitField("expert", 0, 16, 15),
    BitField("is_l2", 0, 31, 1),
)


# ----------------------------------------------------------------------------- the grid_sync words


class GridSyncWord(IntEnum):
    """Words of the buffer's ``grid_sync`` segment (u64 each; who writes, reads and resets them:
    ``layout``'s segment docs, ``megamoe sizes --verbose``)."""

    COUNT_EXCHANGE = 0
    COMBINE_ARRIVALS = 2
    EPOCH = 4
    TILE_COUNTER = 5


GRID_SYNC_DOCS: Dict[GridSyncWord, str] = {
    GridSyncWord.COUNT_EXCHANGE: "+ epoch parity (words 0 and 1): the count exchange's arrivals",
    GridSyncWord.COMBINE_ARRIVALS: "this rank's CTAs arrived at the combine barrier",
    GridSyncWord.EPOCH: "the call counter",
    GridSyncWord.TILE_COUNTER: "the producers' next tile",
}
GRID_SYNC_WORDS = 8


# ----------------------------------------------------------------------------- shared memory

SMEM_ALIGN_BYTES = 1024  # the kernel aligns SharedStorage to 1024 bytes (the TMA tiles' 128B swizzle)
# How far the budget may exceed SharedStorage plus that alignment before the build fails:
# measured 216-224 bytes in profiling builds, 528-536 in the others (they reserve the counters too).
SMEM_SPARE_BYTES = 1024


# One MXFP4 weight stage as megamoe_cli/kernel/weight_layout.py stores it and the kernel copies it
# (kFp4StageBytes): 256 rows of 128 K as 64 bytes of e2m1 codes, then the rows' four 32-wide runs'
# scale indices
FP4_STAGE_BYTES = BLOCK_N * (BLOCK_K // 2 + BLOCK_K // 32)
# MXFP4 builds keep their expansion table in a 1024-byte block ahead of the stage buffers (Fp4Storage)
FP4_TABLE_BYTES = 1024


def smem_budget(num_experts: int, num_ranks: int, block_m: int, num_stages: int,
                weights: str = "fp8") -> Dict[str, int]:
    """Bytes of dynamic shared memory by ``SharedStorage`` member (csrc/megamoe/storage.cuh).

    The sum is what a variant launches with (``smem_bytes``).  Every build checks it
    (kernel.cuh): at least ``sizeof(SharedStorage) + SMEM_ALIGN_BYTES`` and at most
    ``SMEM_SPARE_BYTES`` more, so a member added, grown or removed there without its term here
    fails the build."""
    e_local = num_experts // num_ranks
    fp4 = weights == "fp4"
    return {
        "a, sfa, sfb (per stage)": num_stages * (block_m * BLOCK_K + block_m * 4 + 16),
        # e4m3 B tiles: one per stage (TMA writes them), or two the MXFP4 consumers expand into
        "b": (2 if fp4 else num_stages) * BLOCK_N * BLOCK_K,
        "b_raw (MXFP4 stages), fp4_table": num_stages * FP4_STAGE_BYTES + FP4_TABLE_BYTES if fp4 else 0,
        # a row's amax per consumer warpgroup: a split slice's rows (MXFP4 wide slices: all block_m)
        "row_amax": 2 * (block_m if fp4 else 64) * 4,
        "full, empty, stage_tile": 32 * num_stages + 16,
        "tile_slot": 8 * (num_stages + 2),
        "schedule": 4 * (e_local + 2 * (e_local + 1) + e_local * (num_ranks + 1)) + 8 + 8,
        "send_count": 4 * num_experts,
        # Reserved in every build, so a profiling build launches with the release build's size.
        "prof": 3 * 16 * 8,
        "publish_slot, publish_taken, member padding": 256,
        "base alignment": SMEM_ALIGN_BYTES,
    }


def smem_bytes(num_experts: int, num_ranks: int, block_m: int, num_stages: int, weights: str = "fp8") -> int:
    return sum(smem_budget(num_experts, num_ranks, block_m, num_stages, weights).values())


# ----------------------------------------------------------------------------- C++ generation


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:].lower() for part in name.split("_"))


def cpp_name(prefix: str, member: IntEnum) -> str:
    """``kPhase`` + ``BAD_TOPK_IDX`` -> ``kPhaseBadTopkIdx``; ``EPILOGUE_L1`` -> ``EpilogueL1``."""
    return prefix + _camel(member.name)


def _cpp_enum(cpp_type: str, prefix: str, members: Type[IntEnum], docs: Mapping[IntEnum, str]) -> List[str]:
    lines = [f"enum {cpp_type} : uint32_t {{"]
    for member in members:
        doc = docs.get(member)
        lines.append(f"    {cpp_name(prefix, member)} = {member.value},{'  // ' + doc if doc else ''}")
    lines.append("};")
    return lines


def _constants(values: Iterable[Tuple[str, int]], hex_values: bool = False) -> List[str]:
    return [f"constexpr uint32_t {name} = {value:#x}u;" if hex_values else f"constexpr uint32_t {name} = {value}u;"
            for name, value in values]


def contract_header() -> str:
    """The C++ text of ``contract.cuh``: the names the kernel headers use for the facts above.

    Self-contained (it includes what it needs) and guarded by ``MEGAMOE_CONTRACT``, which
    common.cuh requires."""
    lines = [
        "// contract.cuh: generated by megamoe_cli/kernel/contract.py (contract_header); do not edit.",
        "#ifndef MEGAMOE_CONTRACT",
        "#define MEGAMOE_CONTRACT 1",
        "#include <cstddef>",
        "#include <cstdint>",
        "namespace megamoe {",
        "",
    ]
    lines += _constants([("kBlockN", BLOCK_N), ("kBlockK", BLOCK_K), ("kNumThreads", NUM_THREADS),
                         ("kMaxRanks", MAX_RANKS), ("kMaxTopk", MAX_TOPK),
                         ("kSmemAlignBytes", SMEM_ALIGN_BYTES), ("kSmemSpareBytes", SMEM_SPARE_BYTES),
                         ("kFp4StageBytes", FP4_STAGE_BYTES), ("kFp4TableBytes", FP4_TABLE_BYTES)])
    supported = " || ".join(f"block_m == {b}u" for b in SUPPORTED_BLOCK_M)
    lines += [f"constexpr bool supported_block_m(uint32_t block_m) {{ return {supported}; }}", ""]
    lines += ["// Phases named in failure records"]
    lines += _cpp_enum("Phase", "kPhase", Phase, {})
    lines += ["", "// Failure record in host-pinned memory (Params::diag)", "struct Diagnostic {"]
    lines += [f"    {_STRUCT_CODES[kind][1]} {name};" for name, kind in DIAGNOSTIC_FIELDS]
    lines += ["};"]
    lines += _constants([("kDiagMagic", DIAGNOSTIC_MAGIC)], hex_values=True)
    lines += _constants([("kDiagRecordBytes", DIAGNOSTIC_RECORD_BYTES)])
    lines += [f"static_assert(offsetof(Diagnostic, {name}) == {offset}, \"Diagnostic.{name}: see contract.py\");"
              for name, offset in diagnostic_offsets().items()]
    lines += [f"static_assert(sizeof(Diagnostic) == {DIAGNOSTIC.size} && sizeof(Diagnostic) <= kDiagRecordBytes, "
              "\"Diagnostic: see contract.py\");", ""]
    lines += ["// Profiling builds: counters (cycles unless said; per sampling thread, summed over CTAs)"]
    lines += _cpp_enum("ProfileSlot", "kProf", ProfileSlot, PROFILE_SLOT_DOCS)
    lines += _constants([("kProfileCapacity", PROFILE_CAPACITY)])
    lines += ["static_assert(" + str(len(ProfileSlot)) + " <= kProfileCapacity, \"ProfileSlot: see contract.py\");", ""]
    lines += ["// Profiling builds: timeline events, four words each: {globaltimer ns, clock64, place, when}"]
    lines += _cpp_enum("TraceKind", "kTrace", TraceKind, TRACE_KIND_DOCS)
    lines += _constants([("kTraceEvents", TRACE_CAPACITY)])
    lines += _constants((f"kTrace{_camel(f.name)}Shift", f.shift) for f in TRACE_FIELDS)
    lines += ["", "// Words of the grid_sync segment (u64 each)"]
    lines += _cpp_enum("GridSyncWord", "kGridSync", GridSyncWord, GRID_SYNC_DOCS)
    lines += _constants([("kGridSyncWords", GRID_SYNC_WORDS)])
    lines += ["", "}  // namespace megamoe", "#endif  // MEGAMOE_CONTRACT", ""]
    return "\n".join(lines)

"""Post-link edit of a cubin's sm_90 SASS: scheduling hints on the promotion FFMAs.

After each wait for a warpgroup's WGMMAs (``WARPGROUP.DEPBAR``) the consumer promotes the
partial accumulators with a run of FFMAs.  ptxas emits that run with about half of the FFMAs
marked "do not yield", nearly all of them carrying an operand-reuse flag for the next FFMA; the
others let the warp scheduler switch warps.  ``edit_promotion_ffma`` changes that mix on the
first ``fraction`` of each run: ``yield`` clears the no-yield bit on the FFMAs that also carry
the reuse flag (and the flag, which needs the warp to stay), ``hold`` sets the no-yield bit on
every FFMA without it.  Both bits are hints: the reuse flag only saves a register-file read, and
the stall counts and scoreboards that order dependent instructions are untouched, so results do
not change; only the order in which warps issue does.  Measured slower both ways
(docs/PERF_NOTES.md entry 38): a diagnostic, off by default.

Encoding facts used (sm_90, 128-bit instructions stored as two little-endian 64-bit words):
the opcode is the low 12 bits of the first word (FFMA with three register sources 0x223,
``WARPGROUP.ARRIVE`` / ``WARPGROUP.DEPBAR`` 0x9c5, the latter with bit 47 set, QGMMA 0x9f3;
a region also ends at BSYNC 0x941, CALL 0x944, BRA 0x947, WARPSYNC 0x948, EXIT 0x94d,
RET 0x950 and BAR 0xb1d); in the second word, bit 45 is the no-yield bit of the control code
and bit 59 the reuse flag of source operand B.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

from ..errors import MegaMoEError
from ..files import atomic_write
from .build import _TEMP_MARK

OP_MASK = 0xFFF
OP_FFMA_RRR = 0x223
OP_WARPGROUP = 0x9C5
WARPGROUP_DEPBAR_BIT = 1 << 47
# Instructions that end a promotion region: control flow, barriers, the next WGMMA group.
OP_REGION_END = frozenset({0x941, 0x944, 0x947, 0x948, 0x94D, 0x950, 0xB1D, 0x9F3})
NO_YIELD_BIT = 1 << 45
REUSE_B_BIT = 1 << 59

_ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True)
class TextSection:
    name: str
    offset: int
    size: int


@dataclass(frozen=True)
class PatchReport:
    regions: int  # promotion regions found (one per WARPGROUP.DEPBAR followed by FFMAs)
    ffma: int  # FFMAs in those regions
    changed: int  # FFMAs whose hint bits the edit changed


def text_sections(cubin: bytes) -> List[TextSection]:
    """The ``.text.<function>`` sections of an ELF64 little-endian cubin."""
    if len(cubin) < 64 or cubin[:4] != _ELF_MAGIC:
        raise MegaMoEError(f"not a cubin: expected an ELF file, got {len(cubin)} bytes starting {cubin[:4]!r}")
    if cubin[4] != 2 or cubin[5] != 1:
        raise MegaMoEError(f"cubin: expected ELF64 little-endian, got class {cubin[4]} data {cubin[5]}")
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    if shentsize != 64:
        raise MegaMoEError(f"cubin: expected 64-byte ELF64 section headers, got {shentsize}-byte ones")
    if shnum == 0 or shoff + shnum * 64 > len(cubin):
        raise MegaMoEError(
            f"cubin: expected a section table of 1 or more entries inside the file's {len(cubin)} bytes, "
            f"got {shnum} entries at offset {shoff}"
        )
    if shstrndx >= shnum:
        raise MegaMoEError(f"cubin: expected the section-name table index below {shnum}, got {shstrndx}")

    def header(index: int) -> Tuple[int, int, int, int]:
        name, kind, _flags, _addr, offset, size = struct.unpack_from("<IIQQQQ", cubin, shoff + index * 64)
        return name, kind, offset, size

    _, _, str_offset, str_size = header(shstrndx)
    if str_offset + str_size > len(cubin):
        raise MegaMoEError(
            f"cubin: the section-name table ({str_size} B at {str_offset}) lies outside the file's {len(cubin)} bytes"
        )
    names = cubin[str_offset : str_offset + str_size]
    sections = []
    for index in range(shnum):
        name_offset, kind, offset, size = header(index)
        end = names.find(b"\0", name_offset)
        if end < 0:
            raise MegaMoEError(f"cubin: section {index}'s name at {name_offset} has no terminating NUL in the name table")
        name = names[name_offset:end].decode("ascii", "replace")
        if name.startswith(".text.") and kind == 1:  # SHT_PROGBITS
            if offset + size > len(cubin):
                raise MegaMoEError(
                    f"cubin: section {name} ({size} B at {offset}) lies outside the file's {len(cubin)} bytes"
                )
            if size % 16:
                raise MegaMoEError(f"cubin: section {name} is {size} B, expected whole 16-byte instructions")
            sections.append(TextSection(name, offset, size))
    return sections


def _words(code: bytes | bytearray, offset: int, size: int) -> Iterator[Tuple[int, int, int]]:
    for position in range(offset, offset + size, 16):
        low, high = struct.unpack_from("<QQ", code, position)
        yield position, low, high


def _is_depbar(low: int) -> bool:
    return (low & OP_MASK) == OP_WARPGROUP and bool(low & WARPGROUP_DEPBAR_BIT)


def _promotion_regions(code: bytes | bytearray, section: TextSection) -> List[List[Tuple[int, int, int]]]:
    """FFMAs (position, low, high) after each WARPGROUP.DEPBAR, up to the next WGMMA group or branch."""
    regions: List[List[Tuple[int, int, int]]] = []
    current = None
    for position, low, high in _words(code, section.offset, section.size):
        op = low & OP_MASK
        if _is_depbar(low):
            if current:
                regions.append(current)
            current = []
        elif op == OP_WARPGROUP or op in OP_REGION_END:
            if current:
                regions.append(current)
            current = None
        elif current is not None and op == OP_FFMA_RRR:
            current.append((position, low, high))
    if current:
        regions.append(current)
    return regions


MODES = ("yield", "hold")


def edit_promotion_ffma(cubin: bytes, mode: str = "hold", fraction: float = 1.0) -> Tuple[bytes, PatchReport]:
    """Edit the scheduling hints of the first ``fraction`` of each promotion FFMA run (see the
    module docstring for ``mode``); returns the edited cubin and what was found and changed."""
    if mode not in MODES:
        raise MegaMoEError(f"edit_promotion_ffma: mode must be one of {list(MODES)}, got {mode!r}")
    if not 0.0 <= fraction <= 1.0:
        raise MegaMoEError(f"edit_promotion_ffma: fraction must be within [0, 1], got {fraction!r}")
    code = bytearray(cubin)
    regions = ffma = changed = 0
    for section in text_sections(cubin):
        for run in _promotion_regions(code, section):
            regions += 1
            ffma += len(run)
            for position, _low, high in run[: int(len(run) * fraction)]:
                if mode == "yield" and high & REUSE_B_BIT and high & NO_YIELD_BIT:
                    high &= ~(REUSE_B_BIT | NO_YIELD_BIT)
                elif mode == "hold" and not high & NO_YIELD_BIT:
                    high |= NO_YIELD_BIT
                else:
                    continue
                struct.pack_into("<Q", code, position + 8, high)
                changed += 1
    return bytes(code), PatchReport(regions, ffma, changed)


def edited_cubin(cubin_path: Path, mode: str, fraction: float) -> Tuple[Path, Optional[PatchReport]]:
    """The cubin to load: ``cubin_path`` itself when ``fraction`` is 0, else its promotion-FFMA
    edit, written beside it (``kernel.<mode><fraction>.cubin``, atomically) and reused.

    The edit is recomputed from the compiled cubin each time (it is cheap): a stale or partial
    file is replaced, never trusted, and an up-to-date one is left alone.  An edit that finds or
    changes nothing is refused, so an experiment never times the unedited kernel by mistake.
    """
    if not fraction:
        return cubin_path, None
    original = cubin_path.read_bytes()
    patched, report = edit_promotion_ffma(original, mode, fraction)
    if report.regions == 0 or report.changed == 0:
        raise MegaMoEError(
            f"promotion hints '{mode}' (fraction {fraction!r}) changed nothing in {cubin_path}: {report}; expected "
            "FFMA runs after WARPGROUP.DEPBAR with hints to edit (a new ptxas may encode them differently); "
            "set MEGAMOE_PROMOTION_HINTS=off"
        )
    target = cubin_path.with_name(f"{cubin_path.stem}.{mode}{fraction!r}{cubin_path.suffix}")
    try:
        current = target.read_bytes()
    except OSError:
        current = None
    if current != patched:
        # Named like the JIT's own temporaries, so a killed writer's leftover is swept with them.
        atomic_write(target, lambda tmp: Path(tmp).write_bytes(patched), prefix=target.name + _TEMP_MARK)
    return target, report

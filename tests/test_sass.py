"""CPU tier: the promotion-FFMA edit of jit/sass.py on a synthetic cubin (no nvcc needed).

The ELF built here has the section layout of a cubin (a section-name table and one
``.text.<kernel>`` section of 16-byte instructions); the instructions use the sm_90 opcodes
and control bits the edit reads.  test_kernel_build.py checks the edit on real builds.
"""

import struct

import pytest

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.jit import sass

NOYIELD, REUSE_B = sass.NO_YIELD_BIT, sass.REUSE_B_BIT
CTRL = 0x000FC20000000000  # stall 1, no scoreboards (a plain FFMA's control code)


def ffma(dst, hint=True, op=sass.OP_FFMA_RRR):
    """An FFMA into register ``dst``; ``hint``: with operand-B reuse and no-yield, as ptxas pairs them."""
    return (0x0000000518007000 | op | (dst << 16), CTRL | ((REUSE_B | NOYIELD) if hint else 0))


DEPBAR = (0x00008000000079C5, 0x000FE40000010000)
ARRIVE = (0x00000000000079C5, 0x000FE20000000000)
BRA = (0xFFFFFFF0003C8947, 0x000FEC000383FFFF)
FMUL = (0x000000D2D5057220, 0x080FE20000400000 | NOYIELD)  # has the bits but is not an FFMA


def make_cubin(sections):
    """ELF64 LE with a shstrtab and the given {name: [(low, high), ...]} PROGBITS sections."""
    names = b"\0.shstrtab\0" + b"".join(n.encode() + b"\0" for n in sections)
    blobs = [b"".join(struct.pack("<QQ", lo, hi) for lo, hi in code) for code in sections.values()]
    offset = 64
    layout = []  # (name offset, type, data offset, size)
    layout.append((1, 3, offset, len(names)))
    data = names
    name_at = 1 + len(".shstrtab") + 1
    for name, blob in zip(sections, blobs):
        pad = (-(offset + len(data))) % 16
        data += b"\0" * pad
        layout.append((name_at, 1, offset + len(data), len(blob)))
        data += blob
        name_at += len(name) + 1
    shoff = offset + len(data) + (-(offset + len(data)) % 8)
    data += b"\0" * (shoff - offset - len(data))
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, len(layout) + 1, 1)
    table = b"\0" * 64 + b"".join(struct.pack("<IIQQQQIIQQ", n, t, 0, 0, o, s, 0, 0, 16, 0) for n, t, o, s in layout)
    return bytes(header) + data + table


def words(cubin, section):
    (text,) = [s for s in sass.text_sections(cubin) if s.name == section]
    return [struct.unpack_from("<QQ", cubin, p) for p in range(text.offset, text.offset + text.size, 16)]


LOOP = [
    ARRIVE, ffma(1),  # before any wait: not a promotion
    DEPBAR, ffma(10), ffma(11, hint=False), ffma(12), FMUL, ffma(13), ffma(10),  # R10 written twice
    ARRIVE, ffma(20),  # the next WGMMA group ends the region
    DEPBAR, ffma(30), ffma(31, hint=False), ffma(32), ffma(33, hint=False), BRA, ffma(40),  # a branch ends it too
    DEPBAR, ffma(50, op=0x823),  # FFMA with an immediate: not the promotion form
]


def test_sections_are_found_by_name():
    cubin = make_cubin({".text.megamoe_kernel": LOOP, ".nv.info": [ARRIVE]})
    (text,) = sass.text_sections(cubin)
    assert text.name == ".text.megamoe_kernel" and text.size == 16 * len(LOOP)
    assert words(cubin, ".text.megamoe_kernel") == LOOP


def changed_words(cubin, patched):
    before, after = words(cubin, ".text.megamoe_kernel"), words(patched, ".text.megamoe_kernel")
    changed = {i for i, (a, b) in enumerate(zip(before, after)) if a != b}
    (text,) = sass.text_sections(cubin)  # bytes outside the text section are untouched
    assert patched[: text.offset] == cubin[: text.offset]
    assert patched[text.offset + text.size:] == cubin[text.offset + text.size:]
    return before, after, changed


def test_yield_clears_reuse_and_no_yield_on_hinted_promotion_ffmas_only():
    cubin = make_cubin({".text.megamoe_kernel": LOOP})
    patched, report = sass.edit_promotion_ffma(cubin, "yield")
    assert report == sass.PatchReport(regions=2, ffma=9, changed=6)
    before, after, changed = changed_words(cubin, patched)
    # R10 (both writes), R12, R13, R30, R32; not R11 / R31 / R33 (no hint), not R1 / R20 / R40
    # (outside a region), not the FMUL, not the immediate-operand FFMA.
    second_r10 = len(LOOP) - 1 - LOOP[::-1].index(ffma(10))
    assert changed == {LOOP.index(ffma(d)) for d in (10, 12, 13, 30, 32)} | {second_r10}
    for i in changed:
        (lo0, hi0), (lo1, hi1) = before[i], after[i]
        assert lo0 == lo1 and hi0 ^ hi1 == REUSE_B | NOYIELD and not hi1 & (REUSE_B | NOYIELD)


def test_hold_sets_no_yield_on_the_promotion_ffmas_without_it():
    cubin = make_cubin({".text.megamoe_kernel": LOOP})
    patched, report = sass.edit_promotion_ffma(cubin, "hold")
    assert report == sass.PatchReport(regions=2, ffma=9, changed=3)
    before, after, changed = changed_words(cubin, patched)
    assert changed == {LOOP.index(ffma(d, hint=False)) for d in (11, 31, 33)}
    for i in changed:
        (lo0, hi0), (lo1, hi1) = before[i], after[i]
        assert lo0 == lo1 and hi1 == hi0 | NOYIELD and not hi1 & REUSE_B


def test_fraction_edits_the_leading_part_of_each_run():
    cubin = make_cubin({".text.k": LOOP})
    _, half = sass.edit_promotion_ffma(cubin, "yield", 0.5)
    # Runs of 5 and 4 FFMAs: the first 2 of each; hinted among them R10 and R30.
    assert half.changed == 2
    _, half = sass.edit_promotion_ffma(cubin, "hold", 0.5)
    assert half.changed == 2  # R11 and R31
    unchanged, none = sass.edit_promotion_ffma(cubin, "hold", 0.0)
    assert none.changed == 0 and unchanged == cubin


def test_bad_input_is_refused_with_what_was_expected():
    with pytest.raises(MegaMoEError, match="expected an ELF"):
        sass.text_sections(b"not a cubin" * 10)
    with pytest.raises(MegaMoEError, match="ELF64 little-endian"):
        sass.text_sections(b"\x7fELF\x01\x01" + bytes(80))
    good = make_cubin({".text.k": LOOP})
    shoff = struct.unpack_from("<Q", good, 0x28)[0]
    with pytest.raises(MegaMoEError, match="expected a section table .* inside the file's"):
        sass.text_sections(good[:shoff + 64])  # the table cut short
    bad_index = bytearray(good)
    struct.pack_into("<H", bad_index, 0x3E, 9)
    with pytest.raises(MegaMoEError, match="section-name table index below 3, got 9"):
        sass.text_sections(bytes(bad_index))
    with pytest.raises(MegaMoEError, match="within \\[0, 1\\]"):
        sass.edit_promotion_ffma(make_cubin({".text.k": LOOP}), "hold", 1.5)
    with pytest.raises(MegaMoEError, match="mode must be one of"):
        sass.edit_promotion_ffma(make_cubin({".text.k": LOOP}), "fast")


def test_edited_cubin_is_written_once_beside_the_build_and_replaced_when_stale(tmp_path):
    original = tmp_path / "kernel.cubin"
    original.write_bytes(make_cubin({".text.k": LOOP}))
    same, report = sass.edited_cubin(original, "off", 0.0)
    assert same == original and report is None
    path, report = sass.edited_cubin(original, "hold", 1.0)
    assert path == tmp_path / "kernel.hold1.0.cubin" and report.changed == 3
    expected = path.read_bytes()
    assert expected == sass.edit_promotion_ffma(original.read_bytes(), "hold")[0]
    stamp = (path.stat().st_ino, path.stat().st_mtime_ns)
    again, _ = sass.edited_cubin(original, "hold", 1.0)  # up to date: left alone
    assert again == path and (path.stat().st_ino, path.stat().st_mtime_ns) == stamp
    path.write_bytes(expected[:100])  # a truncated leftover is never trusted
    again, _ = sass.edited_cubin(original, "hold", 1.0)
    assert again == path and path.read_bytes() == expected
    other, _ = sass.edited_cubin(original, "yield", 0.5)
    assert other.name == "kernel.yield0.5.cubin" and other.read_bytes() != expected
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernel.cubin", "kernel.hold1.0.cubin", "kernel.yield0.5.cubin"]


def test_an_edit_that_changes_nothing_is_refused(tmp_path):
    # No promotion runs at all (a compiler that encodes them differently looks like this).
    bare = tmp_path / "kernel.cubin"
    bare.write_bytes(make_cubin({".text.k": [ARRIVE, ffma(1), BRA]}))
    with pytest.raises(MegaMoEError, match="changed nothing.*MEGAMOE_PROMOTION_HINTS=off"):
        sass.edited_cubin(bare, "yield", 1.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernel.cubin"]


def test_the_environment_names_the_edit(monkeypatch):
    from megamoe_cli.kernel_source import ENV_PROMOTION_HINTS, promotion_hints

    for raw, expected in (("off", ("off", 0.0)), ("hold", ("hold", 1.0)), ("yield:0.5625", ("yield", 0.5625))):
        monkeypatch.setenv(ENV_PROMOTION_HINTS, raw)
        assert promotion_hints() == expected
    for raw in ("fast", "hold:2", "hold:x"):
        monkeypatch.setenv(ENV_PROMOTION_HINTS, raw)
        with pytest.raises(MegaMoEError, match=ENV_PROMOTION_HINTS):
            promotion_hints()

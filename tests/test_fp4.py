"""MXFP4 expert weights (SPEC §2b) on the CPU: quantization, the kernel's weight layout and its
on-chip expansion to e4m3, emulated bit for bit from the constants in csrc/megamoe/fp4.cuh, the
SwiGLU clamp in the reference, and the errors bad weights get before any launch."""

import itertools
import math
import re

import pytest
import torch
from helpers import mxfp4_from_fp8

from megamoe_cli.errors import MegaMoEError
from megamoe_cli.fused import transform_weights_for_mega_moe
from megamoe_cli.kernel import weight_layout as wl
from megamoe_cli.kernel.kernel_source import FP4_STAGE_BYTES, Variant, csrc_dir
from megamoe_cli.layout import PRESETS, MoEShape
from megamoe_cli.problem import make_problem
from megamoe_cli.reference.layer import moe_reference, moe_reference_distributed, moe_reference_loop
from megamoe_cli.reference.quant import (
    E2M1_VALUES,
    check_mxfp4,
    dequantize_mxfp4,
    e2m1_codes,
    e2m1_values,
    quantize_mxfp4,
    quantize_per_block,
)

FP4_SOURCE = (csrc_dir() / "megamoe" / "fp4.cuh").read_text()
CONSUMER_SOURCE = (csrc_dir() / "megamoe" / "consumer.cuh").read_text()
SMALL_FP4 = MoEShape(hidden=512, intermediate=256, num_experts=8, num_topk=2, weights="fp4")


# --- quantization -----------------------------------------------------------------------------

def test_e2m1_rounds_to_nearest_even():
    grid = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    v = torch.cat([torch.linspace(-6, 6, 4801), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, -0.25])])
    got = e2m1_values(e2m1_codes(v))
    nearest = grid[(v.unsqueeze(1) - grid).abs().argmin(1)]
    dist_got, dist_best = (got - v).abs(), (nearest - v).abs()
    assert torch.equal(dist_got, dist_best), "not the nearest e2m1 value"
    ties = {0.25: 0.0, 0.75: 1.0, 1.25: 1.0, 1.75: 2.0, 2.5: 2.0, 3.5: 4.0, 5.0: 4.0, -5.0: -4.0}
    for x, want in ties.items():  # ties go to the even mantissa
        assert float(e2m1_values(e2m1_codes(torch.tensor([x])))[0]) == want


def test_quantize_picks_the_power_of_two_that_fits_each_run():
    torch.manual_seed(0)
    w = torch.randn(3, 64, 256) * torch.logspace(-3, 3, 256)  # runs of very different magnitudes
    packed, scales = quantize_mxfp4(w)
    assert packed.dtype == scales.dtype == torch.uint8
    assert packed.shape == (3, 64, 128) and scales.shape == (3, 64, 8)
    amax = w.reshape(3, 64, 8, 32).abs().amax(-1)
    s = scales.to(torch.int32) - 127
    assert (amax <= 6 * torch.exp2(s.double())).all(), "a run's amax does not fit e2m1 at its scale"
    assert (amax > 3 * torch.exp2(s.double())).all(), "a smaller power of two would have held the run"
    deq = dequantize_mxfp4(packed, scales)
    rel = (deq - w).norm() / w.norm()
    assert 0.05 < rel < 0.2, rel  # e2m1's 1-bit mantissa, not a broken scale
    again_p, again_s = quantize_mxfp4(deq)
    assert torch.equal(dequantize_mxfp4(again_p, again_s), deq), "dequantized weights do not re-quantize exactly"


def test_all_zero_runs_and_fp8_input():
    packed, scales = quantize_mxfp4(torch.zeros(2, 32))
    assert not packed.any() and dequantize_mxfp4(packed, scales).abs().max() == 0
    q, sf = quantize_per_block(torch.randn(2, 128, 256))
    p, s = mxfp4_from_fp8(q, sf)
    assert p.shape == (2, 128, 128) and s.shape == (2, 128, 8)


def test_bad_mxfp4_inputs_are_one_clear_error():
    p, s = quantize_mxfp4(torch.randn(4, 64))
    with pytest.raises(MegaMoEError, match="scales must be \\(4, 2\\)"):
        check_mxfp4("op", p, s[:, :1])
    with pytest.raises(MegaMoEError, match="NaN code 255"):
        check_mxfp4("op", p, torch.full_like(s, 255))
    with pytest.raises(MegaMoEError, match="must be torch.uint8, got torch.float32"):
        check_mxfp4("op", p, s.float())
    with pytest.raises(MegaMoEError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))


# --- the kernel's expansion, emulated -----------------------------------------------------------

def byte_perm(x: int, y: int, s: int) -> int:
    """PTX prmt.b32 (ptx::prmt): result byte n is byte (s >> 4n) & 7 of the 8 bytes {y:x}, or,
    where bit 3 of that selector nibble is set, that byte's sign bit replicated over all 8 bits
    (the kernel's selectors must keep bit 3 clear; one that did not would be caught here)."""
    src = (y << 32) | x
    out = 0
    for n in range(4):
        sel = (s >> (4 * n)) & 0xF
        byte = (src >> (8 * (sel & 7))) & 0xFF
        if sel & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * n)
    return out


def kernel_expand_word():
    """fp4_expand_word as fp4.cuh writes it: its mask, shift and sign masks are read from the
    source, so this emulation follows the kernel (a changed constant changes both)."""
    body = FP4_SOURCE[FP4_SOURCE.index("void fp4_expand_word"):]
    body = body[: body.index("\n}\n")]
    mask = int(re.search(r"and\.b32 %0, %1, (0x[0-9a-fA-F]+);", body).group(1), 16)
    lo_sign = int(re.search(r"lo = ptx::prmt\(lut\.x, lut\.y, mag\) \| \(w & (0x[0-9a-fA-F]+)u\);", body).group(1), 16)
    hi = re.search(r"hi = ptx::prmt\(lut\.x, lut\.y, mag >> (\d+)\) \| \(\(w << (\d+)\) & (0x[0-9a-fA-F]+)u\);", body)
    hi_shift, sign_shift, hi_sign = int(hi.group(1)), int(hi.group(2)), int(hi.group(3), 16)

    def expand(w: int, lut: tuple) -> tuple:
        mag = w & mask
        lo = byte_perm(lut[0], lut[1], mag & 0xFFFF) | (w & lo_sign)
        hi = byte_perm(lut[0], lut[1], (mag >> hi_shift) & 0xFFFF) | (((w << sign_shift) & 0xFFFFFFFF) & hi_sign)
        return lo, hi

    return expand


def kernel_index_byte():
    """fp4_index_byte as fp4.cuh writes it (its selector read from the source): a row's index word
    and a byte number -> that byte's scale index."""
    body = FP4_SOURCE[FP4_SOURCE.index("uint32_t fp4_index_byte"):]
    body = body[: body.index("\n}\n")]
    m = re.search(r"return ptx::prmt\(word, 0u, (0x[0-9a-fA-F]+)u \| byte\);", body)
    base = int(m.group(1), 16)
    return lambda word, byte: byte_perm(word, 0, base | byte)


def kernel_table_index(table: int = 0x2A700):
    """The register-operand path's table lookup as consumer.cuh and fp4.cuh write it (the index
    word's scaling and fp4_table_slot's selector read from the source): a row's index word and a
    byte number -> the entry the load at the prmt's address reads, for a table at shared address
    ``table`` (a multiple of 256, as storage.cuh asserts).  An address that is not an entry of the
    table fails here."""
    assert table % 256 == 0
    scale = re.search(r"scaled\[u\]\[r\] \*= sizeof\((\w+)\);", CONSUMER_SOURCE).group(1)
    factor = {"uint2": 8, "uint32_t": 4, "uint4": 16, "uint8_t": 1}[scale]
    body = FP4_SOURCE[FP4_SOURCE.index("uint32_t fp4_table_slot"):]
    body = body[: body.index("\n}\n")]
    base = int(re.search(r"return ptx::prmt\(scaled, table, (0x[0-9a-fA-F]+)u \| byte\);", body).group(1), 16)
    assert "ptx::ld_shared_v2_u32_at(fp4_table_slot(table, scaled[r], byte))" in FP4_SOURCE

    def index(word: int, byte: int) -> int:
        address = byte_perm((word * factor) & 0xFFFFFFFF, table, base | byte)
        offset = address - table
        assert 0 <= offset < 8 * wl.FP4_NUM_SCALES and offset % 8 == 0, (hex(word), byte, hex(address))
        return offset // 8

    return index


def test_table_slot_reads_each_index_byte_entry():
    """fp4_table_slot, with the index words scaled as run_tile_rs scales them, addresses entry i of
    the table for index i in any byte of the word, whatever the other bytes hold, for any table
    base that is a multiple of 256."""
    gen = torch.Generator().manual_seed(11)
    for table in (0x0, 0x2A700, 0x3FF00):
        index = kernel_table_index(table)
        for i in range(wl.FP4_NUM_SCALES):
            for byte in range(4):
                others = torch.randint(0, wl.FP4_NUM_SCALES, (4,), generator=gen).tolist()
                others[byte] = i
                word = sum(b << (8 * k) for k, b in enumerate(others))
                assert index(word, byte) == i, (table, i, byte, others)


def test_normal_vote_flags_every_index_below_the_first_normal_one():
    """fp4_normal_bytes as fp4.cuh writes it (its constants read from the source), ANDed over
    rows as the kernel does, leaves kFp4AllNormal exactly when every index byte is at least
    kFp4FirstNormalIndex, for every index a stage can hold (0 to FP4_NUM_SCALES - 1)."""
    _, first = kernel_entry()
    body = FP4_SOURCE[FP4_SOURCE.index("uint32_t fp4_normal_bytes"):]
    body = body[: body.index("\n}\n")]
    m = re.search(r"return word \+ \((\d+)u - kFp4FirstNormalIndex\) \* (0x[0-9a-fA-F]+)u;", body)
    add = ((int(m.group(1)) - first) * int(m.group(2), 16)) & 0xFFFFFFFF
    all_normal = int(re.search(r"kFp4AllNormal = (0x[0-9a-fA-F]+)u;", FP4_SOURCE).group(1), 16)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2000):
        rows = torch.randint(0, wl.FP4_NUM_SCALES, (4, 4), generator=gen)
        # mostly normal indices, so that both outcomes occur
        rows = torch.where(torch.rand(4, 4, generator=gen) < 0.97, rows.clamp(min=first), rows)
        normal = all_normal
        for row in rows.tolist():
            word = sum(b << (8 * i) for i, b in enumerate(row))
            normal &= (word + add) & 0xFFFFFFFF
        assert (normal == all_normal) == bool((rows >= first).all()), rows
    for index in range(wl.FP4_NUM_SCALES):  # every index in every byte position
        for byte in range(4):
            word = (first << 0 | first << 8 | first << 16 | first << 24) & ~(0xFF << (8 * byte)) | (index << (8 * byte))
            assert ((((word + add) & 0xFFFFFFFF) & all_normal) == all_normal) == (index >= first), (index, byte)


def word_of(codes: list) -> int:
    """Eight codes (K order) as the kernel's 32-bit word, packed by the library (fp4_words)."""
    packed = wl.fp4_words(torch.tensor(codes, dtype=torch.uint8)).tolist()
    return sum(b << (8 * i) for i, b in enumerate(packed))


def table_entry(index: int) -> tuple:
    """fp4_fill_table's entry: e4m3 bytes of the 8 magnitudes times 2^(index - bias), RNE."""
    scale = 2.0 ** (index - wl.FP4_SCALE_BIAS)
    b = torch.tensor([v * scale for v in E2M1_VALUES]).to(torch.float8_e4m3fn).view(torch.uint8).tolist()
    return sum(x << (8 * i) for i, x in enumerate(b[:4])), sum(x << (8 * i) for i, x in enumerate(b[4:]))


def test_bias_and_table_size_match_the_kernel():
    assert int(re.search(r"kFp4ScaleBias = (\d+);", FP4_SOURCE).group(1)) == wl.FP4_SCALE_BIAS
    assert int(re.search(r"kFp4NumScales = (\d+);", FP4_SOURCE).group(1)) == wl.FP4_NUM_SCALES
    assert f"{wl.FP4_SCALE_BIAS} + {wl.FP4_MAX_REL_EXP} + 1" and wl.FP4_SCALE_BIAS + wl.FP4_MAX_REL_EXP + 1 == wl.FP4_NUM_SCALES
    assert FP4_STAGE_BYTES == 256 * (64 + 4)


def test_expand_word_gives_every_code_its_signed_value():
    expand = kernel_expand_word()
    for index in (0, 10, 17, 20, wl.FP4_SCALE_BIAS, 31):
        lut = table_entry(index)
        want_mag = [(lut[k // 4] >> (8 * (k % 4))) & 0xFF for k in range(8)]
        gen = torch.Generator().manual_seed(index)
        words = [list(range(8)), [8 + k for k in range(8)]] + torch.randint(0, 16, (300, 8), generator=gen).tolist()
        for codes in words:
            lo, hi = expand(word_of(codes), lut)
            got = [(lo >> (8 * k)) & 0xFF for k in range(4)] + [(hi >> (8 * k)) & 0xFF for k in range(4)]
            want = [want_mag[c & 7] | (0x80 if c & 8 else 0) for c in codes]
            assert got == want, (index, codes)


def kernel_entry():
    """fp4_entry as fp4.cuh writes it, and the first index the kernel computes entries from
    (kFp4FirstNormalIndex), both read from the source."""
    const = {name: int(value, 16) for name, value in
             re.findall(r"(kE2m1AsE4m3Lo|kE2m1AsE4m3Hi|kFp4EntryStepLo|kFp4EntryStepHi) = (0x[0-9a-fA-F]+)u", FP4_SOURCE)}
    assert len(const) == 4
    first = wl.FP4_SCALE_BIAS - int(re.search(r"kFp4FirstNormalIndex = kFp4ScaleBias - (\d+);", FP4_SOURCE).group(1))
    # both expansions take the table path when any index of the warp's rows is below `first`
    assert "normal &= fp4_normal_bytes(indices[j]);" in FP4_SOURCE
    assert "__any_sync(0xffffffffu, normal != kFp4AllNormal)" in FP4_SOURCE
    # the register-operand path reads every entry from the table (kernel_table_index): no vote
    assert "fp4_normal_bytes" not in CONSUMER_SOURCE

    def entry(index: int) -> tuple:
        d = index - wl.FP4_SCALE_BIAS
        return ((const["kE2m1AsE4m3Lo"] + d * const["kFp4EntryStepLo"]) & 0xFFFFFFFF,
                (const["kE2m1AsE4m3Hi"] + d * const["kFp4EntryStepHi"]) & 0xFFFFFFFF)

    return entry, first


def test_computed_entries_equal_the_table_where_the_kernel_computes_them():
    """The expansion computes a scale's table entry when every index of the warp's rows is at
    least the first normal one: there it must be the table's (RNE) entry, and one index lower it
    must not be (the threshold is where e4m3 turns subnormal, not an arbitrary cut)."""
    entry, first = kernel_entry()
    for index in range(first, wl.FP4_NUM_SCALES):
        assert entry(index) == table_entry(index), index
    assert entry(first - 1) != table_entry(first - 1)


def _expand_words(stage: torch.Tensor, byte_of, index_byte=None) -> torch.Tensor:
    """One MXFP4 stage's words expanded with the kernel's word expansion and table entries, word t
    of run `run` (group t's word `run`, at slot t ^ ((row >> 1) & 3)) with the scale index in byte
    ``byte_of(run, t)`` of its row's index word, into logical K order: its low four e4m3 bytes are
    K 32 run + 4 t .., its high four K 32 run + 16 + 4 t .. (FP4_RUN_ORDER).  As floats."""
    expand = kernel_expand_word()
    index_byte = index_byte or kernel_index_byte()
    tables = [table_entry(i) for i in range(wl.FP4_NUM_SCALES)]
    data = stage[: 256 * 64].view(256, 64)
    idx_words = stage[256 * 64 :].view(torch.int32).tolist()
    out = torch.empty(256, 128, dtype=torch.uint8)
    for row in range(256):
        words = data[row].view(torch.int32).tolist()
        for t in range(4):
            slot = t ^ ((row >> 1) & 3)
            for run in range(4):
                index = index_byte(idx_words[row] & 0xFFFFFFFF, byte_of(run, t))
                lo, hi = expand(words[4 * slot + run] & 0xFFFFFFFF, tables[index])
                out[row, 32 * run + 4 * t : 32 * run + 4 * t + 4] = torch.tensor([(lo >> 8 * k) & 0xFF for k in range(4)],
                                                                                 dtype=torch.uint8)
                out[row, 32 * run + 16 + 4 * t : 32 * run + 20 + 4 * t] = torch.tensor(
                    [(hi >> 8 * k) & 0xFF for k in range(4)], dtype=torch.uint8)
    return out.view(torch.float8_e4m3fn).float()


def emulate_stage(stage: torch.Tensor, is_l2: bool) -> torch.Tensor:
    """One MXFP4 stage -> the 256 x 128 e4m3 values (as floats) the kernel expands it to, in
    logical (unswizzled) order, before the block scale."""
    # the run whose scale index a word takes, as fp4_expand_row picks it (L2: permuted K columns),
    # where the thread finds its groups (fp4_group_slot), which word of a group is a run's, and
    # where the words' halves go
    assert "even = is_l2 ? run & 2u : run, odd = is_l2 ? (run & 2u) + 1 : run;" in FP4_SOURCE
    assert "return group ^ ((row >> 1) & 3u);" in FP4_SOURCE
    assert "return row * kFp4RowBytes + fp4_group_slot(row, group) * 16;" in FP4_SOURCE
    assert "reinterpret_cast<const uint4*>(raw + fp4_group_offset(row, t)));" in FP4_SOURCE
    assert "return run == 0 ? group.x : run == 1 ? group.y : run == 2 ? group.z : group.w;" in FP4_SOURCE
    for t, lut in enumerate(("lut0", "lut0", "lut1", "lut1")):
        assert f"fp4_expand_word(fp4_group_word(w[{t}], run), {lut}, lo[{t}], hi[{t}]);" in FP4_SOURCE
    assert "((2 * run) ^ swizzle) * 16, lo[0], lo[1], lo[2], lo[3]);" in FP4_SOURCE
    assert "((2 * run + 1) ^ swizzle) * 16, hi[0], hi[1], hi[2], hi[3]);" in FP4_SOURCE

    def byte_of(run, t):  # words 0-1 take the scale of byte `even`, 2-3 of `odd`
        even, odd = ((run & 2), (run & 2) + 1) if is_l2 else (run, run)
        return even if t < 2 else odd

    return _expand_words(stage, byte_of)


def register_path_offsets():
    """run_tile_rs's stage offsets (consumer.cuh, its expressions read from the source): one group
    offset and one index offset per thread, plus a constant per unit u and row half r, must be
    where fp4_group_offset and the index words put the group t and the index word of the thread's
    row 128 wg + 64 u + 16 warp + g + 8 r (the rows whose A fragments it holds, and whose
    accumulators the epilogues read)."""
    assert "return row * kFp4RowBytes + fp4_group_slot(row, group) * 16;" in FP4_SOURCE
    group_row = re.search(r"uint32_t group_offset = fp4_group_offset\((.+), t\);", CONSUMER_SOURCE).group(1)
    group_step = re.search(r"raw \+ group_offset \+ (.+)\)\);", CONSUMER_SOURCE).group(1)
    index_base = re.search(r"uint32_t index_offset = (.+);", CONSUMER_SOURCE).group(1)
    index_step = re.search(r"raw \+ index_offset \+ (.+)\);", CONSUMER_SOURCE).group(1)
    consts = {"kFp4RowBytes": 64, "kFp4DataBytes": 256 * 64}

    def group_offset(row, t):
        return row * 64 + (t ^ wl.fp4_group_slot_key(row)) * 16

    for wg in range(2):
        for warp in range(4):
            for g in range(8):
                for t in range(4):
                    env = dict(consts, wg=wg, warp=warp, g=g, t=t)
                    base = group_offset(eval(group_row, {}, env), t)
                    index = eval(index_base, {}, env)
                    for u in range(2):
                        for r in range(2):
                            row = 128 * wg + 64 * u + 16 * warp + g + 8 * r
                            env.update(u=u, r=r)
                            assert base + eval(group_step, {}, env) == group_offset(row, t), (wg, warp, g, t, u, r)
                            assert index + eval(index_step, {}, env) == consts["kFp4DataBytes"] + 4 * row, (wg, warp, g, u, r)


def test_register_path_offsets_reach_each_rows_groups():
    register_path_offsets()


def emulate_fragments(stage: torch.Tensor, is_l2: bool) -> torch.Tensor:
    """The same stage as the register-operand path expands it (fp4.cuh fp4_unit_fragments): the
    thread of quad lane t loads group t of a row, and word s of it, with the scale index of byte
    s (L1) or (s & 2) | (t >> 1) (L2), expands to the row's K 32 s + 4 t .. + 3 (its A fragment's
    low register) and 32 s + 16 + 4 t .. (high); returned in logical K order like emulate_stage."""
    assert "const uint32_t byte = is_l2 ? (s & 2u) | (t >> 1) : s;" in FP4_SOURCE
    register_path_offsets()  # each thread's loads reach its rows' group t and index word
    assert "fp4_expand_word(fp4_group_word(w[r], s), lut, a[s][r], a[s][2 + r]);" in FP4_SOURCE
    return _expand_words(stage, lambda s, t: ((s & 2) | (t >> 1)) if is_l2 else s, kernel_table_index())


@pytest.mark.parametrize("path", ["stored_tile", "register_fragments"])
@pytest.mark.parametrize("layer", ["l1", "l2"])
def test_expanded_stages_equal_the_dequantized_weights(layer, path):
    """Every value the kernel would feed the tensor cores, from a stored e4m3 tile or straight as
    WGMMA A fragments, times its block's FP32 scale, equals the exact dequantized weight where its
    run lies at most 8 binades below the block's largest, and lies within 2^-10 of the block's
    scale (half an e4m3 subnormal step) further below."""
    torch.manual_seed(1)
    e, n, k = 1, 256, 256
    w = torch.randn(e, n, k) * torch.exp2(12 - torch.randint(0, 22, (e, n, k // 32)).float()).repeat_interleave(32, dim=2)
    packed, scales = quantize_mxfp4(w)
    stages, block_sf = wl.fp4_layer(packed, scales, layer)
    block_exp = wl.fp4_block_exponents(scales)
    assert torch.equal(block_sf, torch.exp2(block_exp.float()))
    # per-element exact value, block exponent and relative run exponent, moved as the layout moves them
    b_elem = block_exp.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)
    rel_elem = (scales.to(torch.int32) - 127).repeat_interleave(32, dim=2) - b_elem
    if layer == "l1":
        perm = wl.permute_l1_rows
    else:
        def perm(t):
            return wl.permute_l2_columns(wl.permute_l2_rows(t))
    order = perm(torch.arange(e * n * k, dtype=torch.int64).view(e, n, k)).reshape(-1)
    want = dequantize_mxfp4(packed, scales).reshape(-1)[order].view(n, k)
    b_perm = b_elem.reshape(-1)[order].view(n, k)
    rel_perm = rel_elem.reshape(-1)[order].view(n, k)
    assert (rel_perm <= wl.FP4_MAX_REL_EXP).all() and (rel_perm < -12).any() and (rel_perm >= -8).float().mean() > 0.3
    for kb in range(k // 128):
        cols = slice(128 * kb, 128 * kb + 128)
        emulate = emulate_stage if path == "stored_tile" else emulate_fragments
        got = emulate(stages[0, 0, kb], layer == "l2") * torch.exp2(b_perm[:, cols].float())
        exact = rel_perm[:, cols] >= -8
        assert torch.equal(got[exact], want[:, cols][exact]), "an exactly representable weight changed"
        bound = torch.exp2(b_perm[:, cols].float() - 10)
        assert ((got - want[:, cols]).abs() <= bound).all(), "a value below e4m3's normal range moved too far"


def test_stage_words_are_wgmma_a_fragments():
    """The stage layout's promise to the register-operand path (weight_layout.FP4_RUN_ORDER,
    fp4_group_slot_key; fp4.cuh fp4_unit_fragments): the thread of quad lane t that holds rows g and
    g + 8 of a WGMMA m64nNk32 e4m3 A operand needs, for K step s, the bytes of K 32 s + 4 t .. + 3
    (registers a0, a1) and 32 s + 16 + 4 t .. + 3 (a2, a3) of each row (PTX ISA, wgmma register
    fragments for .e4m3 A).  In the stage, word s of a row's group t, read at slot t ^ key(row),
    expands to exactly those: its low half the first four, its high half the second.  And the
    16-byte loads of both paths are free of bank conflicts: a quarter warp's eight lanes (the unit
    of a 16-byte shared load) reach eight different 16-byte bank groups, whether they hold groups
    0-3 of two rows (the register path) or one group of eight consecutive rows (the stored tile)."""
    expand = kernel_expand_word()
    assert "return row * kFp4RowBytes + fp4_group_slot(row, group) * 16;" in FP4_SOURCE
    register_path_offsets()
    assert "fp4_expand_word(fp4_group_word(w[r], s), lut, a[s][r], a[s][2 + r]);" in FP4_SOURCE
    torch.manual_seed(7)
    codes = torch.randint(0, 16, (1, 256, 128), dtype=torch.uint8)
    indices = torch.full((1, 256, 4), wl.FP4_SCALE_BIAS, dtype=torch.uint8)  # 2^0: e4m3 = the e2m1 value
    stage = wl.fp4_stages(codes, indices)[0, 0, 0]
    words = stage[: 256 * 64].view(256, 64).view(torch.int32)  # [256, 16]: 4 slots x 4 words
    lut = table_entry(wl.FP4_SCALE_BIAS)
    e4m3 = torch.tensor([e2m1_values(torch.tensor([c])).item() for c in range(16)]).to(torch.float8_e4m3fn)
    want_bytes = e4m3.view(torch.uint8)[codes[0].long()]  # [256, 128]
    for row in range(256):
        for t in range(4):
            slot = t ^ wl.fp4_group_slot_key(row)
            for s in range(4):
                lo, hi = expand(int(words[row, 4 * slot + s]) & 0xFFFFFFFF, lut)
                got = [(lo >> 8 * k) & 0xFF for k in range(4)] + [(hi >> 8 * k) & 0xFF for k in range(4)]
                want = want_bytes[row, 32 * s + 4 * t: 32 * s + 4 * t + 4].tolist() + \
                    want_bytes[row, 32 * s + 16 + 4 * t: 32 * s + 20 + 4 * t].tolist()
                assert got == want, (row, s, t)

    def bank_group(row, t):
        return (row * 64 + 16 * (t ^ wl.fp4_group_slot_key(row))) // 16 % 8

    for first in range(0, 256, 16):  # a warp's 16 rows of a unit: lane l holds rows first + l / 4 and + 8
        for r in (0, 8):
            for quarter in range(4):
                lanes = range(8 * quarter, 8 * quarter + 8)
                assert len({bank_group(first + r + lane // 4, lane % 4) for lane in lanes}) == 8, (first, r, quarter)
    for first in range(0, 256, 8):  # the stored tile: eight consecutive rows' group t
        for t in range(4):
            assert len({bank_group(row, t) for row in range(first, first + 8)}) == 8, (first, t)


def _c_expression(source: str, pattern: str) -> str:
    """The right-hand side of the one C++ line matching ``pattern``, as Python (unsigned ``/`` ->
    ``//``)."""
    found = re.findall(pattern, source)
    assert len(found) == 1, (pattern, found)
    return found[0].replace(" / ", " // ")


def test_register_path_epilogues_store_where_the_layout_expects():
    """The register-operand decode tiles' epilogues (consumer.cuh rs_epilogue_l1 / _l2) put each
    value where the weight layout expects it.  L1: a thread's accumulator rows g and g + 8 of warp
    `warp`, unit `u`, warpgroup `wg` are tile rows 128 wg + 64 u + 16 warp + g (+ 8), which after
    permute_l1_rows are gate (and up) channel 8 (8 wg + 4 u + warp) + g of the tile's 128; its
    activation must land at the pool column W2's permuted K columns (permute_l2_columns) read that
    channel from.  L2: W2 row `row` holds output channel permute_l2_rows's source of that row,
    which is the column the staged output must go to."""
    e = 1
    channels = torch.arange(2 * 128).view(1, 2 * 128, 1)  # one tile's 256 rows: 128 gate, 128 up
    l1_rows = wl.permute_l1_rows(channels.expand(e, 256, 128)).view(256, 128)[:, 0]
    pool_channel = wl.permute_l2_columns(torch.arange(128).view(1, 1, 128).expand(1, 32, 128))[0, 0]  # column -> channel
    column_expr = _c_expression(CONSUMER_SOURCE, r"const uint32_t column = (64 \* wg [^;]*);")
    for wg, u, warp, g in itertools.product(range(2), range(2), range(4), range(8)):
        row = 128 * wg + 64 * u + 16 * warp + g
        gate, up = int(l1_rows[row]), int(l1_rows[row + 8])
        assert gate < 128 and up == gate + 128, (row, gate, up)  # rows g / g + 8: a channel's gate and up
        column = eval(column_expr, {"wg": wg, "u": u, "warp": warp, "g": g})
        assert int(pool_channel[column]) == gate, (wg, u, warp, g, column)
    out_channel = wl.permute_l2_rows(torch.arange(256).view(1, 256, 1).expand(1, 256, 8))[0, :, 0]  # row -> channel
    l2_expr = _c_expression(CONSUMER_SOURCE, r"const uint32_t column = (row - r [^;]*);")
    for row in range(256):
        assert eval(l2_expr, {"row": row, "r": row % 32}) == int(out_channel[row]), row


def test_transform_checks_formats_before_any_launch():
    p = make_problem(SMALL_FP4, 0, 1, 4, 4)
    l1, l2 = transform_weights_for_mega_moe((p.w1, p.w1_sf), (p.w2, p.w2_sf))
    assert l1.weights == l2.weights == "fp4"
    assert l1.weight.shape == (8, 256 * 2 // 256, 512 // 128, FP4_STAGE_BYTES)
    assert l1.scale.shape == (8, 2 * 256 // 128, 512 // 128, 2) and l2.scale.shape == (8, 512 // 128, 256 // 128)
    fp8 = make_problem(MoEShape(512, 256, 8, 2), 0, 1, 4, 4)
    with pytest.raises(MegaMoEError, match="one weight format, got l1 fp4 .* and l2 fp8"):
        transform_weights_for_mega_moe((p.w1, p.w1_sf), (fp8.w2, fp8.w2_sf))
    with pytest.raises(MegaMoEError, match="NaN code"):
        transform_weights_for_mega_moe((p.w1, torch.full_like(p.w1_sf, 255)), (p.w2, p.w2_sf))
    with pytest.raises(MegaMoEError, match="l2: MXFP4 scales must be"):
        transform_weights_for_mega_moe((p.w1, p.w1_sf), (p.w2, p.w2_sf[..., :2]))
    with pytest.raises(MegaMoEError, match="w2 must be MXFP4"):
        transform_weights_for_mega_moe((p.w1, p.w1_sf), (p.w2[:, :256], p.w2_sf[:, :256]))


# --- reference and variants ---------------------------------------------------------------------

@pytest.mark.slow
def test_reference_dequantizes_mxfp4_exactly_and_clamps():
    p = make_problem(SMALL_FP4, 0, 1, 12, 12, seed=3)
    y = moe_reference(p.x, p.x_sf, p.topk_idx, p.topk_weights, p.w1, p.w1_sf, p.w2, p.w2_sf)
    assert torch.equal(y, moe_reference_loop(p.x, p.x_sf, p.topk_idx, p.topk_weights, p.w1, p.w1_sf, p.w2, p.w2_sf))
    # the same layer with the weights as FP32 tensors through the FP8 reference's math
    w1 = dequantize_mxfp4(p.w1, p.w1_sf).double()
    h = (p.x.float() * p.x_sf.repeat_interleave(128, 1)).double() @ w1[0].T
    assert torch.isfinite(h).all()
    clamped = moe_reference(p.x, p.x_sf, p.topk_idx, p.topk_weights, p.w1, p.w1_sf, p.w2, p.w2_sf,
                            activation_clamp=0.05)
    assert not torch.equal(clamped, y), "a clamp of 0.05 did not bite"
    wide = moe_reference(p.x, p.x_sf, p.topk_idx, p.topk_weights, p.w1, p.w1_sf, p.w2, p.w2_sf,
                         activation_clamp=1e6)
    assert torch.equal(wide, y), "a clamp nothing reaches changed the result"
    shape = MoEShape(512, 256, 8, 2, weights="fp4", activation_clamp=0.05)
    pc = make_problem(shape, 0, 1, 12, 12, seed=3)
    assert torch.equal(moe_reference_distributed(pc), clamped)


def test_presets_and_variant_names():
    pro, flash = PRESETS["deepseek-v4-pro"], PRESETS["deepseek-v4-flash"]
    assert (pro.weights, pro.activation_clamp) == ("fp4", 10.0) and (flash.hidden, flash.num_experts) == (4096, 256)
    assert "_wfp4_clamp10_" in Variant(pro, 2, 128, 64, 4).name
    assert "_w" not in Variant(PRESETS["deepseek-v3"], 2, 128, 64, 4).name  # FP8 names (and caches) unchanged
    Variant(pro, 2, 128, 128, 4).validate()  # wide and narrow block_m 128 tiles
    with pytest.raises(MegaMoEError, match="MXFP4 weights run with"):
        Variant(pro, 2, 128, 128, 3, 2).validate()
    with pytest.raises(MegaMoEError, match="activation_clamp must be"):
        MoEShape(512, 256, 8, 2, activation_clamp=-1.0)
    assert math.isclose(MoEShape(512, 256, 8, 2, activation_clamp=3).activation_clamp, 3.0)



def test_mxfp4_as_fp8_blocks_is_what_the_kernel_expands():
    """The baseline's conversion (every weight as e4m3 times its block's 2^B) equals the kernel's
    expansion value for value, flushes and subnormals included."""
    torch.manual_seed(5)
    w = torch.randn(1, 256, 256) * torch.exp2(12 - torch.randint(0, 22, (1, 256, 8)).float()).repeat_interleave(32, 2)
    packed, scales = quantize_mxfp4(w)
    q, sf = wl.mxfp4_as_fp8_blocks(packed, scales)
    assert q.dtype == torch.float8_e4m3fn and sf.shape == (1, 2, 2)
    stages, block_sf = wl.fp4_layer(packed, scales, "l1")
    assert torch.equal(sf, block_sf)
    got = emulate_stage(stages[0, 0, 1], False)  # the second K block of the one 256-row tile
    want = wl.permute_l1_rows(q.view(torch.uint8)).view(torch.float8_e4m3fn)[0, :, 128:].float()
    assert torch.equal(got, want)

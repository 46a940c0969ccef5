// MXFP4 weights expanded to e4m3 on chip (SPEC §2b): the format's constants and the expansion of
// one stored stage into the 128B-swizzled e4m3 tile that the FP8 WGMMAs read, or straight into
// WGMMA A fragments.  No kernel state: the consumers (consumer.cuh) and the expansion
// microbenchmark (csrc/microbench/fp4_expand.cu) run the same code.  The stage as
// megamoe_cli/kernel/weight_layout.py lays it out (fp4_stages): kFp4StageRows rows x kFp4RowBytes bytes
// of codes, then kFp4StageRows rows x 4 scale indices (each run's exponent relative to its 128x128
// block's FP32 scale, biased by kFp4ScaleBias).  Word t of 32-code run s holds codes 4t..4t+3 and
// 16+4t..16+4t+3 (FP4_RUN_ORDER: a WGMMA A fragment's two registers of K step s) as
// weight_layout.fp4_words packs 8 codes; a row's 16-byte group t holds word t of runs 0-3 (one
// thread's fragments of all four K steps) and sits at slot t ^ fp4_group_slot_key(row).
#pragma once
#include <cuda_fp8.h>

#include <cstdint>

#include "ptx.cuh"

namespace megamoe {

constexpr uint32_t kFp4StageRows = 256;                 // the tile's N (the contract's BLOCK_N)
constexpr uint32_t kFp4StageK = 128;                    // one K block (the contract's BLOCK_K)
constexpr uint32_t kFp4RowBytes = kFp4StageK / 2;       // two codes a byte
constexpr uint32_t kFp4DataBytes = kFp4StageRows * kFp4RowBytes;
constexpr uint32_t kFp4NumScales = 32;
constexpr int32_t kFp4ScaleBias = 25;
// Scale indices from which every e2m1 magnitude times 2^(index - kFp4ScaleBias) is a normal e4m3
// value: the stored-tile expansion computes those table entries (fp4_entry), and reads the rest
// (rounded subnormals, flushes) from the table in shared memory; the register-operand path reads
// every entry from the table (fp4_unit_fragments).
constexpr uint32_t kFp4FirstNormalIndex = kFp4ScaleBias - 5;

// Bit 7 of byte b is set where scale-index byte b of `word` is at least kFp4FirstNormalIndex
// (indices are below kFp4NumScales, so no byte carries into the next): ANDed over a warp's rows,
// anything but kFp4AllNormal left means some entry must come from the table.  One add a word,
// half the instructions of comparing bytes (__vcmpltu4).
constexpr uint32_t kFp4AllNormal = 0x80808080u;
__device__ __forceinline__ uint32_t fp4_normal_bytes(uint32_t word) {
    return word + (128u - kFp4FirstNormalIndex) * 0x01010101u;
}

// The 16-byte slot of group `group` in stage row `row` (weight_layout.fp4_group_slot_key): eight
// consecutive rows' loads of one group, or of groups t = lane % 4 of two rows, are free of bank
// conflicts
__device__ __forceinline__ uint32_t fp4_group_slot(uint32_t row, uint32_t group) { return group ^ ((row >> 1) & 3u); }

// Where group `group` of stage row `row` starts, in bytes from the stage
__device__ __forceinline__ uint32_t fp4_group_offset(uint32_t row, uint32_t group) {
    return row * kFp4RowBytes + fp4_group_slot(row, group) * 16;
}

// Word `run` of a group (the group's words are runs 0-3's)
__device__ __forceinline__ uint32_t fp4_group_word(const uint4& group, uint32_t run) {
    return run == 0 ? group.x : run == 1 ? group.y : run == 2 ? group.z : group.w;
}

// Table entry i: the e4m3 bytes of the 8 e2m1 magnitudes times 2^(i - kFp4ScaleBias), codes 0-3
// in .x and 4-7 in .y, rounded to nearest even where e4m3 has no exact value (subnormals,
// flushes to zero; see megamoe_cli/kernel/weight_layout.py).
__device__ __forceinline__ uint2 fp4_table_entry(uint32_t index) {
    constexpr float kE2m1[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float scale = __int_as_float((127 + static_cast<int32_t>(index) - kFp4ScaleBias) << 23);
    uint32_t word[2] = {0u, 0u};
    #pragma unroll
    for (uint32_t c = 0; c < 8; ++c) {
        const uint32_t byte = __nv_cvt_float_to_fp8(kE2m1[c] * scale, __NV_SATFINITE, __NV_E4M3);
        word[c / 4] |= byte << (8 * (c % 4));
    }
    return make_uint2(word[0], word[1]);
}

// Eight e2m1 codes (a word as weight_layout.fp4_words packs them: nibble k holds code k's
// magnitude in bits 0-2 and one code's sign in bit 3, codes 0-3's at bits 7, 15, 23, 31, codes
// 4-7's at bits 3, 11, 19, 27) -> eight e4m3 bytes, codes 0-3 in `lo` and 4-7 in `hi`: the
// magnitudes by byte permutes of the scale's table entry, the signs ORed in at bit 7 of their bytes
// as they lie or after a 4-bit shift.  Seven instructions: the permutes are ptx::prmt, whose
// selectors (the magnitudes, every nibble's bit 3 clear) need no further mask, where __byte_perm
// would AND each with 0x7777 (two more a word); the mask is opaque to the compiler, which would
// otherwise narrow it into one mask per half.
__device__ __forceinline__ void fp4_expand_word(uint32_t w, uint2 lut, uint32_t& lo, uint32_t& hi) {
    uint32_t mag;
    asm("and.b32 %0, %1, 0x77777777;" : "=r"(mag) : "r"(w));
    lo = ptx::prmt(lut.x, lut.y, mag) | (w & 0x80808080u);
    hi = ptx::prmt(lut.x, lut.y, mag >> 16) | ((w << 4) & 0x80808080u);
}

// Byte `byte` (0-3) of `word`, zero-extended: one prmt (its upper selector nibbles pick byte 0 of
// the zero operand), where a shift and a mask take two
__device__ __forceinline__ uint32_t fp4_index_byte(uint32_t word, uint32_t byte) {
    return ptx::prmt(word, 0u, 0x4440u | byte);
}

// The table entry of a scale index from kFp4FirstNormalIndex up, computed: the e4m3 bytes of the
// magnitudes {0, 0.5, 1, 1.5 | 2, 3, 4, 6} with d = index - kFp4ScaleBias added to the exponent
// field (bits 3-6) of every nonzero byte.  No byte carries into the next: the smallest nonzero
// byte (0.5: 0x30) stays positive down to d = -5, and the largest (6: 0x4c) reaches 0x7c (384)
// at d = 6, below NaN (0x7f).  Two IMADs instead of a dependent shared-memory load.
constexpr uint32_t kE2m1AsE4m3Lo = 0x3c383000u, kE2m1AsE4m3Hi = 0x4c484440u;
constexpr uint32_t kFp4EntryStepLo = 0x08080800u, kFp4EntryStepHi = 0x08080808u;  // d = 1 (byte 0: code 0 stays 0)
__device__ __forceinline__ uint2 fp4_entry(uint32_t index) {
    // base + (index - bias) * step, modulo 2^32 (a negative d subtracts), one IMAD a word
    constexpr uint32_t kBias = static_cast<uint32_t>(kFp4ScaleBias);
    return make_uint2(index * kFp4EntryStepLo + (kE2m1AsE4m3Lo - kBias * kFp4EntryStepLo),
                      index * kFp4EntryStepHi + (kE2m1AsE4m3Hi - kBias * kFp4EntryStepHi));
}

// Runs [first_run, first_run + kRuns) of the thread's stage row `row`, its four groups `w`
// already loaded, into the e4m3 tile `dst`, in the 128B-swizzled layout TMA would have written
// (16-byte unit u of row r at unit u ^ (r % 8)): word t of a run expands to K 4t.. of the run
// (low half) and K 16 + 4t.. (high half), so the low halves fill the run's first unit and the high
// halves its second.  Words 0-1 take the scale index of byte `even`, 2-3 of byte `odd`: the run's
// own in L1; in L2, whose K columns are permuted inside 64-column groups
// (transform_weights_for_mega_moe), run s's columns with K % 16 < 8 hold channels of the group's
// run 2 (s / 2), the rest of run 2 (s / 2) + 1.  kTable: the entries from `table` (some index of
// the warp's rows is below kFp4FirstNormalIndex), else computed.
template <bool kTable, uint32_t kRuns>
__device__ __forceinline__ void fp4_expand_row(const uint2* table, const uint4 (&w)[4], uint8_t* dst, uint32_t row,
                                               uint32_t indices, bool is_l2, uint32_t first_run) {
    uint8_t* dst_row = dst + row * kFp4StageK;
    const uint32_t swizzle = row % 8;
    #pragma unroll
    for (uint32_t i = 0; i < kRuns; ++i) {
        const uint32_t run = first_run + i;
        const uint32_t even = is_l2 ? run & 2u : run, odd = is_l2 ? (run & 2u) + 1 : run;
        const uint32_t i0 = fp4_index_byte(indices, even), i1 = fp4_index_byte(indices, odd);
        const uint2 lut0 = kTable ? ptx::ld_shared_v2_u32(&table[i0]) : fp4_entry(i0);
        const uint2 lut1 = kTable ? ptx::ld_shared_v2_u32(&table[i1]) : fp4_entry(i1);
        uint32_t lo[4], hi[4];
        fp4_expand_word(fp4_group_word(w[0], run), lut0, lo[0], hi[0]);
        fp4_expand_word(fp4_group_word(w[1], run), lut0, lo[1], hi[1]);
        fp4_expand_word(fp4_group_word(w[2], run), lut1, lo[2], hi[2]);
        fp4_expand_word(fp4_group_word(w[3], run), lut1, lo[3], hi[3]);
        ptx::st_shared_v4_u32(dst_row + ((2 * run) ^ swizzle) * 16, lo[0], lo[1], lo[2], lo[3]);
        ptx::st_shared_v4_u32(dst_row + ((2 * run + 1) ^ swizzle) * 16, hi[0], hi[1], hi[2], hi[3]);
    }
}

// Expand part `part` of kParts (kFp4StageRows / kParts rows) of the stored stage `raw` into the
// e4m3 tile `dst` (kFp4StageRows x kFp4StageK bytes), by the 128 threads of one warpgroup (`tid`
// % 128).  A thread takes whole rows (part rows + 128 j + tid % 128), or with kParts 4 two threads
// share a row (runs 0-1 and 2-3): a warp reads its rows' groups at bank-spreading slots and its
// stores of one unit index cover every bank group.  `table`: kFp4NumScales entries
// (fp4_table_entry).
template <uint32_t kParts>
__device__ __forceinline__ void fp4_expand_part(const uint8_t* raw, const uint2* table, uint8_t* dst, uint32_t part,
                                                bool is_l2, uint32_t tid) {
    constexpr uint32_t kPartRows = kFp4StageRows / kParts;
    constexpr uint32_t kThreadsPerRow = kPartRows >= 128 ? 1 : 128 / kPartRows;
    constexpr uint32_t kRows = kPartRows >= 128 ? kPartRows / 128 : 1;  // rows per thread
    constexpr uint32_t kRuns = 4 / kThreadsPerRow;
    static_assert(kPartRows % 128 == 0 || kThreadsPerRow == 2, "a part is a multiple of 128 rows, or 64");
    const uint32_t first_row = kPartRows * part + (tid % 128) / kThreadsPerRow;
    const uint32_t first_run = kThreadsPerRow == 1 ? 0 : 2 * (tid % 2);
    // Every load of the stage goes out before the vote on the scales, so the codes' round trip
    // through shared memory overlaps the indices' instead of following the branch (the loads are
    // volatile: the compiler keeps them where they are written).
    uint32_t indices[kRows];
    uint4 w[kRows][4];
    #pragma unroll
    for (uint32_t j = 0; j < kRows; ++j) {
        const uint32_t row = first_row + 128 * j;
        indices[j] = ptx::ld_shared_u32(raw + kFp4DataBytes + row * 4);
        #pragma unroll
        for (uint32_t t = 0; t < 4; ++t)
            w[j][t] = ptx::ld_shared_v4_u32(
                reinterpret_cast<const uint4*>(raw + fp4_group_offset(row, t)));
    }
    uint32_t normal = kFp4AllNormal;
    #pragma unroll
    for (uint32_t j = 0; j < kRows; ++j)
        normal &= fp4_normal_bytes(indices[j]);
    const bool table_path = __any_sync(0xffffffffu, normal != kFp4AllNormal);
    #pragma unroll
    for (uint32_t j = 0; j < kRows; ++j) {
        if (table_path)
            fp4_expand_row<true, kRuns>(table, w[j], dst, first_row + 128 * j, indices[j], is_l2, first_run);
        else
            fp4_expand_row<false, kRuns>(table, w[j], dst, first_row + 128 * j, indices[j], is_l2, first_run);
    }
}

// Where the table entry of scale-index byte `byte` of a row lies: `scaled` is the row's index
// word times sizeof(uint2) (each index is below kFp4NumScales, so each byte's product stays in its
// byte), `table` the table's shared-memory address, a multiple of the table's 256 bytes, so the
// entry's offset is the address's low byte: one prmt makes the address, where an index, a shift and
// an add take three (or two IMADs compute a normal entry).
static_assert(kFp4NumScales * sizeof(uint2) == 256, "fp4_table_slot: the entry offsets are one byte");
__device__ __forceinline__ uint32_t fp4_table_slot(uint32_t table, uint32_t scaled, uint32_t byte) {
    return ptx::prmt(scaled, table, 0x7650u | byte);
}

// The register-operand path (decode tiles of at most 16 rows, consumer.cuh run_tile_rs): the A
// fragments of one 64-row unit of the stage for its four K steps, expanded straight from the
// stored words.  Thread (warp w, lane l: g = l / 4, t = l % 4) holds rows first_row = unit + 16 w
// + g and first_row + 8; a[s] = {row g K 32 s + 4 t.., row g + 8 the same, row g K 32 s + 16 + 4 t..,
// row g + 8 the same} (wgmma's .e4m3 A fragment), which is word t of run s of each row: `w`, the
// rows' groups t (one 16-byte load each, at fp4_group_offset of the row and t).  `scaled`: the two
// rows' scale-index words times sizeof(uint2); a word's scale is its run's (L1) or, in L2's
// permuted runs, the 64-column group's run 2 (s / 2) + t / 2 (fp4_expand_row).  Every entry comes
// from the table at `table` (its shared-memory address): one prmt and one load a word, against
// an index prmt and two IMADs for a computed one, and no vote on the indices, since the table
// holds the subnormal and flushed entries too.
__device__ __forceinline__ void fp4_unit_fragments(const uint4 (&w)[2], uint32_t table, uint32_t t,
                                                   const uint32_t (&scaled)[2], bool is_l2, uint32_t (&a)[4][4]) {
    #pragma unroll
    for (uint32_t r = 0; r < 2; ++r) {
        #pragma unroll
        for (uint32_t s = 0; s < 4; ++s) {
            const uint32_t byte = is_l2 ? (s & 2u) | (t >> 1) : s;
            const uint2 lut = ptx::ld_shared_v2_u32_at(fp4_table_slot(table, scaled[r], byte));
            fp4_expand_word(fp4_group_word(w[r], s), lut, a[s][r], a[s][2 + r]);
        }
    }
}

// Half `half` (128 rows) of the stage, by one warpgroup (fp4_expand_part)
__device__ __forceinline__ void fp4_expand_half(const uint8_t* raw, const uint2* table, uint8_t* dst, uint32_t half,
                                                bool is_l2, uint32_t tid) {
    fp4_expand_part<2>(raw, table, dst, half, is_l2, tid);
}

}  // namespace megamoe

// The consumer role (warpgroups 1 and 2): FP8 WGMMAs with per-128-K promotion over each tile
// the producer streams in, the MXFP4 expansion of the weights to e4m3 in shared memory (or, for
// decode tiles of at most 16 rows, straight into register operands: run_tile_rs), the L1
// SwiGLU/requant epilogue (handed to the publisher) and the L2 combine-push epilogue.  Knows
// nothing about ranks except where the L2 epilogue pushes a finished row.
#pragma once
#include "producer.cuh"
#include "publisher.cuh"
#include "scheduler.cuh"
#include "storage.cuh"

namespace megamoe {

// MXFP4 expansion table (fp4_table_entry), filled by the first kFp4NumScales consumer threads
// before the schedule barrier, which orders it for all.
template <typename Storage>  // a template, so FP8 builds (no Fp4Storage) discard the body unchecked
__device__ __forceinline__ void fp4_fill_table(Storage& ss, uint32_t consumer_thread) {
    if constexpr (kWeightFp4) {
        if (consumer_thread < kFp4NumScales)
            ss.fp4_table[consumer_thread] = fp4_table_entry(consumer_thread);
    }
}

// Expand B half `half` of stage `stage` into the e4m3 tile `dst` (fp4_expand_half, fp4.cuh).
template <typename Storage>
__device__ __forceinline__ void fp4_expand(const Storage& ss, uint32_t stage, uint8_t* dst, uint32_t half, bool is_l2,
                                           uint32_t tid) {
    if constexpr (kWeightFp4)
        fp4_expand_half(ss.b_raw[stage], ss.fp4_table, dst, half, is_l2, tid);
}

__device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.0f + __expf(-x)); }

// What one consumer warpgroup owns inside a tile: kParts parts of 64 rows x 128 columns, part j
// the rows from row_base(row_set(j)) and tile half half(j), its accumulators acc[64 j ..].
// FP8 wide (block_m 128): rows 64 wg.. and both halves.  Split columns (block_m 64, or a narrow
// block_m 128 block, one with at most 64 valid rows): rows 0-63 and half wg, so a block that is
// mostly padding costs half the WGMMAs (notes entry 27).  MXFP4 wide (kRowSets 2): all 128 rows
// of half wg, so each warpgroup's WGMMAs read only the e4m3 half it expands itself and the two
// warpgroups never wait for each other inside the K loop: one's expansion can run under the
// other's WGMMAs.
template <bool kNarrow>
struct WgSlice {
    static constexpr uint32_t kRowSets = kWeightFp4 && kBlockM == 128 && !kNarrow ? 2 : 1;
    static constexpr bool kSplitColumns = kBlockM == 64 || kNarrow || kRowSets == 2;
    static constexpr uint32_t kParts = kSplitColumns && kRowSets == 1 ? 1 : 2;
    uint32_t wg;
    // The first row of row set `set`
    __device__ __forceinline__ uint32_t row_base(uint32_t set) const {
        return kRowSets == 2 ? 64 * set : kSplitColumns ? 0 : 64 * wg;
    }
    __device__ __forceinline__ uint32_t row_set(uint32_t j) const { return kRowSets == 2 ? j : 0; }
    __device__ __forceinline__ uint32_t half(uint32_t j) const { return kSplitColumns ? wg : j; }
};

// What the epilogues read from global memory: an L1 tile's routing weights of the thread's
// rows, an L2 tile's pool metadata of them ({rank, token, slot}: where each row goes).  Loaded
// when a tile starts, so that the latency is not paid between the last promotion and the
// stores (only the epilogue reads them, so the loop does not wait for them), except for MXFP4
// wide slices: their four rows' inputs held through the loop make ptxas spill, so run_tile
// loads them after it.
// Row 2 s + r of the thread: row r0 + 8 r of its row set s.
template <uint32_t kRowSets>
struct EpilogueInputs {
    float weight[2 * kRowSets];
    int4 src[2 * kRowSets];
    bool valid[2 * kRowSets];  // L2: the row holds a pair (its push goes out)
};

template <typename Slice>
__device__ __forceinline__ EpilogueInputs<Slice::kRowSets> load_epilogue_inputs(const Params& p, const SharedStorage& ss,
                                                                                 const Tile& tile, Slice slice,
                                                                                 uint32_t tid) {
    const uint32_t warp = (tid % 128) / 32, lane = tid % 32;
    const uint32_t m0 = tile.block * kBlockM;
    EpilogueInputs<Slice::kRowSets> in;
    #pragma unroll
    for (uint32_t s = 0; s < Slice::kRowSets; ++s) {
        const uint32_t r0 = slice.row_base(s) + warp * 16 + lane / 4;
        if (!tile.is_l2) {
            const float* pool_weights = at<float>(p, p.off_l1_pool_weights);
            in.weight[2 * s] = __ldcg(pool_weights + m0 + r0);
            in.weight[2 * s + 1] = __ldcg(pool_weights + m0 + r0 + 8);
            in.src[2 * s] = in.src[2 * s + 1] = make_int4(0, 0, 0, 0);
            in.valid[2 * s] = in.valid[2 * s + 1] = false;
        } else {
            in.weight[2 * s] = in.weight[2 * s + 1] = 0.0f;
            const int4* meta = at<int4>(p, p.off_pool_src_meta);
            #pragma unroll
            for (uint32_t r = 0; r < 2; ++r) {
                // Three scalar loads, not one vector: a dead fourth word's register would be
                // reused by the K loop, whose write would then wait for the load to land.
                const uint32_t k = 2 * s + r;
                in.src[k] = make_int4(0, 0, 0, 0);
                in.valid[k] = tile.direct ? ss.schedule.direct_row_valid(tile.expert, r0 + 8 * r) : r0 + 8 * r < tile.rows;
                if (in.valid[k]) {
                    const int* row_meta = reinterpret_cast<const int*>(meta + m0 + r0 + 8 * r);
                    in.src[k].x = __ldcg(row_meta);
                    in.src[k].y = __ldcg(row_meta + 1);
                    in.src[k].z = __ldcg(row_meta + 2);
                }
            }
        }
    }
    return in;
}

// The consumers' cycle counters, a compile-time instrumentation policy: in profiling builds
// (MEGAMOE_PROFILE) each warpgroup's first thread samples into ss.prof[wg]; in every other build
// the struct is empty and the MEGAMOE_PROF lines that read it compile to nothing, so the hot path
// has one signature for both and release builds spend no register or instruction on it.
// ss.prof[wg]: slots 0-6 count ProfileSlot 0-6 and are summed into megamoe_profile at the end of
// consumer_loop; 10-15 count MAINLOOP_L1, MAINLOOP_HEAD, MAINLOOP_HEAD_L2, MMA_WAIT, FP4_EXPAND,
// FP4_EXPAND_BARRIER; 7-9 hold timestamps (the L1 epilogue's release, the current tile's or phase's
// start, consumer_loop's start).
struct ConsumerProfile {
#ifdef MEGAMOE_PROFILE
    bool sampler;        // this thread samples (its warpgroup's first)
    uint64_t* counters;  // ss.prof[wg]
    __device__ __forceinline__ ConsumerProfile(SharedStorage& ss, uint32_t wg, uint32_t tid)
        : sampler(tid % 128 == 0), counters(ss.prof[wg]) {}
    // The accounting both tile paths (run_tile, run_tile_rs) share: the first two K blocks'
    // time from the tile's start (call before K block kb's stage wait) ...
    __device__ __forceinline__ void k_block_start(const Tile& tile, uint32_t kb) const {
        if (sampler && kb == 2) {
            const uint64_t head = clock64() - counters[8];
            counters[11] += head;
            if (tile.is_l2)
                counters[12] += head;
        }
    }
    // ... the main loop's end (returns the epilogue's start) ...
    __device__ __forceinline__ uint64_t mainloop_end(const Tile& tile) const {
        const uint64_t now = clock64();
        if (sampler) {
            counters[kProfMainloop] += now - counters[8];
            if (!tile.is_l2)
                counters[10] += now - counters[8];
        }
        return now;
    }
    // ... a span into slot `slot` ...
    __device__ __forceinline__ void add(uint32_t slot, uint64_t since) const {
        if (sampler)
            counters[slot] += clock64() - since;
    }
    // ... and the epilogue's end (an L1 epilogue set counters[7] at its release: publish_l1_tile).
    __device__ __forceinline__ void epilogue_end(const Tile& tile, uint64_t epilogue_start) const {
        if (sampler && tile.is_l2) {
            counters[kProfEpilogueL2] += clock64() - epilogue_start;
            counters[kProfTilesL2] += 1;
        } else if (sampler) {
            counters[kProfEpilogueL1] += clock64() - epilogue_start;
            counters[kProfTilesL1] += 1;
            MEGAMOE_PROF_ADD(kProfEpilogueL1Math, counters[7] - epilogue_start);
            MEGAMOE_PROF_ADD(kProfEpilogueL1Release, clock64() - counters[7]);
        }
    }
#else
    __device__ __forceinline__ ConsumerProfile(SharedStorage&, uint32_t, uint32_t) {}
#endif
};

// Hands a finished L1 tile (its pool columns and scales written by every consumer thread) to the
// publisher warp; false when the publisher has not caught up within the deadline.
// NOTES: the L2 producer reads these columns with TMA (async proxy) after acquiring the block's
// ready bit of this N tile, so every writer fences the proxies, then arrives at the publisher
// warp's barrier; that warp's fence and relaxed OR publish the tile (a release pattern,
// cumulative over every writer's stores through the barrier: publish_l1_tiles).  The consumers
// go on to their next tile without waiting for each other or for the fence (notes entry 64: it
// was a barrier of both warpgroups and thread 0's fence and OR).
template <typename Storage>
__device__ __forceinline__ bool publish_l1_tile(const Params& p, Storage& ss, const Tile& tile, uint32_t tid,
                                                const ConsumerProfile& prof, uint32_t& l1_tiles) {
    MEGAMOE_PROF(if (prof.sampler) prof.counters[7] = clock64();)
    ptx::fence_proxy_async_global();
    const uint32_t seq = l1_tiles;
    if (!publisher_caught_up(p, ss, seq))
        return false;
    ++l1_tiles;
    if (tid % kNumConsumerThreads == 0)
        ss.publish_slot[seq & 1] = make_uint4(tile.block * kL2ReadyWords + tile.n / 32, 1u << (tile.n % 32), seq, 0);
    publish_arrive(seq & 1);
    return true;
}

// L1 epilogue: act = silu(gate) * up * routing weight, requantized to FP8 with one scale
// per row per 128 channels.  Tile half c holds channels [64 c, 64 c + 64) of the tile's
// 128; inside a half, accumulator column 16 g + i is gate channel 8 g + i, 16 g + 8 + i up.
// The act of channel 8 g + 2 q + e (lane q of a quad) is stored at pool column 16 q + 2 g + e
// of the half, so each lane stores its 16 values of a row as one 16-byte vector; W2's K
// columns carry the same permutation (transform_weights_for_mega_moe).
template <typename Slice>
__device__ __forceinline__ bool epilogue_l1(const Params& p, SharedStorage& ss, const Tile& tile,
                                            float (&acc)[64 * kNumPartsPerWg], Slice slice, uint32_t tid,
                                            const EpilogueInputs<Slice::kRowSets>& in, const ConsumerProfile& prof,
                                            uint32_t& l1_tiles) {
    constexpr uint32_t kSets = Slice::kRowSets;
    const uint32_t warp = (tid % 128) / 32, lane = tid % 32, q = lane % 4;
    const uint32_t m0 = tile.block * kBlockM;
    uint32_t r0[kSets];
    #pragma unroll
    for (uint32_t s = 0; s < kSets; ++s)
        r0[s] = slice.row_base(s) + warp * 16 + lane / 4;

    // Activations overwrite the gate slots of the accumulators.
    float amax[kSets][2];
    #pragma unroll
    for (uint32_t s = 0; s < kSets; ++s)
        amax[s][0] = amax[s][1] = 0.0f;
    #pragma unroll
    for (uint32_t h = 0; h < Slice::kParts; ++h) {
        const uint32_t set = slice.row_set(h);
        #pragma unroll
        for (uint32_t g = 0; g < 8; ++g) {
            #pragma unroll
            for (uint32_t r = 0; r < 2; ++r) {
                #pragma unroll
                for (uint32_t e = 0; e < 2; ++e) {
                    float& gate = acc[64 * h + 8 * g + 2 * r + e];
                    const float up = acc[64 * h + 8 * g + 4 + 2 * r + e];
                    const float weight = in.weight[2 * set + r];
                    if constexpr (kActivationClamp > 0.0f)
                        gate = silu(fminf(gate, kActivationClamp)) *
                               fminf(fmaxf(up, -kActivationClamp), kActivationClamp) * weight;
                    else
                        gate = silu(gate) * up * weight;
                    amax[set][r] = fmaxf(amax[set][r], fabsf(gate));
                }
            }
        }
    }
    #pragma unroll
    for (uint32_t s = 0; s < kSets; ++s) {
        #pragma unroll
        for (uint32_t r = 0; r < 2; ++r) {
            amax[s][r] = fmaxf(amax[s][r], __shfl_xor_sync(0xffffffffu, amax[s][r], 1));
            amax[s][r] = fmaxf(amax[s][r], __shfl_xor_sync(0xffffffffu, amax[s][r], 2));
        }
    }
    if constexpr (Slice::kSplitColumns) {
        // The row's other 64 channels live in the other warpgroup.
        if (q == 0) {
            #pragma unroll
            for (uint32_t s = 0; s < kSets; ++s) {
                ss.row_amax[slice.wg][r0[s]] = amax[s][0];
                ss.row_amax[slice.wg][r0[s] + 8] = amax[s][1];
            }
        }
        ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);
        #pragma unroll
        for (uint32_t s = 0; s < kSets; ++s) {
            amax[s][0] = fmaxf(ss.row_amax[0][r0[s]], ss.row_amax[1][r0[s]]);
            amax[s][1] = fmaxf(ss.row_amax[0][r0[s] + 8], ss.row_amax[1][r0[s] + 8]);
        }
    }
    float sf[kSets][2], inv[kSets][2];
    #pragma unroll
    for (uint32_t s = 0; s < kSets; ++s) {
        #pragma unroll
        for (uint32_t r = 0; r < 2; ++r) {
            sf[s][r] = fmaxf(amax[s][r], 1e-4f) / 448.0f;
            inv[s][r] = 1.0f / sf[s][r];
        }
    }
    uint8_t* pool = at<uint8_t>(p, p.off_l2_pool);
    #pragma unroll
    for (uint32_t s = 0; s < kSets; ++s) {
        #pragma unroll
        for (uint32_t r = 0; r < 2; ++r) {
            uint8_t* dst = pool + static_cast<uint64_t>(m0 + r0[s] + 8 * r) * kIntermediate + tile.n * 128 + 16 * q;
            #pragma unroll
            for (uint32_t h = 0; h < Slice::kParts; ++h) {
                if (slice.row_set(h) != s)
                    continue;
                uint32_t packed[4];
                #pragma unroll
                for (uint32_t w = 0; w < 4; ++w) {
                    // bytes 4 w .. 4 w + 3 = channels g = 2 w, 2 w + 1 (e = 0, 1 each)
                    const float* a0 = &acc[64 * h + 8 * (2 * w) + 2 * r];
                    const float* a1 = &acc[64 * h + 8 * (2 * w + 1) + 2 * r];
                    const __nv_fp8x2_storage_t lo = __nv_cvt_float2_to_fp8x2(
                        make_float2(a0[0] * inv[s][r], a0[1] * inv[s][r]), __NV_SATFINITE, __NV_E4M3);
                    const __nv_fp8x2_storage_t hi = __nv_cvt_float2_to_fp8x2(
                        make_float2(a1[0] * inv[s][r], a1[1] * inv[s][r]), __NV_SATFINITE, __NV_E4M3);
                    packed[w] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
                }
                *reinterpret_cast<uint4*>(dst + slice.half(h) * 64) = make_uint4(packed[0], packed[1], packed[2], packed[3]);
            }
        }
    }
    if ((!Slice::kSplitColumns || slice.wg == 0) && q == 0) {
        float* pool_sf = at<float>(p, p.off_l2_pool_sf) + static_cast<uint64_t>(tile.n) * p.num_max_pool_tokens + m0;
        #pragma unroll
        for (uint32_t s = 0; s < kSets; ++s) {
            pool_sf[r0[s]] = sf[s][0];
            pool_sf[r0[s] + 8] = sf[s][1];
        }
    }
    return publish_l1_tile(p, ss, tile, tid, prof, l1_tiles);
}

// L2 epilogue: BF16 rows pushed straight from the accumulators into the source rank's
// combine slot [k][token].  W2's output rows are permuted inside every 32-row group (see
// transform_weights_for_mega_moe): accumulator column 32 jj + 8 t + 2 q + e holds output
// column 32 jj + 8 q + 2 t + e, so lane q of a quad owns 8 consecutive output columns
// (16 bytes) per 32-column group and writes them with one vector store; no staging.
template <typename Slice>
__device__ __forceinline__ void epilogue_l2(const Params& p, SharedStorage& ss, const Tile& tile,
                                            const float (&acc)[64 * kNumPartsPerWg], Slice slice, uint32_t tid,
                                            const EpilogueInputs<Slice::kRowSets>& in) {
    const uint32_t q = tid % 4;
    (void)ss;
    __nv_bfloat16* combine = at<__nv_bfloat16>(p, p.off_combine);
    #pragma unroll
    for (uint32_t k = 0; k < 2 * Slice::kRowSets; ++k) {
        const uint32_t r = k % 2;
        if (!in.valid[k])
            continue;
        const int4 src = in.src[k];
        __nv_bfloat16* dst = combine +
                             (static_cast<uint64_t>(src.z) * kNumMaxTokens + static_cast<uint32_t>(src.y)) * kHidden +
                             tile.n * kBlockN;
        dst = map_to_rank(p, dst, static_cast<uint32_t>(src.x));
        #pragma unroll
        for (uint32_t h = 0; h < Slice::kParts; ++h) {
            if (slice.row_set(h) != k / 2)
                continue;
            #pragma unroll
            for (uint32_t jj = 0; jj < 4; ++jj) {
                uint32_t packed[4];
                #pragma unroll
                for (uint32_t t = 0; t < 4; ++t) {
                    const uint32_t i = 64 * h + 4 * (4 * jj + t) + 2 * r;
                    const __nv_bfloat162 v = __floats2bfloat162_rn(acc[i], acc[i + 1]);
                    packed[t] = *reinterpret_cast<const uint32_t*>(&v);
                }
                *reinterpret_cast<uint4*>(dst + slice.half(h) * 128 + 32 * jj + 8 * q) =
                    make_uint4(packed[0], packed[1], packed[2], packed[3]);
            }
        }
    }
}

// MMA consumer warpgroup `wg` (0 or 1); see WgSlice for the part of each tile it owns.
// Per 128-K block and part (WgSlice): 4 WGMMAs into `part`, wait, then promote into `acc`
// with the row's A scale and the half's B scale(s).  Returns kConsumerOk, or the parity of
// a stage wait that timed out (the caller reports it: no call inside this loop).
constexpr uint32_t kConsumerOk = 0xffffffffu;
constexpr uint32_t kConsumerPublisherLate = 0xfffffffeu;  // publisher_caught_up timed out

// K block `it` of a warpgroup's stream: its stage and parity, and the wait for the producer to
// fill it (both tile paths).  The index is shuffled so ptxas sees a warp-uniform stage: the WGMMA
// descriptors are then built in uniform registers (32 R2UR and ~50 instructions fewer per K
// block; notes entry 26).
struct KBlock {
    uint32_t it_uniform, stage, phase;
    __device__ __forceinline__ explicit KBlock(uint32_t it)
        : it_uniform(__shfl_sync(0xffffffffu, it, 0)), stage(it_uniform % kNumStages), phase((it / kNumStages) & 1) {}
    // false: the wait timed out (the caller returns `phase` for consumer_loop to report)
    template <typename Storage>
    __device__ __forceinline__ bool wait_full(const Params& p, Storage& ss, const Tile& tile, uint32_t kb,
                                              const ConsumerProfile& prof) const {
        MEGAMOE_PROF(prof.k_block_start(tile, kb); const uint64_t prof_t1 = clock64();)
        if (!mbar_wait_or_timeout(p, &ss.full[stage], phase))
            return false;
        MEGAMOE_PROF(prof.add(kProfStageWait, prof_t1);)
        return true;
    }
};

// One tile: main loop and epilogue, for the warpgroup's slice of it.
template <bool kNarrow>
__device__ __forceinline__ uint32_t run_tile(const Params& p, SharedStorage& ss, const Tile& tile, uint32_t wg,
                                             uint32_t tid, uint32_t& it, float (&acc)[64 * kNumPartsPerWg],
                                             float (&part)[64], const ConsumerProfile& prof, uint32_t& l1_tiles) {
    using Slice = WgSlice<kNarrow>;
    const Slice slice{wg};
    const uint32_t warp = (tid % 128) / 32, lane = tid % 32;
    const uint32_t num_k = tile.is_l2 ? kNumL2KBlocks : kNumL1KBlocks;
    MEGAMOE_PROF(uint64_t* prof_c = prof.counters;)
    EpilogueInputs<Slice::kRowSets> in;
    if constexpr (Slice::kRowSets == 1)
        in = load_epilogue_inputs(p, ss, tile, slice, tid);
    #pragma unroll
    for (uint32_t i = 0; i < 64 * kNumPartsPerWg; ++i)
        acc[i] = 0.0f;
    for (uint32_t kb = 0; kb < num_k; ++kb, ++it) {
        const KBlock k_block(it);
        if (!k_block.wait_full(p, ss, tile, kb, prof))
            return k_block.phase;
        const uint32_t it_uniform = k_block.it_uniform, stage = k_block.stage;
        // MXFP4: warpgroup wg expands B half wg into e4m3 tile it % 2, then a barrier of the
        // warpgroup orders the expansion (and every warp's proxy fence) before its WGMMAs, the
        // only ones that read that half (every MXFP4 slice splits the columns: WgSlice).
        // NOTES: expanding K block it overwrites half wg of tile (it - 2) % 2 only after the
        // barrier of it - 1, which every warp of warpgroup wg, the half's only reader, reaches
        // after waiting for its WGMMAs of it - 2.  (Expanding K block it + 1 under the WGMMAs of
        // it measured slower: docs/PERF_NOTES.md.)
        const uint32_t b_tile = kWeightFp4 ? it_uniform & 1 : stage;
        if constexpr (kWeightFp4) {
            static_assert(Slice::kSplitColumns, "an MXFP4 e4m3 half has one reader");
            MEGAMOE_PROF(const uint64_t prof_t3 = clock64();)
            fp4_expand(ss, stage, ss.b[b_tile], wg, tile.is_l2, tid);
            ptx::fence_proxy_async_shared();  // the WGMMAs read the e4m3 tile through the async proxy
            MEGAMOE_PROF(const uint64_t prof_t4 = clock64(); if (prof.sampler) prof_c[14] += prof_t4 - prof_t3;)
            if (wg)
                ptx::named_bar_sync(kBarExpand + 1, 128);
            else
                ptx::named_bar_sync(kBarExpand, 128);
            MEGAMOE_PROF(if (prof.sampler) prof_c[15] += clock64() - prof_t4;)
        }
        float sfa[Slice::kRowSets][2];
        #pragma unroll
        for (uint32_t s = 0; s < Slice::kRowSets; ++s) {
            const uint32_t r0 = slice.row_base(s) + warp * 16 + lane / 4;
            sfa[s][0] = ptx::ld_shared_f32(&ss.sfa[stage][r0]);
            sfa[s][1] = ptx::ld_shared_f32(&ss.sfa[stage][r0 + 8]);
        }
        float sfb_even[Slice::kParts], sfb_odd[Slice::kParts];
        #pragma unroll
        for (uint32_t h = 0; h < Slice::kParts; ++h) {
            sfb_even[h] = ptx::ld_shared_f32(&ss.sfb[stage][2 * slice.half(h)]);
            sfb_odd[h] = tile.is_l2 ? sfb_even[h] : ptx::ld_shared_f32(&ss.sfb[stage][2 * slice.half(h) + 1]);
        }
        #pragma unroll
        for (uint32_t h = 0; h < Slice::kParts; ++h) {
            const uint64_t desc_a = ptx::make_smem_desc_sw128(ss.a[stage] + slice.row_base(slice.row_set(h)) * kBlockK);
            const uint64_t desc_b = ptx::make_smem_desc_sw128(ss.b[b_tile] + slice.half(h) * 128 * kBlockK);
            #pragma unroll
            for (uint32_t i = 0; i < 64; ++i)
                ptx::warpgroup_fence_operand(part[i]);
            ptx::wgmma_fence();
            #pragma unroll
            for (uint32_t k = 0; k < kBlockK / kWgmmaK; ++k)
                ptx::wgmma_m64n128k32_e4m3(part, desc_a + 2 * k, desc_b + 2 * k, k > 0 ? 1 : 0);
            ptx::wgmma_commit();
            // (MXFP4 builds only: in FP8 ones the timestamp's registers make the loop spill)
            MEGAMOE_PROF(const uint64_t prof_t5 = kWeightFp4 ? clock64() : 0;)
            ptx::wgmma_wait<0>();
            #pragma unroll
            for (uint32_t i = 0; i < 64; ++i)
                ptx::warpgroup_fence_operand(part[i]);
            MEGAMOE_PROF(if (kWeightFp4 && prof.sampler) prof_c[13] += clock64() - prof_t5;)
            if (h == Slice::kParts - 1 && lane == 0)
                release_stage(ss, stage);

            // Promote: acc += part * sfa(row) * sfb(column group)
            const float sfa0 = sfa[slice.row_set(h)][0], sfa1 = sfa[slice.row_set(h)][1];
            const float s00 = sfa0 * sfb_even[h], s01 = sfa0 * sfb_odd[h];
            const float s10 = sfa1 * sfb_even[h], s11 = sfa1 * sfb_odd[h];
            #pragma unroll
            for (uint32_t i = 0; i < 64; ++i) {
                const bool odd_group = ((i / 4) % 2) == 1;
                const bool second_row = ((i / 2) % 2) == 1;
                const float scale = second_row ? (odd_group ? s11 : s10) : (odd_group ? s01 : s00);
                acc[64 * h + i] = fmaf(part[i], scale, acc[64 * h + i]);
            }
        }
    }
    MEGAMOE_PROF(const uint64_t prof_t2 = prof.mainloop_end(tile);)
    if constexpr (Slice::kRowSets == 2)
        in = load_epilogue_inputs(p, ss, tile, slice, tid);
    if (tile.is_l2)
        epilogue_l2(p, ss, tile, acc, slice, tid, in);
    else if (!epilogue_l1(p, ss, tile, acc, slice, tid, in, prof, l1_tiles))
        return kConsumerPublisherLate;
    MEGAMOE_PROF(prof.epilogue_end(tile, prof_t2);)
    return kConsumerOk;
}

// ---- MXFP4 decode tiles with the weights as register operands ----------------------------------
// A tile whose valid rows are among the 16 that RsRows names (its first 16, or in a direct-pool
// block at world size 2 each source's first 8: rs_tile) runs with the operands swapped: each
// WGMMA's A is 64 weight rows, expanded from the stage straight into fragments
// (fp4_unit_fragments), and its B those 16 rows of the A tile (m64n16k32): no e4m3 tile and a
// quarter of a 64-row tile's MMA and promotion work (PERF_NOTES entries 95-96).  Warpgroup wg
// owns weight rows [128 wg, 128 wg + 128) as two 64-row units; accumulator i of unit u is weight
// row 128 wg + 64 u + 16 warp + g + 8 ((i / 2) % 2) (g = lane / 4) for token 8 (i / 4) + 2 t + i % 2
// (t = lane % 4).  The epilogues transpose through e4m3 tile 0, which these tiles do not
// otherwise use, between barriers of both warpgroups.
constexpr uint32_t kRsTokens = 16;
// The block rows a tile's 16 tokens are: token j is row j, except in a direct-pool block at world
// size 2, where source rank 1's rows start at kDirectRowsPerSrc: there tokens 8-15 are rank 1's
// first 8 rows (the B operand's second 8-row group, kDirectRowsPerSrc rows after the first).
struct RsRows {
    uint32_t group_rows;  // rows between the tokens' two 8-row groups
    __device__ __forceinline__ explicit RsRows(const Tile& tile)
        : group_rows(kNumRanks == 2 && kDirectRowsPerSrc > 0 && tile.direct ? kDirectRowsPerSrc : 8) {}
    __device__ __forceinline__ uint32_t row(uint32_t token) const { return (token / 8) * group_rows + token % 8; }
};
// Whether a tile's valid rows are all among RsRows's 16: at most 16 rows, or a direct-pool block
// whose sources hold at most 16 (world size 1) or 8 each (world size 2; beyond, its rows spread
// over more groups than 16 tokens have).
template <typename Schedule>
__device__ __forceinline__ bool rs_tile(const Schedule& schedule, const Tile& tile) {
    if (!tile.direct)
        return tile.rows <= kRsTokens;
    if constexpr (kNumRanks == 1)
        return !schedule.direct_row_valid(tile.expert, kRsTokens);
    if constexpr (kNumRanks == 2)
        return !schedule.direct_row_valid(tile.expert, 8) && !schedule.direct_row_valid(tile.expert, kDirectRowsPerSrc + 8);
    return false;
}
constexpr uint32_t kRsStagingBytes = kRsTokens * kBlockN * 2;  // L2: BF16 [16 tokens][256 columns]
static_assert(kRsStagingBytes + 8 * kRsTokens * sizeof(float) <= kSmemBBytes, "staging and amax in e4m3 tile 0");

// L1: act = silu(gate) * up * routing weight per (channel, token), requantized per token over the
// tile's 128 channels, stored at the pool columns epilogue_l1 uses (channel 8 g' + 2 q + e of a
// 64-channel half at column 16 q + 2 g' + e), 16 rows of the block.
template <typename Storage>
__device__ __forceinline__ bool rs_epilogue_l1(const Params& p, Storage& ss, const Tile& tile, RsRows rows, float (&acc)[2][8],
                                               uint32_t wg, uint32_t tid, const ConsumerProfile& prof, uint32_t& l1_tiles) {
    const uint32_t warp = (tid % 128) / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    const uint32_t m0 = tile.block * kBlockM;
    const float* pool_weights = at<float>(p, p.off_l1_pool_weights) + m0;
    float amax[2][2] = {{0.0f, 0.0f}, {0.0f, 0.0f}};
    #pragma unroll
    for (uint32_t j = 0; j < 2; ++j) {
        #pragma unroll
        for (uint32_t e = 0; e < 2; ++e) {
            const float weight = __ldcg(pool_weights + rows.row(8 * j + 2 * t + e));
            #pragma unroll
            for (uint32_t u = 0; u < 2; ++u) {
                float& gate = acc[u][4 * j + e];  // row g: the gate; row g + 8 (slot + 2): its up
                const float up = acc[u][4 * j + 2 + e];
                if constexpr (kActivationClamp > 0.0f)
                    gate = silu(fminf(gate, kActivationClamp)) * fminf(fmaxf(up, -kActivationClamp), kActivationClamp) *
                           weight;
                else
                    gate = silu(gate) * up * weight;
                amax[j][e] = fmaxf(amax[j][e], fabsf(gate));
            }
        }
    }
    #pragma unroll
    for (uint32_t j = 0; j < 2; ++j)
        #pragma unroll
        for (uint32_t e = 0; e < 2; ++e)
            #pragma unroll
            for (uint32_t m = 4; m < 32; m *= 2)
                amax[j][e] = fmaxf(amax[j][e], __shfl_xor_sync(0xffffffffu, amax[j][e], m));
    uint8_t* staging = ss.b[0];
    float* token_amax = reinterpret_cast<float*>(staging + kRsStagingBytes);  // [8 warps][16 tokens]
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);  // both K loops done: tile 0 is free
    if (g == 0) {
        #pragma unroll
        for (uint32_t j = 0; j < 2; ++j)
            #pragma unroll
            for (uint32_t e = 0; e < 2; ++e)
                token_amax[(4 * wg + warp) * kRsTokens + 8 * j + 2 * t + e] = amax[j][e];
    }
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);
    float* pool_sf = at<float>(p, p.off_l2_pool_sf) + static_cast<uint64_t>(tile.n) * p.num_max_pool_tokens + m0;
    #pragma unroll
    for (uint32_t j = 0; j < 2; ++j) {
        #pragma unroll
        for (uint32_t e = 0; e < 2; ++e) {
            const uint32_t token = 8 * j + 2 * t + e;
            float m = 0.0f;
            #pragma unroll
            for (uint32_t w = 0; w < 8; ++w)
                m = fmaxf(m, token_amax[w * kRsTokens + token]);
            const float sf = fmaxf(m, 1e-4f) / 448.0f, inv = 1.0f / sf;
            if (wg == 0 && warp == 0 && g == 0)
                pool_sf[rows.row(token)] = sf;
            #pragma unroll
            for (uint32_t u = 0; u < 2; ++u) {
                const uint32_t column = 64 * wg + 16 * (g / 2) + 2 * (4 * u + warp) + g % 2;
                staging[token * 128 + column] = __nv_cvt_float_to_fp8(acc[u][4 * j + e] * inv, __NV_SATFINITE, __NV_E4M3);
            }
        }
    }
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);
    {
        const uint32_t token = tid / 8, piece = tid % 8;  // 16 rows x 8 pieces of 16 bytes
        if (token < kRsTokens) {
            uint8_t* pool =
                at<uint8_t>(p, p.off_l2_pool) + static_cast<uint64_t>(m0 + rows.row(token)) * kIntermediate + tile.n * 128;
            *reinterpret_cast<uint4*>(pool + 16 * piece) =
                ptx::ld_shared_v4_u32(reinterpret_cast<const uint4*>(staging + token * 128 + 16 * piece));
        }
    }
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);  // staging read: the next tile may write tile 0
    return publish_l1_tile(p, ss, tile, tid, prof, l1_tiles);
}

// L2: BF16 outputs staged by token (W2's rows are permuted inside 32-row groups: weight row
// 8 t' + 2 q' + e' of a group is output column 8 q' + 2 t' + e'), then each valid token's 512
// bytes pushed by one warp, 16 bytes a lane, into its source rank's combine slot.
template <typename Storage>
__device__ __forceinline__ void rs_epilogue_l2(const Params& p, Storage& ss, const Tile& tile, RsRows rows, const float (&acc)[2][8],
                                               uint32_t wg, uint32_t tid) {
    const uint32_t warp = (tid % 128) / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
    __nv_bfloat16* staging = reinterpret_cast<__nv_bfloat16*>(ss.b[0]);
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);  // both K loops done: tile 0 is free
    #pragma unroll
    for (uint32_t u = 0; u < 2; ++u) {
        #pragma unroll
        for (uint32_t i = 0; i < 8; ++i) {
            const uint32_t row = 128 * wg + 64 * u + 16 * warp + g + 8 * ((i / 2) % 2), r = row % 32;
            const uint32_t column = row - r + 8 * ((r % 8) / 2) + 2 * (r / 8) + r % 2;
            staging[(8 * (i / 4) + 2 * t + i % 2) * kBlockN + column] = __float2bfloat16_rn(acc[u][i]);
        }
    }
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);
    const uint32_t m0 = tile.block * kBlockM;
    const int* meta = reinterpret_cast<const int*>(at<int4>(p, p.off_pool_src_meta) + m0);
    __nv_bfloat16* combine = at<__nv_bfloat16>(p, p.off_combine);
    #pragma unroll
    for (uint32_t k = 0; k < kRsTokens / 8; ++k) {
        const uint32_t token = 4 * wg + warp + 8 * k;
        const uint32_t row = rows.row(token);
        if (tile.direct ? !ss.schedule.direct_row_valid(tile.expert, row) : row >= tile.rows)
            continue;
        const int3 src = make_int3(__ldcg(meta + 4 * row), __ldcg(meta + 4 * row + 1), __ldcg(meta + 4 * row + 2));
        __nv_bfloat16* dst = combine +
                             (static_cast<uint64_t>(src.z) * kNumMaxTokens + static_cast<uint32_t>(src.y)) * kHidden +
                             tile.n * kBlockN;
        dst = map_to_rank(p, dst, static_cast<uint32_t>(src.x));
        *reinterpret_cast<uint4*>(dst + 8 * lane) =
            ptx::ld_shared_v4_u32(reinterpret_cast<const uint4*>(staging + token * kBlockN + 8 * lane));
    }
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);  // staging read: the next tile may write tile 0
}

// One decode tile with the weights as register operands (see above); returns as run_tile does.
// kL2: the tile's layer, a template argument so that the compiler sees L2's K steps 0-1 and 2-3
// take the same scale (fp4_unit_fragments) and loads each table entry once for both.
template <bool kL2, typename Storage>
__device__ __forceinline__ uint32_t run_tile_rs(const Params& p, Storage& ss, const Tile& tile, uint32_t wg, uint32_t tid,
                                                uint32_t& it, const ConsumerProfile& prof, uint32_t& l1_tiles) {
    if constexpr (kWeightFp4) {
        const uint32_t warp = (tid % 128) / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
        const uint32_t num_k = kL2 ? kNumL2KBlocks : kNumL1KBlocks;
        const RsRows rows(tile);
        float acc[2][8], part[2][8];
        #pragma unroll
        for (uint32_t u = 0; u < 2; ++u)
            #pragma unroll
            for (uint32_t i = 0; i < 8; ++i)
                acc[u][i] = 0.0f;
        // The thread's rows 128 wg + 64 u + 16 warp + g + 8 r: where their groups t and index words
        // lie in a stage.  Rows 8 and 64 apart share a slot, so one offset each serves all four;
        // opaque, so the compiler keeps them instead of recomputing them every K block.
        uint32_t group_offset = fp4_group_offset(128 * wg + 16 * warp + g, t);
        uint32_t index_offset = kFp4DataBytes + (128 * wg + 16 * warp + g) * 4;
        asm volatile("" : "+r"(group_offset), "+r"(index_offset));
        const uint32_t table = ptx::smem_addr(ss.fp4_table);
        for (uint32_t kb = 0; kb < num_k; ++kb, ++it) {
            const KBlock k_block(it);
            if (!k_block.wait_full(p, ss, tile, kb, prof))
                return k_block.phase;
            const uint32_t stage = k_block.stage;
            MEGAMOE_PROF(const uint64_t prof_t3 = clock64();)
            const uint8_t* raw = ss.b_raw[stage];
            // Every load of the stage first, so the codes' round trip overlaps the indices' and
            // the table loads that follow them
            uint32_t scaled[2][2];
            uint4 w[2][2];
            #pragma unroll
            for (uint32_t u = 0; u < 2; ++u) {
                #pragma unroll
                for (uint32_t r = 0; r < 2; ++r) {
                    scaled[u][r] = ptx::ld_shared_u32(raw + index_offset + (64 * u + 8 * r) * 4);
                    w[u][r] = ptx::ld_shared_v4_u32(reinterpret_cast<const uint4*>(raw + group_offset + (64 * u + 8 * r) * kFp4RowBytes));
                }
            }
            uint32_t a[2][4][4];
            #pragma unroll
            for (uint32_t u = 0; u < 2; ++u) {
                #pragma unroll
                for (uint32_t r = 0; r < 2; ++r)
                    scaled[u][r] *= sizeof(uint2);  // byte offsets of the table entries (fp4_table_slot)
                fp4_unit_fragments(w[u], table, t, scaled[u], kL2, a[u]);
            }
            MEGAMOE_PROF(prof.add(14, prof_t3);)  // the fragments' loads and expansion: FP4_EXPAND
            float sfa[2][2];
            #pragma unroll
            for (uint32_t j = 0; j < 2; ++j)
                #pragma unroll
                for (uint32_t e = 0; e < 2; ++e)
                    sfa[j][e] = ptx::ld_shared_f32(&ss.sfa[stage][rows.row(8 * j + 2 * t + e)]);
            const float sfb_gate = ptx::ld_shared_f32(&ss.sfb[stage][2 * wg]);
            const float sfb_up = kL2 ? sfb_gate : ptx::ld_shared_f32(&ss.sfb[stage][2 * wg + 1]);
            const uint64_t desc_b = ptx::make_smem_desc_sw128(ss.a[stage], rows.group_rows * kBlockK);  // RsRows's rows
            #pragma unroll
            for (uint32_t u = 0; u < 2; ++u)
                #pragma unroll
                for (uint32_t i = 0; i < 8; ++i)
                    ptx::warpgroup_fence_operand(part[u][i]);
            ptx::wgmma_fence();
            #pragma unroll
            for (uint32_t u = 0; u < 2; ++u)
                #pragma unroll
                for (uint32_t k = 0; k < kBlockK / kWgmmaK; ++k)
                    ptx::wgmma_m64n16k32_e4m3_rs(part[u], a[u][k], desc_b + 2 * k, k > 0 ? 1 : 0);
            ptx::wgmma_commit();
            MEGAMOE_PROF(const uint64_t prof_t5 = clock64();)
            ptx::wgmma_wait<0>();
            MEGAMOE_PROF(prof.add(13, prof_t5);)  // MMA_WAIT
            #pragma unroll
            for (uint32_t u = 0; u < 2; ++u)
                #pragma unroll
                for (uint32_t i = 0; i < 8; ++i)
                    ptx::warpgroup_fence_operand(part[u][i]);
            if (lane == 0)
                release_stage(ss, stage);
            #pragma unroll
            for (uint32_t u = 0; u < 2; ++u)
                #pragma unroll
                for (uint32_t i = 0; i < 8; ++i)
                    acc[u][i] = fmaf(part[u][i], sfa[i / 4][i % 2] * (((i / 2) % 2) ? sfb_up : sfb_gate), acc[u][i]);
        }
        MEGAMOE_PROF(const uint64_t prof_t2 = prof.mainloop_end(tile);)
        if (kL2)
            rs_epilogue_l2(p, ss, tile, rows, acc, wg, tid);
        else if (!rs_epilogue_l1(p, ss, tile, rows, acc, wg, tid, prof, l1_tiles))
            return kConsumerPublisherLate;
        MEGAMOE_PROF(prof.epilogue_end(tile, prof_t2);)
    }
    return kConsumerOk;
}

__device__ __forceinline__ uint32_t consumer_loop(const Params& p, SharedStorage& ss, uint32_t wg, uint32_t tid,
                                                  const ConsumerProfile& prof, uint32_t& l1_tiles) {
    float acc[64 * kNumPartsPerWg], part[64];
    uint32_t it = 0;
    MEGAMOE_PROF(uint64_t* prof_c = prof.counters;
                 if (prof.sampler) { for (uint32_t i = 0; i < 8; ++i) prof_c[i] = 0;
                                     for (uint32_t i = 10; i < 16; ++i) prof_c[i] = 0;
                                     prof_c[9] = clock64(); })
    while (true) {
        // The first stage of a tile says which tile it is (or that none is left).
        MEGAMOE_PROF(if (prof.sampler) prof_c[8] = clock64();)
        if (!mbar_wait_or_timeout(p, &ss.full[it % kNumStages], (it / kNumStages) & 1))
            return (it / kNumStages) & 1;
        MEGAMOE_PROF(if (prof.sampler) { prof_c[kProfTileWait] += clock64() - prof_c[8]; prof_c[8] = clock64(); })
        // Shuffled so the compiler sees a warp-uniform tile.
        uint4 packed = ptx::ld_shared_v4_u32(&ss.stage_tile[it % kNumStages]);
        packed.x = __shfl_sync(0xffffffffu, packed.x, 0);
        if (packed.x == kNoMoreTiles) {
            MEGAMOE_PROF(if (prof.sampler && wg == 0) MEGAMOE_TRACE(kTraceTilesDone, ss.schedule.epoch, 0, 0);)
            break;
        }
        packed.y = __shfl_sync(0xffffffffu, packed.y, 0);
        packed.z = __shfl_sync(0xffffffffu, packed.z, 0);
        packed.w = __shfl_sync(0xffffffffu, packed.w, 0);
        const Tile tile = unpack_tile(packed);
        MEGAMOE_PROF(if (prof.sampler && wg == 0) MEGAMOE_TRACE(kTraceTileStart, ss.schedule.epoch, trace_tile(tile), tile.block);)
        uint32_t status;
        if (kWeightFp4 && rs_tile(ss.schedule, tile)) {
            // MXFP4 decode tile: the weights as register operands (run_tile_rs); it reads no e4m3
            // tile and its epilogue syncs both warpgroups before and after using tile 0
            status = tile.is_l2 ? run_tile_rs<true>(p, ss, tile, wg, tid, it, prof, l1_tiles)
                                 : run_tile_rs<false>(p, ss, tile, wg, tid, it, prof, l1_tiles);
        } else if constexpr (kBlockM == 128) {
            // A block with at most 64 valid rows (an expert's last, mostly padding) runs with
            // the columns split between the warpgroups: half the WGMMAs (notes entry 27).
            const bool narrow = tile.rows <= 64;
            status = narrow ? run_tile<true>(p, ss, tile, wg, tid, it, acc, part, prof, l1_tiles)
                            : run_tile<false>(p, ss, tile, wg, tid, it, acc, part, prof, l1_tiles);
        } else {
            status = run_tile<false>(p, ss, tile, wg, tid, it, acc, part, prof, l1_tiles);
        }
        if (status != kConsumerOk)
            return status;
        MEGAMOE_PROF(if (prof.sampler && wg == 0) MEGAMOE_TRACE(kTraceTileEnd, ss.schedule.epoch, trace_tile(tile), tile.block);)
    }
    MEGAMOE_PROF(if (prof.sampler) {
        for (uint32_t i = 0; i < 7; ++i)
            MEGAMOE_PROF_ADD(i, prof_c[i]);
        MEGAMOE_PROF_ADD(kProfMainloopL1, prof_c[10]);
        MEGAMOE_PROF_ADD(kProfMainloopHead, prof_c[11]);
        MEGAMOE_PROF_ADD(kProfMainloopHeadL2, prof_c[12]);
        MEGAMOE_PROF_ADD(kProfMmaWait, prof_c[13]);
        MEGAMOE_PROF_ADD(kProfFp4Expand, prof_c[14]);
        MEGAMOE_PROF_ADD(kProfFp4ExpandBarrier, prof_c[15]);
        MEGAMOE_PROF_ADD(kProfConsumerLoop, clock64() - prof_c[9]);
    })
    return kConsumerOk;
}

}  // namespace megamoe

// Dispatch: count (token, k) pairs per expert straight into the owning ranks' counters,
// build the pool schedule, and pull token rows from the peers into the expert-major pool.
#pragma once
#include "barrier.cuh"

namespace megamoe {

// Pool schedule, identical in every CTA of a rank (each CTA computes it from the
// received counts).  Expert `e` owns pool blocks [block_start[e], block_start[e+1]).
struct Schedule {
    uint32_t expert_count[kNumExpertsPerRank];
    uint32_t block_start[kNumExpertsPerRank + 1];
    uint32_t row_start[kNumExpertsPerRank + 1];
    uint32_t src_start[kNumExpertsPerRank][kNumRanks + 1];
    uint64_t epoch;
    // 1: this call runs on the direct pool (kDirectRowsPerSrc): expert e's one block is pool
    // block e, nothing is pulled.  Set by the count exchange, cleared by build_schedule when
    // some (expert, source) count does not fit.
    uint32_t direct;

    __device__ __forceinline__ uint32_t num_blocks() const { return block_start[kNumExpertsPerRank]; }
    __device__ __forceinline__ uint32_t num_rows() const { return row_start[kNumExpertsPerRank]; }

    // Largest expert whose start (in `starts`) is <= value.
    __device__ __forceinline__ static uint32_t upper_expert(const uint32_t* starts, uint32_t value) {
        uint32_t lo = 0, hi = kNumExpertsPerRank;  // invariant: starts[lo] <= value < starts[hi]
        while (hi - lo > 1) {
            const uint32_t mid = (lo + hi) / 2;
            if (starts[mid] <= value)
                lo = mid;
            else
                hi = mid;
        }
        return lo;
    }
    __device__ __forceinline__ uint32_t expert_of_block(uint32_t block) const { return upper_expert(block_start, block); }
    __device__ __forceinline__ uint32_t valid_rows(uint32_t expert, uint32_t block) const {
        const uint32_t first = (block - block_start[expert]) * kBlockM;
        return min(kBlockM, expert_count[expert] - first);
    }
    // Whether row `row` of expert e's direct-pool block holds a pair: source rank
    // row / kDirectRowsPerSrc pushed that many rows of it.  When the ranks do not divide 64, the
    // block's last rows belong to no rank (src == kNumRanks) and hold none.
    __device__ __forceinline__ bool direct_row_valid(uint32_t expert, uint32_t row) const {
        constexpr uint32_t kRows = kDirectRowsPerSrc > 0 ? kDirectRowsPerSrc : 1;  // (unused without it)
        const uint32_t src = row / kRows;
        return src < kNumRanks && row % kRows < src_start[expert][src + 1] - src_start[expert][src];
    }
};

// Whether small calls push their rows into the owners' pools (see kDirectRowsPerSrc): the
// pool must hold one block per local expert.  The same on every rank (one buffer config).
__device__ __forceinline__ bool direct_pool_enabled(const Params& p) {
    return kDirectRowsPerSrc > 0 && p.num_max_pool_tokens >= kNumExpertsPerRank * kBlockM;
}

// A small call: at most kNumDispatchThreads pairs, counted by CTA 0 in shared memory.
__device__ __forceinline__ uint32_t num_call_pairs(const Params& p) { return static_cast<uint32_t>(p.num_tokens) * kNumTopk; }
__device__ __forceinline__ bool small_call(const Params& p) { return num_call_pairs(p) <= kNumDispatchThreads; }
// Whether this rank pushes its rows into the owners' direct pools this call (dispatch_count).
__device__ __forceinline__ bool pushes_rows(const Params& p) { return small_call(p) && direct_pool_enabled(p); }

// An input given by address (mega_moe(..., x=...)), else the buffer's copy of it.  The count and
// the pushes read it there: the other CTAs' copies into the buffer are not visible before the
// count exchange.
template <typename T>
__device__ __forceinline__ const T* call_input(const Params& p, uint64_t given, uint64_t offset) {
    return given != 0 ? reinterpret_cast<const T*>(given) : at<T>(p, offset);
}

// Receive counters of one call: [parity][source rank][local expert] in the owner's buffer;
// calls alternate between the two halves by the parity of their epoch.
__device__ __forceinline__ uint32_t* recv_counts(const Params& p, uint64_t epoch) {
    return at<uint32_t>(p, p.off_expert_recv_count) + (epoch & 1) * kNumRanks * kNumExpertsPerRank;
}

// Copy one pair's row, or part of it, into pool row `pool_row`, by one warp, kBatch 16-byte loads
// in flight per lane: 16-byte pieces [vec_begin, vec_end) of the FP8 row and, with `head`, its
// scales (the pool's are column-major), routing weight and `meta` ({source rank, token, slot}).
// The caller maps the sources (pull: the peer's x); the pool is this rank's plus dst_delta
// (push: the owner's, p.peer_delta[owner]).
template <uint32_t kBatch>
__device__ __forceinline__ void copy_pair_row(const Params& p, const uint8_t* src_x_row, const float* src_sf_row,
                                              const float* src_weight, int4 meta, uint32_t pool_row, int64_t dst_delta,
                                              uint32_t vec_begin, uint32_t vec_end, bool head, uint32_t lane) {
    constexpr uint32_t kSfPerRow = kHidden / 128;
    const int4* src_row = reinterpret_cast<const int4*>(src_x_row);
    int4* dst_row = reinterpret_cast<int4*>(p.buffer + dst_delta + p.off_l1_pool + static_cast<uint64_t>(pool_row) * kHidden);
    for (uint32_t base = vec_begin; base < vec_end; base += 32 * kBatch) {
        int4 v[kBatch];
        #pragma unroll
        for (uint32_t u = 0; u < kBatch; ++u) {
            const uint32_t idx = base + u * 32 + lane;
            if (idx < vec_end)
                v[u] = __ldcg(src_row + idx);
        }
        #pragma unroll
        for (uint32_t u = 0; u < kBatch; ++u) {
            const uint32_t idx = base + u * 32 + lane;
            if (idx < vec_end)
                dst_row[idx] = v[u];
        }
    }
    if (!head)
        return;
    float* dst_sf = reinterpret_cast<float*>(p.buffer + dst_delta + p.off_l1_pool_sf) + pool_row;
    #pragma unroll
    for (uint32_t kb = lane; kb < kSfPerRow; kb += 32)
        dst_sf[static_cast<uint64_t>(kb) * p.num_max_pool_tokens] = __ldcg(src_sf_row + kb);
    if (lane == 0) {
        reinterpret_cast<float*>(p.buffer + dst_delta + p.off_l1_pool_weights)[pool_row] = __ldcg(src_weight);
        reinterpret_cast<int4*>(p.buffer + dst_delta + p.off_pool_src_meta)[pool_row] = meta;
    }
}

// The direct pool's pushes (every pair of a small call, before the exchange): kPushParts warps
// per pair, anywhere in the grid (warp u: pair u / kPushParts, part u % kPushParts of its row),
// so each part is one batch of loads in flight (two per lane: the dispatch warps' 56 registers)
// and no SM copies more than a few parts (one CTA copying every row took longer than the pull
// it replaced: 2-55 us more at 1-12 tokens).  A pair's slot is its rank among this rank's
// pairs of the same expert, in pair order (a ballot over topk_idx), so the slots of an expert
// are 0 .. count - 1 like dispatch_count's.  Only slots below kDirectRowsPerSrc are pushed;
// CTA 0's count checks the experts and traps on bad ones.  The generic->async proxy fence
// mirrors the pull's: the owners' producers read the rows with TMA after the exchange.
constexpr uint32_t kPushParts = 8;

constexpr uint32_t kPushBatch = 2;
// (one batch per part up to hidden 8192: 16-byte pieces per part <= 32 lanes * kPushBatch)

__device__ __forceinline__ uint32_t push_ctas(uint32_t num_pairs) {
    return ceil_div(num_pairs * kPushParts, kNumDispatchWarps);
}

__device__ __forceinline__ void push_rows(const Params& p, const int64_t* topk_idx, uint32_t num_pairs, uint32_t warp,
                                          uint32_t lane) {
    constexpr uint32_t kVecs = kHidden / 16;
    constexpr uint32_t kPartVecs = (kVecs + kPushParts - 1) / kPushParts;
    constexpr uint32_t kPairChunks = (kNumDispatchThreads + 31) / 32;
    const uint8_t* x = call_input<uint8_t>(p, p.in_x, p.off_x);
    const float* x_sf = call_input<float>(p, p.in_x_sf, p.off_x_sf);
    const float* topk_weights = call_input<float>(p, p.in_topk_weights, p.off_topk_weights);
    const uint32_t stride = gridDim.x * kNumDispatchWarps;
    for (uint32_t u = blockIdx.x * kNumDispatchWarps + warp; u < num_pairs * kPushParts; u += stride) {
        const uint32_t j = u / kPushParts, part = u % kPushParts;
        const int64_t e = topk_idx[j];
        if (e < 0 || e >= kNumExperts)
            continue;
        const uint32_t expert = static_cast<uint32_t>(e);
        uint32_t slot = 0;
        #pragma unroll
        for (uint32_t c = 0; c < kPairChunks; ++c) {
            const uint32_t i = 32 * c + lane;
            slot += __popc(__ballot_sync(0xffffffffu, i < j && topk_idx[i] == e));
        }
        if (slot >= kDirectRowsPerSrc)
            continue;
        const uint32_t row = expert % kNumExpertsPerRank * kBlockM + p.rank * kDirectRowsPerSrc + slot;
        const uint32_t token = j / kNumTopk;
        copy_pair_row<kPushBatch>(p, x + static_cast<uint64_t>(token) * kHidden, x_sf + static_cast<uint64_t>(token) * (kHidden / 128),
                      topk_weights + j, make_int4(static_cast<int>(p.rank), static_cast<int>(token), static_cast<int>(j % kNumTopk), 0),
                      row, p.peer_delta[expert / kNumExpertsPerRank], part * kPartVecs, min(kVecs, (part + 1) * kPartVecs),
                      part == 0, lane);
    }
    ptx::fence_proxy_async_global();
}

// dispatch_count's count of a small call in CTA 0's shared memory (see there).
__device__ __forceinline__ void count_in_shared_memory(const Params& p, const int64_t* topk_idx, uint32_t* recv_count,
                                                       int32_t* src_table, uint32_t num_pairs, uint32_t dispatch_thread,
                                                       uint32_t* smem_count) {
    const int64_t expert = dispatch_thread < num_pairs ? topk_idx[dispatch_thread] : -1;
    for (uint32_t e = dispatch_thread; e < kNumExperts; e += kNumDispatchThreads)
        smem_count[e] = 0;
    ptx::named_bar_sync(kBarDispatch, kNumDispatchThreads);
    if (expert >= kNumExperts) {
        fail(p, kPhaseBadTopkIdx, kNumExperts, static_cast<uint64_t>(expert), dispatch_thread);
    } else if (expert >= 0) {
        const uint32_t dst_rank = static_cast<uint32_t>(expert) / kNumExpertsPerRank;
        const uint32_t local_expert = static_cast<uint32_t>(expert) % kNumExpertsPerRank;
        const uint32_t slot = atomicAdd(smem_count + expert, 1u);
        if (slot >= kNumMaxTokens) {
            fail(p, kPhaseTooManyPairs, kNumMaxTokens, slot, static_cast<uint32_t>(expert));
        } else {
            int32_t* dst = src_table + (static_cast<uint64_t>(local_expert) * kNumRanks + p.rank) * kNumMaxTokens + slot;
            *map_to_rank(p, dst, dst_rank) = static_cast<int32_t>(dispatch_thread);
        }
    }
    ptx::named_bar_sync(kBarDispatch, kNumDispatchThreads);
    for (uint32_t e = dispatch_thread; e < kNumExperts; e += kNumDispatchThreads) {
        const uint32_t n = smem_count[e];
        if (n != 0)
            *map_to_rank(p, recv_count + e % kNumExpertsPerRank, e / kNumExpertsPerRank) = n;
    }
}

// Phase 1: reserve a slot per (token, k) pair with one system-scope atomic on the owning
// rank's receive counter for this rank (the counter's final value is the count the owner
// schedules from), and store the pair's source index into the owner's table at that slot.
// With at most kNumDispatchThreads pairs (12 tokens at top-8), every pair is CTA 0's, and it
// counts them in shared memory instead: one pair per thread, slots from shared-memory atomics,
// then one plain store per touched expert of its final count into the owner's counter, which
// no other CTA of this rank touches this call.  The exchange's system fence publishes those
// stores like the atomics.  A remote atomic is a round trip over NVLink on the path to the
// exchange; this takes it off (the exchange waits for the stores' acknowledgements anyway).
// Such a rank also pushes each pair's row, scales, routing weight and {rank, token, slot} into
// the owner's direct-pool block when the pool has one (direct_pool_enabled) and the pair's slot
// fits (slot < kDirectRowsPerSrc), from many CTAs (push_rows), before the exchange; the
// exchange tells the owners (count_exchange) and they decide whether to use it (build_schedule).
__device__ __forceinline__ void dispatch_count(const Params& p, uint64_t epoch, uint32_t dispatch_thread,
                                               uint32_t* smem_count) {
    const int64_t* topk_idx = call_input<int64_t>(p, p.in_topk_idx, p.off_topk_idx);
    uint32_t* recv_count = recv_counts(p, epoch) + p.rank * kNumExpertsPerRank;
    int32_t* src_table = at<int32_t>(p, p.off_src_token_topk_idx);
    const uint32_t num_pairs = num_call_pairs(p);
    if (small_call(p)) {
        if (blockIdx.x == 0)
            count_in_shared_memory(p, topk_idx, recv_count, src_table, num_pairs, dispatch_thread, smem_count);
        if (pushes_rows(p))
            push_rows(p, topk_idx, num_pairs, dispatch_thread / 32, dispatch_thread % 32);
        return;
    }
    const uint32_t stride = gridDim.x * kNumDispatchThreads;
    for (uint32_t i = blockIdx.x * kNumDispatchThreads + dispatch_thread; i < num_pairs; i += stride) {
        const int64_t expert = topk_idx[i];
        if (expert < 0)
            continue;
        if (expert >= kNumExperts) {
            fail(p, kPhaseBadTopkIdx, kNumExperts, static_cast<uint64_t>(expert), i);
            continue;
        }
        const uint32_t dst_rank = static_cast<uint32_t>(expert) / kNumExpertsPerRank;
        const uint32_t local_expert = static_cast<uint32_t>(expert) % kNumExpertsPerRank;
        // System scope: the owner's counter is also taken by the other ranks' CTAs.
        const uint32_t slot = atomicAdd_system(map_to_rank(p, recv_count + local_expert, dst_rank), 1u);
        if (slot >= kNumMaxTokens) {
            fail(p, kPhaseTooManyPairs, kNumMaxTokens, slot, static_cast<uint32_t>(expert));
            continue;
        }
        int32_t* dst = src_table + (static_cast<uint64_t>(local_expert) * kNumRanks + p.rank) * kNumMaxTokens + slot;
        *map_to_rank(p, dst, dst_rank) = static_cast<int32_t>(i);
    }
}

// Phase 3: every CTA derives the pool schedule from the received counts.
__device__ __forceinline__ void build_schedule(const Params& p, Schedule& s, uint32_t dispatch_thread) {
    const uint32_t* recv_count = recv_counts(p, s.epoch);
    for (uint32_t e = dispatch_thread; e < kNumExpertsPerRank; e += kNumDispatchThreads) {
        uint32_t total = 0;
        #pragma unroll
        for (uint32_t r = 0; r < kNumRanks; ++r) {
            s.src_start[e][r] = total;
            const uint32_t n = __ldcg(recv_count + r * kNumExpertsPerRank + e);
            if (n > kDirectRowsPerSrc)
                s.direct = 0;  // every writer stores the same value
            total += n;
        }
        s.src_start[e][kNumRanks] = total;
        s.expert_count[e] = total;
    }
    ptx::named_bar_sync(kBarDispatch, kNumDispatchThreads);

    // Exclusive scans over experts by the first dispatch warp: each lane owns a chunk.
    if (dispatch_thread < 32) {
        const uint32_t lane = dispatch_thread;
        constexpr uint32_t kChunk = (kNumExpertsPerRank + 31) / 32;
        const uint32_t begin = min(lane * kChunk, kNumExpertsPerRank);
        const uint32_t end = min(begin + kChunk, kNumExpertsPerRank);
        uint32_t rows = 0, blocks = 0;
        for (uint32_t e = begin; e < end; ++e) {
            rows += s.expert_count[e];
            blocks += ceil_div(s.expert_count[e], kBlockM);
        }
        uint32_t rows_incl = rows, blocks_incl = blocks;
        #pragma unroll
        for (uint32_t d = 1; d < 32; d <<= 1) {
            const uint32_t r = __shfl_up_sync(0xffffffffu, rows_incl, d);
            const uint32_t b = __shfl_up_sync(0xffffffffu, blocks_incl, d);
            if (lane >= d) {
                rows_incl += r;
                blocks_incl += b;
            }
        }
        uint32_t row_acc = rows_incl - rows, block_acc = blocks_incl - blocks;
        for (uint32_t e = begin; e < end; ++e) {
            s.row_start[e] = row_acc;
            s.block_start[e] = block_acc;
            row_acc += s.expert_count[e];
            block_acc += ceil_div(s.expert_count[e], kBlockM);
        }
        if (lane == 31) {
            s.row_start[kNumExpertsPerRank] = rows_incl;
            s.block_start[kNumExpertsPerRank] = blocks_incl;
        }
    }
}

// Phase 4: pull rows.  Global dispatch warp `w` handles received rows w, w + W, ... in
// expert-major order, so pool blocks fill roughly in the order the GEMM consumes them.
// NOTES: each landed row is published with a fence and a relaxed add (a release pattern) on
// its block's arrival counter after a generic->async proxy fence, because the GEMM reads the
// pool via TMA.
__device__ __forceinline__ void dispatch_pull(const Params& p, const Schedule& s, uint32_t dispatch_warp,
                                              uint32_t lane) {
    constexpr uint32_t kPullWarps = kNumDispatchWarps - 1;  // the last one publishes L1 tiles
    if (s.direct)
        return;  // the sources pushed every row (push_rows)
    const uint32_t num_rows = s.num_rows();
    // The grid size and the buffer's addresses are derived again per row: held in registers
    // across the row copy, they spilled at the producer warpgroup's 56 registers.  `delta` is
    // 0 (s.direct, read by a volatile load that ptxas cannot hoist, so neither the addresses).
    for (uint32_t j = blockIdx.x * kPullWarps + dispatch_warp; j < num_rows; j += ptx::num_ctas() * kPullWarps) {
        const int64_t delta = ptx::ld_volatile_shared_u32(&s.direct);
        const int32_t* src_table = at<int32_t>(p, p.off_src_token_topk_idx + delta);
        const uint8_t* x = at<uint8_t>(p, p.off_x + delta);
        const float* x_sf = at<float>(p, p.off_x_sf + delta);
        const float* topk_weights = at<float>(p, p.off_topk_weights + delta);
        uint32_t* l1_arrival = at<uint32_t>(p, p.off_l1_arrival + delta);
        const uint32_t e = Schedule::upper_expert(s.row_start, j);
        const uint32_t row_in_expert = j - s.row_start[e];
        uint32_t src = 0;
        #pragma unroll
        for (uint32_t r = 1; r < kNumRanks; ++r)
            if (s.src_start[e][r] <= row_in_expert)
                src = r;
        const uint32_t slot = row_in_expert - s.src_start[e][src];
        const uint32_t pool_row = s.block_start[e] * kBlockM + row_in_expert;
        const int32_t pair = __ldcg(src_table + (static_cast<uint64_t>(e) * kNumRanks + src) * kNumMaxTokens + slot);
        const uint32_t token = static_cast<uint32_t>(pair) / kNumTopk;
        const uint32_t k = static_cast<uint32_t>(pair) % kNumTopk;

        copy_pair_row<4>(p, map_to_rank(p, x + static_cast<uint64_t>(token) * kHidden, src),
                      map_to_rank(p, x_sf + static_cast<uint64_t>(token) * (kHidden / 128), src),
                      map_to_rank(p, topk_weights + pair, src),
                      make_int4(static_cast<int>(src), static_cast<int>(token), static_cast<int>(k), 0), pool_row, delta, 0,
                      kHidden / 16, true, lane);
        ptx::fence_proxy_async_global();
        __syncwarp();
        if (lane == 0) {
            __threadfence();  // with the relaxed add below: a release pattern (ptx.cuh)
            ptx::red_relaxed_gpu_add_u32(l1_arrival + pool_row / kBlockM, 1);
        }
    }
}

}  // namespace megamoe

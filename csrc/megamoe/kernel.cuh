// The persistent Mega MoE kernel: role split and phase order.
//   all threads   inputs given by address: copied into the symmetric buffer before the split
//                 (the profile's consumer start slot includes it)
//   warp 0        producer (producer.cuh): takes tiles in the scheduler's order (scheduler.cuh)
//                 and streams them through the stage ring by TMA, for both GEMMs
//   warps 1-3     dispatcher (dispatch_role; dispatch.cuh): count (into the owners' counters;
//                 small calls also push their rows into the owners' direct pools) -> exchange
//                 (barrier.cuh) -> schedule -> pull (warps 1-2, not on the direct pool); warp 3
//                 then becomes the publisher (publisher.cuh): it announces each finished L1 tile
//   warpgroups 1-2  consumers (consumer.cuh): WGMMA over each stage, L1 + SwiGLU, L2 + combine
//                 push; then (consumer_role) barrier, cleanup and the top-k reduce into y
//                 (combine.cuh)
// The roles meet in shared memory (storage.cuh).  One CTA per SM, all co-resident (the
// exchange and the combine barrier wait for every CTA).
#pragma once
#include "combine.cuh"
#include "consumer.cuh"
#include "dispatch.cuh"
#include "producer.cuh"
#include "publisher.cuh"
#include "scheduler.cuh"
#include "storage.cuh"

namespace megamoe {

// The launch's shared memory (contract.smem_budget) covers SharedStorage and its alignment,
// and stays close to it: a member changed without its term in the budget fails here.
static_assert(sizeof(SharedStorage) + kSmemAlignBytes <= MEGAMOE_SMEM_BYTES,
              "contract.smem_budget is smaller than SharedStorage needs");
static_assert(MEGAMOE_SMEM_BYTES - (sizeof(SharedStorage) + kSmemAlignBytes) <= kSmemSpareBytes,
              "contract.smem_budget exceeds what SharedStorage needs by more than kSmemSpareBytes");

constexpr uint32_t kProducerRegisters = 56;
constexpr uint32_t kConsumerRegisters = 224;

__device__ __forceinline__ SharedStorage& shared_storage() {
    extern __shared__ uint8_t smem_raw[];
    const uintptr_t base = (reinterpret_cast<uintptr_t>(smem_raw) + kSmemAlignBytes - 1) & ~uintptr_t(kSmemAlignBytes - 1);
    return *reinterpret_cast<SharedStorage*>(base);
}

// Copy nbytes (a multiple of 4; both addresses 16-byte aligned, which the host checks) with
// every thread of the grid: 16-byte pieces, four loads in flight per thread, then the tail.
__device__ __forceinline__ void copy_bytes(uint8_t* dst, const uint8_t* src, uint64_t nbytes, uint64_t tid,
                                           uint64_t nthreads) {
    const uint64_t n16 = nbytes / 16;
    const int4* s = reinterpret_cast<const int4*>(src);
    int4* d = reinterpret_cast<int4*>(dst);
    uint64_t i = tid;
    for (; i + 3 * nthreads < n16; i += 4 * nthreads) {
        int4 v[4];
        #pragma unroll
        for (uint32_t u = 0; u < 4; ++u)
            v[u] = __ldcs(s + i + u * nthreads);
        #pragma unroll
        for (uint32_t u = 0; u < 4; ++u)
            d[i + u * nthreads] = v[u];
    }
    for (; i < n16; i += nthreads)
        d[i] = __ldcs(s + i);
    if (tid < (nbytes % 16) / 4)
        reinterpret_cast<uint32_t*>(dst + n16 * 16)[tid] = reinterpret_cast<const uint32_t*>(src + n16 * 16)[tid];
}

// Inputs given by address (mega_moe(..., x=..., x_sf=..., topk_idx=..., topk_weights=...)): the
// whole grid copies this call's rows into the buffer before the roles split, instead of a
// separate copy before the launch.  The block barrier after it and the count exchange (a
// system fence, then relaxed adds that every peer acquires) publish the copies to the peers
// that pull from them, the same chain that publishes the count phase's remote writes.
__device__ __forceinline__ void copy_given_inputs(const Params& p) {
    const uint64_t n = p.num_tokens;
    const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    const uint64_t nthreads = static_cast<uint64_t>(gridDim.x) * blockDim.x;
    copy_bytes(at<uint8_t>(p, p.off_x), reinterpret_cast<const uint8_t*>(p.in_x), n * kHidden, tid, nthreads);
    copy_bytes(at<uint8_t>(p, p.off_x_sf), reinterpret_cast<const uint8_t*>(p.in_x_sf), n * (kHidden / 128) * 4, tid,
               nthreads);
    copy_bytes(at<uint8_t>(p, p.off_topk_idx), reinterpret_cast<const uint8_t*>(p.in_topk_idx), n * kNumTopk * 8, tid,
               nthreads);
    copy_bytes(at<uint8_t>(p, p.off_topk_weights), reinterpret_cast<const uint8_t*>(p.in_topk_weights),
               n * kNumTopk * 4, tid, nthreads);
}

__device__ __forceinline__ void dispatch_role(const Params& p, SharedStorage& ss, uint32_t dispatch_thread) {
    MEGAMOE_PROF(if (dispatch_thread == 0) {
        ss.prof[2][4] = clock64();
        MEGAMOE_PROF_ADD(kProfDispatchStart, ss.prof[2][4] - ss.prof[2][3]);
    })
    uint64_t* grid_sync = at<uint64_t>(p, p.off_grid_sync);
    Schedule& s = ss.schedule;

    dispatch_count(p, s.epoch, dispatch_thread, ss.send_count);
    ptx::named_bar_sync(kBarDispatch, kNumDispatchThreads);
    if (dispatch_thread == 0) {
        MEGAMOE_PROF(const uint64_t prof_t0 = clock64(); MEGAMOE_PROF_ADD(kProfDispatchCount, prof_t0 - ss.prof[2][4]);)
        // Working CTAs: those with pairs to count (kNumDispatchThreads pairs per CTA), rows to
        // push (a small call on the direct pool: push_rows) or inputs to copy
        // (copy_given_inputs: x is the largest copy, 16 bytes per thread; CTA 0 always).
        static_assert(kNumTopk * 8 <= kHidden, "x must be the largest input copy (working CTAs)");
        const uint32_t num_pairs = num_call_pairs(p);
        const bool pushed = pushes_rows(p);
        const uint32_t pair_ctas = max(ceil_div(num_pairs, kNumDispatchThreads), pushed ? push_ctas(num_pairs) : 0u);
        const uint32_t copy_ctas =
            p.in_x != 0 ? ceil_div(static_cast<uint32_t>(p.num_tokens) * (kHidden / 16), kNumThreads) : 0;
        const uint32_t working = max(1u, min(gridDim.x, max(pair_ctas, copy_ctas)));
        s.direct = count_exchange(p, grid_sync + kGridSyncCountExchange + (s.epoch & 1), working, pushed) == kNumRanks;
        MEGAMOE_PROF_ADD(kProfDispatchExchange, clock64() - prof_t0);
    }
    ptx::named_bar_sync(kBarDispatch, kNumDispatchThreads);

    build_schedule(p, s, dispatch_thread);
    ptx::named_bar_sync(kBarDispatch, kNumDispatchThreads);
    MEGAMOE_PROF(if (dispatch_thread == 0) MEGAMOE_TRACE(kTraceScheduleDone, s.epoch, 0, 0);)
    ptx::named_bar_arrive(kBarSchedule, kNumThreads);

    MEGAMOE_PROF(if (dispatch_thread == 0) ss.prof[2][5] = clock64();)
    if (dispatch_thread / 32 == kNumDispatchWarps - 1) {  // the publisher warp
        publish_l1_tiles(p, ss, dispatch_thread % 32);
        return;
    }
    dispatch_pull(p, s, dispatch_thread / 32, dispatch_thread % 32);
    MEGAMOE_PROF(if (dispatch_thread == 0) {
        MEGAMOE_PROF_ADD(kProfDispatchSchedule, ss.prof[2][5] - ss.prof[2][4]);
        MEGAMOE_PROF_ADD(kProfDispatchPull, clock64() - ss.prof[2][5]);
    })
}

__device__ __forceinline__ void consumer_role(const Params& p, SharedStorage& ss, uint32_t wg, uint32_t tid) {
    uint64_t* grid_sync = at<uint64_t>(p, p.off_grid_sync);
    const uint32_t ct = wg * 128 + tid % 128;
    const ConsumerProfile prof(ss, wg, tid);
    MEGAMOE_PROF(if (prof.sampler) { MEGAMOE_PROF_ADD(kProfConsumerStart, clock64() - ss.prof[2][3]);
                                     MEGAMOE_PROF_ADD(kProfSamplers, 1); })
    uint32_t l1_tiles = 0;
    const uint32_t stuck = consumer_loop(p, ss, wg, tid, prof, l1_tiles);
    if (stuck == kConsumerPublisherLate || (stuck == kConsumerOk && !publisher_caught_up(p, ss, l1_tiles)))
        fail(p, kPhasePublish, l1_tiles - 1, ptx::ld_volatile_shared_u32(&ss.publish_taken), l1_tiles);
    else if (stuck != kConsumerOk)
        fail(p, kPhasePipeline, stuck, stuck ^ 1, 0);
    // The publisher warp's last barrier: no more L1 tiles
    if (ct == 0)
        ss.publish_slot[l1_tiles & 1] = make_uint4(kNoMoreTiles, 0, l1_tiles, 0);
    publish_arrive(l1_tiles & 1);
    MEGAMOE_PROF(if (prof.sampler) prof.counters[8] = clock64();)

    // The reduce's warps: warp w of CTA b is reduce warp w * grid + b, so the few units of a
    // small call (up to 7 parts of each token's row) land on different SMs, not on one.
    const uint32_t reduce_warp = (ct / 32) * gridDim.x + blockIdx.x, reduce_warps = gridDim.x * 8;
    const bool first_valid = reduce_first_slot_valid(p, reduce_warp, reduce_warps, ct % 32);

    // Every local L2 push is done; wait for every rank's pushes into our combine buffer.
    __threadfence_system();
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);
    if (ct == 0)
        combine_barrier(p, grid_sync + kGridSyncCombineArrivals, ss.schedule.epoch * 4 + 2);
    ptx::named_bar_sync(kBarConsumers, kNumConsumerThreads);
    MEGAMOE_PROF(if (prof.sampler) { MEGAMOE_PROF_ADD(kProfCombineBarrier, clock64() - prof.counters[8]); prof.counters[8] = clock64(); }
                 if (ct == 0) MEGAMOE_TRACE(kTraceBarrierDone, ss.schedule.epoch, 0, 0);)

    // Cleanup: every counter this call used returns to zero for the next call.
    const uint32_t gt = blockIdx.x * kNumConsumerThreads + ct;
    const uint32_t stride = gridDim.x * kNumConsumerThreads;
    uint32_t* l1_arrival = at<uint32_t>(p, p.off_l1_arrival);
    uint32_t* l2_arrival = at<uint32_t>(p, p.off_l2_arrival);
    uint32_t* recv_count = recv_counts(p, ss.schedule.epoch);
    for (uint32_t i = gt; i < ss.schedule.num_blocks(); i += stride)
        l1_arrival[i] = 0;
    // (a direct-pool call's blocks are its experts' numbers)
    const uint32_t used_blocks = ss.schedule.direct ? kNumExpertsPerRank : ss.schedule.num_blocks();
    for (uint32_t i = gt; i < used_blocks * kL2ReadyWords; i += stride)
        l2_arrival[i] = 0;
    // This call's parity: every local CTA has built its schedule from it (before the combine
    // barrier), and no peer adds to it again before the call after next (count_exchange).
    for (uint32_t i = gt; i < kNumRanks * kNumExpertsPerRank; i += stride)
        recv_count[i] = 0;
    if (gt == 0) {
        grid_sync[kGridSyncCountExchange + (ss.schedule.epoch & 1)] = 0;
        grid_sync[kGridSyncTileCounter] = 0;  // every producer has taken its last tile
    }

    combine_reduce(p, reduce_warp, reduce_warps, ct % 32, first_valid);
    MEGAMOE_PROF(if (prof.sampler) {
        MEGAMOE_PROF_ADD(kProfReduce, clock64() - prof.counters[8]);
        MEGAMOE_PROF_ADD(kProfConsumerTotal, clock64() - ss.prof[2][3]);
    }
                 if (ct == 0) MEGAMOE_TRACE(kTraceCtaEnd, ss.schedule.epoch, 0, 0);)

    if (blockIdx.x == 0 && ct == 0)
        grid_sync[kGridSyncEpoch] = ss.schedule.epoch + 1;
}

}  // namespace megamoe

extern "C" __global__ void __launch_bounds__(megamoe::kNumThreads, 1) megamoe_kernel(const __grid_constant__ Params p) {
    using namespace megamoe;
    SharedStorage& ss = shared_storage();
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    if (threadIdx.x == 0) {
        MEGAMOE_PROF(ss.prof[2][3] = clock64();)
        #pragma unroll
        for (uint32_t i = 0; i < kNumStages; ++i) {
            ptx::mbar_init(&ss.full[i], 1);
            ptx::mbar_init(&ss.empty[i], kNumConsumerThreads / 32 * kClusterM);
        }
        #pragma unroll
        for (uint32_t i = 0; i < kTileSlots; ++i)
            ss.tile_slot[i] = 0;  // before the cluster barrier: the leader's forwards come after it
        ss.publish_taken = 0;
        ptx::fence_mbarrier_init();
        ptx::fence_proxy_async_shared();
        // Every CTA's copy: its rank waits need it.  Block 0 advances it only at the very end,
        // after the combine barrier that every CTA reaches after reading it here.
        ss.schedule.epoch = at<uint64_t>(p, p.off_grid_sync)[kGridSyncEpoch];
        MEGAMOE_TRACE(kTraceCtaStart, ss.schedule.epoch, 0, 0);
        ptx::tma_prefetch_desc(&p.tmap_l1_a);
        ptx::tma_prefetch_desc(&p.tmap_l1_b);
        ptx::tma_prefetch_desc(&p.tmap_l2_a);
        ptx::tma_prefetch_desc(&p.tmap_l2_b);
    }
    if (p.in_x != 0)
        copy_given_inputs(p);
    // NOTES: with clusters, the other CTAs' barriers must be initialized before any
    // multicast or remote arrive targets them.
    if constexpr (kClusterM == 1)
        __syncthreads();
    else
        ptx::cluster_sync();

    if (warp < 4) {
        ptx::setmaxnreg_dec<kProducerRegisters>();
        if (warp == 0) {
            ptx::named_bar_sync(kBarSchedule, kNumThreads);
            if (lane == 0)
                producer_loop(p, ss, kClusterM == 1 ? 0 : ptx::cluster_ctarank());
        } else {
            dispatch_role(p, ss, threadIdx.x - 32);
        }
    } else {
        ptx::setmaxnreg_inc<kConsumerRegisters>();
        fp4_fill_table(ss, threadIdx.x - 128);
        ptx::named_bar_sync(kBarSchedule, kNumThreads);
        // Shuffled so the compiler knows the warpgroup index is warp-uniform.  (The WGMMA
        // descriptors still move through R2UR: see docs/PERF_NOTES.md entries 14 and 24.)
        consumer_role(p, ss, __shfl_sync(0xffffffffu, warp / 4 - 1, 0), threadIdx.x - 128);
    }
}

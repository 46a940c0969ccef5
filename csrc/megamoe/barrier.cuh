// Grid-wide and cross-rank barriers.  Every wait has a real-time deadline.
#pragma once
#include "common.cuh"

namespace megamoe {

// Grid barrier among one thread of every CTA.  counter[0] counts arrivals and returns
// to zero after every barrier; counter[1] is a generation that only grows, so the
// words need no reset between calls and stay valid if the grid size changes.
// NOTES: the generation is read (acquire) before arriving, so the last arriver cannot
// have advanced it yet; the last arriver's release on the generation publishes every
// write the other CTAs released with their arrival.
__device__ __forceinline__ void grid_barrier(const Params& p, uint64_t* counter, uint32_t phase) {
    const uint64_t gen = ptx::ld_acquire_gpu_u64(counter + 1);
    const uint64_t old = ptx::atom_add_release_gpu_u64(counter, 1);
    if (old == gridDim.x - 1) {
        atomicExch(reinterpret_cast<unsigned long long*>(counter), 0ull);
        ptx::atom_add_release_gpu_u64(counter + 1, 1);
        return;
    }
    // Twice the deadline: the CTAs this barrier waits for may be stuck in a timed wait of their
    // own (the tile pipeline, an arrival, a pull); that wait's diagnostic names the real cause,
    // so it must fire first.
    Deadline d(2 * p.timeout_ns);
    uint64_t now;
    while ((now = ptx::ld_acquire_gpu_u64(counter + 1)) == gen)
        d.check(p, phase, gen + 1, now, 0);
}

// The count exchange: every working CTA of every rank announces that its pairs are counted
// (its atomics on the owners' receive counters and its stores into their tables are done)
// and its inputs copied by one release add on every rank's `arrivals` word, and every CTA
// waits until its own word says that every working CTA of every rank has.  One add carries a
// CTA (bits 0-19); CTA 0's also carries its rank's number of working CTAs (bits 20-39) and
// its rank (bits 40-47), so no rank needs the others' counts: the exchange is complete once
// every rank is announced and the CTAs equal the announced numbers.
// The word is this call's parity's ([0] or [1] of grid_sync), zeroed by the cleanup phase.
// NOTES: a peer adds to the same parity's word again two calls later, after this rank's next
// combine barrier, which this rank's next kernel signals only after this kernel's cleanup
// (stream order, and the system fence before the signal).  Replaces a grid barrier, CTA 0's
// publish of the counts and a cross-rank barrier.
constexpr uint64_t kExchangeGridUnit = 1ull << 20, kExchangeRankUnit = 1ull << 40;

// Only the CTAs that wrote something the peers read before the exchange (`working`: the
// first ones, see dispatch_role) take part; the others only wait, so a CTA that starts late
// delays the exchange only when it has pairs to count or inputs to copy.
__device__ __forceinline__ void count_exchange(const Params& p, uint64_t* arrivals, uint32_t working) {
    if (blockIdx.x < working) {
        const uint64_t add = 1 + (blockIdx.x == 0 ? kExchangeRankUnit + working * kExchangeGridUnit : 0);
        __threadfence_system();
        #pragma unroll
        for (uint32_t r = 0; r < kNumRanks; ++r)
            ptx::red_release_sys_add_u64(map_to_rank(p, arrivals, r), add);
    }
    Deadline d(p.timeout_ns);
    while (true) {
        const uint64_t v = ptx::ld_acquire_sys_u64(arrivals);
        const uint64_t ctas = v % kExchangeGridUnit, announced = (v / kExchangeGridUnit) % kExchangeGridUnit;
        if (v / kExchangeRankUnit == kNumRanks && ctas == announced)
            return;
        // index 0: ranks announced (expected all); index 1: CTAs arrived (expected those announced)
        const uint64_t ranks = v / kExchangeRankUnit;
        if (ranks < kNumRanks)
            d.check(p, kPhaseCountExchange, kNumRanks, ranks, 0);
        else
            d.check(p, kPhaseCountExchange, announced, ctas, 1);
    }
}

// Cross-rank barrier, in two halves.  rank_signal (one thread of CTA 0): store `value`
// into every rank's flag slot for this rank.  rank_wait (one thread of every CTA that needs
// the barrier): wait until every rank's slot here reached it.  Values only grow
// (epoch * 4 + barrier index), so a fast peer already at a later barrier also passes.
// NOTES: the system-scope fence before the release stores orders every remote and local
// write this CTA (and, through the grid barrier before, every CTA) made; a CTA that acquires
// every rank's flag, its own rank's included, sees all of them without a second grid barrier.
__device__ __forceinline__ void rank_signal(const Params& p, uint64_t value) {
    uint64_t* flags = at<uint64_t>(p, p.off_rank_flags);
    __threadfence_system();
    #pragma unroll
    for (uint32_t r = 0; r < kNumRanks; ++r)
        ptx::st_release_sys_u64(map_to_rank(p, flags + p.rank, r), value);
}

__device__ __forceinline__ void rank_wait(const Params& p, uint64_t value, uint32_t phase) {
    const uint64_t* flags = at<uint64_t>(p, p.off_rank_flags);
    #pragma unroll
    for (uint32_t r = 0; r < kNumRanks; ++r) {
        Deadline d(p.timeout_ns);
        uint64_t now;
        while ((now = ptx::ld_acquire_sys_u64(flags + r)) < value)
            d.check(p, phase, value, now, r);
    }
}

}  // namespace megamoe

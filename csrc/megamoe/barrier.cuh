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

// The publisher role (the last dispatch warp, once the schedule is built): announces each
// finished L1 tile to the L2 tiles that wait for it (L2Ready), off the consumers' path; and the
// consumers' side of that handoff.
#pragma once
#include "scheduler.cuh"
#include "storage.cuh"

namespace megamoe {

// Test-only fault injection, the kernel's one build switch besides profiling: empty unless a
// fault-injection build defines MEGAMOE_EXP_SLOW_PUBLISHER or MEGAMOE_EXP_STUCK_PUBLISHER
// (kernel_source.experiment_defines, from $MEGAMOE_EXPERIMENT, which scripts/fault_probe.py sets for
// tests/gpu/test_fused_faults.py).  They check the consumers' side of the handoff below, which a
// healthy publisher never exercises:
//   SLOW_PUBLISHER   this warp starts 2 ms late, so the consumers of a CTA with 3 or more L1
//                    tiles must wait for it (publisher_caught_up) and the result stays right;
//   STUCK_PUBLISHER  it never publishes, so the consumers' wait times out with the
//                    L1-tile publication diagnostic, before the waits it holds up.
// tests/test_kernel_headers.py fails on a MEGAMOE_EXP_ switch anywhere else.
__device__ __forceinline__ void publisher_fault_hook(uint32_t lane) {
#if defined(MEGAMOE_EXP_SLOW_PUBLISHER) || defined(MEGAMOE_EXP_STUCK_PUBLISHER)
    if (lane == 0) {
#ifdef MEGAMOE_EXP_STUCK_PUBLISHER
        while (true)  // until a timeout traps the grid
            __nanosleep(100000);
#endif
        const uint64_t until = ptx::globaltimer_ns() + 2000000;  // 2 ms
        while (ptx::globaltimer_ns() < until)
            __nanosleep(10000);
    }
    __syncwarp();
#else
    (void)lane;
#endif
}

// The publisher warp (the last dispatch warp): for every L1 tile of this CTA, once both
// consumer warpgroups arrived (after their stores and proxy fences), one fence and the relaxed
// OR of the tile's ready bit, off the consumers' path.  The consumers end the sequence with
// kNoMoreTiles after their last tile (consumer_role).
// NOTES: two barriers by tile parity.  The consumers arrive for tile i + 2 (rewriting slot
// i % 2) only after this warp counted tile i in publish_taken (publisher_caught_up), so one
// barrier phase never holds the arrivals of two tiles; the slot's sequence number checks
// that.  The consumers run a whole tile's main loop between two arrivals of one parity, so
// they normally find tile i taken long before.  A consumer that fails (fail) traps the
// grid, so this warp never waits for a missing arrival.
__device__ __forceinline__ void publish_l1_tiles(const Params& p, SharedStorage& ss, uint32_t lane) {
    uint32_t* ready = at<uint32_t>(p, p.off_l2_arrival);
    publisher_fault_hook(lane);
    for (uint32_t i = 0;; ++i) {
        if (i & 1)
            ptx::named_bar_sync(kBarPublish + 1, kNumConsumerThreads + 32);
        else
            ptx::named_bar_sync(kBarPublish, kNumConsumerThreads + 32);
        const uint4 w = ss.publish_slot[i & 1];
        if (w.z != i && lane == 0)  // cannot happen while the consumers wait for publish_taken
            fail(p, kPhasePublishSlot, i, w.z, w.x);
        if (w.x == kNoMoreTiles)
            return;
        if (lane == 0) {
            __threadfence();  // cumulative over the consumers' stores (the barrier orders them before it)
            ptx::red_relaxed_gpu_or_u32(ready + w.x, w.y);
            // After the OR, which uses the slot's words: the slot is read before it is freed
            *reinterpret_cast<volatile uint32_t*>(&ss.publish_taken) = i + 1;
        }
    }
}

// Slot seq % 2 and its barrier are free again once the publisher warp has taken L1 tile seq - 2
// (it counts the tiles it took in publish_taken).  The consumers run a whole L1 tile between
// two arrivals of one parity, so this holds at once unless the publisher stalls; if they
// arrived first, tiles seq - 2 and seq would fill one barrier phase and the publisher would
// miss a tile.  Every consumer thread checks before it arrives; false after half of
// p.timeout_ns (the caller reports it outside the K loop: kConsumerPublisherLate).  Half: the
// publisher waits for nobody but these consumers, while this CTA's producer (empty stages)
// and the L2 tiles everywhere (ready bits) wait for this wait, so it must time out first and
// name the publisher, not what it held up.
__device__ __forceinline__ bool publisher_caught_up(const Params& p, SharedStorage& ss, uint32_t seq) {
    if (seq < 2 || ptx::ld_volatile_shared_u32(&ss.publish_taken) + 1 >= seq)
        return true;
    const uint64_t start = ptx::globaltimer_ns();
    uint32_t iter = 0;
    while (ptx::ld_volatile_shared_u32(&ss.publish_taken) + 1 < seq) {
        if ((++iter & 255u) == 0 && ptx::globaltimer_ns() - start > p.timeout_ns / 2)
            return false;
    }
    return true;
}

// The consumers' side of publish_l1_tiles, by L1-tile parity.  (Constant barrier ids: with an
// id in a register ptxas reserves all 16.)
__device__ __forceinline__ void publish_arrive(uint32_t parity) {
    if (parity)
        ptx::named_bar_arrive(kBarPublish + 1, kNumConsumerThreads + 32);
    else
        ptx::named_bar_arrive(kBarPublish, kNumConsumerThreads + 32);
}

}  // namespace megamoe

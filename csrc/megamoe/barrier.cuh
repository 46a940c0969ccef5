// The count exchange and the combine barrier.  Every wait has a real-time deadline.
#pragma once
#include "common.cuh"

namespace megamoe {

// The count exchange: every working CTA of every rank announces that its pairs are counted
// (its atomics on the owners' receive counters, or its stores of the final counts, and its
// stores into their tables and direct pools are done) and its inputs copied by one add (a
// system fence, then relaxed adds: release patterns) on every rank's `arrivals` word, and
// every CTA waits until its own word says that every working CTA of every rank has.  One add
// carries a CTA (bits 0-19); CTA 0's also carries its rank's number of working CTAs (bits
// 20-39), its rank (bits 40-47) and, when the rank pushed its rows into the owners' direct
// pools (dispatch_count), a push (bits 48-55), so no rank needs the others' counts: the
// exchange is complete once every rank is announced and the CTAs equal the announced numbers.
// Returns the number of ranks that pushed.
// The word is grid_sync[kGridSyncCountExchange + the call's epoch parity], zeroed by the cleanup phase.
// NOTES: a peer adds to the same parity's word again two calls later, after this rank's next
// combine barrier, which this rank's next kernel signals only after this kernel's cleanup
// (stream order, and the system fence before the signal).  Replaces a grid barrier, CTA 0's
// publish of the counts and a cross-rank barrier.
constexpr uint64_t kExchangeGridUnit = 1ull << 20, kExchangeRankUnit = 1ull << 40, kExchangePushUnit = 1ull << 48;

// Only the CTAs that wrote something the peers read before the exchange (`working`: the
// first ones, see dispatch_role) take part; the others only wait, so a CTA that starts late
// delays the exchange only when it has pairs to count or inputs to copy.
__device__ __forceinline__ uint32_t count_exchange(const Params& p, uint64_t* arrivals, uint32_t working, bool pushed) {
    if (blockIdx.x < working) {
        const uint64_t add =
            1 + (blockIdx.x == 0 ? kExchangeRankUnit + working * kExchangeGridUnit + (pushed ? kExchangePushUnit : 0) : 0);
        // One fence, then relaxed adds (release patterns, ptx.cuh): the peers' first, this
        // rank's last, none waiting for another
        __threadfence_system();
        #pragma unroll
        for (uint32_t i = 1; i <= kNumRanks; ++i)
            ptx::red_relaxed_sys_add_u64(map_to_rank(p, arrivals, (p.rank + i) % kNumRanks), add);
    }
    Deadline d(p.timeout_ns);
    while (true) {
        const uint64_t v = ptx::ld_acquire_sys_u64(arrivals);
        const uint64_t ctas = v % kExchangeGridUnit, announced = (v / kExchangeGridUnit) % kExchangeGridUnit;
        // index 0: ranks announced (expected all); index 1: CTAs arrived (expected those announced)
        const uint64_t ranks = (v / kExchangeRankUnit) % (kExchangePushUnit / kExchangeRankUnit);
        if (ranks == kNumRanks && ctas == announced)
            return static_cast<uint32_t>(v / kExchangePushUnit);
        if (ranks < kNumRanks)
            d.check(p, kPhaseCountExchange, kNumRanks, ranks, 0);
        else
            d.check(p, kPhaseCountExchange, announced, ctas, 1);
    }
}

// Cross-rank signal (one thread, after a system fence): store `value` into every rank's flag
// slot for this rank.  Values only grow (epoch * 4 + barrier index), so a fast peer already
// at a later barrier also passes a wait for this one.
// NOTES: the system-scope fence before the relaxed stores (release patterns, one fence for all
// of them) orders every remote and local write this thread made or acquired; a CTA that
// acquires every rank's flag, its own rank's included, sees all of them.
__device__ __forceinline__ void rank_signal(const Params& p, uint64_t value) {
    uint64_t* flags = at<uint64_t>(p, p.off_rank_flags);
    __threadfence_system();
    #pragma unroll
    for (uint32_t i = 1; i <= kNumRanks; ++i)  // the peers first, this rank last
        ptx::st_relaxed_sys_u64(map_to_rank(p, flags + p.rank, (p.rank + i) % kNumRanks), value);
}

// The combine barrier (one thread of every CTA): every CTA of every rank has pushed its L2
// rows.  Each CTA arrives with one acq_rel add on this rank's counter; the last local arriver
// signals every rank (rank_signal), then returns the counter to zero, and every CTA waits for
// every rank's signal, its own rank's included.  A grid barrier with a generation
// word followed by CTA 0's signal took three more dependent round trips from the last tile to
// the reduce: the generation read before arriving, the reset and generation bump, and CTA 0
// noticing the bump.
// NOTES: every CTA's consumers fence (system scope) and meet at a block barrier before its
// add; the last arriver's add acquires every earlier add (one release sequence of RMWs), so
// its system fence and the stores after it in rank_signal are cumulative over every local push.
// The reset is not ordered against anything in this call: the counter's next add comes from
// the next launch, after this grid has ended.  A missing signal of this rank means a local
// CTA never arrived: that wait gets twice the deadline, since the CTA it waits for may be
// stuck in a timed wait of its own (a tile pipeline, an arrival) whose diagnostic names the
// real cause and must fire first.
__device__ __forceinline__ void combine_barrier(const Params& p, uint64_t* counter, uint64_t value) {
    if (ptx::atom_add_acq_rel_gpu_u64(counter, 1) == gridDim.x - 1) {
        rank_signal(p, value);
        ptx::st_relaxed_gpu_u64(counter, 0);  // after the signal: the signal's fence need not wait for it
    }
    const uint64_t* flags = at<uint64_t>(p, p.off_rank_flags);
    #pragma unroll
    for (uint32_t i = 0; i < kNumRanks; ++i) {
        const uint32_t r = (p.rank + i) % kNumRanks;  // own rank first: a local straggler is named first
        const bool local = r == p.rank;
        Deadline d(local ? 2 * p.timeout_ns : p.timeout_ns);
        uint64_t now;
        while ((now = ptx::ld_acquire_sys_u64(flags + r)) < value)
            d.check(p, local ? kPhaseCombineBarrier : kPhaseCombineRankBarrier, value, now, r);
    }
}

}  // namespace megamoe

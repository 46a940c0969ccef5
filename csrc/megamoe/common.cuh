// Compile-time shape/config constants and small helpers shared by every role.
// The generated translation unit (megamoe_cli/kernel/kernel_source.py) defines the MEGAMOE_* macros,
// `struct Params` and the contract (megamoe_cli/kernel/contract.py: tile shape, Phase, Diagnostic,
// ProfileSlot, TraceKind, GridSyncWord) before including kernel.cuh.
#pragma once
#include <cstdint>
#include <cstdio>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "fp4.cuh"
#include "ptx.cuh"

#ifndef MEGAMOE_CONTRACT
#error "the generated contract (megamoe_cli/kernel/contract.py, contract_header) must come before the kernel headers"
#endif

// Cycle counters for profiling builds (MEGAMOE_PROFILE): summed over CTAs, read by the host
// through the module global; slots: ProfileSlot.
// The same builds keep a timeline: megamoe_trace holds up to kTraceEvents events of
// {globaltimer ns, clock64, place, when}, packed by the contract's kTrace*Shift (place: CTA,
// pool block, TraceKind; when: call epoch, info), taken in order from megamoe_trace_count.
#ifdef MEGAMOE_PROFILE
extern "C" {
__device__ unsigned long long megamoe_profile[megamoe::kProfileCapacity];
__device__ unsigned int megamoe_trace_count;
__device__ ulonglong4 megamoe_trace[megamoe::kTraceEvents];
}
#define MEGAMOE_PROF(...) __VA_ARGS__
#define MEGAMOE_PROF_ADD(slot, value) atomicAdd(&megamoe_profile[slot], static_cast<unsigned long long>(value))
#define MEGAMOE_TRACE(kind, epoch, info, block) megamoe_trace_event(kind, epoch, info, block)
__device__ __forceinline__ void megamoe_trace_event(uint32_t kind, uint64_t epoch, uint32_t info, uint32_t block) {
    const uint32_t i = atomicAdd(&megamoe_trace_count, 1u);
    if (i < megamoe::kTraceEvents)
        megamoe_trace[i] = make_ulonglong4(megamoe::ptx::globaltimer_ns(), clock64(),
                                           (static_cast<unsigned long long>(blockIdx.x) << megamoe::kTraceCtaShift) |
                                               (static_cast<unsigned long long>(block) << megamoe::kTraceBlockShift) |
                                               (static_cast<unsigned long long>(kind) << megamoe::kTraceKindShift),
                                           (epoch << megamoe::kTraceEpochShift) |
                                               (static_cast<unsigned long long>(info) << megamoe::kTraceInfoShift));
}
#else
#define MEGAMOE_PROF(...)
#define MEGAMOE_PROF_ADD(slot, value) ((void)0)
#define MEGAMOE_TRACE(kind, epoch, info, block) ((void)0)
#endif

namespace megamoe {

constexpr uint32_t kHidden = MEGAMOE_HIDDEN;
constexpr uint32_t kIntermediate = MEGAMOE_INTERMEDIATE;
constexpr uint32_t kNumExperts = MEGAMOE_NUM_EXPERTS;
constexpr uint32_t kNumTopk = MEGAMOE_NUM_TOPK;
constexpr uint32_t kNumRanks = MEGAMOE_NUM_RANKS;
constexpr uint32_t kNumMaxTokens = MEGAMOE_NUM_MAX_TOKENS;
constexpr uint32_t kNumStages = MEGAMOE_NUM_STAGES;
constexpr uint32_t kNumExpertsPerRank = kNumExperts / kNumRanks;

// Tile shape: BLOCK_M pool rows x BLOCK_N output columns, K step 128 (one scale block).
// BLOCK_M = 64: each consumer warpgroup owns one 128-column half of the tile (decode).
// BLOCK_M = 128: each consumer warpgroup owns two 64 x 128 parts (prefill: half the B traffic
// per FLOP), 64 rows and both column halves (FP8) or all rows and one half (MXFP4; WgSlice).
constexpr uint32_t kBlockM = MEGAMOE_BLOCK_M;
constexpr uint32_t kNumPartsPerWg = kBlockM / 64;
// Cluster of kClusterM CTAs sharing each stage's B or A by TMA multicast: consecutive M blocks
// of one expert and the same N tile (each CTA loads 256 / kClusterM rows of B and multicasts
// them to all), or an expert's odd last block and consecutive N tiles (the leader multicasts A).
constexpr uint32_t kClusterM = MEGAMOE_CLUSTER_M;
static_assert(kClusterM == 1 || kClusterM == 2, "cluster_m must be 1 or 2");
constexpr uint32_t kWgmmaK = 32;

// Roles (kNumThreads): warpgroup 0 = TMA producer warp + dispatch warps; warpgroups 1, 2 = MMA consumers.
constexpr uint32_t kNumConsumerThreads = 256;
constexpr uint32_t kNumDispatchWarps = 3;
constexpr uint32_t kNumDispatchThreads = kNumDispatchWarps * 32;

// L1 produces 2*I columns (gate/up interleaved by 8), L2 produces H columns.
constexpr uint32_t kNumL1NTiles = 2 * kIntermediate / kBlockN;
constexpr uint32_t kNumL2NTiles = kHidden / kBlockN;
constexpr uint32_t kNumL1KBlocks = kHidden / kBlockK;
constexpr uint32_t kNumL2KBlocks = kIntermediate / kBlockK;
// L2 K block j reads the 128 intermediate columns that L1 N tile j writes, so an L2 tile waits
// for its block's L1 tiles one K block at a time: each block has kL2ReadyWords words of ready
// bits in the buffer's l2_arrival segment (bit j % 32 of word j / 32: L1 N tile j is written).
static_assert(kNumL2KBlocks == kNumL1NTiles, "L2 K block j is L1 N tile j's output");
constexpr uint32_t kL2ReadyWords = (kNumL1NTiles + 31) / 32;

static_assert(supported_block_m(kBlockM), "block_m: see contract.SUPPORTED_BLOCK_M");
static_assert(kHidden % kBlockN == 0, "hidden must be a multiple of 256");
static_assert((2 * kIntermediate) % kBlockN == 0, "intermediate must be a multiple of 128");
static_assert(kNumExperts % kNumRanks == 0, "experts must divide evenly over ranks");
static_assert(kNumRanks <= kMaxRanks, "at most kMaxRanks ranks");
static_assert(kNumTopk <= kMaxTopk, "at most kMaxTopk top-k slots");

// Direct pool (small calls): when every rank has at most kNumDispatchThreads pairs, each rank
// pushes its rows straight into the owners' pools before the count exchange (from many CTAs:
// push_rows), at fixed rows: expert e's block is pool block e, and source rank r's rows of it
// are rows [r * kDirectRowsPerSrc, (r + 1) * kDirectRowsPerSrc) (64 / ranks, rounded down: with
// 3, 5, 6 or 7 ranks the block's last rows belong to no rank).  The owner then runs its tiles with no
// pull, provided no (expert, source) pair count exceeds kDirectRowsPerSrc (else it pulls as
// usual and ignores the pushed rows).  block_m 64 without clusters only (0: never).
constexpr uint32_t kDirectRowsPerSrc = (kBlockM == 64 && kClusterM == 1) ? kBlockM / kNumRanks : 0;

// Expert weight format (SPEC §2b): FP8 e4m3 with 128x128 FP32 block scales, or MXFP4 (e2m1
// codes, one scale per 32 along K), streamed at half the bytes and expanded to e4m3 in shared
// memory by the consumer warpgroup that reads them (fp4.cuh: the stage's layout and expansion).
#ifndef MEGAMOE_WEIGHT_FP4
#define MEGAMOE_WEIGHT_FP4 0u
#endif
constexpr bool kWeightFp4 = MEGAMOE_WEIGHT_FP4 != 0;
static_assert(kFp4StageRows == kBlockN && kFp4StageK == kBlockK, "MXFP4 stage: one B tile's K block (fp4.cuh)");
static_assert(kFp4StageBytes == kFp4DataBytes + kBlockN * (kBlockK / 32), "MXFP4 stage: see contract.py");
static_assert(!kWeightFp4 || kClusterM == 1,
              "MXFP4 weights: no clusters (B would have to be multicast into both CTAs' e4m3 tiles)");

// L1 epilogue clamp of the models that clamp their SwiGLU (0: off): gate <= c, -c <= up <= c
#ifndef MEGAMOE_ACTIVATION_CLAMP
#define MEGAMOE_ACTIVATION_CLAMP 0.0f
#endif
constexpr float kActivationClamp = MEGAMOE_ACTIVATION_CLAMP;

// Shared-memory stage: A tile (BLOCK_M x 128 fp8), B tile (256 x 128 fp8, or its MXFP4 stage),
// A scales.
constexpr uint32_t kSmemABytes = kBlockM * kBlockK;
constexpr uint32_t kSmemBBytes = kBlockN * kBlockK;
constexpr uint32_t kSmemSfaBytes = kBlockM * sizeof(float);
constexpr uint32_t kStageTxBytes = kSmemABytes + (kWeightFp4 ? kFp4StageBytes : kSmemBBytes) + kSmemSfaBytes;
// e4m3 B tiles: one per stage (TMA writes them), or for MXFP4 two the consumers expand into in turn
constexpr uint32_t kNumBTiles = kWeightFp4 ? 2 : kNumStages;

// Barrier ids (0 is __syncthreads)
constexpr uint32_t kBarSchedule = 1;   // all threads: schedule in shared memory is ready
constexpr uint32_t kBarDispatch = 2;   // dispatch warps
constexpr uint32_t kBarConsumers = 3;  // both consumer warpgroups
constexpr uint32_t kBarPublish = 4;    // 4 and 5 (L1-tile parity): consumer warpgroups -> publisher warp
constexpr uint32_t kBarExpand = 6;     // 6 and 7 (warpgroup): MXFP4 B half expanded

__device__ __forceinline__ uint32_t ceil_div(uint32_t a, uint32_t b) { return (a + b - 1) / b; }

template <typename T>
__device__ __forceinline__ T* at(const Params& p, uint64_t offset) {
    return reinterpret_cast<T*>(p.buffer + offset);
}

// Map an address inside the local symmetric buffer to the same address in rank `r`'s buffer.
template <typename T>
__device__ __forceinline__ T* map_to_rank(const Params& p, T* ptr, uint32_t r) {
    return reinterpret_cast<T*>(reinterpret_cast<int64_t>(ptr) + p.peer_delta[r]);
}

// The failure record (Diagnostic, in host-pinned memory at p.diag): the first failing thread
// fills it and traps; the host reads it after the launch fails.  No printf: a call anywhere in
// the kernel would make ptxas serialize the WGMMA pipeline.
// Only the first failing thread writes the record and traps; later ones return to what
// they were doing (spinning, or skipping a bad pair), so no trap lands before the record.
__device__ __noinline__ void fail(const Params& p, uint32_t phase, uint64_t expected, uint64_t observed,
                                  uint32_t index) {
    Diagnostic* diag = reinterpret_cast<Diagnostic*>(p.diag);
    if (diag != nullptr) {
        if (atomicCAS(&diag->magic, 0u, 1u) != 0u)
            return;
        diag->rank = static_cast<uint32_t>(p.rank);
        diag->phase = phase;
        diag->cta = blockIdx.x;
        diag->thread = threadIdx.x;
        diag->index = index;
        diag->expected = expected;
        diag->observed = observed;
        __threadfence_system();
        atomicExch(&diag->magic, kDiagMagic);
        __threadfence_system();
    }
    __trap();
}

// A spin-wait that gives up after p.timeout_ns of real time.
struct Deadline {
    uint64_t start;
    uint64_t limit;
    uint32_t iter;
    __device__ __forceinline__ explicit Deadline(uint64_t timeout_ns)
        : start(ptx::globaltimer_ns()), limit(timeout_ns), iter(0) {}
    __device__ __forceinline__ void check(const Params& p, uint32_t phase, uint64_t expected, uint64_t observed,
                                          uint32_t index) {
        if ((++iter & 255u) != 0)
            return;
        if (ptx::globaltimer_ns() - start > limit)
            fail(p, phase, expected, observed, index);
    }
};

// The same wait without the call to fail(): false once p.timeout_ns has passed, and the
// caller reports it outside its loop, so the consumer's K loop holds no call (a call there
// makes ptxas keep the loop's values live across it; a noreturn fail() instead made it cap
// the kernel's registers and spill, docs/PERF_NOTES.md entry 14).
__device__ __forceinline__ bool mbar_wait_or_timeout(const Params& p, uint64_t* bar, uint32_t parity) {
    if (ptx::mbar_try_wait(bar, parity))
        return true;
    const uint64_t start = ptx::globaltimer_ns();
    uint32_t iter = 0;
    while (!ptx::mbar_try_wait(bar, parity)) {
        if ((++iter & 255u) == 0 && ptx::globaltimer_ns() - start > p.timeout_ns)
            return false;
    }
    return true;
}

__device__ __forceinline__ void mbar_wait(const Params& p, uint64_t* bar, uint32_t parity) {
    if (ptx::mbar_try_wait(bar, parity))
        return;
    Deadline d(p.timeout_ns);
    while (!ptx::mbar_try_wait(bar, parity))
        d.check(p, kPhasePipeline, parity, parity ^ 1, 0);
}

// A stage's empty barrier.  With clusters the other CTAs' consumers arrive on it too, with
// CTA-scope release semantics (ptx::mbar_arrive_cluster), so a CTA-scope acquire matches
// them; a cluster-scope acquire would pair with nothing and compiles to an L1 invalidate
// (CCTL.IVALL) after every wait (notes entry 48).
__device__ __forceinline__ void empty_wait(const Params& p, uint64_t* bar, uint32_t parity) {
    mbar_wait(p, bar, parity);
}

}  // namespace megamoe

// MXFP4 expansion microbenchmark: the fused kernel's consumer K loop with MXFP4 weights on data
// that stays in shared memory (no HBM, no producer, no dispatch), to find what bounds the
// expansion.  One CTA per SM of 384 threads as in the kernel: warpgroup 0 only helps fill shared
// memory, then hands its registers to the two consumer warpgroups (setmaxnreg, the kernel's 56 and
// 224), each owning one 128-row half of the 256-row B tile as block_m 64 does; the expansion is
// the kernel's own (fp4.cuh: fp4_expand_half), the WGMMAs and the promotion those of
// consumer.cuh's run_tile.
//
// Modes (per K block of 128, per warpgroup):
//   kernel         expand the half from stored stage kb % 4 into e4m3 tile kb % 2, proxy fence,
//                  warpgroup barrier, 4 SS m64n128k32 on it, wait, 64-FFMA promotion: the kernel's loop
//   mma            the same without the expansion, fence and barrier (the tiles already expanded)
//   expand         the expansion, fence and barrier alone, in both warpgroups at once
//   expand_alone   the same in warpgroup 1 only (warpgroup 2 idles): one warp per scheduler
//   expand_vs_mma  warpgroup 1 runs `expand` while warpgroup 2 runs `mma` on its own tile: the
//                  expansion beside the other warpgroup's WGMMAs and their shared-memory reads
//   nofence        kernel without the proxy fence (the WGMMAs may read stale bytes: timing only)
//   rs16_stage     weights as register-sourced A on the kernel's stage layout (fp4.cuh: each
//                  thread's fragment words one 16-byte group at a swizzled slot): each warpgroup
//                  owns two 64-row units of B; per unit a thread loads its two rows' groups (one load
//                  a row), expands them straight into A fragments and runs 4 RS m64n16k32 per unit
//                  for one 16-token group of the A tile (as B), wait, 16-FFMA promotion
//   rs64_stage     rs16_stage for four 16-token groups (a full 64-row block)
// (the two modes above time the computed-entry path: every scale normal)
//   rs_kernel      the kernel's register-operand K block as consumer.cuh's run_tile_rs runs it:
//                  each warpgroup's two 64-row units, every scale entry from the table
//                  (fp4_unit_fragments), the four A scales and two B scales loaded per K block, 8 RS
//                  m64n16k32, one wait, 16-FFMA promotion (no stage waits or releases: data stays)
//   rs_quad        rs_kernel in four consumer warpgroups (640 threads; setmaxnreg 56 / 104), each one
//                  64-row unit of the stage: the same work per stage over twice the warps
// Prints each mode's cycles per K block in each consumer warpgroup (mean over the SMs; a warpgroup
// that idles prints "-").  Numbers only: the codes are a hash of their position, every scale index is
// normal (the computed table entries) unless --subnormal puts one in every fourth row.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o fp4_expand fp4_expand.cu
// Run:   ./fp4_expand [--kblocks N] [--subnormal] [mode ...]          (scripts/fp4_expand.sh)
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../megamoe/fp4.cuh"
#include "../megamoe/ptx.cuh"
#include "check.cuh"

namespace ptx = megamoe::ptx;
using megamoe::kFp4DataBytes;
using megamoe::kFp4NumScales;
using megamoe::kFp4StageK;
using megamoe::kFp4StageRows;

enum Mode { kKernel, kMma, kExpand, kExpandAlone, kExpandVsMma, kNoFence, kRs16Stage, kRs64Stage, kRsKernel, kRsQuad,
            kNumModes };
static const char* kModeNames[kNumModes] = {"kernel", "mma", "expand", "expand_alone", "expand_vs_mma",
                                            "nofence", "rs16_stage", "rs64_stage", "rs_kernel", "rs_quad"};
__host__ __device__ constexpr bool is_rs(Mode m) { return m == kRs16Stage || m == kRs64Stage; }
__host__ __device__ constexpr bool is_quad(Mode m) { return m == kRsQuad; }
__host__ __device__ constexpr bool is_rs_kernel(Mode m) { return m == kRsKernel || m == kRsQuad; }
// Consumer warpgroups and threads of a mode's CTA (one more warpgroup idles, as the kernel's producer's)
__host__ __device__ constexpr uint32_t consumer_wgs(Mode m) { return is_quad(m) ? 4 : 2; }
__host__ __device__ constexpr uint32_t cta_threads(Mode m) { return 128 * (1 + consumer_wgs(m)); }

constexpr uint32_t kStages = 4;
constexpr uint32_t kStageBytes = kFp4DataBytes + kFp4StageRows * (kFp4StageK / 32);
constexpr uint32_t kTileBytes = kFp4StageRows * kFp4StageK;  // e4m3
constexpr uint32_t kABytes = 64 * kFp4StageK;
constexpr uint32_t kWarmup = 16;  // K blocks before the timed ones
constexpr uint32_t kIdleRegisters = 56, kConsumerRegisters = 224;  // kernel.cuh's producer and consumer budgets
// rs_quad: 640 threads start at 96 registers; the idle warpgroup releases 40 each at 56
constexpr uint32_t kQuadConsumerRegisters = 104;  // setmaxnreg.inc takes only what .dec released
// Named barriers (0 is __syncthreads): all consumers, each warpgroup's expansion
constexpr uint32_t kBarBoth = 1, kBarExpand = 2;

struct Smem {
    uint8_t b[2][kTileBytes];  // first: 1024-byte aligned for the 128B swizzle
    uint8_t a[kABytes];
    uint8_t raw[kStages][kStageBytes];
    uint2 table[kFp4NumScales];
    float sfa[64];
    float sfb[4];
};

static_assert(offsetof(Smem, table) % 256 == 0, "fp4_table_slot: the table starts at a multiple of 256 bytes");

struct Result {
    unsigned long long cycles[4];  // summed over CTAs, per consumer warpgroup
    unsigned int ctas[4];
    float sink;
};

__device__ __forceinline__ uint32_t hash32(uint32_t x) {
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

template <Mode kMode>
__device__ __forceinline__ bool expands(uint32_t wg) {
    if constexpr (kMode == kMma) return false;
    if constexpr (kMode == kExpandAlone || kMode == kExpandVsMma) return wg == 0;
    return true;
}

template <Mode kMode>
__device__ __forceinline__ bool multiplies(uint32_t wg) {
    if constexpr (kMode == kExpand || kMode == kExpandAlone) return false;
    if constexpr (kMode == kExpandVsMma) return wg == 1;
    return true;
}

__device__ __forceinline__ void expand_stage(Smem& s, uint32_t kb, uint32_t wg, uint32_t tid, bool fence) {
    megamoe::fp4_expand_half(s.raw[kb % kStages], s.table, s.b[kb & 1], wg, false, tid);
    if (fence)
        ptx::fence_proxy_async_shared();
}

__device__ __forceinline__ void expand_barrier(uint32_t wg) { ptx::named_bar_sync(kBarExpand + wg, 128); }

// 4 SS m64n128k32 of tile kb % 2's B half `half` (128 rows) into `part`, committed, not waited for.
__device__ __forceinline__ void issue_mma(Smem& s, uint32_t kb, uint32_t half, float (&part)[64]) {
    const uint64_t desc_a = ptx::make_smem_desc_sw128(s.a);
    const uint64_t desc_b = ptx::make_smem_desc_sw128(s.b[kb & 1] + half * 128 * kFp4StageK);
    #pragma unroll
    for (uint32_t i = 0; i < 64; ++i)
        ptx::warpgroup_fence_operand(part[i]);
    ptx::wgmma_fence();
    #pragma unroll
    for (uint32_t k = 0; k < kFp4StageK / 32; ++k)
        ptx::wgmma_m64n128k32_e4m3(part, desc_a + 2 * k, desc_b + 2 * k, k > 0 ? 1 : 0);
    ptx::wgmma_commit();
}

// Wait for the warpgroup's WGMMAs, then promote as run_tile does: acc += part * sfa(row) * sfb(group).
__device__ __forceinline__ void wait_and_promote(const Smem& s, uint32_t tid, float (&part)[64], float (&acc)[64]) {
    const uint32_t r0 = ((tid % 128) / 32) * 16 + (tid % 32) / 4;
    const float sfa0 = ptx::ld_shared_f32(&s.sfa[r0]), sfa1 = ptx::ld_shared_f32(&s.sfa[r0 + 8]);
    const float sfb_even = ptx::ld_shared_f32(&s.sfb[0]), sfb_odd = ptx::ld_shared_f32(&s.sfb[1]);
    ptx::wgmma_wait<0>();
    #pragma unroll
    for (uint32_t i = 0; i < 64; ++i)
        ptx::warpgroup_fence_operand(part[i]);
    const float s00 = sfa0 * sfb_even, s01 = sfa0 * sfb_odd, s10 = sfa1 * sfb_even, s11 = sfa1 * sfb_odd;
    #pragma unroll
    for (uint32_t i = 0; i < 64; ++i) {
        const bool odd_group = ((i / 4) % 2) == 1;
        const bool second_row = ((i / 2) % 2) == 1;
        const float scale = second_row ? (odd_group ? s11 : s10) : (odd_group ? s01 : s00);
        acc[i] = fmaf(part[i], scale, acc[i]);
    }
}

template <uint32_t N>
__device__ __forceinline__ void zero(float (&x)[N]) {
    #pragma unroll
    for (uint32_t i = 0; i < N; ++i)
        x[i] = 0.0f;
}

// What every mode reports: the accumulators' sum (so that nothing is optimized away) and, for a
// warpgroup that ran (`active`), its cycles
template <uint32_t N>
__device__ __forceinline__ void report(Result* out, const float* acc, long long cycles, uint32_t wg, uint32_t tid,
                                       bool active = true) {
    float sum = 0.0f;
    #pragma unroll
    for (uint32_t i = 0; i < N; ++i)
        sum += acc[i];
    atomicAdd(&out->sink, sum);
    if (active && tid % 128 == 0) {
        atomicAdd(&out->cycles[wg], static_cast<unsigned long long>(cycles));
        atomicAdd(&out->ctas[wg], 1u);
    }
}

// A fragments of one 64-row unit (rows unit_row + 16 warp + lane / 4 and + 8) for the four K
// runs: a[s] = {row g K 32 s + 4 t.., row g + 8 same, row g K 32 s + 16 + 4 t.., row g + 8 same}.
// A thread's words are group t of its row in the kernel's stage layout (fp4.cuh): word t of each
// run, one 16-byte load from its slot.
__device__ __forceinline__ void rs_row_words(const uint8_t* raw, uint32_t row, uint32_t t, uint32_t (&w)[4]) {
    const uint4 v = ptx::ld_shared_v4_u32(
        reinterpret_cast<const uint4*>(raw + row * megamoe::kFp4RowBytes + megamoe::fp4_group_slot(row, t) * 16));
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
}

__device__ __forceinline__ void rs_unit_fragments(const uint8_t* raw, uint32_t unit_row, uint32_t tid, uint32_t (&a)[4][4]) {
    const uint32_t warp = (tid % 128) / 32, lane = tid % 32, t = lane % 4;
    const uint32_t r1 = unit_row + 16 * warp + lane / 4, r2 = r1 + 8;
    const uint32_t i1 = ptx::ld_shared_u32(raw + kFp4DataBytes + r1 * 4), i2 = ptx::ld_shared_u32(raw + kFp4DataBytes + r2 * 4);
    uint32_t w1[4], w2[4];
    rs_row_words(raw, r1, t, w1);
    rs_row_words(raw, r2, t, w2);
    #pragma unroll
    for (uint32_t s = 0; s < 4; ++s) {
        megamoe::fp4_expand_word(w1[s], megamoe::fp4_entry((i1 >> (8 * s)) & 0xffu), a[s][0], a[s][2]);
        megamoe::fp4_expand_word(w2[s], megamoe::fp4_entry((i2 >> (8 * s)) & 0xffu), a[s][1], a[s][3]);
    }
}

template <uint32_t kGroups>
__device__ __forceinline__ void fence_groups(float (&part)[4][2][8]) {
    #pragma unroll
    for (uint32_t g = 0; g < kGroups; ++g)
        #pragma unroll
        for (uint32_t u = 0; u < 2; ++u)
            #pragma unroll
            for (uint32_t i = 0; i < 8; ++i)
                ptx::warpgroup_fence_operand(part[g][u][i]);
}

// One K block of rs16_stage / rs64_stage in consumer warpgroup wg: kGroups 16-token groups of the A tile.
template <uint32_t kGroups>
__device__ __forceinline__ void rs_k_block(Smem& s, uint32_t kb, uint32_t wg, uint32_t tid, float (&part)[4][2][8],
                                           float (&acc)[4][2][8]) {
    uint32_t a[2][4][4];
    #pragma unroll
    for (uint32_t u = 0; u < 2; ++u)
        rs_unit_fragments(s.raw[kb % kStages], 128 * wg + 64 * u, tid, a[u]);
    const uint64_t desc = ptx::make_smem_desc_sw128(s.a);
    fence_groups<kGroups>(part);
    ptx::wgmma_fence();
    #pragma unroll
    for (uint32_t g = 0; g < kGroups; ++g)
        #pragma unroll
        for (uint32_t u = 0; u < 2; ++u)
            #pragma unroll
            for (uint32_t k = 0; k < 4; ++k)
                ptx::wgmma_m64n16k32_e4m3_rs(part[g][u], a[u][k], desc + (g * 16 * kFp4StageK >> 4) + 2 * k, k > 0 ? 1 : 0);
    ptx::wgmma_commit();
    const uint32_t t = (tid % 32) % 4;
    const float sfb_gate = ptx::ld_shared_f32(&s.sfb[0]), sfb_up = ptx::ld_shared_f32(&s.sfb[1]);
    ptx::wgmma_wait<0>();
    fence_groups<kGroups>(part);
    #pragma unroll
    for (uint32_t g = 0; g < kGroups; ++g) {
        // accumulator i: row g (gate) or g + 8 (up) by (i / 2) % 2, token 16 g + 8 (i / 4) + 2 t + i % 2
        float sa[4];
        #pragma unroll
        for (uint32_t c = 0; c < 4; ++c)
            sa[c] = ptx::ld_shared_f32(&s.sfa[16 * g + 8 * (c / 2) + 2 * t + c % 2]);
        #pragma unroll
        for (uint32_t u = 0; u < 2; ++u)
            #pragma unroll
            for (uint32_t i = 0; i < 8; ++i)
                acc[g][u][i] = fmaf(part[g][u][i], sa[2 * (i / 4) + i % 2] * (((i / 2) % 2) ? sfb_up : sfb_gate), acc[g][u][i]);
    }
}

// One K block of rs_kernel / rs_quad: kUnits 64-row units of the stage from the thread's first row
// (its group and index offsets as run_tile_rs keeps them), A fragments from the table, 16 tokens.
template <uint32_t kUnits>
__device__ __forceinline__ void rs_kernel_k_block(Smem& s, uint32_t kb, uint32_t group_offset, uint32_t index_offset,
                                                  uint32_t table, uint32_t tid, float (&part)[2][8], float (&acc)[2][8]) {
    const uint32_t t = tid % 4;
    const uint8_t* raw = s.raw[kb % kStages];
    uint32_t scaled[kUnits][2];
    uint4 w[kUnits][2];
    #pragma unroll
    for (uint32_t u = 0; u < kUnits; ++u) {
        #pragma unroll
        for (uint32_t r = 0; r < 2; ++r) {
            scaled[u][r] = ptx::ld_shared_u32(raw + index_offset + (64 * u + 8 * r) * 4);
            w[u][r] = ptx::ld_shared_v4_u32(reinterpret_cast<const uint4*>(raw + group_offset + (64 * u + 8 * r) * megamoe::kFp4RowBytes));
        }
    }
    uint32_t a[kUnits][4][4];
    #pragma unroll
    for (uint32_t u = 0; u < kUnits; ++u) {
        #pragma unroll
        for (uint32_t r = 0; r < 2; ++r)
            scaled[u][r] *= sizeof(uint2);
        megamoe::fp4_unit_fragments(w[u], table, t, scaled[u], false, a[u]);
    }
    float sfa[2][2];
    #pragma unroll
    for (uint32_t j = 0; j < 2; ++j)
        #pragma unroll
        for (uint32_t e = 0; e < 2; ++e)
            sfa[j][e] = ptx::ld_shared_f32(&s.sfa[8 * j + 2 * t + e]);
    const float sfb_gate = ptx::ld_shared_f32(&s.sfb[0]), sfb_up = ptx::ld_shared_f32(&s.sfb[1]);
    const uint64_t desc = ptx::make_smem_desc_sw128(s.a);
    #pragma unroll
    for (uint32_t u = 0; u < kUnits; ++u)
        #pragma unroll
        for (uint32_t i = 0; i < 8; ++i)
            ptx::warpgroup_fence_operand(part[u][i]);
    ptx::wgmma_fence();
    #pragma unroll
    for (uint32_t u = 0; u < kUnits; ++u)
        #pragma unroll
        for (uint32_t k = 0; k < 4; ++k)
            ptx::wgmma_m64n16k32_e4m3_rs(part[u], a[u][k], desc + 2 * k, k > 0 ? 1 : 0);
    ptx::wgmma_commit();
    ptx::wgmma_wait<0>();
    #pragma unroll
    for (uint32_t u = 0; u < kUnits; ++u)
        #pragma unroll
        for (uint32_t i = 0; i < 8; ++i)
            ptx::warpgroup_fence_operand(part[u][i]);
    #pragma unroll
    for (uint32_t u = 0; u < kUnits; ++u)
        #pragma unroll
        for (uint32_t i = 0; i < 8; ++i)
            acc[u][i] = fmaf(part[u][i], sfa[i / 4][i % 2] * (((i / 2) % 2) ? sfb_up : sfb_gate), acc[u][i]);
}

// rs_kernel / rs_quad: consumer warpgroup wg's loop over its units (two from row 128 wg, or one
// from row 64 wg)
template <Mode kMode>
__device__ __forceinline__ void rs_kernel_loop(Smem& s, uint32_t tid, uint32_t wg, uint32_t num_kb, uint32_t consumers,
                                               Result* out) {
    constexpr uint32_t kUnits = kMode == kRsQuad ? 1 : 2;
    const uint32_t warp = (tid % 128) / 32, g = (tid % 32) / 4, t = tid % 4;
    const uint32_t first_row = 64 * kUnits * wg + 16 * warp + g;
    uint32_t group_offset = megamoe::fp4_group_offset(first_row, t);
    uint32_t index_offset = kFp4DataBytes + first_row * 4;
    asm volatile("" : "+r"(group_offset), "+r"(index_offset));
    const uint32_t table = ptx::smem_addr(s.table);
    float part[2][8], acc[2][8];
    #pragma unroll
    for (uint32_t u = 0; u < 2; ++u)
        #pragma unroll
        for (uint32_t i = 0; i < 8; ++i)
            part[u][i] = acc[u][i] = 0.0f;
    long long start = 0;
    for (uint32_t kb = 0; kb < kWarmup + num_kb; ++kb) {
        if (kb == kWarmup) {
            ptx::named_bar_sync(kBarBoth, consumers);
            start = clock64();
        }
        rs_kernel_k_block<kUnits>(s, kb, group_offset, index_offset, table, tid, part, acc);
    }
    report<16>(out, &acc[0][0], clock64() - start, wg, tid);
}

// One K block of the mode in warpgroup wg (kb counts from 0 over warm-up and timed blocks).
template <Mode kMode>
__device__ __forceinline__ void k_block(Smem& s, uint32_t kb, uint32_t wg, uint32_t tid,
                                        float (&part)[64], float (&acc)[64]) {
    if (expands<kMode>(wg)) {
        expand_stage(s, kb, wg, tid, kMode != kNoFence);
        expand_barrier(wg);
    }
    if (multiplies<kMode>(wg)) {
        // expand_vs_mma: warpgroup 2 multiplies its own half of tile 1, which warpgroup 1's
        // expansion into tile kb % 2 only ever writes the other half of
        issue_mma(s, kMode == kExpandVsMma ? 1 : kb, wg, part);
        wait_and_promote(s, tid, part, acc);
    }
}

template <Mode kMode>
__device__ __forceinline__ void two_consumers(Smem& s, uint32_t tid, uint32_t wg, uint32_t num_kb, Result* out);

template <Mode kMode>
__global__ void __launch_bounds__(cta_threads(kMode), 1) fp4_expand_kernel(uint32_t num_kb, bool subnormal, Result* out) {
    extern __shared__ __align__(1024) uint8_t smem_raw[];
    // the e4m3 tiles' 128B swizzle needs 1024-byte alignment, which dynamic shared memory may lack
    Smem& s = *reinterpret_cast<Smem*>(smem_raw + (1024u - ptx::smem_addr(smem_raw) % 1024u) % 1024u);

    // Stored stages: hashed codes; scale indices in the normal range [kFp4FirstNormalIndex, 31],
    // or with --subnormal one below it in every fourth row (the warps then read the table).
    for (uint32_t i = threadIdx.x; i < kStages * kStageBytes / 4; i += blockDim.x) {
        const uint32_t stage = i / (kStageBytes / 4), word = i % (kStageBytes / 4);
        uint32_t v = hash32(i * 2654435761u + blockIdx.x);
        if (word >= kFp4DataBytes / 4) {
            const uint32_t row = word - kFp4DataBytes / 4;
            uint32_t idx = 0;
            for (uint32_t r = 0; r < 4; ++r) {
                uint32_t e = megamoe::kFp4FirstNormalIndex + ((v >> (8 * r)) & 0xffu) % (32 - megamoe::kFp4FirstNormalIndex);
                if (subnormal && row % 4 == 0 && r == 0)
                    e = megamoe::kFp4FirstNormalIndex - 1 - ((v >> 3) & 7u);
                idx |= e << (8 * r);
            }
            v = idx;
        }
        reinterpret_cast<uint32_t*>(s.raw[stage])[word] = v;
    }
    for (uint32_t i = threadIdx.x; i < kABytes / 4; i += blockDim.x)
        reinterpret_cast<uint32_t*>(s.a)[i] = hash32(i + 7u) & 0x37373737u;  // finite e4m3, |x| < 1
    if (threadIdx.x < kFp4NumScales)
        s.table[threadIdx.x] = megamoe::fp4_table_entry(threadIdx.x);
    if (threadIdx.x < 64)
        s.sfa[threadIdx.x] = 1.0f + threadIdx.x * 1e-3f;
    if (threadIdx.x < 4)
        s.sfb[threadIdx.x] = 0.5f;
    __syncthreads();
    if (threadIdx.x < 128) {
        ptx::setmaxnreg_dec<kIdleRegisters>();
        return;
    }
    const uint32_t tid = threadIdx.x - 128, wg = tid / 128;
    constexpr uint32_t kConsumers = 128 * consumer_wgs(kMode);
    if constexpr (is_rs_kernel(kMode)) {
        if constexpr (is_quad(kMode))
            ptx::setmaxnreg_inc<kQuadConsumerRegisters>();
        else
            ptx::setmaxnreg_inc<kConsumerRegisters>();
        rs_kernel_loop<kMode>(s, tid, wg, num_kb, kConsumers, out);
    } else if constexpr (is_rs(kMode)) {
        ptx::setmaxnreg_inc<kConsumerRegisters>();
        constexpr uint32_t kGroups = kMode == kRs64Stage ? 4 : 1;
        float part[4][2][8], acc[4][2][8];
        #pragma unroll
        for (uint32_t g = 0; g < 4; ++g)
            #pragma unroll
            for (uint32_t u = 0; u < 2; ++u)
                #pragma unroll
                for (uint32_t i = 0; i < 8; ++i)
                    part[g][u][i] = acc[g][u][i] = 0.0f;
        long long start = 0;
        for (uint32_t kb = 0; kb < kWarmup + num_kb; ++kb) {
            if (kb == kWarmup) {
                ptx::named_bar_sync(kBarBoth, kConsumers);
                start = clock64();
            }
            rs_k_block<kGroups>(s, kb, wg, tid, part, acc);
        }
        report<64>(out, &acc[0][0][0], clock64() - start, wg, tid);
    } else {
        two_consumers<kMode>(s, tid, wg, num_kb, out);
    }
}

// The two-consumer modes' loop (warpgroups 1 and 2 of 384 threads, as in the kernel)
template <Mode kMode>
__device__ __forceinline__ void two_consumers(Smem& s, uint32_t tid, uint32_t wg, uint32_t num_kb, Result* out) {
    ptx::setmaxnreg_inc<kConsumerRegisters>();
    // Both tiles expanded once (the mma mode and warpgroup 2 of expand_vs_mma read them as they are)
    for (uint32_t kb = 0; kb < 2; ++kb)
        expand_stage(s, kb, wg, tid, true);
    ptx::named_bar_sync(kBarBoth, 256);

    float part[64], acc[64];
    zero(part);
    zero(acc);
    const bool active = expands<kMode>(wg) || multiplies<kMode>(wg);
    const uint32_t total = kWarmup + num_kb;
    long long start = 0;
    if (active) {
        for (uint32_t kb = 0; kb < total; ++kb) {
            if (kb == kWarmup) {
                if constexpr (kMode != kExpandAlone)
                    ptx::named_bar_sync(kBarBoth, 256);  // the timed blocks start together
                start = clock64();
            }
            k_block<kMode>(s, kb, wg, tid, part, acc);
        }
    } else if constexpr (kMode != kExpandAlone) {
        ptx::named_bar_sync(kBarBoth, 256);  // an idle warpgroup still meets the start barrier
    }
    report<64>(out, acc, clock64() - start, wg, tid, active);
}

template <Mode kMode>
static void run(const char* name, uint32_t num_kb, bool subnormal, int num_sms) {
    const size_t smem = sizeof(Smem) + 1024;
    CHECK(cudaFuncSetAttribute(fp4_expand_kernel<kMode>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    Result* d_out;
    CHECK(cudaMalloc(&d_out, sizeof(Result)));
    Result r{};
    for (int rep = 0; rep < 3; ++rep) {  // the last of three launches counts (clocks settled)
        CHECK(cudaMemset(d_out, 0, sizeof(Result)));
        fp4_expand_kernel<kMode><<<num_sms, cta_threads(kMode), smem>>>(num_kb, subnormal, d_out);
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
    }
    CHECK(cudaMemcpy(&r, d_out, sizeof(Result), cudaMemcpyDeviceToHost));
    CHECK(cudaFree(d_out));
    printf("%-14s", name);
    for (uint32_t w = 0; w < consumer_wgs(kMode); ++w) {
        if (r.ctas[w])
            printf(" %10.1f", static_cast<double>(r.cycles[w]) / r.ctas[w] / num_kb);
        else
            printf(" %10s", "-");
    }
    printf("   (sink %g)\n", static_cast<double>(r.sink));
}

int main(int argc, char** argv) {
    uint32_t num_kb = 4096;
    bool subnormal = false;
    std::vector<std::string> modes;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--kblocks") && i + 1 < argc) {
            num_kb = static_cast<uint32_t>(atoi(argv[++i]));
        } else if (!strcmp(argv[i], "--subnormal")) {
            subnormal = true;
        } else if (argv[i][0] == '-') {
            fprintf(stderr, "fp4_expand: unknown option %s (expected --kblocks N, --subnormal, modes)\n", argv[i]);
            return 2;
        } else {
            modes.push_back(argv[i]);
        }
    }
    if (num_kb == 0) {
        fprintf(stderr, "fp4_expand: --kblocks must be positive\n");
        return 2;
    }
    if (modes.empty())
        for (int m = 0; m < kNumModes; ++m)
            modes.push_back(kModeNames[m]);
    int device = 0, num_sms = 0;
    CHECK(cudaGetDevice(&device));
    CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device));
    printf("fp4_expand: %d CTAs, %u K blocks each%s; cycles per K block, consumer warpgroup 1 / 2 [/ 3 / 4]\n", num_sms, num_kb,
           subnormal ? ", a subnormal scale in every fourth row" : "");
    for (const std::string& name : modes) {
        int m = 0;
        while (m < kNumModes && name != kModeNames[m])
            ++m;
        switch (m) {
            case kKernel: run<kKernel>(kModeNames[m], num_kb, subnormal, num_sms); break;
            case kMma: run<kMma>(kModeNames[m], num_kb, subnormal, num_sms); break;
            case kExpand: run<kExpand>(kModeNames[m], num_kb, subnormal, num_sms); break;
            case kExpandAlone: run<kExpandAlone>(kModeNames[m], num_kb, subnormal, num_sms); break;
            case kExpandVsMma: run<kExpandVsMma>(kModeNames[m], num_kb, subnormal, num_sms); break;
            case kNoFence: run<kNoFence>(kModeNames[m], num_kb, subnormal, num_sms); break;
            case kRs16Stage: run<kRs16Stage>(kModeNames[m], num_kb, subnormal, num_sms); break;
            case kRs64Stage: run<kRs64Stage>(kModeNames[m], num_kb, subnormal, num_sms); break;
            case kRsKernel: run<kRsKernel>(kModeNames[m], num_kb, subnormal, num_sms); break;
            case kRsQuad: run<kRsQuad>(kModeNames[m], num_kb, subnormal, num_sms); break;
            default:
                fprintf(stderr, "fp4_expand: unknown mode %s\n", name.c_str());
                return 2;
        }
    }
    return 0;
}

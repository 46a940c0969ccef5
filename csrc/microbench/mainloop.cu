// Main-loop microbenchmark: the FP8 WGMMA K loop of one 128 x 256 tile per CTA with per-128-K
// promotion, alone (no dispatch, no epilogue), to find what bounds the fused kernel's main loop.
// One CTA per SM: warp 0 streams stages with 1-D bulk copies from an L2-resident buffer (or, with
// --no-load, only signals them), warpgroups 1 and 2 consume.
//
// Modes (per 128-K block, per consumer warpgroup owning 64 rows):
//   halves      the fused kernel's loop: 2 x (4 SS m64n128k32 into a 64-register partial,
//               wait, 64 FFMA promotion)                                     tile 128 x 256
//   nopromo128  the same WGMMAs straight into the accumulators, no wait or promotion: the loop's
//               ceiling without promotion                                    tile 128 x 256
// Numbers only: operands are arbitrary bytes, the result is summed into a sink.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -o mainloop mainloop.cu
// Run:   ./mainloop [--no-load] [--random] [--src-mib N] [--b-stream G] [--kblocks N] [mode ...]
// (--b-stream G: B streamed from DRAM, each group of G CTAs reading one sequence once;
//  --tile-kb N C: halves only, a tile boundary every N K blocks: both warpgroups meet
//  at a barrier and spend C cycles, like the epilogue; --no-tile-barrier: without the barrier;
//  --stagger S: warpgroup 2 spends S more cycles there; --copy-mib M: warps 1-3 copy rows between
//  two M MiB buffers the whole time, like the fused kernel's dispatch warps; --tma2d: A and B by 2-D
//  tensor TMA with the fused kernel's layouts, see the producer)
// (--random: random finite FP8 operands instead of a constant; --src-mib: size of the buffer
// the stages are streamed from, 3 MiB = L2-resident by default)
#include <cuda.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../megamoe/ptx.cuh"
#include "check.cuh"

namespace ptx = megamoe::ptx;

enum Mode { kHalves, kNoPromo128, kNumModes };
static const char* kModeNames[kNumModes] = {"halves", "nopromo128"};

constexpr uint32_t kStages = 4;
constexpr uint32_t kABytes = 128 * 128;
constexpr uint32_t kBBytes = 256 * 128;

struct Smem {
    uint8_t a[kStages][kABytes];
    uint8_t b[kStages][kBBytes];
    float sfa[kStages][128];
    uint64_t full[kStages];
    uint64_t empty[kStages];
    volatile uint32_t consumers_done;
};

// The mbarrier, TMA and WGMMA wrappers are the fused kernel's (ptx.cuh); this wait is one asm
// loop on purpose (no divergent C++ loop around it).
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
    asm volatile(
        "{\n.reg .pred p;\nW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W;\n}\n" ::"r"(ptx::smem_addr(b)),
        "r"(parity)
        : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     ptx::smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(ptx::smem_addr(bar))
                 : "memory");
}
template <int N>
__device__ __forceinline__ void fence_regs(float (&r)[N]) {
    #pragma unroll
    for (int i = 0; i < N; ++i)
        ptx::warpgroup_fence_operand(r[i]);
}

// A tile boundary of the halves mode: both warpgroups meet (like the L1 epilogue's barrier)
// and spend `spin` cycles on epilogue work before the next tile's first K block.
__device__ __forceinline__ void tile_boundary(bool barrier, uint32_t spin) {
    if (barrier)
        asm volatile("bar.sync 1, 256;" ::: "memory");
    const unsigned long long e0 = clock64();
    while (clock64() - e0 < spin) {
    }
}

template <int N>
__device__ __forceinline__ void promote(float* acc, float (&part)[N], float s0, float s1) {
    #pragma unroll
    for (int i = 0; i < N; ++i)
        acc[i] = fmaf(part[i], ((i / 2) % 2) ? s1 : s0, acc[i]);
}

// One K block of the halves loop on stage s (A rows at descriptor da): per 128-column half, 4 SS
// m64n128k32 into `part`, wait, promote; the stage released after the second half's wait.
__device__ __forceinline__ void halves_block(Smem& ss, uint32_t s, uint64_t da, float (&part)[64], float* acc, float sa0,
                                             float sa1, float sb0, float sb1, uint32_t lane) {
    #pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
        const uint64_t db = ptx::make_smem_desc_sw128(ss.b[s] + h * 128 * 128);
        fence_regs(part);
        ptx::wgmma_fence();
        #pragma unroll
        for (uint32_t k = 0; k < 4; ++k)
            ptx::wgmma_m64n128k32_e4m3(part, da + 2 * k, db + 2 * k, k > 0);
        ptx::wgmma_commit();
        ptx::wgmma_wait<0>();
        fence_regs(part);
        if (h == 1 && lane == 0)
            ptx::mbar_arrive(&ss.empty[s]);
        promote(acc + 64 * h, part, sa0 * (h ? sb1 : sb0), sa1 * (h ? sb1 : sb0));
    }
}

template <int kMode>
__global__ void __launch_bounds__(384, 1)
    mainloop_kernel(const uint8_t* __restrict__ src, uint32_t src_stages, const float* __restrict__ sfb,
                    uint32_t num_kb, bool load, bool random, const uint8_t* __restrict__ b_stream, uint32_t b_group,
                    uint32_t tile_kb, uint32_t epi_cycles, bool tile_barrier, uint32_t stagger,
                    const int4* __restrict__ copy_src, int4* __restrict__ copy_dst, uint64_t copy_vecs,
                    const __grid_constant__ CUtensorMap tmap_a, const __grid_constant__ CUtensorMap tmap_b,
                    uint32_t tma_a_blocks, uint32_t tma_b_stages, float* sink, unsigned long long* cycles) {
    extern __shared__ uint8_t raw[];
    Smem& ss = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        ss.consumers_done = 0;
        for (uint32_t s = 0; s < kStages; ++s) {
            ptx::mbar_init(&ss.full[s], 1);
            ptx::mbar_init(&ss.empty[s], 8);  // every consumer warp that reads it
        }
        ptx::fence_mbarrier_init();
    }
    for (uint32_t i = threadIdx.x; i < kStages * 128; i += blockDim.x)
        (&ss.sfa[0][0])[i] = 1.0f + 1e-3f * (i % 7);
    for (uint32_t i = threadIdx.x; i < kStages * (kABytes + kBBytes) / 4; i += blockDim.x)
        reinterpret_cast<uint32_t*>(&ss.a[0][0])[i] =
            random ? (((i + blockIdx.x * 7919u) * 2654435761u) >> 3) & 0x77777777u  // random finite e4m3 bytes
                   : 0x38383838u ^ (i * 2654435761u & 0x03030303u);
    ptx::fence_proxy_async_shared();
    __syncthreads();

    if (warp < 4) {
        ptx::setmaxnreg_dec<56>();
        if (warp == 0 && lane == 0) {
            for (uint32_t kb = 0; kb < num_kb; ++kb) {
                const uint32_t s = kb % kStages;
                mbar_wait(&ss.empty[s], ((kb / kStages) & 1) ^ 1);
                if (load && tma_a_blocks != 0) {
                    // Like the fused kernel: A from a [rows, 7168] FP8 pool by 2-D tensor TMA (128 rows x
                    // 128 bytes, rows 7168 bytes apart, 128B swizzle), each row block shared by 16 CTAs
                    // at a time and advancing every 56 K blocks; B tiles by 2-D TMA from a tiled weight
                    // buffer, each sequence shared by 4 CTAs.
                    const uint32_t rb = ((blockIdx.x / 16) * 7 + kb / 56) % tma_a_blocks;
                    const uint32_t bt = ((blockIdx.x / 4) * 97 + kb) % tma_b_stages;
                    ptx::mbar_arrive_expect_tx(&ss.full[s], kABytes + kBBytes + 512);
                    ptx::tma_load_2d(ss.a[s], &tmap_a, &ss.full[s], (kb % 56) * 128, rb * 128);
                    ptx::tma_load_2d(ss.b[s], &tmap_b, &ss.full[s], 0, bt * (kBBytes / 128));
                    bulk_load(ss.sfa[s], src, 512, &ss.full[s]);
                } else if (load) {
                    const uint8_t* from = src + static_cast<uint64_t>((blockIdx.x * 7 + kb) % src_stages) * (kABytes + kBBytes);
                    ptx::mbar_arrive_expect_tx(&ss.full[s], kABytes + kBBytes + 512);
                    bulk_load(ss.a[s], from, kABytes, &ss.full[s]);
                    // B either from the L2-resident buffer, or streamed: every group of b_group
                    // CTAs reads its own sequence once (like b_group M blocks sharing an expert)
                    const uint8_t* b_from = b_stream != nullptr
                                                ? b_stream + (static_cast<uint64_t>(blockIdx.x / b_group) * num_kb + kb) * kBBytes
                                                : from + kABytes;
                    bulk_load(ss.b[s], b_from, kBBytes, &ss.full[s]);
                    bulk_load(ss.sfa[s], reinterpret_cast<const float*>(from), 512, &ss.full[s]);
                } else {
                    ptx::mbar_arrive(&ss.full[s]);
                }
            }
        } else if (warp > 0 && copy_src != nullptr) {
            // Like the fused kernel's dispatch warps: global -> register -> global row copies
            // (4 x 16 bytes in flight per lane) while the consumers run.
            uint64_t i = (static_cast<uint64_t>(blockIdx.x) * 3 + (warp - 1)) * 128 + lane;
            const uint64_t stride = static_cast<uint64_t>(gridDim.x) * 3 * 128;
            while (ss.consumers_done < 2) {
                int4 v[4];
                #pragma unroll
                for (uint32_t u = 0; u < 4; ++u)
                    v[u] = __ldcg(copy_src + ((i + 32 * u) & (copy_vecs - 1)));
                #pragma unroll
                for (uint32_t u = 0; u < 4; ++u)
                    copy_dst[(i + 32 * u) & (copy_vecs - 1)] = v[u];
                i += stride;
            }
        }
        return;
    }
    ptx::setmaxnreg_inc<224>();
    const uint32_t wg = __shfl_sync(0xffffffffu, warp / 4 - 1, 0);
    const uint32_t wt = threadIdx.x % 128, wwarp = wt / 32;
    const uint32_t r0 = 64 * wg + wwarp * 16 + lane / 4;
    constexpr uint32_t kAccRegs = 128;
    float acc[kAccRegs];
    #pragma unroll
    for (uint32_t i = 0; i < kAccRegs; ++i)
        acc[i] = 0.0f;
    const unsigned long long t0 = clock64();

    if constexpr (kMode == kHalves) {
        float part[64];
        for (uint32_t kb = 0; kb < num_kb; ++kb) {
            const uint32_t s = kb % kStages;
            const float sb0 = __ldg(sfb + (kb % 64) * 2), sb1 = __ldg(sfb + (kb % 64) * 2 + 1);
            mbar_wait(&ss.full[s], (kb / kStages) & 1);
            const float sa0 = ss.sfa[s][r0] , sa1 = ss.sfa[s][r0 + 8];
            const uint64_t da = ptx::make_smem_desc_sw128(ss.a[s] + 64 * wg * 128);
            halves_block(ss, s, da, part, acc, sa0, sa1, sb0, sb1, lane);
            if (tile_kb != 0 && (kb + 1) % tile_kb == 0)
                tile_boundary(tile_barrier, epi_cycles + (wg == 1 ? stagger : 0));
        }
    } else if constexpr (kMode == kNoPromo128) {
        // Accumulators straight in the WGMMA registers; stage kb is released once block kb+1's
        // WGMMAs are issued and kb's have retired (wait<1>).
        for (uint32_t kb = 0; kb < num_kb; ++kb) {
            const uint32_t s = kb % kStages;
            mbar_wait(&ss.full[s], (kb / kStages) & 1);
            const uint64_t da = ptx::make_smem_desc_sw128(ss.a[s] + 64 * wg * 128);
            fence_regs(acc);
            ptx::wgmma_fence();
            #pragma unroll
            for (uint32_t h = 0; h < 2; ++h) {
                const uint64_t db = ptx::make_smem_desc_sw128(ss.b[s] + h * 128 * 128);
                #pragma unroll
                for (uint32_t k = 0; k < 4; ++k)
                    ptx::wgmma_m64n128k32_e4m3(*reinterpret_cast<float(*)[64]>(acc + 64 * h), da + 2 * k, db + 2 * k, 1);
            }
            ptx::wgmma_commit();
            ptx::wgmma_wait<1>();
            fence_regs(acc);
            if (kb > 0 && lane == 0)
                ptx::mbar_arrive(&ss.empty[(kb - 1) % kStages]);
        }
        ptx::wgmma_wait<0>();
        fence_regs(acc);
    }
    const unsigned long long t1 = clock64();
    if (wt == 0)
        atomicAdd(const_cast<uint32_t*>(&ss.consumers_done), 1u);
    float sum = 0.0f;
    #pragma unroll
    for (uint32_t i = 0; i < kAccRegs; ++i)
        sum += acc[i];
    atomicAdd(sink, sum);
    if (wt == 0)
        atomicAdd(cycles, t1 - t0);
}

// Fills `words` 32-bit words with the operand pattern: random finite e4m3 bytes or a constant.
__global__ void fill_operands(uint32_t* p, uint64_t words, bool random) {
    for (uint64_t i = blockIdx.x * static_cast<uint64_t>(blockDim.x) + threadIdx.x; i < words;
         i += static_cast<uint64_t>(gridDim.x) * blockDim.x)
        p[i] = random ? static_cast<uint32_t>(((i * 2654435761ull) >> 3) & 0x77777777u) : 0x38383838u;
}

static CUtensorMap g_tmap_a, g_tmap_b;
static uint32_t g_tma_a_blocks = 0, g_tma_b_stages = 0;

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                 const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                 CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// A 2-D u8 tensor map: rows of `cols` bytes, boxes of 128 bytes x box_rows, 128B swizzle.
static CUtensorMap make_tmap(void* base, uint64_t cols, uint64_t rows, uint32_t box_rows) {
    static EncodeTiled encode = nullptr;
    if (encode == nullptr) {
        cudaDriverEntryPointQueryResult status;
        CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), 12000,
                                               cudaEnableDefault, &status));
        if (encode == nullptr) {
            fprintf(stderr, "cuTensorMapEncodeTiled not found\n");
            exit(1);
        }
    }
    CUtensorMap map;
    const cuuint64_t dims[2] = {cols, rows};
    const cuuint64_t strides[1] = {cols};
    const cuuint32_t box[2] = {128, box_rows};
    const cuuint32_t elem[2] = {1, 1};
    const CUresult r = encode(&map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, base, dims, strides, box, elem,
                              CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                              CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) {
        fprintf(stderr, "cuTensorMapEncodeTiled failed: %d\n", static_cast<int>(r));
        exit(1);
    }
    return map;
}

static const int4* g_copy_src = nullptr;
static int4* g_copy_dst = nullptr;
static uint64_t g_copy_vecs = 0;

template <int kMode>
static void run_mode(int sms, uint32_t num_kb, bool load, bool random, const uint8_t* b_stream, uint32_t b_group, uint32_t tile_kb, uint32_t epi_cycles, bool tile_barrier, uint32_t stagger, const uint8_t* src, uint32_t src_stages, const float* sfb,
                     float* sink, unsigned long long* cycles) {
    auto kernel = mainloop_kernel<kMode>;
    const size_t smem = sizeof(Smem) + 1024;
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    const uint32_t n = 256;
    constexpr uint32_t kRows = 128;
    const double flops = 2.0 * kRows * n * 128 * static_cast<double>(num_kb) * sms;
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    std::vector<float> ms;
    double cyc_per_kb = 0;
    for (int rep = 0; rep < 6; ++rep) {
        CHECK(cudaMemset(cycles, 0, sizeof(unsigned long long)));
        CHECK(cudaEventRecord(e0));
        kernel<<<sms, 384, smem>>>(src, src_stages, sfb, num_kb, load, random, b_stream, b_group, tile_kb, epi_cycles, tile_barrier, stagger, g_copy_src, g_copy_dst, g_copy_vecs, g_tmap_a, g_tmap_b, g_tma_a_blocks, g_tma_b_stages, sink, cycles);
        CHECK(cudaGetLastError());
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float t;
        CHECK(cudaEventElapsedTime(&t, e0, e1));
        unsigned long long c;
        CHECK(cudaMemcpy(&c, cycles, sizeof(c), cudaMemcpyDeviceToHost));
        if (rep > 0) {
            ms.push_back(t);
            cyc_per_kb += static_cast<double>(c) / (2.0 * sms) / num_kb * (128.0 / kRows);  // per 128 rows
        }
    }
    std::sort(ms.begin(), ms.end());
    const double med = ms[ms.size() / 2];
    cyc_per_kb /= ms.size();
    const double ideal = 128.0 * n * 128 / 4096.0;
    printf("%-12s load=%d random=%d src=%uMiB b_group=%u tile_kb=%u epi=%u bar=%d stagger=%u tile=%ux%u  %8.3f ms  %7.1f TFLOPS  %7.1f cycles/kblock (ideal %.0f: %.0f%%)  clock %.2f GHz\n",
           kModeNames[kMode], load ? 1 : 0, random ? 1 : 0, static_cast<unsigned>(src_stages * 48ull / 1024), b_stream ? b_group : 0, tile_kb, epi_cycles, tile_barrier ? 1 : 0, stagger, kRows, n, med, flops / med / 1e9, cyc_per_kb, ideal, 100.0 * ideal / cyc_per_kb,
           cyc_per_kb * kRows / 128.0 * num_kb / (med * 1e-3) / 1e9);
    fflush(stdout);
}

int main(int argc, char** argv) {
    bool load = true, random = false;
    uint32_t src_mib = 3, b_group = 0, tile_kb = 0, epi_cycles = 0, stagger = 0;
    bool tile_barrier = true;
    uint32_t copy_mib = 0;
    bool tma2d = false;
    uint32_t num_kb = 2048;
    std::vector<int> modes;
    for (int i = 1; i < argc; ++i) {
        if (!strcmp(argv[i], "--no-load")) {
            load = false;
        } else if (!strcmp(argv[i], "--b-stream") && i + 1 < argc) {
            b_group = static_cast<uint32_t>(atoi(argv[++i]));
        } else if (!strcmp(argv[i], "--tile-kb") && i + 2 < argc) {
            tile_kb = static_cast<uint32_t>(atoi(argv[++i]));
            epi_cycles = static_cast<uint32_t>(atoi(argv[++i]));
        } else if (!strcmp(argv[i], "--copy-mib") && i + 1 < argc) {
            copy_mib = static_cast<uint32_t>(atoi(argv[++i]));
        } else if (!strcmp(argv[i], "--tma2d")) {
            tma2d = true;
        } else if (!strcmp(argv[i], "--no-tile-barrier")) {
            tile_barrier = false;
        } else if (!strcmp(argv[i], "--stagger") && i + 1 < argc) {
            stagger = static_cast<uint32_t>(atoi(argv[++i]));
        } else if (!strcmp(argv[i], "--random")) {
            random = true;
        } else if (!strcmp(argv[i], "--src-mib") && i + 1 < argc) {
            src_mib = static_cast<uint32_t>(atoi(argv[++i]));
        } else if (!strcmp(argv[i], "--kblocks") && i + 1 < argc) {
            num_kb = static_cast<uint32_t>(atoi(argv[++i]));
        } else {
            int found = -1;
            for (int m = 0; m < kNumModes; ++m)
                if (!strcmp(argv[i], kModeNames[m]))
                    found = m;
            if (found < 0) {
                fprintf(stderr, "unknown argument '%s' (modes:", argv[i]);
                for (int m = 0; m < kNumModes; ++m)
                    fprintf(stderr, " %s", kModeNames[m]);
                fprintf(stderr, ")\n");
                return 2;
            }
            modes.push_back(found);
        }
    }
    if (modes.empty())
        for (int m = 0; m < kNumModes; ++m)
            modes.push_back(m);
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    const uint32_t src_stages = std::max<uint32_t>(1, src_mib * 1024 / 48);  // 3 MiB (default): stays in L2
    uint8_t* src;
    float *sfb, *sink;
    unsigned long long* cycles;
    CHECK(cudaMalloc(&src, static_cast<size_t>(src_stages) * (kABytes + kBBytes)));
    {
        std::vector<uint8_t> h(static_cast<size_t>(src_stages) * (kABytes + kBBytes));
        for (size_t i = 0; i < h.size(); ++i)
            h[i] = random ? static_cast<uint8_t>(((i * 2654435761ull) >> 7) & 0x77) : 0x38;
        CHECK(cudaMemcpy(src, h.data(), h.size(), cudaMemcpyHostToDevice));
    }
    uint8_t* b_stream = nullptr;
    if (b_group > 0) {
        const size_t bytes = static_cast<size_t>((sms + b_group - 1) / b_group) * num_kb * kBBytes;
        CHECK(cudaMalloc(&b_stream, bytes));
        CHECK(cudaMemset(b_stream, 0x38, bytes));
    }
    if (tma2d) {
        // Pool: 65536 rows x 7168 bytes (470 MB); weights: 8192 tiles of 256 x 128 bytes (268 MB).
        const uint64_t pool_rows = 65536, pool_cols = 7168, b_tiles = 8192;
        void *pool, *weights;
        CHECK(cudaMalloc(&pool, pool_rows * pool_cols));
        CHECK(cudaMalloc(&weights, b_tiles * 256 * 128));
        fill_operands<<<1024, 256>>>(static_cast<uint32_t*>(pool), pool_rows * pool_cols / 4, random);
        fill_operands<<<1024, 256>>>(static_cast<uint32_t*>(weights), b_tiles * 256 * 128 / 4, random);
        CHECK(cudaGetLastError());
        g_tmap_a = make_tmap(pool, pool_cols, pool_rows, 128);
        g_tmap_b = make_tmap(weights, 128, b_tiles * 256, 256);
        g_tma_a_blocks = static_cast<uint32_t>(pool_rows / 128);
        g_tma_b_stages = static_cast<uint32_t>(b_tiles);
    }
    if (copy_mib & (copy_mib - 1)) {
        fprintf(stderr, "--copy-mib must be a power of two, got %u\n", copy_mib);
        return 2;
    }
    if (copy_mib > 0) {
        g_copy_vecs = static_cast<uint64_t>(copy_mib) << 16;  // 16-byte vectors
        int4 *a, *b;
        CHECK(cudaMalloc(&a, g_copy_vecs * 16));
        CHECK(cudaMalloc(&b, g_copy_vecs * 16));
        CHECK(cudaMemset(a, 1, g_copy_vecs * 16));
        g_copy_src = a;
        g_copy_dst = b;
    }
    CHECK(cudaMalloc(&sfb, 128 * sizeof(float)));
    std::vector<float> h(128, 1.0f);
    CHECK(cudaMemcpy(sfb, h.data(), 128 * sizeof(float), cudaMemcpyHostToDevice));
    CHECK(cudaMalloc(&sink, sizeof(float)));
    CHECK(cudaMalloc(&cycles, sizeof(unsigned long long)));
    printf("SMs %d, %u K blocks per CTA, %u stages\n", sms, num_kb, kStages);
    for (int m : modes) {
        switch (m) {
            case kHalves: run_mode<kHalves>(sms, num_kb, load, random, b_stream, b_group, tile_kb, epi_cycles, tile_barrier, stagger, src, src_stages, sfb, sink, cycles); break;
            case kNoPromo128: run_mode<kNoPromo128>(sms, num_kb, load, random, b_stream, b_group, tile_kb, epi_cycles, tile_barrier, stagger, src, src_stages, sfb, sink, cycles); break;
        }
    }
    CHECK(cudaDeviceSynchronize());
    return 0;
}

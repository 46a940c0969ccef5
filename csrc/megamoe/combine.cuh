// Combine: FP32 sum of the valid top-k slots, in slot order, into BF16 y.
#pragma once
#include "common.cuh"

namespace megamoe {

// Warp per token, or per part of a token's row when there are fewer tokens than warps (a
// warp's steps are dependent round trips: at 1 token the whole row in one warp took ~15 us
// after every other CTA had finished; notes entry 50).  Each lane owns 8 consecutive channels
// per chunk and sums kUnroll chunks at once.  Every valid slot's loads of an iteration are
// issued before any is summed, so kUnroll * top-k 16-byte loads are in flight per lane (the
// reduce streams the whole combine buffer once and only the consumer warps run it; with the
// sums between the slots' loads only kUnroll were in flight: notes entry 36).  An invalid slot loads nothing and
// adds +0, which leaves the FP32 sum (started at +0) exactly as the valid slots make it.
struct ReduceShape {
    static constexpr uint32_t kChunks = kHidden / 8;
    static constexpr uint32_t kUnroll = kNumTopk <= 8 ? 4 : (kNumTopk <= 16 ? 2 : 1);
    static constexpr uint32_t kSteps = (kChunks + 32 * kUnroll - 1) / (32 * kUnroll);  // per token row
    // Parts per token: contiguous ranges of its steps, one warp each (1 once tokens >= warps)
    __device__ __forceinline__ static uint32_t parts(uint32_t num_tokens, uint32_t num_warps) {
        return max(1u, min(kSteps, num_warps / max(1u, num_tokens)));
    }
};

// Whether slot `lane` of token t holds a pair (lanes past top-k: no).  The reduce's first
// unit calls it before the combine barrier (topk_idx is this call's input, published by the
// count exchange), so that load is not one more round trip after the barrier.
__device__ __forceinline__ bool reduce_slot_valid(const Params& p, uint32_t t, uint32_t lane) {
    return lane < kNumTopk && at<int64_t>(p, p.off_topk_idx)[static_cast<uint64_t>(t) * kNumTopk + lane] >= 0;
}
__device__ __forceinline__ bool reduce_first_slot_valid(const Params& p, uint32_t global_warp, uint32_t num_warps,
                                                        uint32_t lane) {
    const uint32_t num_tokens = static_cast<uint32_t>(p.num_tokens);
    const uint32_t parts = ReduceShape::parts(num_tokens, num_warps);
    return global_warp < num_tokens * parts && reduce_slot_valid(p, global_warp / parts, lane);
}

// first_valid: reduce_first_slot_valid(p, global_warp, num_warps, lane), loaded earlier.
__device__ __forceinline__ void combine_reduce(const Params& p, uint32_t global_warp, uint32_t num_warps, uint32_t lane,
                                               bool first_valid) {
    const __nv_bfloat16* combine = at<__nv_bfloat16>(p, p.off_combine);
    __nv_bfloat16* y = reinterpret_cast<__nv_bfloat16*>(p.y);
    constexpr uint32_t kChunks = ReduceShape::kChunks;
    constexpr uint32_t kUnroll = ReduceShape::kUnroll;
    constexpr uint32_t kSteps = ReduceShape::kSteps;
    const uint32_t num_tokens = static_cast<uint32_t>(p.num_tokens);
    const uint32_t parts = ReduceShape::parts(num_tokens, num_warps);
    for (uint32_t unit = global_warp; unit < num_tokens * parts; unit += num_warps) {
        const uint32_t t = unit / parts, part = unit % parts;
        const bool valid = unit == global_warp ? first_valid : reduce_slot_valid(p, t, lane);
        const uint32_t mask = __ballot_sync(0xffffffffu, valid);
        const __nv_bfloat16* src = combine + static_cast<uint64_t>(t) * kHidden;
        const uint32_t c_end = min(kChunks, (part + 1) * kSteps / parts * 32 * kUnroll);
        for (uint32_t c0 = part * kSteps / parts * 32 * kUnroll + lane; c0 < c_end; c0 += 32 * kUnroll) {
            int4 raw[kNumTopk][kUnroll];
            #pragma unroll
            for (uint32_t k = 0; k < kNumTopk; ++k) {
                #pragma unroll
                for (uint32_t u = 0; u < kUnroll; ++u) {
                    const uint32_t c = c0 + 32 * u;
                    raw[k][u] = ((mask >> k) & 1) && c < c_end
                                    ? __ldcg(reinterpret_cast<const int4*>(
                                          src + static_cast<uint64_t>(k) * kNumMaxTokens * kHidden + c * 8))
                                    : make_int4(0, 0, 0, 0);
                }
            }
            float sum[kUnroll][8];
            #pragma unroll
            for (uint32_t u = 0; u < kUnroll; ++u)
                #pragma unroll
                for (uint32_t i = 0; i < 8; ++i)
                    sum[u][i] = 0.0f;
            #pragma unroll
            for (uint32_t k = 0; k < kNumTopk; ++k) {
                #pragma unroll
                for (uint32_t u = 0; u < kUnroll; ++u) {
                    const __nv_bfloat162* v = reinterpret_cast<const __nv_bfloat162*>(&raw[k][u]);
                    #pragma unroll
                    for (uint32_t i = 0; i < 4; ++i) {
                        const float2 f = __bfloat1622float2(v[i]);
                        sum[u][2 * i] += f.x;
                        sum[u][2 * i + 1] += f.y;
                    }
                }
            }
            #pragma unroll
            for (uint32_t u = 0; u < kUnroll; ++u) {
                const uint32_t c = c0 + 32 * u;
                if (c >= c_end)
                    continue;
                int4 out;
                __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
                #pragma unroll
                for (uint32_t i = 0; i < 4; ++i)
                    o[i] = __floats2bfloat162_rn(sum[u][2 * i], sum[u][2 * i + 1]);
                reinterpret_cast<int4*>(y + static_cast<uint64_t>(t) * kHidden)[c] = out;
            }
        }
    }
}

}  // namespace megamoe

// The producer role (one thread of warp 0): takes tiles from the scheduler and streams their
// A rows, A scales and B weights through the stage ring by TMA; and the consumers' release of
// a stage back to it.
#pragma once
#include "scheduler.cuh"
#include "storage.cuh"

namespace megamoe {

// The stage's MXFP4 tile as stored (a template, so FP8 builds discard it unchecked)
template <typename Storage>
__device__ __forceinline__ uint8_t* fp4_raw_stage(Storage& ss, uint32_t stage) {
    if constexpr (kWeightFp4)
        return ss.b_raw[stage];
    else
        return nullptr;
}

// TMA producer (one thread).  Waits until a tile's rows are in the pool, then streams A,
// A scales and B through the stage ring; every stage carries its decoded tile (pack_tile), and a stage
// without data ends the loop.  With clusters, a unit's CTAs each load their own A block and
// one part of the shared B, multicast to every CTA of the cluster; the CTAs of an odd last
// block each load their own B while the leader multicasts the shared A and its scales.  The
// empty barriers count the consumers of all of them, since a multicast overwrites the stage
// everywhere.
// NOTES: tiles are taken in increasing order and each CTA finishes them in the order it
// took them; an L2 tile only waits for L1 tiles, which were all taken before it, so the
// waits cannot form a cycle.
__device__ __forceinline__ void producer_loop(const Params& p, SharedStorage& ss, uint32_t cluster_rank) {
    const Schedule& s = ss.schedule;
    const uint32_t* l1_arrival = at<uint32_t>(p, p.off_l1_arrival);
    const uint32_t* l2_arrival = at<uint32_t>(p, p.off_l2_arrival);
    TileSource source{reinterpret_cast<uint32_t*>(at<uint64_t>(p, p.off_grid_sync) + kGridSyncTileCounter),
                      ss.tile_slot, cluster_rank, 0};
    uint32_t it = 0;
    const uint32_t total = num_tiles(s);
    MEGAMOE_PROF(uint64_t& prof_arrival = ss.prof[2][0]; uint64_t& prof_empty = ss.prof[2][1]; prof_arrival = prof_empty = 0;
                 ss.prof[2][2] = clock64();)
    while (true) {
        const uint32_t t = source.next(p);
        if (t >= total) {
            MEGAMOE_PROF_ADD(kProfProducerArrival, prof_arrival);
            MEGAMOE_PROF_ADD(kProfProducerEmpty, prof_empty);
            MEGAMOE_PROF_ADD(kProfProducerTotal, clock64() - ss.prof[2][2]);
            const uint32_t stage = it % kNumStages;
            empty_wait(p, &ss.empty[stage], ((it / kNumStages) & 1) ^ 1);
            ss.stage_tile[stage] = make_uint4(kNoMoreTiles, 0, 0, 0);
            ptx::mbar_arrive(&ss.full[stage]);
            return;
        }
        const Tile tile = decode_tile(s, t, cluster_rank);
        const uint4 packed = pack_tile(t, tile);
        MEGAMOE_TRACE(kTraceTake, s.epoch, trace_tile(tile), tile.block);
        if (!tile.is_l2 && tile.direct) {
            ptx::fence_proxy_async_global();  // pushed before the exchange: TMA reads them now
        } else if (!tile.is_l2) {
            // Wait until the tile's A rows landed (an L2 tile waits per K block: L2Ready)
            const uint32_t* counter = l1_arrival + tile.block;
            MEGAMOE_PROF(const uint64_t prof_t0 = clock64();)
            uint32_t now = ptx::ld_acquire_gpu_u32(counter);
            if (now < tile.rows) {
                Deadline d(p.timeout_ns);
                while ((now = ptx::ld_acquire_gpu_u32(counter)) < tile.rows)
                    d.check(p, kPhaseL1Arrival, tile.rows, now, tile.block);
            }
            MEGAMOE_PROF(prof_arrival += clock64() - prof_t0;)
            ptx::fence_proxy_async_global();
        }
        L2Ready ready;

        const CUtensorMap* tmap_a = tile.is_l2 ? &p.tmap_l2_a : &p.tmap_l1_a;
        const CUtensorMap* tmap_sfa = tile.is_l2 ? &p.tmap_l2_sfa : &p.tmap_l1_sfa;
        const CUtensorMap* tmap_b = tile.is_l2 ? &p.tmap_l2_b : &p.tmap_l1_b;
        const uint32_t num_k = tile.is_l2 ? kNumL2KBlocks : kNumL1KBlocks;
        // Weights are stored stage by stage: [expert][n tile][k block][256 rows][128 bytes]
        const uint32_t num_n = tile.is_l2 ? kNumL2NTiles : kNumL1NTiles;
        const uint32_t b_first = (tile.expert * num_n + tile.n) * num_k;
        const uint32_t a_row = tile.block * kBlockM;
        // Whether this CTA shares B (a part of it, multicast) or A (the leader's, multicast)
        const bool share_b = kClusterM > 1 && !tile.share_a;
        const bool share_a = kClusterM > 1 && tile.share_a;
        constexpr uint32_t kBPartRows = kBlockN / kClusterM;
        constexpr uint16_t kClusterMask = static_cast<uint16_t>((1u << kClusterM) - 1);
        // B scales: L1 [E_local, 2I/128, H/128, {gate, up}], L2 [E_local, H/128, I/128]; this
        // tile's two 128-column halves are scale rows 2 n and 2 n + 1.
        const float* sfb_half0 =
            tile.is_l2 ? reinterpret_cast<const float*>(p.w2_sf) +
                             (static_cast<uint64_t>(tile.expert) * (kHidden / 128) + 2 * tile.n) * kNumL2KBlocks
                       : reinterpret_cast<const float*>(p.w1_sf) +
                             (static_cast<uint64_t>(tile.expert) * (2 * kIntermediate / 128) + 2 * tile.n) *
                                 kNumL1KBlocks * 2;
        const uint32_t sfb_half_stride = tile.is_l2 ? kNumL2KBlocks : kNumL1KBlocks * 2;
        for (uint32_t kb = 0; kb < num_k; ++kb, ++it) {
            if (tile.is_l2) {
                MEGAMOE_PROF(const uint64_t prof_t1 = clock64();)
                ready.wait(p, l2_arrival, tile.block, kb);
                MEGAMOE_PROF(prof_arrival += clock64() - prof_t1;)
            }
            const uint32_t stage = it % kNumStages;
            const uint32_t phase = (it / kNumStages) & 1;
            MEGAMOE_PROF(const uint64_t prof_t2 = clock64();)
            empty_wait(p, &ss.empty[stage], phase ^ 1);
            MEGAMOE_PROF(prof_empty += clock64() - prof_t2;)
            ss.stage_tile[stage] = packed;
            if (tile.is_l2) {
                ptx::cp_async_ca<4>(&ss.sfb[stage][0], sfb_half0 + kb);
                ptx::cp_async_ca<4>(&ss.sfb[stage][2], sfb_half0 + sfb_half_stride + kb);
            } else {
                ptx::cp_async_ca<8>(&ss.sfb[stage][0], sfb_half0 + 2 * kb);
                ptx::cp_async_ca<8>(&ss.sfb[stage][2], sfb_half0 + sfb_half_stride + 2 * kb);
            }
            ptx::cp_async_mbar_arrive(&ss.full[stage]);
            // Every CTA's stage receives all of A, its scales and B, whoever loads them
            ptx::mbar_arrive_expect_tx(&ss.full[stage], kStageTxBytes);
            const int32_t a_k = static_cast<int32_t>(kb * kBlockK), a_m = static_cast<int32_t>(a_row);
            if (!share_a) {
                ptx::tma_load_2d(ss.a[stage], tmap_a, &ss.full[stage], a_k, a_m);
                ptx::tma_load_2d(ss.sfa[stage], tmap_sfa, &ss.full[stage], a_row, kb);
            } else if (cluster_rank == 0) {
                ptx::tma_load_2d_multicast(ss.a[stage], tmap_a, &ss.full[stage], a_k, a_m, kClusterMask);
                ptx::tma_load_2d_multicast(ss.sfa[stage], tmap_sfa, &ss.full[stage], a_row, kb, kClusterMask);
            }
            const int32_t b_row = static_cast<int32_t>((b_first + kb) * kBlockN);
            if constexpr (kWeightFp4) {
                const uint8_t* w = reinterpret_cast<const uint8_t*>(tile.is_l2 ? p.w2 : p.w1);
                ptx::bulk_load(fp4_raw_stage(ss, stage), w + static_cast<uint64_t>(b_first + kb) * kFp4StageBytes,
                               kFp4StageBytes, &ss.full[stage]);
            } else if (!share_b) {
                // The B tensor map's box is one part (kBPartRows rows): all parts, locally
                #pragma unroll
                for (uint32_t r = 0; r < kClusterM; ++r)
                    ptx::tma_load_2d(ss.b[stage] + r * kBPartRows * kBlockK, tmap_b, &ss.full[stage], 0,
                                     b_row + static_cast<int32_t>(r * kBPartRows));
            } else {
                ptx::tma_load_2d_multicast(ss.b[stage] + cluster_rank * kBPartRows * kBlockK, tmap_b, &ss.full[stage],
                                           0, b_row + static_cast<int32_t>(cluster_rank * kBPartRows), kClusterMask);
            }
            MEGAMOE_PROF(if (kb == 0) MEGAMOE_TRACE(kTraceFirstIssue, s.epoch, trace_tile(tile), tile.block);
                         if (kb == num_k - 1) MEGAMOE_TRACE(kTraceLastIssue, s.epoch, trace_tile(tile), tile.block);)
        }
    }
}

// Release a stage to every producer whose multicast writes it.
__device__ __forceinline__ void release_stage(SharedStorage& ss, uint32_t stage) {
    if constexpr (kClusterM == 1) {
        ptx::mbar_arrive(&ss.empty[stage]);
    } else {
        #pragma unroll
        for (uint32_t r = 0; r < kClusterM; ++r)
            ptx::mbar_arrive_cluster(ptx::map_shared_to_rank(&ss.empty[stage], r));
    }
}

}  // namespace megamoe

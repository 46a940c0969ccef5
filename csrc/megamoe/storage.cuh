// What the roles share in shared memory: the stage ring, the tile handoffs, the schedule and
// the publisher's slots (one struct, so contract.smem_budget can check its size: kernel.cuh).
#pragma once
#include <cstddef>
#include <type_traits>

#include "dispatch.cuh"
#include "scheduler.cuh"

namespace megamoe {

// MXFP4 builds: each stage's weight tile as stored, and the expansion table (fp4_expand), kept
// ahead of the stage buffers in a multiple of 1024 bytes so those stay aligned for the swizzle.
struct Fp4Storage {
    uint8_t b_raw[kNumStages][kFp4StageBytes];
    uint2 fp4_table[kFp4NumScales];
    uint8_t fp4_pad[kFp4TableBytes - sizeof(uint2) * kFp4NumScales];
};
struct NoFp4Storage {};
static_assert(sizeof(Fp4Storage) % 1024 == 0, "the stage buffers after Fp4Storage must stay 1024-byte aligned");
static_assert(offsetof(Fp4Storage, fp4_table) % 256 == 0, "fp4_table_slot: the table starts at a multiple of 256 bytes");

struct SharedStorage : std::conditional<kWeightFp4, Fp4Storage, NoFp4Storage>::type {
    // Stage buffers (each A/B tile 1024-byte aligned for the 128B swizzle)
    uint8_t a[kNumStages][kSmemABytes];
    uint8_t b[kNumBTiles][kSmemBBytes];
    float sfa[kNumStages][kBlockM];
    // B scales of the stage's K block: {half 0 gate, half 0 up, half 1 gate, half 1 up} for
    // L1; {half 0, -, half 1, -} for L2 (copied by the producer with the stage)
    alignas(16) float sfb[kNumStages][4];
    float row_amax[2][kWeightFp4 ? kBlockM : 64];  // per consumer warpgroup, by tile row (epilogue_l1)
    // L1 tiles handed to the publisher warp (publish_l1_tiles), by parity: {ready word index,
    // bit, the tile's sequence number among this CTA's L1 tiles, -}
    alignas(16) uint4 publish_slot[2];
    // L1 tiles the publisher warp has taken from the slots (publisher_caught_up)
    uint32_t publish_taken;
    uint64_t full[kNumStages];
    uint64_t empty[kNumStages];
    // The stage's tile as the producer decoded it (pack_tile), or kNoMoreTiles in .x
    alignas(16) uint4 stage_tile[kNumStages];
    // Tiles forwarded by the cluster leader's producer (TileSource); zeroed at start
    uint64_t tile_slot[kTileSlots];
    Schedule schedule;
    // Pairs per expert of a call small enough for CTA 0 to count alone (dispatch_count)
    uint32_t send_count[kNumExperts];
    MEGAMOE_PROF(uint64_t prof[3][16];)  // per consumer warpgroup (slots 0-6, 10-15), then the producer
};

}  // namespace megamoe

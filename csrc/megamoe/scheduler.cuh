// The tile scheduler: the order in which the CTAs take the expert GEMMs' tiles (all L1 tiles,
// then all L2 tiles, over the pool schedule that dispatch builds), how a tile is encoded on its
// way from the producer to the consumers, and the waits that order tiles (an L1 tile's rows, an
// L2 tile's K blocks).  The producer takes tiles from it; the consumers only unpack them.
#pragma once
#include "dispatch.cuh"

namespace megamoe {

// Slots of the ring through which a cluster leader forwards tiles (TileSource)
constexpr uint32_t kTileSlots = kNumStages + 2;

struct Tile {
    bool is_l2;
    // With clusters: true when the cluster's CTAs share this block's A (each its own N tile of
    // an expert's last block, when the expert has an odd number of blocks), false when they
    // share the N tile's B (consecutive blocks).  Only the producer reads it.
    bool share_a;
    uint32_t expert;
    uint32_t block;
    uint32_t n;
    uint32_t rows;  // valid rows of the block (a direct-pool block: all; see direct)
    bool direct;    // a direct-pool block (Schedule::direct): rows valid by Schedule::direct_row_valid
};

// The producer decodes each tile once and hands it to the consumers with every stage, so
// a tile start costs the consumers one shared load instead of a binary search over the
// experts and two divisions on the path to the first WGMMA (notes entry 35).
static_assert(kNumExpertsPerRank <= 0xffffu && kNumL2NTiles <= 0xffffu && kNumL1NTiles <= 0xffffu &&
                  kBlockM <= 0xffffu,
              "pack_tile keeps the expert, the N tile and the valid rows in 16 bits each");
__device__ __forceinline__ uint4 pack_tile(uint32_t t, const Tile& tile) {
    return make_uint4(t, tile.expert | (tile.n << 16), tile.block,
                      tile.rows | (tile.is_l2 ? 1u << 16 : 0u) | (tile.direct ? 1u << 17 : 0u));
}
__device__ __forceinline__ Tile unpack_tile(const uint4& v) {
    Tile tile;
    tile.expert = v.y & 0xffffu;
    tile.n = v.y >> 16;
    tile.block = v.z;
    tile.rows = v.w & 0xffffu;
    tile.is_l2 = (v.w >> 16) & 1u;
    tile.direct = (v.w >> 17) & 1u;
    tile.share_a = false;
    return tile;
}

// A tile is the work of one cluster (one CTA without clusters) in one layer: expert `e` with
// `nb` blocks has nb * num_n / kClusterM of them, so the tiles of a layer are numbered by the
// blocks' prefix sum and no CTA of a cluster is ever left without a block.
static_assert(kNumL1NTiles % kClusterM == 0 && kNumL2NTiles % kClusterM == 0,
              "clusters pair the N tiles of an expert's odd last block: both layers need a multiple of "
              "cluster_m N tiles");
__device__ __forceinline__ uint32_t num_tiles(const Schedule& s) {
    return s.num_blocks() * (kNumL1NTiles + kNumL2NTiles) / kClusterM;
}

// Tiles: all L1 tiles, then all L2 tiles; inside a layer, expert-major, then N tile, then
// unit (kClusterM consecutive blocks sharing the N tile's B), so CTAs working at the same
// time share the expert's B tile in L2.  With clusters, an expert's odd last block comes
// after its units: kClusterM CTAs take kClusterM consecutive N tiles of it and share its A.
__device__ __forceinline__ Tile decode_tile(const Schedule& s, uint32_t t, uint32_t cluster_rank) {
    Tile tile;
    const uint32_t num_l1 = s.num_blocks() * kNumL1NTiles / kClusterM;
    tile.is_l2 = t >= num_l1;
    const uint32_t num_n = tile.is_l2 ? kNumL2NTiles : kNumL1NTiles;
    if (tile.is_l2)
        t -= num_l1;
    // Expert e's tiles are [block_start[e] * num_n / kClusterM, block_start[e + 1] * num_n / kClusterM)
    tile.expert = Schedule::upper_expert(s.block_start, t * kClusterM / num_n);
    const uint32_t first = s.block_start[tile.expert];
    const uint32_t num_blocks = s.block_start[tile.expert + 1] - first;
    const uint32_t num_units = num_blocks / kClusterM;
    const uint32_t local = t - first * num_n / kClusterM;
    uint32_t block_in_expert;
    if (kClusterM == 1 || local < num_units * num_n) {
        tile.share_a = false;
        tile.n = local / num_units;
        block_in_expert = (local % num_units) * kClusterM + cluster_rank;
    } else {
        tile.share_a = true;
        tile.n = (local - num_units * num_n) * kClusterM + cluster_rank;
        block_in_expert = num_blocks - 1;
    }
    tile.direct = s.direct != 0;
    if (tile.direct) {  // one block per expert (kDirectRowsPerSrc rows per source fit in it)
        tile.block = tile.expert;
        tile.rows = kBlockM;
    } else {
        tile.block = first + block_in_expert;
        tile.rows = s.valid_rows(tile.expert, tile.block);
    }
    return tile;
}

constexpr uint32_t kNoMoreTiles = 0xffffffffu;

// A tile in the profiling build's timeline: layer (bit 31), expert (bits 16-30), N tile.
__device__ __forceinline__ uint32_t trace_tile(const Tile& tile) {
    return (tile.is_l2 ? 1u << 31 : 0u) | ((tile.expert & 0x7fffu) << 16) | (tile.n & 0xffffu);
}

// Where the producer takes its next tile: an atomic counter per rank, so the tiles in flight
// across the GPU form one contiguous window of the tile order and CTAs sharing an expert's B
// tile stay close in time (L2 reuse).  With clusters only the leader (cluster rank 0) takes
// tiles; it forwards each one to the other CTAs' `tile_slot` ring through distributed shared
// memory as (sequence << 32 | tile), so every CTA of a cluster works on the same tile.
// NOTES: a ring of kTileSlots >= kNumStages + 1 slots cannot be overrun (one more for margin):
// the leader takes tile i only after issuing tile i - 1's last stage (iteration L), whose empty
// wait needs every CTA's consumers to have released iteration L - kNumStages; that iteration
// belongs to tile i - 1 - kNumStages or later (every tile has at least one K block), so the
// other producers have read slot i - 1 - kNumStages and every slot before it.

struct TileSource {
    uint32_t* counter;
    uint64_t* slots;  // this CTA's tile_slot ring
    uint32_t cluster_rank;
    uint32_t taken;   // tiles taken so far (the sequence number of the next one, minus 1)
    __device__ __forceinline__ uint32_t next(const Params& p) {
        if constexpr (kClusterM == 1) {
            (void)p;
            return atomicAdd(counter, 1u);
        } else {
            const uint32_t slot = taken % kTileSlots;
            const uint64_t seq = static_cast<uint64_t>(++taken) << 32;
            if (cluster_rank == 0) {
                const uint32_t t = atomicAdd(counter, 1u);
                #pragma unroll
                for (uint32_t r = 1; r < kClusterM; ++r)
                    ptx::st_relaxed_cluster_u64(ptx::map_shared_to_rank(slots + slot, r), seq | t);
                return t;
            }
            uint64_t v = ptx::ld_relaxed_cluster_shared_u64(slots + slot);
            if ((v >> 32) != (seq >> 32)) {
                // Twice the deadline: this wait only follows the leader's stage waits, whose own
                // diagnostic names the real cause, so it must fire first.
                Deadline d(2 * p.timeout_ns);
                while (((v = ptx::ld_relaxed_cluster_shared_u64(slots + slot)) >> 32) != (seq >> 32))
                    d.check(p, kPhaseClusterTile, seq >> 32, v >> 32, slot);
            }
            return static_cast<uint32_t>(v);
        }
    }
};

// An L2 tile's wait for the L1 tile that writes the A columns of its next K block: L2 K block n
// reads the 128 intermediate columns of L1 N tile n, which the L1 epilogue announces as bit n
// of the block's ready words.  So an L2 tile streams the K blocks whose L1 tiles are done while
// its block's other L1 tiles still run, instead of waiting for all of them.  K blocks go in
// order, so the accumulation order, and with it the result, does not depend on timing (taking
// any ready K block first measured ~1 us faster at 1 token and 1-3 us slower at 4 and 32: notes
// entry 50).
struct L2Ready {
    uint32_t bits = 0;  // the current word's bits acquired so far (K blocks 32 (kb / 32) ...)
    __device__ __forceinline__ void wait(const Params& p, const uint32_t* ready_words, uint32_t block, uint32_t kb) {
        if (kb % 32 == 0)
            bits = 0;
        const uint32_t want = 1u << (kb % 32);
        if ((bits & want) == 0) {
            const uint32_t* word = ready_words + block * kL2ReadyWords + kb / 32;
            bits = ptx::ld_acquire_gpu_u32(word);
            if ((bits & want) == 0) {
                Deadline d(p.timeout_ns);
                while (((bits = ptx::ld_acquire_gpu_u32(word)) & want) == 0)
                    d.check(p, kPhaseL2Arrival, kb, bits, block);
            }
            ptx::fence_proxy_async_global();  // TMA reads the columns after this acquire
        }
    }
};

}  // namespace megamoe

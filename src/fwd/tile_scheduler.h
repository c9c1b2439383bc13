// flash3: which (query block, head, batch) tiles each block of the forward kernel computes.
//
// The kernel is persistent when the grid has fewer blocks than tiles: block i computes tiles
// i, i + gridDim.x, i + 2 gridDim.x, ... (a grid of one block per tile is the non-persistent
// kernel, for the ablation). Tile order:
//   non-causal: query blocks of one (head, batch) are adjacent, so the blocks running at the
//               same time share K and V in L2;
//   causal:     longest-processing-time first: the last query blocks, which see the most keys,
//               come first for every (head, batch), so the short tiles fill the tail.
#pragma once

#include <cute/tensor.hpp>

namespace flash3::detail {

struct FwdTile {
  int m_block, head, batch;
};

template <bool kCausal>
struct FwdTileScheduler {
  int num_m_blocks, nheads, num_tiles;

  __host__ __device__ FwdTileScheduler(int seqlen_q, int block_m, int nheads_, int batch)
      : num_m_blocks((seqlen_q + block_m - 1) / block_m),
        nheads(nheads_),
        num_tiles(num_m_blocks * nheads_ * batch) {}

  __device__ __forceinline__ FwdTile tile(int t) const {
    FwdTile r;
    int hb;
    if constexpr (kCausal) {
      const int heads_batches = num_tiles / num_m_blocks;
      r.m_block = num_m_blocks - 1 - t / heads_batches;
      hb = t % heads_batches;
    } else {
      r.m_block = t % num_m_blocks;
      hb = t / num_m_blocks;
    }
    r.head = hb % nheads;
    r.batch = hb / nheads;
    return r;
  }
};

}  // namespace flash3::detail

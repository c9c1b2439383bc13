// flash3: which (query block, head, batch) tiles each block of the forward kernel computes.
//
// The kernel is persistent when the grid has fewer blocks than tiles: block i computes tiles
// i, i + gridDim.x, i + 2 gridDim.x, ... (a grid of one block per tile is the non-persistent
// kernel, for the ablation). Tile order:
//   non-causal: query blocks of one (head, batch) are adjacent, so the blocks running at the
//               same time share K and V in L2;
//   causal:     longest-processing-time first (the last query blocks, which see the most keys,
//               come first, so the short tiles fill the tail), within sections of (head, batch)
//               pairs whose K and V fit in about half the L2: all (head, batch) pairs at once
//               would stream every K and V from DRAM (ncu: 73% of DRAM bandwidth at hdim 128,
//               causal, seqlen 2k, batch 8, 16 heads).
#pragma once

#include <cute/tensor.hpp>

namespace flash3::detail {

struct FwdTile {
  int m_block, head, batch;
};

template <bool kCausal>
struct FwdTileScheduler {
  int num_m_blocks, nheads, num_tiles;
  int section;  // (head, batch) pairs per L2 section (causal)

  __host__ __device__ FwdTileScheduler(int seqlen_q, int block_m, int nheads_, int batch,
                                       int section_ = 1)
      : num_m_blocks((seqlen_q + block_m - 1) / block_m),
        nheads(nheads_),
        num_tiles(num_m_blocks * nheads_ * batch),
        section(section_ < 1 ? 1 : section_) {}

  // (head, batch) pairs whose K and V (seqlen_k x head_dim x 2 tensors x elem bytes) fit in
  // `l2_bytes`.
  static int l2_section(int seqlen_k, int head_dim, int elem_bytes, long long l2_bytes) {
    const long long per_pair = (long long)seqlen_k * head_dim * 2 * elem_bytes;
    const long long n = per_pair > 0 ? l2_bytes / per_pair : 1;
    return n < 1 ? 1 : (n > (1 << 30) ? (1 << 30) : int(n));
  }

  __device__ __forceinline__ FwdTile tile(int t) const {
    FwdTile r;
    int hb;
    if constexpr (kCausal) {
      const int heads_batches = num_tiles / num_m_blocks;
      const int sec = min(section, heads_batches);
      const int first_hb = t / (sec * num_m_blocks) * sec;
      const int in_section = min(sec, heads_batches - first_hb);  // the last may be smaller
      const int rest = t - first_hb * num_m_blocks;
      hb = first_hb + rest % in_section;
      r.m_block = num_m_blocks - 1 - rest / in_section;
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

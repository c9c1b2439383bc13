// flash3: the backward's tile scheduler: which blocks of work (kBlockN keys of one (head, batch)
// pair) a thread block computes, in which order, and in which order each visits its query blocks.
//   static      (Traits::kPersistent off): one thread block per item, item = blockIdx.x;
//   persistent  (on, bwd_config.h): one thread block per SM (bwd_persistent_grid) takes items in
//               the same order from a counter (TileStream): a scheduler thread, warp 3 of the
//               producer warpgroup, draws the next one when asked (tile_request) and hands it to
//               the producer, the dQ writers and the consumers through a two-slot ring.
#pragma once

#include <cstdint>

#include "bwd/bwd_traits.h"
#include "common/block_order.h"
#include "common/mask.h"
#include "common/tile_stream.h"

namespace flash3::detail {

// One block of work: key block n_block of the pair (head, batch), bh = batch * nheads + head,
// K and V of kv head head_kv, visiting m_count query blocks; visit i is query block at(i).
struct BwdItem {
  int n_block, head, head_kv, batch, m_count, m_base;
  int m_end, m_rot;  // kSpreadVisits, non-causal: the visits rotated by m_rot
  int64_t bh;
};

// The query block of a key block's i-th visit: |m_base - i| is m_begin + i with m_base =
// -m_begin, and m_end - 1 - i with m_base = m_end - 1.
__device__ __forceinline__ int bwd_m_at(int m_base, int i) { return abs(m_base - i); }

template <class Traits>
struct BwdScheduler {
  using Params = typename Traits::Params;
  static constexpr bool kPersistent = Traits::kPersistent;
  // Threads that read each item from the ring: the producer, the dQ writer warps, the consumers.
  static constexpr int kRingReaders = 1 + 32 * Traits::kDQWriters + Traits::kNumConsumerThreads;

  // Item t -> (n_block, head, batch). Non-causal: n_block fastest (the blocks of one head run
  // together and share its Q, dO in L2). Causal: longest-processing-time first (n_block 0 visits
  // every query block, the last one the fewest), within sections of (head, batch) pairs whose Q
  // and dO fit in half the L2 (the first l2_big of l2_section + 1 pairs, then of l2_section:
  // block_order.h, bwd_sections): n_block slowest inside a section. (With n_block slowest over
  // all heads, 132 blocks streamed 132 heads' Q, dO at once: at 16k, hdim 256 that is ~2 GB, from
  // DRAM.) Both orders dispatch item (n-1, h, b) before (n, h, b), which the deterministic mode
  // relies on.
  //
  // The query blocks of an item (Mask::m_block_range: causal skips those whose rows all lie
  // before the key block's first key), visited last to first where causal, else first to last.
  // NOTES: causal, the blocks running at the same time (consecutive key blocks of one head,
  // whose first query blocks differ) then all start at the last query block and move in step,
  // reading each Q, dO tile from L2 together and adding into the same dQ tile one after another,
  // as in the non-causal case; first to last, block n runs one query block ahead of block n + 1,
  // so the blocks of a head stream the whole head's Q, dO and dQ accumulator through L2 at once,
  // and in the deterministic mode each block waits a step for its predecessor. Measured
  // (docs/perf-log.md B8, B28): last to first +50% at head dim 256 at 8k-16k, and since the
  // in-order loop of B26-B27 also at head dims 64 and 128 (+2-8% at 512-2k, with the store-first
  // of bwd_dq_store_first it allows; within 3% either way from 4k).
  // kSpreadVisits (bwd_config.h, static only), where the adds into a tile may come in any order
  // (the default mode without store-first: no dq_sem): the blocks of a head no longer move in
  // step but are spread over the query blocks: causal first to last (each from its own first
  // block), non-causal key block n from query block n * m_count / n_blocks on, wrapping around.
  // Measured at head dim 256 (docs/perf-log.md B39): +1-3% (so B8's +50% for last to first there
  // no longer holds since the L2 sections and the in-order loop); at head dims 64 and 128 no
  // difference.
  static __device__ __forceinline__ BwdItem item(Params const& params, int t) {
    BwdItem it;
    int pair;
    if (Traits::kGeneral && params.varlen_items != nullptr) {
      const int4 e = params.varlen_items[t];
      it.n_block = e.x;
      pair = e.z * params.nheads + e.y;
    } else if constexpr (Traits::kCausal) {
      bwd_causal_block(t, params.n_blocks, params.nheads * params.batch, params.l2_section, params.l2_big,
                       it.n_block, pair);
    } else {
      it.n_block = t % params.n_blocks;
      pair = t / params.n_blocks;
    }
    it.head = pair % params.nheads;
    it.batch = pair / params.nheads;
    it.head_kv = it.head / params.nheads_per_kv;
    it.bh = pair;
    const auto mask = Traits::MaskT::template at<Traits::kGeneral>(
        params.seqlens.template of<Traits::kGeneral>(it.batch), params.mask);
    int m_begin;
    mask.template m_block_range<Traits::kBlockM, Traits::kBlockN>(it.n_block, m_begin, it.m_end);
    it.m_count = it.m_end - m_begin;
    const bool spread = Traits::kSpreadVisits && params.dq_sem == nullptr;
    // One register for both orders (bwd_m_at). (A flag and both bounds cost a spill at head dim 128.)
    it.m_base = Traits::kCausal && !spread ? it.m_end - 1 : -m_begin;
    // (64-bit: n_block x m_count may pass 2^31 at a few million tokens.)
    it.m_rot = !Traits::kCausal && spread ? int(int64_t(it.n_block) * it.m_count / params.n_blocks) : 0;
    return it;
  }

  // The query block of visit i of `it`.
  static __device__ __forceinline__ int at(BwdItem const& it, int i) {
    int m = bwd_m_at(it.m_base, i);
    if constexpr (!Traits::kCausal && Traits::kSpreadVisits) {
      m += it.m_rot;
      if (m >= it.m_end) m -= it.m_count;
    }
    return m;
  }

  // Static: this thread block's one item.
  static __device__ __forceinline__ BwdItem static_item(Params const& params) {
    static_assert(!kPersistent);
    return item(params, int(blockIdx.x));
  }

  // Persistent: the item stream. stream().tile(k, shared) is this block's k-th item
  // (>= num_items(params) past the last).
  static __device__ __forceinline__ TileStream<true> stream(Params const& params) {
    return TileStream<true>{params.tile_counter, num_items(params)};
  }
  // The items of the launch: with variable lengths, as many as the list has.
  static __device__ __forceinline__ int num_items(Params const& params) {
    if constexpr (Traits::kGeneral) {
      if (params.varlen_count != nullptr) {
        const int n = *params.varlen_count;
        return n < params.num_items ? n : params.num_items;
      }
    }
    return params.num_items;
  }

  // Persistent: thread 0's share of the block's start: the ring's barriers.
  template <class Shared>
  static __device__ __forceinline__ void init_barriers(Shared& shared) {
    for (int i = 0; i < 2; ++i) {
      shared.tile_full[i].init(1);
      shared.tile_empty[i].init(kRingReaders);
    }
    shared.tile_request.init(1);
  }

  // Persistent: the scheduler thread. Item k + 1 is drawn once the producer asks for it
  // (tile_request: when it starts item k, or after item k's last load, bwd_load.h).
  template <class Shared>
  static __device__ __forceinline__ void run(Params const& params, Shared& shared) {
    const TileStream<true> items = stream(params);
    for (int k = 0;; ++k) {
      if (k > 0) shared.tile_request.wait((k - 1) & 1);
      const int t = items.draw(k);
      items.publish(k, t, shared.tile_ring, shared.tile_full, shared.tile_empty);
      if (t >= items.num_tiles) break;
    }
  }
};

}  // namespace flash3::detail

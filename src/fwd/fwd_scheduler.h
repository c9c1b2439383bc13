// flash3: the forward's tile scheduler: which pieces of work each block of the kernel computes.
// A tile is (kBlockM query rows, head, batch) of O; a piece of work is key blocks [n_lo, n_hi)
// of one tile (the whole tile, except in the tail kernel). With variable lengths the tiles come
// from a list built on the device (runtime/varlen_tiles.h), longest sequences first.
//
// The kernel is persistent when the grid has fewer blocks than tiles (one block per SM).
//   static   (non-causal: all tiles take the same time) block i computes tiles i, i + gridDim.x,
//            ...; query blocks of one (head, batch) are adjacent, so the blocks running at the
//            same time share K and V in L2;
//   dynamic  (causal: tiles differ in length) the next tile is drawn from a counter when the
//            producer has issued the last load of the previous one (common/tile_stream.h), in
//            longest-processing-time-first order within L2-sized sections of (head, batch) pairs
//            (common/block_order.h);
//   tail     (non-causal, FwdTailPieces) the last partial wave of tiles cut along the keys over
//            all SMs (common/tail_split.h): each block takes at most two pieces, and the pieces
//            of a cut tile are combined by fwd_combine.h.
// A grid of one block per tile is the non-persistent kernel, for the ablation.
#pragma once

#include <cutlass/arch/barrier.h>

#include "common/block_order.h"
#include "common/mask.h"
#include "common/seqlen.h"
#include "common/tail_split.h"
#include "common/tile_stream.h"

namespace flash3::detail {

struct FwdTile {
  int m_block, head, batch;
};

// One piece of work: key blocks [n_lo, n_hi) of tile `index` (coordinates `tile`), visited from
// n_hi - 1 down to n_lo. part >= 0: a piece of a cut tile, whose slot is 2 x block + part
// (fwd_combine.h); part = -1: the whole tile. index >= the scheduler's end: no more work.
struct FwdWork {
  int index, n_lo, n_hi, part;
  FwdTile tile;
};

struct FwdSchedulerParams {
  int batch, nheads;
  int l2_section;     // (head, batch) pairs per L2 section of the causal tile order
  int l2_tail_first;  // the first pair of the last section (causal_tail_first, block_order.h)
  int* tile_counter;  // dynamic: two ints, zero at launch (null: the static order)
  int tiles_end;      // the main kernel computes tiles [0, tiles_end), whole
  TailSplit split;    // the tail kernel: the pieces of tiles [split.full_tiles, tiles_end)
  // Variable lengths (general kernels): tile t is varlen_tiles[t] = (m_block, head, batch, -),
  // and there are min(tiles_end, *varlen_count) tiles (runtime/varlen_tiles.h); null: fixed.
  const int4* varlen_tiles;
  const int* varlen_count;
};

// The dynamic scheduler's hand-off: the scheduler thread passes each tile index to the producer
// and the consumers through a two-slot ring (full: scheduler -> all, empty: all -> scheduler);
// the producer asks for the next one (request) when it has issued a tile's last load.
struct FwdSchedulerStorage {
  cutlass::arch::ClusterBarrier tile_full[2], tile_empty[2], tile_request;
  int tile_ring[2];  // (the tail kernel: [0] passes "this piece is the last of its tile")
};

template <class Traits>
struct FwdScheduler {
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  using Params = FwdSchedulerParams;
  using SharedStorage = FwdSchedulerStorage;

  SeqLens seqlens;
  MaskOffsets mask_offsets;
  int num_m_blocks, nheads, num_tiles, section, tail_first, tiles_end;
  TileStream<Traits::kDynamicTiles> tiles;
  int tail_pieces;  // the tail kernel: how many pieces this block computes
  const int4* varlen_tiles;

  __device__ FwdScheduler(const Params& p, SeqLens lens, MaskOffsets mask)
      : seqlens(lens),
        mask_offsets(mask),
        num_m_blocks((lens.max_q() + kBlockM - 1) / kBlockM),
        nheads(p.nheads),
        num_tiles(num_m_blocks * p.nheads * p.batch),
        section(p.l2_section < 1 ? 1 : p.l2_section),
        tail_first(p.l2_tail_first),
        tiles_end(tile_count(p)),
        tiles{p.tile_counter, tiles_end},
        tail_pieces(Traits::kTailPieces ? tail_piece_count(p.split, int(blockIdx.x)) : 0),
        varlen_tiles(p.varlen_tiles) {}

  // The tiles of the launch: with variable lengths, as many as the tile list has.
  __device__ static int tile_count(const Params& p) {
    if constexpr (Traits::kGeneral) {
      if (p.varlen_count != nullptr) {
        const int n = *p.varlen_count;
        return n < p.tiles_end ? n : p.tiles_end;
      }
    }
    return p.tiles_end;
  }

  // Thread 0 of the block, before the kernel's __syncthreads.
  __device__ static void init_barriers(SharedStorage& shared, int consumer_threads) {
    for (int i = 0; i < 2; ++i) {
      shared.tile_full[i].init(1);
      shared.tile_empty[i].init(consumer_threads + 1);  // + the producer thread
    }
    shared.tile_request.init(1);
  }

  // Tile index -> (query block, head, batch). Non-causal: query blocks of a (head, batch) pair
  // adjacent; causal: block_order.h's longest-first order within L2 sections.
  __device__ __forceinline__ FwdTile tile(int t) const {
    FwdTile r;
    if constexpr (Traits::kGeneral) {
      if (varlen_tiles != nullptr) {
        const int4 e = varlen_tiles[t];
        return FwdTile{e.x, e.y, e.z};
      }
    }
    int hb;
    if constexpr (Traits::kCausal) {
      causal_tile(t, num_m_blocks, num_tiles / num_m_blocks, section, tail_first, r.m_block, hb);
    } else {
      r.m_block = t % num_m_blocks;
      hb = t / num_m_blocks;
    }
    r.head = hb % nheads;
    r.batch = hb / nheads;
    return r;
  }

  // This block's k-th piece of work (the producer and the consumers call it with k = 0, 1, ...;
  // with the dynamic order each call takes the next tile from the ring): its index, and in the
  // tail kernel its key blocks. Check done() before locate().
  template <class Shared>
  __device__ __forceinline__ FwdWork work(const Params& params, int k, Shared& shared) const {
    FwdWork w;
    if constexpr (Traits::kTailPieces) {
      if (k < tail_pieces) {
        const TailPiece piece = tail_piece(params.split, int(blockIdx.x), k);
        w.index = piece.tile;
        w.n_lo = piece.n_lo;
        w.n_hi = piece.n_hi;
        w.part = piece.part;
      } else {
        w.index = tiles_end;
      }
    } else {
      w.index = tiles.tile(k, shared.scheduler);
      w.part = -1;
    }
    return w;
  }

  // The coordinates of a piece of work, and (main kernel) its key blocks from the mask.
  __device__ __forceinline__ void locate(FwdWork& w) const {
    w.tile = tile(w.index);
    if constexpr (!Traits::kTailPieces) {
      Traits::MaskT::template at<Traits::kGeneral>(seqlens.template of<Traits::kGeneral>(w.tile.batch), mask_offsets)
          .template n_block_range<kBlockM, kBlockN>(w.tile.m_block, w.n_lo, w.n_hi);
    }
  }
  __device__ __forceinline__ bool done(const FwdWork& w) const { return w.index >= tiles_end; }

  // The scheduler thread of the dynamic order (one thread of the producer warpgroup's warp 1):
  // draws this block's k-th tile when the producer has issued the last load of tile k-1, and
  // hands it to the producer and the consumers.
  // NOTES: in the producer thread itself, the draw made ptxas spill (380 bytes at head dim
  // 256: 24 registers leave no room).
  template <class Shared>
  __device__ __forceinline__ void run_draws(Shared& shared) const {
    for (int k = 0;; ++k) {
      if (k > 0) shared.scheduler.tile_request.wait((k - 1) & 1);
      const int t = tiles.draw(k);
      tiles.publish(k, t, shared.scheduler.tile_ring, shared.scheduler.tile_full, shared.scheduler.tile_empty);
      if (t >= tiles_end) break;
    }
  }

  // The producer, after the last load of a piece: the next tile, please (dynamic order).
  template <class Shared>
  __device__ __forceinline__ void request_next(Shared& shared) const {
    if constexpr (Traits::kDynamicTiles) shared.scheduler.tile_request.arrive();
  }
};

}  // namespace flash3::detail

// flash3: the combine of split work: each piece of a tile cut along the keys (the forward's
// tail split, common/tail_split.h; split-KV decoding later) leaves its normalized O and
// log-sum-exp in a slot of FP32 scratch, and the last piece of the tile to finish combines
// every piece's slot, in piece order, as O = sum_p exp(lse_p - lse) O_p with
// lse = log sum_p exp(lse_p), then the epilogue writes the tile.
#pragma once

#include <cute/tensor.hpp>

#include "common/ptx.h"
#include "common/tail_split.h"
#include "common/wgmma.h"
#include "fwd/fwd_barriers.h"

namespace flash3::detail {

using namespace cute;

struct FwdCombineParams {
  int* split_counter;  // one int per cut tile, zero at launch and left zero
  float* split_o;      // 2 slots per block of Traits::kSplitSlotFloats
};

template <class Traits>
struct FwdCombine {
  // The consumers of a piece of a cut tile (work.part >= 0), with its normalized O in tOrO and
  // its log-sum-exp in lse: returns true (with the tile's combined O and lse in tOrO and lse)
  // in the block that finished the tile's last piece, which then writes the tile; false in the
  // others.
  template <class Work, class TensorO, int kRows>
  __device__ __forceinline__ static bool run(const FwdCombineParams& p, const TailSplit& split,
                                             typename Traits::SharedStorage& shared, const Work& work, TensorO& tOrO,
                                             float (&lse)[kRows], int tidx) {
    Tensor tOrO_rc = make_tensor(tOrO.data(), acc_layout_rowcol(tOrO.layout()));
    // A piece of a cut tile (tail_split.h): its normalized O and lse go to its slot; the
    // last piece of the tile to get here combines every piece's slot, in piece order, as
    // O = sum_p exp(lse_p - lse) O_p with lse = log sum_p exp(lse_p), and writes the tile.
    // NOTES: its own piece is read back from its slot too, so that the sums run in the
    // same order whichever piece finishes last: the output is the same from run to run.
    constexpr int N = Traits::kNumConsumerThreads;
    constexpr int kCols = decltype(size<1>(tOrO_rc))::value;
    static_assert(kRows * kCols * N + kRows * N <= Traits::kSplitSlotFloats);
    const TailSplit& sp = split;
    const int i = work.index - sp.full_tiles;
    auto slot_of = [&](int s) { return p.split_o + size_t(s) * Traits::kSplitSlotFloats; };
    float* mine = slot_of(2 * int(blockIdx.x) + work.part);
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < kCols; ++n) __stcg(mine + (m * kCols + n) * N + tidx, tOrO_rc(m, n));
      __stcg(mine + (kRows * kCols + m) * N + tidx, lse[m]);
    }
    __threadfence();
    named_barrier_sync(N, kFwdBarrierEpilogue);
    const int first = tail_first_block(sp, i), last = tail_last_block(sp, i);
    if (tidx == 0) {
      const int done = atomicAdd(p.split_counter + i, 1);
      const int is_last = done == last - first;
      if (is_last) p.split_counter[i] = 0;  // left zero for the next launch
      // NOTES: the flag goes through the tile ring, unused by the static order: a shared int
      // of its own shifted the main kernel's layout too, and ptxas spilled 48 bytes there.
      *reinterpret_cast<volatile int*>(&shared.scheduler.tile_ring[0]) = is_last;
    }
    named_barrier_sync(N, kFwdBarrierEpilogue);
    if (!*reinterpret_cast<volatile int*>(&shared.scheduler.tile_ring[0])) {
      // Not the last: no output. (With O staged in the Q buffer the O store frees Q; here
      // nothing else does.)
      if constexpr (Traits::kStageOInQ) {
        if (tidx == 0) shared.load.barrier_q_free.arrive();
      }
      return false;
    }
    __threadfence();
    float lse_max[kRows], weight_sum[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      lse_max[m] = -INFINITY;
      weight_sum[m] = 0.f;
    }
    for (int p = first; p <= last; ++p) {
      const float* other = slot_of(tail_slot(sp, i, p));
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < kRows; ++m) lse_max[m] = fmaxf(lse_max[m], __ldcg(other + (kRows * kCols + m) * N + tidx));
    }
    clear(tOrO);
    for (int p = first; p <= last; ++p) {
      const float* other = slot_of(tail_slot(sp, i, p));
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < kRows; ++m) {
        const float w = expf(__ldcg(other + (kRows * kCols + m) * N + tidx) - lse_max[m]);
        weight_sum[m] += w;
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < kCols; ++n) tOrO_rc(m, n) += w * __ldcg(other + (m * kCols + n) * N + tidx);
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      const float inv = 1.0f / weight_sum[m];
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < kCols; ++n) tOrO_rc(m, n) *= inv;
      lse[m] = lse_max[m] + logf(weight_sum[m]);
    }
    return true;
  }
};

}  // namespace flash3::detail

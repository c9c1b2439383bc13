// flash3: the sequence lengths of a batch, the one place the kernels read seqlen_q and seqlen_k
// from. A batch has one length per side, or (variable-length batches) each sequence its own:
// from cu_seqlens (packed tensors: sequence b is rows [cu[b], cu[b + 1])) and/or seqused (only
// the first seqused[b] rows take part).
//
// NOTES: validation (src/validate.cpp) bounds both lengths by kMaxSeqlen = 2^30, so that the
// kernels' 32-bit index arithmetic (ceil-divisions, row + block ends, seqlen_k - seqlen_q, and
// the tile counts, bounded there too) cannot overflow. Variable lengths are clamped to their
// tensors here (of()), so that bad cu_seqlens or seqused values read and write nothing out of
// bounds.
#pragma once

#include "common/host_device.h"

namespace flash3 {

constexpr int kMaxSeqlen = 1 << 30;

namespace detail {

// The lengths of one batch entry, and where it starts in a packed tensor (0 otherwise).
struct SeqLen {
  int q, k;
  int q_start = 0, k_start = 0;
};

// The lengths of every batch entry.
struct SeqLens {
  int seqlen_q = 0, seqlen_k = 0;  // the fixed lengths; with variable lengths, the longest
  // Variable lengths (each null where that side has none): cu_seqlens (batch + 1 entries),
  // seqused (batch), and the rows of the packed tensors.
  const int* cu_q = nullptr;
  const int* cu_k = nullptr;
  const int* used_q = nullptr;
  const int* used_k = nullptr;
  int total_q = 0, total_k = 0;

  // Entry b's lengths (kVarlen: as the pointers say; else the fixed lengths, and the kernel
  // does not read the pointers).
  template <bool kVarlen>
  FLASH3_HD SeqLen of(int b) const {
    SeqLen s{seqlen_q, seqlen_k, 0, 0};
    if constexpr (kVarlen) {
      side(cu_q, used_q, total_q, b, s.q, s.q_start);
      side(cu_k, used_k, total_k, b, s.k, s.k_start);
    }
    return s;
  }
  // The batch coordinate of entry b in the q-side and k-side tensors: 0 where packed (the
  // launchers view a packed (total, heads, head_dim) tensor as a batch of one).
  FLASH3_HD int q_batch(int b) const { return cu_q != nullptr ? 0 : b; }
  FLASH3_HD int k_batch(int b) const { return cu_k != nullptr ? 0 : b; }
  // The longest entry: what grids and tile counts of fixed-length batches are sized by.
  FLASH3_HD int max_q() const { return seqlen_q; }
  FLASH3_HD int max_k() const { return seqlen_k; }
  FLASH3_HD bool varlen() const {
    return cu_q != nullptr || cu_k != nullptr || used_q != nullptr || used_k != nullptr;
  }

 private:
  FLASH3_HD static int clamp(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }
  FLASH3_HD static void side(const int* cu, const int* used, int total, int b, int& len, int& start) {
    if (cu != nullptr) {
      start = clamp(cu[b], 0, total);
      len = clamp(cu[b + 1], start, total) - start;
    }
    if (used != nullptr) len = clamp(used[b], 0, len);
  }
};

}  // namespace detail
}  // namespace flash3

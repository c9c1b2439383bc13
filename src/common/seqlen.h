// flash3: the sequence lengths of a batch, the one place the kernels read seqlen_q and seqlen_k
// from. Today every batch entry has the same lengths; variable-length batches (cu_seqlens,
// seqused) extend this type, not its callers.
//
// NOTES: validation (src/validate.cpp) bounds both lengths by kMaxSeqlen = 2^30, so that the
// kernels' 32-bit index arithmetic (ceil-divisions, row + block ends, seqlen_k - seqlen_q, and
// the tile counts, bounded there too) cannot overflow.
#pragma once

#include "common/host_device.h"

namespace flash3 {

constexpr int kMaxSeqlen = 1 << 30;

namespace detail {

// The lengths of one batch entry.
struct SeqLen {
  int q, k;
};

// The lengths of every batch entry.
struct SeqLens {
  int seqlen_q = 0, seqlen_k = 0;
  FLASH3_HD SeqLen of(int /*batch*/) const { return SeqLen{seqlen_q, seqlen_k}; }
  // The longest entry: what grids and tile counts are sized by.
  FLASH3_HD int max_q() const { return seqlen_q; }
  FLASH3_HD int max_k() const { return seqlen_k; }
};

}  // namespace detail
}  // namespace flash3

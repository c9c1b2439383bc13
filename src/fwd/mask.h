// flash3: attention masks applied to a block of scores S held in WGMMA accumulator registers.
#pragma once

#include "fwd/utils.h"

namespace flash3::detail {

// Sets to -inf every score whose key is out of range (col >= seqlen_k) or, when kCausal, in
// the future of its query under the bottom-right alignment: key j is visible to query i iff
// j <= i + seqlen_k - seqlen_q.
//   tSrS, tScS: the scores and their (row, col) coordinates inside the (kBlockM, kBlockN) tile,
//   both in (row, col) view. row0 / col0: the tile's first query row / key column.
template <bool kCausal, class TensorS, class TensorC>
__device__ __forceinline__ void apply_mask(TensorS& tSrS, TensorC const& tScS, int row0, int col0,
                                           int seqlen_q, int seqlen_k) {
  const int col_limit_k = seqlen_k - col0;  // in-tile columns >= this are past the end
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < size<0>(tSrS); ++m) {
    int col_limit = col_limit_k;
    if constexpr (kCausal) {
      const int row = row0 + get<0>(tScS(m, 0));
      col_limit = min(col_limit, row + 1 + seqlen_k - seqlen_q - col0);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < size<1>(tSrS); ++n) {
      if (get<1>(tScS(m, n)) >= col_limit) tSrS(m, n) = -INFINITY;
    }
  }
}

}  // namespace flash3::detail

// flash3: the attention mask, the one place that says which (query, key) pairs are visible. The
// forward and backward kernels, their schedulers and the launchers all ask it:
//   n_block_end     the key blocks a query block visits (forward),
//   m_block_range   the query blocks a key block visits (backward),
//   needs_masking   whether a (query block, key block) pair needs element masking,
//   key_end         the end of the keys one query row sees,
//   apply / apply_transposed   -inf on the invisible scores of S or S^T in registers.
// Today: no mask (every key below seqlen_k) or causal, aligned bottom-right as in
// FlashAttention-2/3: query i sees key j iff j <= i + seqlen_k - seqlen_q.
#pragma once

#if defined(__CUDACC__)
#include <cute/tensor.hpp>
#endif

#include "common/host_device.h"
#include "common/seqlen.h"

namespace flash3::detail {

template <bool kCausal_>
struct Mask {
  static constexpr bool kCausal = kCausal_;
  int seqlen_q, seqlen_k;

  FLASH3_HD explicit Mask(SeqLen len) : seqlen_q(len.q), seqlen_k(len.k) {}

  // Causal: key j is visible to query i iff j <= i + diagonal().
  FLASH3_HD int diagonal() const { return seqlen_k - seqlen_q; }

  // The keys query `row` sees: [0, key_end(row)); <= 0 where none.
  FLASH3_HD int key_end(int row) const {
    const int end = row + 1 + diagonal();
    return kCausal && end < seqlen_k ? end : seqlen_k;
  }

  // Query block m_block (rows [m_block * kBlockM, +kBlockM)) visits key blocks [0, n_block_end):
  // blocks entirely in the future of its last row are skipped, not computed.
  template <int kBlockM, int kBlockN>
  FLASH3_HD int n_block_end(int m_block) const {
    int n_end = (seqlen_k + kBlockN - 1) / kBlockN;
    if (kCausal) {
      const int last_row = ((m_block + 1) * kBlockM < seqlen_q ? (m_block + 1) * kBlockM : seqlen_q) - 1;
      const int last_col = last_row + diagonal();  // negative: no visible key
      const int causal_end = last_col < 0 ? 0 : last_col / kBlockN + 1;
      n_end = causal_end < n_end ? causal_end : n_end;
    }
    return n_end;
  }

  // Key block n_block is visited by query blocks [m_begin, m_end): the blocks whose rows all
  // lie before its first key are skipped.
  template <int kBlockM, int kBlockN>
  FLASH3_HD void m_block_range(int n_block, int& m_begin, int& m_end) const {
    m_end = (seqlen_q + kBlockM - 1) / kBlockM;
    m_begin = 0;
    if (kCausal) {
      const int first_row = n_block * kBlockN - diagonal();  // the first row to see key n_block * kBlockN
      m_begin = first_row <= 0 ? 0 : (first_row / kBlockM < m_end ? first_row / kBlockM : m_end);
    }
  }

  // Whether the block of rows from row0 and kBlockN keys from col0 holds an invisible pair:
  // keys past the end, or (causal) a key past the first row's diagonal.
  template <int kBlockN>
  FLASH3_HD bool needs_masking(int row0, int col0) const {
    bool need = col0 + kBlockN > seqlen_k;
    if (kCausal) need |= col0 + kBlockN - 1 > row0 + diagonal();
    return need;
  }

#if defined(__CUDACC__)
  // S in (row, col) view with its coordinates inside the tile (tScS, same view); row0 / col0:
  // the tile's first query row / key column. Invisible scores become -inf.
  template <class TensorS, class TensorC>
  __device__ __forceinline__ void apply(TensorS& s, TensorC const& coord, int row0, int col0) const {
    const int col_limit_k = seqlen_k - col0;  // in-tile columns >= this are past the end
#pragma unroll
    for (int m = 0; m < cute::size<0>(s); ++m) {
      int col_limit = col_limit_k;
      if constexpr (kCausal) {
        const int row = row0 + cute::get<0>(coord(m, 0));
        col_limit = min(col_limit, row + 1 + diagonal() - col0);
      }
#pragma unroll
      for (int n = 0; n < cute::size<1>(s); ++n) {
        if (cute::get<1>(coord(m, n)) >= col_limit) s(m, n) = -INFINITY;
      }
    }
  }

  // S^T in (key, query) view with its coordinates (tile key, tile query); col0 / row0: the tile's
  // first key / first query row. Invisible scores become -inf.
  template <class TensorS, class TensorC>
  __device__ __forceinline__ void apply_transposed(TensorS& st, TensorC const& coord, int row0, int col0) const {
#pragma unroll
    for (int j = 0; j < cute::size<1>(st); ++j) {
      // Keys visible to query column j: [0, limit) relative to col0.
      int limit = seqlen_k - col0;
      if constexpr (kCausal) limit = min(limit, row0 + cute::get<1>(coord(0, j)) + diagonal() + 1 - col0);
#pragma unroll
      for (int r = 0; r < cute::size<0>(st); ++r) {
        if (cute::get<0>(coord(r, 0)) >= limit) st(r, j) = -INFINITY;
      }
    }
  }
#endif
};

}  // namespace flash3::detail

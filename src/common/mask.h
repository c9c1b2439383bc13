// flash3: the attention mask, the one place that says which (query, key) pairs are visible. The
// forward and backward kernels, their schedulers, the dQ writers and the launchers all ask it:
//   n_block_range   the key blocks a query block visits (forward; the backward's dQ order),
//   m_block_range   the query blocks a key block visits (backward),
//   needs_masking   whether a (query block, key block) pair needs element masking (the rule;
//                   the main loops test its per-tile form, unmasked_n_blocks / unmasked_m_blocks),
//   key_begin/end   the keys one query row sees,
//   apply / apply_transposed   -inf on the invisible scores of S or S^T in registers.
// Query i sees key j iff j < seqlen_k and, with d = seqlen_k - seqlen_q (masks aligned
// bottom-right, as in FlashAttention-2/3),
//   i + d - left <= j <= i + d + right
// where (left, right) is the sliding window (Window; -1: unbounded on that side) and causal is
// right = 0. Without a window, both bounds are clamped to values that exclude nothing.
#pragma once

#if defined(__CUDACC__)
#include <cute/tensor.hpp>
#endif

#include "common/host_device.h"
#include "common/seqlen.h"

namespace flash3::detail {

// A sliding window (FlashAttention-3's window_size): -1 means unbounded on that side.
struct Window {
  int left = -1, right = -1;
};

// The window as a mask uses it (Mask::lo_off, hi_off), computed once on the host.
// NOTES: kernel parameters, so that the kernels read them from the constant bank where they
// need them: computed in the kernel, the two offsets took two more registers through the whole
// forward mainloop, and ptxas spilled (head dim 128: 0 -> 132 bytes).
// With variable lengths the offsets differ per batch entry: the kernels compute them from the
// window (left, right, as Window) and the entry's lengths (Mask::at).
struct MaskOffsets {
  int lo_off, hi_off;
  int left = -1, right = -1;
};

// kWindow: the kernel is built for sliding windows (the general kernels of variable lengths,
// windows and softcap: FwdGeneral, BwdTraits' kGeneral). Without it the window's tests compile
// away, and so does the right bound where not causal: the code is that of a mask of the end of
// the keys and the diagonal.
// NOTES: one kernel for both cost 3-14% in the backward at head dims 64 and 128 and up to 10% in
// the forward (docs/perf-log.md, W1): the window's bounds and softcap's branch in every kernel.
template <bool kCausal_, bool kWindow_>
struct Mask {
  static constexpr bool kCausal = kCausal_, kWindow = kWindow_;
  static constexpr bool kRightBound = kCausal || kWindow;  // keys right of the window exist
  int seqlen_q, seqlen_k;
  // Query `row` sees keys [row + lo_off, row + hi_off) within [0, seqlen_k):
  // lo_off = d - left, hi_off = d + right + 1, the window clamped to [0, seqlen_k - 1] on the left
  // and [0, seqlen_q - 1] on the right (causal: right = 0).
  int lo_off, hi_off;

  FLASH3_HD Mask(SeqLen len, MaskOffsets o) : seqlen_q(len.q), seqlen_k(len.k), lo_off(o.lo_off), hi_off(o.hi_off) {}
  FLASH3_HD Mask(SeqLen len, Window w) : Mask(len, offsets(len, w)) {}
  // The mask of one batch entry: kPerEntry (variable lengths), its offsets from the window and
  // its own lengths; else the launcher's offsets.
  template <bool kPerEntry>
  FLASH3_HD static Mask at(SeqLen len, const MaskOffsets& o) {
    if constexpr (kPerEntry) return Mask(len, Window{o.left, o.right});
    return Mask(len, o);
  }

  // NOTES: the window clamped so that the row arithmetic below stays in 32 bits (validate.cpp
  // bounds both lengths by 2^30): left >= seqlen_k - 1 and right >= seqlen_q - 1 exclude no key.
  FLASH3_HD static MaskOffsets offsets(SeqLen len, Window w) {
    if (!kWindow) w = Window{};
    const int max_left = len.k > 0 ? len.k - 1 : 0, max_right = len.q > 0 ? len.q - 1 : 0;
    const int left = w.left < 0 || w.left > max_left ? max_left : w.left;
    const int right = kCausal ? 0 : (w.right < 0 || w.right > max_right ? max_right : w.right);
    return MaskOffsets{len.k - len.q - left, len.k - len.q + right + 1, w.left, w.right};
  }

  // The keys query `row` sees: [key_begin(row), key_end(row)); empty where end <= begin.
  FLASH3_HD int key_begin(int row) const {
    if (!kWindow) return 0;
    const int begin = row + lo_off;
    return begin > 0 ? begin : 0;
  }
  FLASH3_HD int key_end(int row) const {
    if (!kRightBound) return seqlen_k;
    const int end = row + hi_off;
    return end < seqlen_k ? end : seqlen_k;
  }

  // The blocks a range of blocks visits, from one rule: query block m (rows r0..r1) and key block
  // n (keys c0..c1, both ends clipped to the lengths) hold a visible pair iff
  //   c0 < r1 + hi_off   and   c1 >= r0 + lo_off,
  // so that enumerating the pairs by query block (n_block_range) and by key block
  // (m_block_range) gives the same set (the deterministic dQ order relies on it).
  // first_reaching: the first block (of kBlock) whose last index reaches `bound`, which (window
  // bounds >= 0) is always below the length, so the clipping of the last block does not matter;
  // end_from: the end of the blocks whose first index is below `bound`.
  template <int kBlock>
  FLASH3_HD static int first_reaching(int bound) {
    return bound <= 0 ? 0 : bound / kBlock;
  }
  template <int kBlock>
  FLASH3_HD static int end_from(int bound, int blocks) {
    if (bound <= 0) return 0;
    const int end = (bound - 1) / kBlock + 1;
    return end < blocks ? end : blocks;
  }

  // Query block m_block visits key blocks [n_begin, n_end) (n_begin >= n_end: none): the blocks
  // outside the window (and, causal, in the future of its last row) are skipped, not computed.
  template <int kBlockM, int kBlockN>
  FLASH3_HD void n_block_range(int m_block, int& n_begin, int& n_end) const {
    const int n_blocks = (seqlen_k + kBlockN - 1) / kBlockN;
    const int r0 = m_block * kBlockM;
    const int r1 = ((m_block + 1) * kBlockM < seqlen_q ? (m_block + 1) * kBlockM : seqlen_q) - 1;
    n_end = kRightBound ? end_from<kBlockN>(r1 + hi_off, n_blocks) : n_blocks;
    n_begin = 0;
    if (kWindow) {
      n_begin = first_reaching<kBlockN>(r0 + lo_off);
      if (n_begin > n_end) n_begin = n_end;
    }
  }

  // Key block n_block is visited by query blocks [m_begin, m_end) (m_begin >= m_end: none).
  template <int kBlockM, int kBlockN>
  FLASH3_HD void m_block_range(int n_block, int& m_begin, int& m_end) const {
    const int m_blocks = (seqlen_q + kBlockM - 1) / kBlockM;
    const int c0 = n_block * kBlockN;
    const int c1 = ((n_block + 1) * kBlockN < seqlen_k ? (n_block + 1) * kBlockN : seqlen_k) - 1;
    m_end = kWindow ? end_from<kBlockM>(c1 - lo_off + 1, m_blocks) : m_blocks;
    m_begin = 0;
    if (kRightBound) {
      m_begin = first_reaching<kBlockM>(c0 - hi_off + 1);
      if (m_begin > m_end) m_begin = m_end;
    }
  }

  // Whether the block of kBlockM rows from row0 and kBlockN keys from col0 holds an invisible
  // pair: keys past the end, right of the first row's window (causal: its diagonal), or left of
  // the last row's window (the last row below seqlen_q: padding rows are never stored).
  template <int kBlockM, int kBlockN>
  FLASH3_HD bool needs_masking(int row0, int col0) const {
    const int last_row = (row0 + kBlockM < seqlen_q ? row0 + kBlockM : seqlen_q) - 1;
    return col0 + kBlockN > seqlen_k || (kRightBound && col0 + kBlockN > row0 + hi_off) ||
           (kWindow && col0 < last_row + lo_off);
  }

  // The blocks a loop over one block's partners leaves unmasked, [lo, hi): needs_masking is false
  // exactly there (tests/test_mask.cpp). Computed once per tile, so that the loop tests its block
  // index against two bounds instead of the mask's four fields and the tile's row. NOTES: the
  // per-block needs_masking kept seqlen_q, seqlen_k, lo_off, hi_off and row0 live through the
  // general kernels' main loops, where ptxas spilled (docs/perf-log.md V5).
  // kHasLo: the range has a lower bound (else lo is ignored: every index is >= 0).
  template <bool kHasLo>
  struct Unmasked {
    int lo, hi;
    FLASH3_HD bool masks(int block) const { return (kHasLo && block < lo) || block >= hi; }
  };
  // Key blocks of the query block whose first row is row0 (the forward's loop).
  template <int kBlockM, int kBlockN>
  FLASH3_HD Unmasked<kWindow> unmasked_n_blocks(int row0) const {
    const int last_row = (row0 + kBlockM < seqlen_q ? row0 + kBlockM : seqlen_q) - 1;
    // (n + 1) kBlockN > x  <=>  n >= floor(x / kBlockN);  n kBlockN < y  <=>  n < ceil(y / kBlockN).
    int hi = floor_div(seqlen_k, kBlockN);
    if (kRightBound) hi = min_int(hi, floor_div(row0 + hi_off, kBlockN));
    const int lo = kWindow ? -floor_div(-(last_row + lo_off), kBlockN) : 0;
    return Unmasked<kWindow>{lo, hi};
  }
  // Query blocks of the key block whose first key is col0 (the backward's loop).
  template <int kBlockM, int kBlockN>
  FLASH3_HD Unmasked<kRightBound> unmasked_m_blocks(int col0) const {
    constexpr int kNone = 1 << 30;  // past any block index
    if (col0 + kBlockN > seqlen_k) return Unmasked<kRightBound>{kNone, -kNone};
    // Right of the window: col0 + kBlockN > m kBlockM + hi_off for m < ceil((col0 + kBlockN - hi_off) / kBlockM).
    const int lo = kRightBound ? -floor_div(-(col0 + kBlockN - hi_off), kBlockM) : 0;
    // Left of it: col0 - lo_off < min(m kBlockM + kBlockM, seqlen_q) - 1, for every m past
    // floor((w - kBlockM + 1) / kBlockM) while w < seqlen_q - 1.
    int hi = kNone;
    if (kWindow) {
      const int w = col0 - lo_off;
      if (w < seqlen_q - 1) hi = floor_div(w - kBlockM + 1, kBlockM) + 1;
    }
    return Unmasked<kRightBound>{lo, hi};
  }
  FLASH3_HD static int floor_div(int x, int d) { return x >= 0 ? x / d : -((-x + d - 1) / d); }
  FLASH3_HD static int min_int(int a, int b) { return a < b ? a : b; }

#if defined(__CUDACC__)
  // S in (row, col) view with its coordinates inside the tile (tScS, same view); row0 / col0:
  // the tile's first query row / key column. Invisible scores become -inf.
  template <class TensorS, class TensorC>
  __device__ __forceinline__ void apply(TensorS& s, TensorC const& coord, int row0, int col0) const {
#pragma unroll
    for (int m = 0; m < cute::size<0>(s); ++m) {
      // Visible in-tile columns: [lo, hi).
      const int row = row0 + cute::get<0>(coord(m, 0));
      const int hi = key_end(row) - col0;
      if constexpr (kWindow) {
        // One unsigned test per score: col - lo < hi - lo. NOTES: two tests per score made ptxas
        // spill 132 bytes in the head dim 128 window kernel.
        const int lo = row + lo_off - col0;
        const unsigned width = hi > lo ? unsigned(hi - lo) : 0u;
#pragma unroll
        for (int n = 0; n < cute::size<1>(s); ++n) {
          if (unsigned(cute::get<1>(coord(m, n)) - lo) >= width) s(m, n) = -INFINITY;
        }
      } else {
#pragma unroll
        for (int n = 0; n < cute::size<1>(s); ++n) {
          if (cute::get<1>(coord(m, n)) >= hi) s(m, n) = -INFINITY;
        }
      }
    }
  }

  // S^T in (key, query) view with its coordinates (tile key, tile query); col0 / row0: the tile's
  // first key / first query row. Invisible scores become -inf.
  template <class TensorS, class TensorC>
  __device__ __forceinline__ void apply_transposed(TensorS& st, TensorC const& coord, int row0, int col0) const {
#pragma unroll
    for (int j = 0; j < cute::size<1>(st); ++j) {
      // Keys visible to query column j: [lo, hi) relative to col0 (one test per score, as apply's).
      const int row = row0 + cute::get<1>(coord(0, j));
      const int hi = key_end(row) - col0;
      const int lo = kWindow ? row + lo_off - col0 : 0;
      const unsigned width = hi > lo ? unsigned(hi - lo) : 0u;
#pragma unroll
      for (int r = 0; r < cute::size<0>(st); ++r) {
        const int key = cute::get<0>(coord(r, 0));
        if (kWindow ? unsigned(key - lo) >= width : key >= hi) st(r, j) = -INFINITY;
      }
    }
  }
#endif
};

}  // namespace flash3::detail

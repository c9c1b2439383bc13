// flash3: the non-causal forward's last, partial wave of tiles cut along the keys and dealt out
// over all SMs (stream-K on the tail only), in plain C++ (no CuTe) so that the CPU tests can
// check it; the launcher and the tail kernel use these functions.
//
// NOTES: non-causal tiles all take the same time, and most shapes have a tile count that is no
// multiple of the SM count (hdim 128 at 16k tokens x hidden 2048: 2048 tiles on 132 SMs = 15
// full waves and 68 tiles, so 64 SMs idle for the last tile-time; ncu: SMs active 94.6% of the
// hdim 128 4k kernel's cycles). The main kernel computes the full waves' tiles [0, full_tiles)
// whole and stays as it is; a second kernel (FwdTailPieces, launched right behind it) takes the
// R = num_tiles mod G tail tiles: their R x nb key-block iterations are dealt out evenly, SM b
// taking the contiguous range [begin(b), begin(b + 1)) of them, so the tail takes R / G of a
// tile-time instead of one. A block's range is shorter than a tile (R < G), so it holds at
// most two pieces. Each piece of a cut tile writes its normalized O and log-sum-exp (FP32) to a
// slot; the last piece of the tile to finish combines all its pieces' slots in piece order
// (so the result does not depend on which piece finished last) and writes the tile out.
// A problem with fewer tiles than SMs is all tail: it runs split over the keys on every SM.
#pragma once

#include "common/host_device.h"

namespace flash3 {

// Split only where it saves at least this many key-block iterations on the critical path: a
// piece costs about 1.6 iterations more than the same keys inside a whole tile (the tile's lone
// first S GEMM and softmax, its epilogue; docs/perf-log.md step 17), a cut tile up to two pieces
// per block plus the combine. Measured (every tail split
// whose blocks took >= 2 key blocks): -0.5% at a saving of 5 iterations (hdim 128 2k), +1.2% at
// 13 (hdim 128 4k), +2% at 22 (8k); with this kernel (step 26): +0.7% at 11 (hdim
// 128 4k, the one sweep point with a saving in [8, 12)), so the bar is 10.
constexpr int kTailSplitMinSaved = 10;

struct TailSplit {
  int full_tiles = 0;  // tiles [0, full_tiles): whole, in the main kernel
  int tail_tiles = 0;  // R: tiles [full_tiles, full_tiles + R) in pieces (0: no split)
  int n_blocks = 1;    // nb: key blocks per tile
  int grid = 1;        // G: blocks of the tail kernel (one per SM, fewer if work() is less)

  // 32-bit math (make_tail_split splits only where grid x work fits in 31 bits): a 64-bit
  // division is a long subroutine in the 24-register producer.
  FLASH3_HD int work() const { return tail_tiles * n_blocks; }
  // First tail iteration of block b (b = grid: the end).
  FLASH3_HD int begin(int b) const { return int(unsigned(b) * unsigned(work()) / unsigned(grid)); }
  // The block whose range holds tail iteration x.
  FLASH3_HD int owner(int x) const { return int((unsigned(x + 1) * unsigned(grid) - 1u) / unsigned(work())); }
};

// The split of num_tiles equal tiles of n_blocks key blocks over `sms` SMs, or none (tail_tiles
// = 0, full_tiles = num_tiles).
inline TailSplit make_tail_split(int num_tiles, int n_blocks, int sms, int min_saved = kTailSplitMinSaved) {
  TailSplit s;
  s.n_blocks = n_blocks < 1 ? 1 : n_blocks;
  s.grid = sms < 1 ? 1 : sms;
  s.full_tiles = num_tiles < 0 ? 0 : num_tiles;
  const int r = s.full_tiles % s.grid;
  const long long w = (long long)r * s.n_blocks;
  const long long share = (w + s.grid - 1) / s.grid;  // the longest block's iterations
  if (r > 0 && s.n_blocks - share >= min_saved && (w + 1) * s.grid < (1ll << 31)) {
    s.full_tiles -= r;
    s.tail_tiles = r;
    // Fewer iterations than SMs: one per block, so that every block of the tail kernel holds a
    // piece (the combine counts on blocks first..last of a tile all holding one).
    if (w < s.grid) s.grid = int(w);
  }
  return s;
}

// One piece of work of a tail block: key blocks [n_lo, n_hi) of tile `tile` (absolute index; the
// kernel visits n_hi - 1 down to n_lo). part >= 0: the tile is cut, and this piece's slot is
// 2 x block + part; part = -1: the piece is the whole tile.
struct TailPiece {
  int tile, n_lo, n_hi, part;
};

// How many pieces tail block b computes (0, 1 or 2).
FLASH3_HD int tail_piece_count(const TailSplit& s, int b) {
  if (s.tail_tiles == 0) return 0;
  const int x0 = s.begin(b), x1 = s.begin(b + 1);
  return x1 > x0 ? (x1 - 1) / s.n_blocks - x0 / s.n_blocks + 1 : 0;
}

// Piece k < tail_piece_count(s, b) of tail block b.
FLASH3_HD TailPiece tail_piece(const TailSplit& s, int b, int k) {
  const int x0 = s.begin(b), x1 = s.begin(b + 1);
  const int i = x0 / s.n_blocks + k;  // tail tile index
  const int lo = (x0 > i * s.n_blocks ? x0 : i * s.n_blocks) - i * s.n_blocks;
  const int hi = (x1 < (i + 1) * s.n_blocks ? x1 : (i + 1) * s.n_blocks) - i * s.n_blocks;
  const bool whole_tile = lo == 0 && hi == s.n_blocks;
  // Iterations count from the tile's first key block in the kernel's order (n_blocks - 1 down).
  return TailPiece{s.full_tiles + i, s.n_blocks - hi, s.n_blocks - lo, whole_tile ? -1 : k};
}

// The blocks holding pieces of tail tile i: [first, last]; the slot of block p's piece of it.
FLASH3_HD int tail_first_block(const TailSplit& s, int i) { return s.owner(i * s.n_blocks); }
FLASH3_HD int tail_last_block(const TailSplit& s, int i) { return s.owner((i + 1) * s.n_blocks - 1); }
FLASH3_HD int tail_slot(const TailSplit& s, int i, int p) {
  // The tile is p's second piece when p's range starts inside an earlier tile.
  return 2 * p + (s.begin(p) < i * s.n_blocks ? 1 : 0);
}

}  // namespace flash3

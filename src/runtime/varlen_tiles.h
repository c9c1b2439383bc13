// flash3: the list of tiles of a variable-length batch, built on the device before the forward
// or backward kernel (whose host side cannot read the lengths without a synchronization).
//
// A tile is `block` rows of one sequence's rows side (the queries: forward; the keys: backward)
// of one head. The list holds every sequence's tiles, longest sequence first (by the length of
// the other side, which sets a tile's work; sequences of equal length in batch order; batches
// above kVarlenSortMax in batch order), so that a persistent kernel drawing from it in order
// ends with the shortest tiles (longest-processing-time first). Within a sequence:
//   longest_first  blocks in the order of their work (reverse: the last query block first for
//                  the causal forward; forward: the first key block first for the causal
//                  backward), each over all heads;
//   otherwise      head by head, blocks in order (the tiles running together share K and V).
// Entry t = (block, head, batch, 0); count = the number of tiles (at most capacity).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "common/seqlen.h"

namespace flash3::detail {

constexpr int kVarlenSortMax = 2048;

struct VarlenTilesArgs {
  SeqLens seqlens;
  int batch = 0, nheads = 0;
  int block = 0;              // rows per tile
  bool by_keys = false;       // tiles of the keys (backward) instead of the queries
  bool longest_first = false; // causal: see above
  bool reverse_blocks = false;
  int4* tiles = nullptr;      // capacity entries
  int* count = nullptr;
  int* scratch = nullptr;     // 2 x batch + 1 ints
  int capacity = 0;
};

// An upper bound on the tiles: nheads x (ceil(total / block) + batch).
inline long long varlen_tile_capacity(long long total, int batch, int nheads, int block) {
  return (long long)nheads * ((total + block - 1) / block + batch);
}
// The bytes of the list for `capacity` tiles: the entries, the count and the scratch, each
// 16-byte aligned.
inline size_t varlen_tiles_bytes(long long capacity, int batch) {
  return (size_t(capacity) * 16 + 16 + (size_t(2 * batch + 1) * 4 + 15) / 16 * 16);
}
// The list of the forward (by_keys false: query blocks; causal: the last one, which sees the
// most keys, first) or of the backward (key blocks; causal: the first one first), `capacity`
// entries (varlen_tile_capacity), placed later (varlen_tiles_place).
inline VarlenTilesArgs varlen_tiles_args(const SeqLens& seqlens, int batch, int nheads, int block, bool by_keys,
                                         bool causal, long long capacity) {
  VarlenTilesArgs a;
  a.seqlens = seqlens;
  a.batch = batch;
  a.nheads = nheads;
  a.block = block;
  a.by_keys = by_keys;
  a.longest_first = causal;
  a.reverse_blocks = !by_keys;
  a.capacity = int(capacity);
  return a;
}

// Points a.tiles, a.count and a.scratch into `memory` (varlen_tiles_bytes of it).
inline void varlen_tiles_place(VarlenTilesArgs& a, char* memory) {
  a.tiles = reinterpret_cast<int4*>(memory);
  a.count = reinterpret_cast<int*>(memory + size_t(a.capacity) * 16);
  a.scratch = a.count + 4;
}

// Builds the list on `stream` (one block).
void build_varlen_tiles(const VarlenTilesArgs& args, cudaStream_t stream);

}  // namespace flash3::detail

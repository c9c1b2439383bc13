// flash3: the list of tiles of a variable-length batch, built on the device before the forward
// or backward kernel (whose host side cannot read the lengths without a synchronization).
//
// A tile is `block` rows of one sequence's rows side (the queries: forward; the keys: backward)
// of one head. The list holds every sequence's tiles, longest sequence first (by the length of
// the other side, which sets a tile's work; sequences of equal length in batch order; batches
// above kVarlenSortMax in batch order), so that a persistent kernel drawing from it in order
// ends with the shortest tiles (longest-processing-time first). Within a sequence:
//   longest_first  in sections of heads (varlen_section_entry), blocks in the order of their
//                  work (reverse: the last query block first for the causal forward; the first
//                  key block first for the causal backward), each over the section's heads;
//   otherwise      head by head, blocks in order (the tiles running together share K and V).
// Entry t = (block, head, batch, 0); count = the number of tiles (at most capacity).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>

#include "common/host_device.h"
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
  // longest_first: a section's head groups (head_group heads each) stream at most section_rows
  // rows of the other side per group (0: one section).
  long long section_rows = 0;
  int head_group = 1;
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
// Causal lists: entry i of a sequence's blocks x nheads entries as (block in the order of work,
// head). The heads go in sections of whole groups of head_group heads, fit_groups groups each at
// most (the groups whose streamed side fits the L2 budget; at least one), the sections as even
// as they go; a section's entries are its blocks in order, each over the section's heads. As in
// the fixed-length causal orders (block_order.h): all heads at once would stream every K and V
// (forward) or Q and dO (backward) of a long sequence from DRAM.
FLASH3_HD void varlen_section_entry(int i, int blocks, int nheads, int head_group, int fit_groups, int& block,
                                    int& head) {
  const int groups = nheads / head_group;
  const int per = fit_groups < 1 ? 1 : fit_groups > groups ? groups : fit_groups;
  const int sections = (groups + per - 1) / per;
  const int base = groups / sections, big = groups % sections;  // the first `big` hold base + 1 groups
  const int big_items = blocks * head_group * (base + 1);
  int j, size;
  if (i < big * big_items) {
    const int k = i / big_items;
    j = i - k * big_items;
    size = (base + 1) * head_group;
    head = k * size;
  } else {
    const int small_items = blocks * head_group * base;
    const int k = (i - big * big_items) / small_items;
    j = i - big * big_items - k * small_items;
    size = base * head_group;
    head = big * (base + 1) * head_group + k * size;
  }
  block = j / size;
  head += j % size;
}

// The list of the forward (by_keys false: query blocks; causal: the last one, which sees the
// most keys, first) or of the backward (key blocks; causal: the first one first), `capacity`
// entries (varlen_tile_capacity), placed later (varlen_tiles_place). Causal: sections of
// head_group heads whose streamed side fits section_rows rows per group (varlen_section_entry).
inline VarlenTilesArgs varlen_tiles_args(const SeqLens& seqlens, int batch, int nheads, int block, bool by_keys,
                                         bool causal, long long capacity, long long section_rows = 0,
                                         int head_group = 1) {
  VarlenTilesArgs a;
  a.seqlens = seqlens;
  a.batch = batch;
  a.nheads = nheads;
  a.block = block;
  a.by_keys = by_keys;
  a.longest_first = causal;
  a.reverse_blocks = !by_keys;
  a.section_rows = section_rows;
  a.head_group = head_group;
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

// flash3: the device side of varlen_tiles.h, one block of kThreads threads:
//   1. each sequence's tile count and sort key (the other side's length);
//   2. its position in the order (a rank count for up to kVarlenSortMax sequences);
//   3. the exclusive prefix sum of the tile counts in that order (CUB's block scan, by chunks);
//   4. each tile's entry, found from its index by a binary search of the prefix sums.
// Up to kVarlenSortMax sequences, the lengths, the order and the prefix sums live in shared
// memory (the binary search is a chain of dependent loads); beyond, in the scratch.
#include <cub/block/block_scan.cuh>

#include "runtime/runtime.h"
#include "runtime/varlen_tiles.h"

namespace flash3::detail {

namespace {

constexpr int kThreads = 1024;

__global__ void __launch_bounds__(kThreads) varlen_tiles_kernel(VarlenTilesArgs a) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;
  __shared__ int carry;
  __shared__ int s_rows[kVarlenSortMax], s_key[kVarlenSortMax], s_order[kVarlenSortMax], s_start[kVarlenSortMax + 1];
  const bool sort = a.batch <= kVarlenSortMax;
  int* order = sort ? s_order : a.scratch;            // order[pos] = the sequence at position pos
  int* start = sort ? s_start : a.scratch + a.batch;  // start[pos] = its first tile; start[batch] = the count
  auto rows_of = [&](int b) {
    const SeqLen len = a.seqlens.of<true>(b);
    return a.by_keys ? len.k : len.q;
  };
  auto rows = [&](int b) { return sort ? s_rows[b] : rows_of(b); };
  auto other = [&](int b) {
    if (sort) return s_key[b];
    const SeqLen len = a.seqlens.of<true>(b);
    return a.by_keys ? len.q : len.k;
  };
  auto tiles_of = [&](int b) { return (rows(b) + a.block - 1) / a.block * a.nheads; };
  if (sort) {
    for (int b = threadIdx.x; b < a.batch; b += kThreads) {
      const SeqLen len = a.seqlens.of<true>(b);
      s_rows[b] = a.by_keys ? len.k : len.q;
      s_key[b] = a.by_keys ? len.q : len.k;
    }
    __syncthreads();
  }
  // 1-2: the order.
  for (int b = threadIdx.x; b < a.batch; b += kThreads) {
    int pos = b;
    if (sort) {
      const int kb = s_key[b];
      pos = 0;
      for (int o = 0; o < a.batch; ++o) {
        const int ko = s_key[o];
        pos += ko > kb || (ko == kb && o < b);
      }
    }
    order[pos] = b;
  }
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  // 3: the prefix sums.
  for (int base = 0; base < a.batch; base += kThreads) {
    const int pos = base + threadIdx.x;
    const int n = pos < a.batch ? tiles_of(order[pos]) : 0;
    int before, chunk;
    Scan(scan_storage).ExclusiveSum(n, before, chunk);
    if (pos < a.batch) start[pos] = carry + before;
    __syncthreads();
    if (threadIdx.x == 0) carry += chunk;
    __syncthreads();
  }
  const int total = carry < a.capacity ? carry : a.capacity;
  if (threadIdx.x == 0) {
    start[a.batch] = carry;
    *a.count = total;
  }
  __syncthreads();
  // 4: the entries.
  for (int t = threadIdx.x; t < total; t += kThreads) {
    int lo = 0, hi = a.batch - 1;  // the last position whose start is <= t
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (start[mid] <= t) lo = mid; else hi = mid - 1;
    }
    const int b = order[lo];
    const int i = t - start[lo];
    const int blocks = (rows(b) + a.block - 1) / a.block;
    int block, head;
    if (a.longest_first) {
      const int len = other(b);
      const long long fit = a.section_rows > 0 && len > 0 ? a.section_rows / len : a.nheads;
      varlen_section_entry(i, blocks, a.nheads, a.head_group, int(fit < a.nheads ? fit : a.nheads), block, head);
      if (a.reverse_blocks) block = blocks - 1 - block;
    } else {
      head = i / blocks;
      block = i % blocks;
    }
    a.tiles[t] = make_int4(block, head, b, 0);
  }
}

}  // namespace

void build_varlen_tiles(const VarlenTilesArgs& args, cudaStream_t stream) {
  varlen_tiles_kernel<<<1, kThreads, 0, stream>>>(args);
  check_cuda(cudaGetLastError(), "variable-length tile list launch");
}

}  // namespace flash3::detail

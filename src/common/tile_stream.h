// flash3: the sequence of work items (tiles) one block of a persistent kernel computes, static
// or drawn from a global counter; the forward's causal tiles and the backward's items use it.
#pragma once

#include <cstdint>

namespace flash3::detail {

// The sequence of tiles one block computes. Static: blockIdx.x, + gridDim.x, + 2 gridDim.x, ...
// Dynamic (params.tile_counter set; causal, where tiles differ in length): the first tile is
// blockIdx.x, each next one is drawn from a global counter by a scheduler thread (warp 1 of the
// producer warpgroup) when the producer has issued the last load of the previous tile (the
// consumers are then about two key blocks from its end), and handed to the producer and the
// consumers through a two-slot ring in shared memory; a block that
// draws past the last tile stops, and the last block to stop sets the counters back to zero
// for the next launch on the stream. NOTES: drawing earlier defeats the balance: a scheduler
// thread that kept the ring full drew each tile three tiles ahead of its use, and measured
// slower than the static round-robin (docs/perf-log.md, step 10).
// kDynamic is a compile-time choice (causal kernels), so that the static kernels carry none of
// it; a dynamic kernel launched without counters (see tile_counter) hands out the static order
// through the same ring.
template <bool kDynamic>
struct TileStream {
  int* counter;  // [0]: tiles handed out beyond the first gridDim.x, [1]: blocks that stopped
  int num_tiles;


  // The scheduler thread: this block's k-th tile, drawn when the producer is about to load it,
  // so that it goes to the block that will be free first (>= num_tiles at the end; call no more
  // then).
  // A block whose first tile is already past the end (a grid sized by a bound on the tile
  // count: variable lengths) stops at once, and counts as stopped.
  __device__ __forceinline__ int draw(int k) const {
    if (counter == nullptr || (k == 0 && int(blockIdx.x) < num_tiles)) return int(blockIdx.x + k * gridDim.x);
    const int n = k == 0 ? int(blockIdx.x) : atomicAdd(counter, 1) + int(gridDim.x);
    if (n >= num_tiles && atomicAdd(counter + 1, 1) == int(gridDim.x) - 1) {
      // Every block has drawn its last (failed) tile: nothing touches the counters any more.
      counter[0] = 0;
      counter[1] = 0;
    }
    return n;
  }

  // The producer and the consumers: this block's k-th tile (from the ring when dynamic).
  template <class Shared>
  __device__ __forceinline__ int tile(int k, Shared& shared) const {
    if constexpr (kDynamic) return receive(k, shared.tile_ring, shared.tile_full, shared.tile_empty);
    return int(blockIdx.x + k * gridDim.x);
  }

  // The k-th tile of this block through the ring (dynamic only).
  template <class Barrier>
  __device__ __forceinline__ void publish(int k, int t, int* ring, Barrier* full, Barrier* empty) const {
    const int slot = k & 1;
    if (k >= 2) empty[slot].wait(((k >> 1) - 1) & 1);
    // NOTES: CUTLASS's mbarrier wrappers carry no "memory" clobber: the volatile accesses and
    // the empty asm statements keep the ring access between the wait and the arrive.
    asm volatile("" ::: "memory");
    *reinterpret_cast<volatile int*>(ring + slot) = t;
    asm volatile("" ::: "memory");
    full[slot].arrive();
  }
  template <class Barrier>
  __device__ __forceinline__ int receive(int k, const int* ring, Barrier* full, Barrier* empty) const {
    const int slot = k & 1;
    full[slot].wait((k >> 1) & 1);
    asm volatile("" ::: "memory");
    const int t = *reinterpret_cast<const volatile int*>(ring + slot);
    asm volatile("" ::: "memory");
    empty[slot].arrive();
    return t;
  }
};

}  // namespace flash3::detail

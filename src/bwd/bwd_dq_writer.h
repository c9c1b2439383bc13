// flash3: dQ out of the backward's main kernel (Algorithm 3, line 14 of the FlashAttention-3
// paper: dQ_i += dS_i K_j, atomically): the consumers hand each visit's FP32 dQ_i tile to one of
// kDQStages shared-memory buffers (bwd_store_dq), and two dQ writer warps (warps 1, 2) add it
// into the global accumulator with one bulk reduce-add each (TMA), so that the consumers never
// wait on that traffic. The accumulator's tiles are in the register order of the dQ GEMM
// (bwd_postprocess_dq undoes it).
#pragma once

#include <cstdint>

#include "bwd/bwd_scheduler.h"
#include "bwd/bwd_traits.h"
#include "common/ptx.h"

namespace flash3::detail {

// The thread of the dQ GEMM (TiledMmadQ) that consumer (or postprocess) thread `thread` stands
// for: all 256 split the GEMM, or, with kDQAlternate, each warpgroup's 128 hold a whole one.
template <class Traits>
__device__ __forceinline__ int bwd_dq_frag_thread(int thread) {
  return Traits::kDQAlternate ? thread % 128 : thread;
}

// The consumer warpgroup (0 or 1) whose dQ "empty" barriers (kDQEmptyPerWG) this thread waits on.
// The causal default kernels read %tid.x afresh at each wait (volatile: not hoisted out of the
// loop): held in a register across the loop, the index cost them a spill in the hot loop and 1-4%
// (docs/perf-log.md B111). The causal general kernels take CUTLASS's warp-uniform warpgroup index
// (the %tid.x read spilled more there, B113); tidx / 128 spills nothing in the non-causal kernels.
template <class Traits>
__device__ __forceinline__ int bwd_dq_empty_wg(int tidx) {
  if constexpr (!Traits::kDQEmptyPerWG) {
    return 0;
  } else if constexpr (Traits::kCausal && Traits::kGeneral) {
    return cutlass::canonical_warp_group_idx() - 1;  // the producer warpgroup is 0
  } else if constexpr (Traits::kCausal) {
    uint32_t tid;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
    return int(tid / 128) - 1;  // the producer warpgroup is 0
  } else {
    return tidx / 128;
  }
}

// dQ of the i-th visited query block to shared memory for the dQ writer, in register order:
// values 4q .. 4q + 3 of the dQ GEMM's thread t at float4 index q * kDQFragThreads + t (256
// threads, or the 128 of one warpgroup with kDQAlternate; 16-byte stores, conflict-free;
// bwd_postprocess_dq undoes the order).
template <class Traits, class AccQ>
__device__ __forceinline__ void bwd_store_dq(typename Traits::SharedStorage& shared, AccQ const& tdQrdQ, int i,
                                             int tidx) {
  const int buf = i % Traits::kDQStages;
  if (i >= Traits::kDQStages) {
    const int wg = bwd_dq_empty_wg<Traits>(tidx);
    named_barrier_sync(Traits::kDQEmptyThreads, kBwdBarDQEmpty + wg * Traits::kDQStages + buf);
  }
  float4* dq_tile = reinterpret_cast<float4*>(shared.smem_dq + buf * Traits::kDQElems);
  static_assert(decltype(size(tdQrdQ))::value % 4 == 0);
  CUTLASS_PRAGMA_UNROLL
  for (int q = 0; q < size(tdQrdQ) / 4; ++q) {
    dq_tile[q * Traits::kDQFragThreads + bwd_dq_frag_thread<Traits>(tidx)] =
        make_float4(tdQrdQ(4 * q), tdQrdQ(4 * q + 1), tdQrdQ(4 * q + 2), tdQrdQ(4 * q + 3));
  }
  cutlass::arch::fence_view_async_shared();  // st.shared -> bulk reduce (async proxy)
  named_barrier_arrive(Traits::kDQBarThreads, kBwdBarDQFull + i % Traits::kDQFullBars);
}

// One more on `counter` once this thread's bulk adds (async proxy) are complete, released at gpu
// scope for whoever acquires the counter (ld_acquire_gpu).
// NOTES: the proxy fence orders the completed bulk adds (async proxy) before this thread's
// generic-proxy release; the release itself is the gpu-scope fence. (A __threadfence() before
// it, a second full fence per add, lengthened every link of the chain of key blocks adding into
// one tile: deterministic mode 3-11% slower, docs/perf-log.md B20.)
__device__ __forceinline__ void bwd_count_bulk_done(int* counter) {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");  // the adds are done
  asm volatile("fence.proxy.async.global;" ::: "memory");
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(counter) : "memory");
}

// The dQ writer warp `writer` (0 or 1) for one block of work: key block n_block of the (head,
// batch) pair bh, whose i-th visit (i = writer, writer + kDQWriters, ...) is query block m_at(i).
// NOTES: two writer warps (warp 1 + w takes the tiles i with i % 2 = w, in buffer i % kDQStages),
// because a bulk reduce's completion can only be waited for by the thread that issued it,
// blocking: in the deterministic mode each add must be complete before the next key block may
// add into the same tile, and with one writer the consumers waited for every completion in turn
// (deterministic 0.60-0.70x of the default at head dim 64; at head dim 256, one buffer,
// 0.70-0.83x with one writer, 0.75-0.97x with two, B24). The buffer is handed back to the
// consumers as soon as it has been read.
// Visits g_begin.. g_end - 1 (static: 0.. m_count - 1; persistent: counted on across the
// block's items, kContinued: then every buffer is handed back, since a later item's visit may wait
// for it).
template <class Traits, bool kContinued = false, class MAt>
__device__ __forceinline__ void bwd_dq_writer(typename Traits::Params const& params,
                                              typename Traits::SharedStorage& shared, int writer, int lane,
                                              int64_t bh, int n_block, int g_begin, int g_end, MAt const& m_at) {
  // Deterministic mode: this key block adds into copy `group` of each tile, as the
  // `turn`-th (bwd_config.h, bwd_dq_groups); copies are [tile][group], groups = 1 otherwise.
  const int groups = params.dq_groups, group = n_block % groups, turn = n_block / groups;
  // The pair's first dQ tile (variable lengths: its sequence's slot, bwd_ws_row).
  int64_t tile0 = bh * params.m_blocks;
  if constexpr (Traits::kGeneral) {
    tile0 = bwd_row0<Traits, true>(params, int(bh / params.nheads), int(bh % params.nheads), bh) / Traits::kBlockM;
  }
  float* dq_accum = params.dq_accum + (tile0 * groups + group) * Traits::kDQElems;
  int* sem = params.dq_sem != nullptr ? params.dq_sem + tile0 * groups + group : nullptr;
  // A window with a left bound skips the first key blocks of a query block: the first one that
  // query block m visits is first_reaching(m x kBlockM + lo_off) (Mask::n_block_range; never past
  // this key block, which visits m). Without a left bound it is block 0. NOTES: lo_off once per
  // item, not the pair's Mask per visit: that cost these 24-register warps about 400
  // instructions and two global loads per visit (ncu source counters, docs/perf-log.md V4).
  int lo_off = 0;
  bool left_bound = false;
  if constexpr (Traits::kGeneral) {
    left_bound = params.mask.left >= 0;
    if (left_bound) {
      lo_off = Traits::MaskT::template at<true>(params.seqlens.template of<true>(int(bh / params.nheads)),
                                                params.mask).lo_off;
    }
  }
  const int first = g_begin + ((writer - g_begin) % Traits::kDQWriters + Traits::kDQWriters) % Traits::kDQWriters;
  for (int i = first; i < g_end; i += Traits::kDQWriters) {
    const int m = m_at(i), buf = i % Traits::kDQStages;
    // The turn of the group's first key block to visit tile m (0 unless a window skips the
    // first key blocks): it stores, and the others count their turns from it.
    // (Only where the adds are counted (sem); one group's turn is the key block itself.)
    int turn0 = 0;
    if (Traits::kGeneral && left_bound && sem != nullptr) {
      const int n_first = Traits::MaskT::template first_reaching<Traits::kBlockN>(m * Traits::kBlockM + lo_off);
      turn0 = groups == 1 ? n_first : (n_first + ((group - n_first % groups) % groups + groups) % groups) / groups;
    }
    named_barrier_sync(Traits::kDQBarThreads, kBwdBarDQFull + i % Traits::kDQFullBars);
    if (lane == 0) {
      float* dst = dq_accum + int64_t(m) * groups * Traits::kDQElems;
      const float* src = shared.smem_dq + buf * Traits::kDQElems;
      if (sem != nullptr && turn > turn0) {
        // Turn turn0 stores (the tiles are not cleared, bwd_config.h). Deterministic: the key
        // blocks of a group add into query tile m's copy in the order of their turns turn0,
        // turn0 + 1, ...; default: in any order once turn0 has stored the tile.
        // NOTES: a short sleep between polls, so that the polling of the writers waiting on
        // a tile does not compete in L2 with the adds they wait for.
        for (;;) {
          const int seen = ld_acquire_gpu(sem + m * groups);
          if (params.dq_ordered ? seen == turn - turn0 : seen > 0) break;
          __nanosleep(128);
        }
        // The acquired store (or adds) before this thread's bulk add (async proxy).
        asm volatile("fence.proxy.async.global;" ::: "memory");
      }
      if (sem != nullptr && turn == turn0) {
        bulk_store_f32(dst, src, Traits::kDQElems * sizeof(float));
      } else {
        bulk_reduce_add_f32(dst, src, Traits::kDQElems * sizeof(float));
      }
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // smem read
    }
    __syncwarp();
    if (kContinued || i + Traits::kDQStages < g_end) {
      named_barrier_arrive(Traits::kDQEmptyThreads, kBwdBarDQEmpty + buf);
      if constexpr (Traits::kDQEmptyPerWG)
        named_barrier_arrive(Traits::kDQEmptyThreads, kBwdBarDQEmpty + Traits::kDQStages + buf);
    }
    if (sem != nullptr && lane == 0 && (params.dq_ordered || turn == turn0)) bwd_count_bulk_done(sem + m * groups);
    __syncwarp();
  }
  // This writer is done with the pair's dQ for this key block: once its adds are complete, one
  // more on the pair's count, which the postprocess waits for (bwd_postprocess_dq), as above.
  if (params.dq_done != nullptr && lane == 0) bwd_count_bulk_done(params.dq_done + bh);
}

// A dQ writer warp's whole work: every item of this thread block (BwdScheduler; static: `it`),
// after the preprocess's clear of the accumulator, or of its counters.
template <class Traits>
__device__ __forceinline__ void bwd_dq_write(typename Traits::Params const& params,
                                             typename Traits::SharedStorage& shared, int writer, int lane,
                                             BwdItem const& it) {
  using Sched = BwdScheduler<Traits>;
  pdl_wait();
  if constexpr (!Traits::kPersistent) {
    bwd_dq_writer<Traits>(params, shared, writer, lane, it.bh, it.n_block, 0, it.m_count,
                          [&](int i) { return Sched::at(it, i); });
  } else {
    // The visits counted on across the items.
    const TileStream<true> items = Sched::stream(params);
    int g = 0;  // this block's visits so far
    for (int k = 0;; ++k) {
      const int t = items.tile(k, shared);
      if (t >= items.num_tiles) break;
      const BwdItem item = Sched::item(params, t);
      bwd_dq_writer<Traits, true>(params, shared, writer, lane, item.bh, item.n_block, g, g + item.m_count,
                                  [base = item.m_base + g](int i) { return bwd_m_at(base, i); });
      g += item.m_count;
    }
  }
}

}  // namespace flash3::detail

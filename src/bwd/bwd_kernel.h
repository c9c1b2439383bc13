// flash3: the backward pass, Algorithm 3 of the FlashAttention-3 paper (shared/paper, Appendix
// B.1), as three kernels:
//   bwd_preprocess  D = rowsum(dO * O), lse * log2(e), the dQ accumulator cleared (bwd_preprocess.h);
//   bwd_kernel      per item (kBlockN keys of one (head, batch): BwdScheduler, bwd_scheduler.h),
//                   warp-specialized:
//                     warp 0      producer: K_j, V_j, then Q_i, dO_i, lse_i, D_i by TMA (bwd_load.h);
//                     warps 1, 2  dQ writers: dQ_i += dS K_j into the FP32 accumulator (bwd_dq_writer.h);
//                     warp 3      (persistent) the scheduler thread (bwd_scheduler.h);
//                     WGs 1, 2    consumers: S, dP, P, dS, dV_j, dK_j, dQ_i with WGMMA, dK_j, dV_j in
//                                 registers (bwd_mainloop_swapped.h at head dims 64, 128;
//                                 bwd_mainloop_ss.h at 256), then dK_j, dV_j out (bwd_epilogue.h);
//   bwd_postprocess dQ = scale * accumulator in the input dtype; GQA/MQA dK, dV summed over the
//                   query heads of each kv head (bwd_postprocess.h).
// bwd_launch.h launches them.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "bwd/bwd_dq_writer.h"
#include "bwd/bwd_epilogue.h"
#include "bwd/bwd_load.h"
#include "bwd/bwd_mainloop_ss.h"
#include "bwd/bwd_mainloop_swapped.h"
#include "bwd/bwd_postprocess.h"
#include "bwd/bwd_preprocess.h"
#include "bwd/bwd_scheduler.h"
#include "bwd/bwd_traits.h"
#include "common/mask.h"
#include "common/ptx.h"

namespace flash3::detail {

// Thread 0: the block's barriers (K/V, and the persistent scheduler's) and the TMA descriptors;
// every thread: the Q and dO pipelines' parameters, warpgroup 0 producing.
template <class Traits>
__device__ __forceinline__ typename Traits::Pipeline::Params bwd_init_block(typename Traits::Params const& params,
                                                                            typename Traits::SharedStorage& shared,
                                                                            int warpgroup) {
  using Pipeline = typename Traits::Pipeline;
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Traits::kTmaBytesQ;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kNumConsumerThreads;
  if (threadIdx.x == 0) {
    shared.barrier_kv.init(1);
    if constexpr (Traits::kPersistent) {
      shared.barrier_kv_free.init(Traits::kNumConsumerThreads);
      shared.barrier_v_free.init(Traits::kNumConsumerThreads);
      shared.barrier_k_free[0].init(Traits::kNumConsumerThreads);
      shared.barrier_k_free[1].init(Traits::kNumConsumerThreads);
      BwdScheduler<Traits>::init_barriers(shared);
    }
    cutlass::arch::fence_barrier_init();
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  }
  return pipe_params;
}

// The consumers (warpgroups 1, 2), every item of the block (static: `it`): dK_j, dV_j = 0; wait
// for K_j, V_j; the main loop over the visited query blocks; dK_j, dV_j out.
template <class Traits>
__device__ __forceinline__ void bwd_consume(typename Traits::Params const& params, typename Traits::SharedStorage& shared,
                                            typename Traits::Pipeline& pipeline_q,
                                            typename Traits::Pipeline& pipeline_do, int tidx, BwdItem const& it) {
  using PipelineState = typename Traits::PipelineState;
  using Sched = BwdScheduler<Traits>;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  typename Traits::TiledMmadKV mma_dkv;
  Tensor tdVrdV = partition_fragment_C(mma_dkv, TileKV{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, TileKV{});

  if constexpr (!Traits::kPersistent) {
    const auto mask = Traits::MaskT::template at<Traits::kGeneral>(
        params.seqlens.template of<Traits::kGeneral>(it.batch), params.mask);
    auto m_at = [&](int i) { return Sched::at(it, i); };
    clear(tdVrdV);
    clear(tdKrdK);
    const int col0 = it.n_block * kBlockN;
    shared.barrier_kv.wait(0);
    if constexpr (Traits::kSdPSwapAB) {
      PipelineState read_q, read_do;
      bwd_mainloop_swapped<Traits>(params, shared, pipeline_q, pipeline_do, 0, it.m_count, m_at, mask, col0, tidx,
                                   tdKrdK, tdVrdV, read_q, read_do, shared.smem_k.data(), [] {});
    } else {
      bwd_mainloop_ss<Traits>(params, shared, pipeline_q, pipeline_do, it.m_count, m_at, mask, col0, tidx, tdKrdK,
                              tdVrdV);
    }
    // dK (scaled), dV: straight to the outputs (MHA) or per query head (GQA), staged in the Q and
    // dO buffers, free once both warpgroups' last GEMMs are done.
    static_assert(cosize_v<typename Traits::SmemLayoutQ> >= cosize_v<typename Traits::SmemLayoutK>);
    if constexpr (Traits::kTmaEpilogue) {
      if (params.dkv_tma && bwd_dkdv_tma_fits<Traits>(params, it.n_block, it.batch)) {
        // MHA: by TMA stores; the block's shared memory stays until they have read it.
        bwd_store_dkdv_tma<Traits>(params, tdKrdK, tdVrdV, tidx, it.n_block, it.head_kv, it.batch,
                                   shared.smem_q.data(), shared.smem_do.data());
        if (tidx == 0) tma_store_wait<0>();
        return;
      }
    }
    if constexpr (Traits::kTmaAddKV) {
      if (params.dkv_add_tma) {
        // GQA, default mode: added by TMA from the Q, dO and K, V buffers (all read by now).
        bwd_add_dkdv_tma<Traits>(params, tdKrdK, tdVrdV, tidx,
                                 int(bwd_kv_row0<Traits>(params, it.batch, it.head_kv)) + col0,
                                 reinterpret_cast<float*>(shared.smem_q.data()),
                                 reinterpret_cast<float*>(shared.smem_k.data()));
        if (tidx == 0) tma_store_wait<0>();
        return;
      }
    }
    bwd_store_dkdv<Traits>(params, tdKrdK, tdVrdV, tidx, col0, it.head_kv, it.batch, it.bh, shared.smem_q.data(),
                           shared.smem_do.data());
  } else {
    // Persistent (swapped loop only). The next item's K, V and first Q, dO load while this one
    // finishes (bwd_load.h). With K, V in registers (kEarlyKV, head dim 64) K alternates between
    // two buffers and dK, dV stage in a buffer of their own; otherwise they stage in the dS^T
    // buffers (the Q, dO buffers already hold the next item's tiles). The visits are counted on
    // across the items, so that the dS^T and dQ buffers and their barriers go on in turn: a visit
    // waits only for the one dQ buffer it reuses, not for the writers to finish the previous item.
    // NOTES: docs/perf-log.md B51 measured 1.7-3.2 us before K, V land and 2.1-2.9 us of epilogue
    // per block of the one-block-per-item kernel, 14-17% of a causal block at seqlen 2k.
    static_assert(Traits::kSdPSwapAB && !Traits::kSpreadVisits);
    const TileStream<true> items = Sched::stream(params);
    PipelineState read_q, read_do;
    int g = 0;  // this block's visits so far
    for (int k = 0;; ++k) {
      const int t = items.tile(k, shared);
      if (t >= items.num_tiles) break;
      const BwdItem item = Sched::item(params, t);
      const auto mask = Traits::MaskT::template at<Traits::kGeneral>(
          params.seqlens.template of<Traits::kGeneral>(item.batch), params.mask);
      const int col0 = item.n_block * kBlockN;
      const int base = item.m_base + g;
      auto m_at = [base](int i) { return bwd_m_at(base, i); };
      clear(tdVrdV);
      clear(tdKrdK);
      // The previous item's dK, dV stores have read their staging tiles, where those were the dS^T
      // buffers: not with kEarlyKV, whose MHA epilogue stages in a buffer of its own (kTmaEpilogue
      // at head dim 64) and whose GQA epilogue stages nothing.
      if (!Traits::kEarlyKV && k > 0) {
        if (tidx == 0) tma_store_wait<0>();
        named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);
      }
      shared.barrier_kv.wait(k & 1);
      typename Traits::Element* k_tile = shared.smem_k.data();
      if constexpr (Traits::kEarlyKV) {
        if (k & 1) k_tile = shared.smem_k_alt.data();
      }
      bwd_mainloop_swapped<Traits>(params, shared, pipeline_q, pipeline_do, g, g + item.m_count, m_at, mask, col0,
                                   tidx, tdKrdK, tdVrdV, read_q, read_do, k_tile, [&] {
                                     if constexpr (Traits::kEarlyKV) shared.barrier_v_free.arrive();
                                   });
      g += item.m_count;
      // This thread's GEMMs, the last readers of K (and V), are done.
      if constexpr (Traits::kEarlyKV) {
        shared.barrier_k_free[k & 1].arrive();
      } else {
        shared.barrier_kv_free.arrive();
      }

      // dK (scaled), dV, staged in a buffer of their own (kEarlyKV; the next epilogue waits for
      // the stores' reads) or in the two dS^T buffers (the consumers meet at the next item's
      // start, after the stores have read them, before any stores the next dS^T).
      // The item and the thread index again from opaque copies: otherwise ptxas keeps the item's
      // output pointers and the epilogue's 64 shared-memory addresses, which do not depend on the
      // item, live across the main loop (108 bytes spilled at head dim 128, reloaded in the row loop).
      static_assert(2 * kBlockN * kHeadDim <= int(cosize_v<typename Traits::SmemLayoutdStStore>));
      int t_after, tidx_after;
      asm volatile("mov.b32 %0, %1;" : "=r"(t_after) : "r"(t));
      asm volatile("mov.b32 %0, %1;" : "=r"(tidx_after) : "r"(tidx));
      const BwdItem ie = Sched::item(params, t_after);
      if (params.dkv_tma && bwd_dkdv_tma_fits<Traits>(params, ie.n_block, ie.batch)) {
        typename Traits::Element* stage = shared.smem_pds.data();
        if constexpr (Traits::kEarlyKV) stage = shared.smem_dkv_stage.data();
        bwd_store_dkdv_tma<Traits>(params, tdKrdK, tdVrdV, tidx_after, ie.n_block, ie.head_kv,
                                   ie.batch, stage, stage + cosize_v<typename Traits::SmemLayoutK>);
      } else {
        // (kEarlyKV: in its own buffer, as the TMA epilogue's: the next item's dS^T may be written
        // before every consumer has read its rows out of the dS^T buffers. Variable lengths: an
        // earlier item's TMA stores have read it before bwd_store_dkdv's first barrier.)
        if (params.dkv_tma && tidx_after == 0) tma_store_wait<0>();
        typename Traits::Element* stage = shared.smem_pds.data();
        if constexpr (Traits::kEarlyKV) stage = shared.smem_dkv_stage.data();
        bwd_store_dkdv<Traits>(params, tdKrdK, tdVrdV, tidx_after, ie.n_block * kBlockN, ie.head_kv, ie.batch, ie.bh,
                               stage, stage + kBlockN * kHeadDim);
      }
    }
    if (tidx == 0) tma_store_wait<0>();  // the last stores' reads, before the block's shared memory goes
  }
}

// The main kernel: one block per item (static) or per SM (persistent), as BwdScheduler says.
// Programmatic dependent launch (bwd_launch.h): the producer and the dQ writers wait for the
// preprocess where they first read its output; the consumers read only what the producer loaded
// after its wait, and write dK, dV, which the preprocess does not touch. The producer lets the
// postprocess launch once past its wait (bwd_pdl_wait_then_launch).
template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    bwd_kernel(const __grid_constant__ typename Traits::Params params) {
  using Pipeline = typename Traits::Pipeline;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  // Variable lengths (static kernels): blocks past the end of the item list have nothing to do.
  if constexpr (Traits::kGeneral && !Traits::kPersistent) {
    if (params.varlen_count != nullptr && int(blockIdx.x) >= *params.varlen_count) return;
  }
  // Static: the block's one item, for every role; persistent: each role reads the item stream.
  BwdItem item{};
  if constexpr (!Traits::kPersistent) item = BwdScheduler<Traits>::static_item(params);

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const typename Pipeline::Params pipe_params = bwd_init_block<Traits>(params, shared, warpgroup);
  Pipeline pipeline_q(shared.pipeline_q, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_do(shared.pipeline_do, pipe_params, Shape<_1, _1, _1>{});
  __syncthreads();

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp_in_wg == 0) {
      if (threadIdx.x == 0) bwd_load<Traits>(params, shared, pipeline_q, pipeline_do, item);  // lines 6-8
    } else if (warp_in_wg <= Traits::kDQWriters) {
      bwd_dq_write<Traits>(params, shared, warp_in_wg - 1, lane, item);  // line 14's adds
    } else if constexpr (Traits::kPersistent) {
      if (warp_in_wg == 3 && lane == 0) BwdScheduler<Traits>::run(params, shared);
    }
    return;
  }
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  bwd_consume<Traits>(params, shared, pipeline_q, pipeline_do, threadIdx.x - 128, item);  // lines 9-16
}

}  // namespace flash3::detail

// flash3: the warp-specialized forward kernel, Algorithm 1 of the FlashAttention-3 paper
// (shared/paper, §3.1), as a role dispatch over its parts:
//   warpgroup 0   producer (fwd_load.h): TMA loads of Q_i, K_j, V_j into shared memory;
//                 with the dynamic tile order, one more thread draws tiles (fwd_scheduler.h);
//   warpgroups 1.. consumers, 64 query rows each (fwd_mainloop.h): S = Q K^T, online softmax,
//                 O += P V, with pingpong and the intra-warpgroup overlap (Algorithm 2); the
//                 pieces of cut tiles are combined (fwd_combine.h); O and the log-sum-exp go
//                 out (fwd_epilogue.h).
// The kernel is persistent: each block loops over the pieces of work its scheduler hands it.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "common/mask.h"
#include "common/ptx.h"
#include "fwd/fwd_fp8_transpose.h"
#include "fwd/fwd_traits.h"

namespace flash3::detail {

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    fwd_kernel(const __grid_constant__ typename Traits::Params params) {
  using Load = FwdLoad<Traits>;
  using Mainloop = typename Traits::Mainloop;
  using Epilogue = FwdEpilogue<Traits>;
  using Pipeline = typename Traits::Pipeline;
  using PipelineV = typename Traits::PipelineV;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const bool is_producer_thread = warpgroup == 0 && threadIdx.x % 128 == 0;

  // Line 1: the barriers of the Q buffer and of the scheduler's ring, and the K and V pipelines
  // over their shared-memory rings.
  if (threadIdx.x == 0) {
    Load::init(shared, params.load);
    FwdScheduler<Traits>::init_barriers(shared.scheduler, Traits::kNumConsumerThreads);
    cutlass::arch::fence_barrier_init();
    Epilogue::init(params.epilogue);
  }
  Pipeline pipeline_k(shared.pipeline_k, Load::template pipeline_params<Pipeline>(warpgroup == 0, is_producer_thread),
                      Shape<_1, _1, _1>{});
  PipelineV pipeline_v(shared.pipeline_v,
                       Load::template pipeline_params<PipelineV>(warpgroup == 0, is_producer_thread),
                       Shape<_1, _1, _1>{});
  __syncthreads();
  // The tail kernel, if one follows, may take each SM as soon as this kernel's block leaves it.
  if constexpr (!Traits::kCausal && !Traits::kTailPieces) pdl_launch_dependents();

  if (warpgroup == 0) {
    // ===================================== producer ======================================
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();  // line 3
    const FwdScheduler<Traits> scheduler(params.scheduler, params.seqlens, params.mask);
    if (Traits::kDynamicTiles && threadIdx.x == 32) return scheduler.run_draws(shared);
    if constexpr (Traits::kFp8) {
      // FP8: warps 2.. transpose V for the PV GEMM (fwd_fp8_transpose.h).
      if (threadIdx.x >= 64) {
        FwdFp8Transpose<Traits>::run(shared, pipeline_v, threadIdx.x - 64);
        asm volatile("exit;");
      }
    }
    // NOTES: the other threads leave with an explicit exit: as a branch to the kernel's shared
    // return, ptxas kept the producer's loop in a divergent region, off the uniform datapath,
    // and spilled its 24 registers.
    if (!is_producer_thread) asm volatile("exit;");
    Load::run(params.load, shared, pipeline_k, pipeline_v, scheduler, params.scheduler, params.nheads_per_kv);  // lines 4-10
    // NOTES: the tail kernel is launched behind the main one with programmatic dependent launch
    // (fwd_launch.h) and reads nothing the main kernel writes; this wait only keeps it from
    // completing before the main kernel does, so that the stream's next work waits for both.
    if constexpr (Traits::kTailPieces) pdl_wait();
    return;
  }

  // ====================================== consumers =======================================
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();  // line 12
  const FwdScheduler<Traits> scheduler(params.scheduler, params.seqlens, params.mask);
  const int tidx = threadIdx.x - 128;
  Tensor tOrO = partition_fragment_C(typename Traits::TiledMmaPV{}, Shape<Int<Traits::kBlockM>, Int<Traits::kHeadDim>>{});
  const auto views = Mainloop::make_views(shared, tidx);
  const FwdPingpong<Traits> turns(warpgroup - 1);
  typename Traits::PipelineState read_k;
  typename Traits::PipelineStateV read_v;
  for (int tiles_done = 0;; ++tiles_done) {
    auto work = scheduler.work(params.scheduler, tiles_done, shared);
    if (scheduler.done(work)) break;
    scheduler.locate(work);
    const SeqLen len = params.seqlens.template of<Traits::kGeneral>(work.tile.batch);
    float lse[Mainloop::kRows];
    // Lines 13-24: O = softmax(Q K^T) V over the piece's key blocks, normalized, and its lse.
    Mainloop::run(params.mainloop, shared, pipeline_k, pipeline_v, read_k, read_v, turns, tidx, tiles_done, views,
                  Traits::MaskT::template at<Traits::kGeneral>(len, params.mask), work.tile.m_block * Traits::kBlockM, work.n_lo, work.n_hi, tOrO, lse,
                  work.tile.batch, work.tile.head, work.tile.head / params.nheads_per_kv);
    if constexpr (Traits::kTailPieces) {
      if (work.part >= 0 &&
          !FwdCombine<Traits>::run(params.combine, params.scheduler.split, shared, work, tOrO, lse, tidx)) {
        continue;  // not the tile's last piece: no output
      }
    }
    const int q_batch = Traits::kGeneral ? params.seqlens.q_batch(work.tile.batch) : work.tile.batch;
    Epilogue::store(params.epilogue, shared, work.tile, len, q_batch, tOrO, lse, tidx, tiles_done);  // line 25
  }
}

}  // namespace flash3::detail

// flash3: the backward's consumer main loop at head dim 256 (not swapped): Algorithm 3, lines
// 9-15 of the FlashAttention-3 paper, per visited query block: S = Q_i K_j^T, dP = dO_i V_j^T,
// P = exp(S - lse), dS = P * (dP - D), dV_j += P^T dO_i, dK_j += dS^T Q_i, dQ_i = dS K_j.
#pragma once

#include "bwd/bwd_dq_writer.h"
#include "bwd/bwd_traits.h"
#include "common/mask.h"
#include "common/ptx.h"
#include "common/softmax.h"
#include "common/wgmma.h"

namespace flash3::detail {

// The consumers' main loop, not swapped (head dim 256): S, dP as (kBlockM, kBlockN); P and dS
// through shared memory; every GEMM reads both operands from shared memory.
// m_at(i): the query block of the i-th visit (BwdScheduler::at, shared with the producer and the
// dQ writers); mask: the item's batch entry's (keys past seqlen_k, causal future).
template <class Traits, class Pipeline, class AccKV, class MAt>
__device__ __forceinline__ void bwd_mainloop_ss(typename Traits::Params const& params,
                                                typename Traits::SharedStorage& shared, Pipeline& pipeline_q,
                                                Pipeline& pipeline_do, int m_count, MAt const& m_at,
                                                typename Traits::MaskT const& mask, int col0, int tidx,
                                                AccKV& tdKrdK, AccKV& tdVrdV) {
  using Element = typename Traits::Element;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  Tensor sQ = make_tensor(make_smem_ptr(shared.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.smem_do.data()), typename Traits::SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(shared.smem_k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.smem_v.data()), typename Traits::SmemLayoutV{});
  Element* p_ptr = shared.smem_pds.data();
  Element* ds_ptr = p_ptr + cosize_v<typename Traits::SmemLayoutP>;
  Tensor sP = make_tensor(make_smem_ptr(p_ptr), typename Traits::SmemLayoutP{});
  Tensor sdS = make_tensor(make_smem_ptr(ds_ptr), typename Traits::SmemLayoutdS{});
  Tensor sQt = make_tensor(make_smem_ptr(shared.smem_q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(shared.smem_do.data()), typename Traits::SmemLayoutdOt{});
  Tensor sKt = make_tensor(make_smem_ptr(shared.smem_k.data()), typename Traits::SmemLayoutKt{});
  Tensor sPt = make_tensor(make_smem_ptr(p_ptr), typename Traits::SmemLayoutPt{});
  Tensor sdSt = make_tensor(make_smem_ptr(ds_ptr), typename Traits::SmemLayoutdSt{});
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  // The shared-memory operands' descriptors from the warpgroup's first thread (common/wgmma.h).
  const int tidx_wg = warpgroup_first_thread(tidx);
  auto thr_dkv_wg = mma_dkv.get_thread_slice(tidx_wg);
  auto thr_dq_wg = mma_dq.get_thread_slice(tidx_wg);
  auto thr_sdp_wg = mma_sdp.get_thread_slice(tidx_wg);

  Tensor tSrQ = thr_sdp_wg.partition_fragment_A(sQ);     // (MMA, M, K, stage)
  Tensor tSrK = thr_sdp_wg.partition_fragment_B(sK);     // (MMA, N, K)
  Tensor tdPrdO = thr_sdp_wg.partition_fragment_A(sdO);  // (MMA, M, K, stage)
  Tensor tdPrV = thr_sdp_wg.partition_fragment_B(sV);
  Tensor tdVrPt = thr_dkv_wg.partition_fragment_A(sPt);
  Tensor tdVrdOt = thr_dkv_wg.partition_fragment_B(sdOt);  // (MMA, N, K, stage)
  Tensor tdKrdSt = thr_dkv_wg.partition_fragment_A(sdSt);
  Tensor tdKrQt = thr_dkv_wg.partition_fragment_B(sQt);    // (MMA, N, K, stage)
  Tensor tdQrdS = thr_dq_wg.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq_wg.partition_fragment_B(sKt);

  Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tdQrdQ = partition_fragment_C(mma_dq, TileQ{});
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));

  // P and dS leave the registers with stmatrix into the swizzled tiles.
  auto smem_copy_p = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
  auto thr_copy_p = smem_copy_p.get_thread_slice(tidx);
  Tensor tPsP = thr_copy_p.partition_D(sP);
  Tensor tPsdS = thr_copy_p.partition_D(sdS);
  Tensor tPrP = make_tensor<Element>(tSrS.layout());
  Tensor tPrdS = make_tensor<Element>(tSrS.layout());
  // Softcap: P (1 - t^2) in FP16 (compute_p, compute_ds).
  Tensor tPQ = make_tensor<cutlass::half_t>(tSrS.layout());

  // One tile GEMM, committed as one group and not waited for (operand fences right after the
  // commit).
  auto gemm = [&](auto zero_init, auto& mma, auto const& tA, auto const& tB, auto& tC) {
    warpgroup_gemm<decltype(zero_init)::value, -1>(mma, tA, tB, tC);
  };
  // S = Q_m K^T and dP = dO_m V^T (two commit groups).
  auto issue_sdp = [&](PipelineState const& rq, PipelineState const& rdo) {
    pipeline_q.consumer_wait(rq);
    gemm(cute::true_type{}, mma_sdp, tSrQ(_, _, _, rq.index()), tSrK, tSrS);
    pipeline_do.consumer_wait(rdo);
    gemm(cute::true_type{}, mma_sdp, tdPrdO(_, _, _, rdo.index()), tdPrV, tdPrdP);
  };
  // P = exp(scale * S - lse) in place of S, 0 where masked (keys past seqlen_k, or in the causal
  // future). Query rows past seqlen_q have lse = +inf (and dO = 0): P = 0, dS = 0 there.
  // NOTES: (row, col) views, so that each thread loads the lse and D of its few rows once.
  Tensor tSrS_rc = make_tensor(tSrS.data(), acc_layout_rowcol(tSrS.layout()));
  Tensor tdPrdP_rc = make_tensor(tdPrdP.data(), acc_layout_rowcol(tdPrdP.layout()));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_layout_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tSrS_rc))::value;
  constexpr int kCols = decltype(size<1>(tSrS_rc))::value;
  Tensor tPrP_rc = make_tensor(tPrP.data(), acc_layout_rowcol(tSrS.layout()));
  Tensor tPQ_rc = make_tensor(tPQ.data(), acc_layout_rowcol(tSrS.layout()));
  const bool softcap = Traits::kGeneral && params.softcap_coef != 0.f;
  const auto unmasked = mask.template unmasked_m_blocks<kBlockM, kBlockN>(col0);
  auto compute_p = [&](int m, int stage) {
    const int row0 = m * kBlockM;
    const float* lse = shared.smem_lse + stage * kBlockM;
    const bool need_mask = unmasked.masks(m);
    if (softcap) {
      // Softcap (common/softmax.h): t = tanh(coef S); P to 16 bits at once, and P (1 - t^2) in
      // FP16 beside it (softcap_pdt), in place of the FP32 P.
      apply_softcap(tSrS, params.softcap_coef);
      if (need_mask) mask.apply(tSrS_rc, tScS_rc, row0, col0);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const float row_lse = lse[get<0>(tScS_rc(i, 0))];
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kCols; j += 2) {
          softcap_p_pdt_pair(tSrS_rc(i, j), tSrS_rc(i, j + 1), params.scale_log2, row_lse, row_lse, &tPrP_rc(i, j),
                             &tPQ_rc(i, j));
        }
      }
      return;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int r = get<0>(tScS_rc(i, 0));
      const float row_lse = lse[r];
      if (need_mask) {
        // visible key columns: [lo, hi) from col0 (one unsigned test per score, as Mask::apply's)
        const int lo = mask.key_begin(row0 + r) - col0, hi = mask.key_end(row0 + r) - col0;
        const unsigned width = hi > lo ? unsigned(hi - lo) : 0u;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kCols; ++j) {
          const bool masked = unsigned(get<1>(tScS_rc(0, j)) - lo) >= width;
          tSrS_rc(i, j) = masked ? 0.0f : fast_exp2(tSrS_rc(i, j) * params.scale_log2 - row_lse);
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kCols; ++j) tSrS_rc(i, j) = fast_exp2(tSrS_rc(i, j) * params.scale_log2 - row_lse);
      }
    }
  };
  // dS = P * (dP - D) in place of dP (softcap: P (1 - t^2) from compute_p, unscaled through
  // dP - D).
  auto compute_ds = [&](int stage) {
    const float* dpsum = shared.smem_dpsum + stage * kBlockM;
    if (softcap) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const float row_d = softcap_d(dpsum[get<0>(tScS_rc(i, 0))]);
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kCols; ++j) tdPrdP_rc(i, j) = softcap_ds(tPQ_rc(i, j), tdPrdP_rc(i, j), row_d);
      }
      return;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float row_d = dpsum[get<0>(tScS_rc(i, 0))];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kCols; ++j) tdPrdP_rc(i, j) = tSrS_rc(i, j) * (tdPrdP_rc(i, j) - row_d);
    }
  };
  // P and dS to shared memory for the second-stage GEMMs of both warpgroups.
  auto write_p_ds = [&](bool wait_free) {
    if (!softcap) convert_into<Element>(tSrS, tPrP);  // softcap: compute_p's
    convert_into<Element>(tdPrdP, tPrdS);
    // Both warpgroups' GEMMs of the previous query block have read P and dS: overwrite them.
    if (wait_free) named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarPFree);
    copy(smem_copy_p, thr_copy_p.retile_S(tPrP), tPsP);
    copy(smem_copy_p, thr_copy_p.retile_S(tPrdS), tPsdS);
    cutlass::arch::fence_view_async_shared();  // st.shared / stmatrix -> WGMMA (async proxy)
    named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarPReady);
  };
  // dK += dS^T Q_m, dV += P^T dO_m, dQ_m = dS K (three commit groups; Q_m, then dO_m can be
  // released early).
  auto issue_grads = [&](int stage_q, int stage_do) {
    gemm(cute::false_type{}, mma_dkv, tdKrdSt, tdKrQt(_, _, _, stage_q), tdKrdK);  // last read of Q_m
    gemm(cute::false_type{}, mma_dkv, tdVrPt, tdVrdOt(_, _, _, stage_do), tdVrdV);  // last read of dO_m
    gemm(cute::true_type{}, mma_dq, tdQrdS, tdQrKt, tdQrdQ);
  };

  // NOTES: in order, one query block at a time: S and dP, then P and dS, then dK, dV, dQ (each
  // step's GEMMs in flight together). (An overlapped schedule, with the next block's S, dP
  // GEMMs issued behind the gradient GEMMs, spilled 770+ bytes here and ptxas serialized every
  // WGMMA: C7512, then C7514; docs/perf-log.md B2-B3.)
  PipelineState read_q, read_do;
  for (int i = 0; i < m_count; ++i) {
    issue_sdp(read_q, read_do);
    warpgroup_wait<1>();  // S (and everything issued before it)
    compute_p(m_at(i), read_q.index());
    warpgroup_wait<0>();  // dP
    compute_ds(read_do.index());
    write_p_ds(i > 0);
    issue_grads(read_q.index(), read_do.index());
    // Each buffer is released as soon as its last GEMM is done, so that (with one stage) the
    // next block's Q and dO load while dV and dQ still run.
    warpgroup_wait<2>();  // dK
    pipeline_q.consumer_release(read_q);
    warpgroup_wait<1>();  // dV
    pipeline_do.consumer_release(read_do);
    warpgroup_wait<0>();  // dQ
    ++read_q;
    ++read_do;
    bwd_store_dq<Traits>(shared, tdQrdQ, i, tidx);
  }
}

}  // namespace flash3::detail

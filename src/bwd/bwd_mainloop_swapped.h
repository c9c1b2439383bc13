// flash3: the backward's consumer main loop at head dims 64 and 128 (swapped: S^T, dP^T, with
// P^T, dS^T as register operands): Algorithm 3, lines 9-15 of the FlashAttention-3 paper.
#pragma once

#include "bwd/bwd_dq_writer.h"
#include "bwd/bwd_traits.h"
#include "common/mask.h"
#include "common/ptx.h"
#include "common/softmax.h"
#include "common/wgmma.h"

namespace flash3::detail {

// The consumers' main loop, swapped (head dims 64, 128; traits: kSdPSwapAB): per query block
//   S^T = K Q_m^T, dP^T = V dO_m^T        (kBlockN x kBlockM; warpgroup w: keys 64w..64w+63)
//   P^T = exp2(S^T * scale - lse), dS^T = P^T (dP^T - D)      (lse, D per column = query)
//   dV += P^T dO_m   (A = P^T from registers)
//   dS^T -> shared memory (stmatrix), dK += dS^T Q_m   (A from registers)
//   both warpgroups' dS^T stored (named barrier), dQ_m = dS K   (dS read MN-major)
// NOTES: dS^T has two buffers, so the one barrier per block suffices: warpgroup A stores block
// i+2's dS^T into buffer i%2 only after passing block i+1's barrier, which warpgroup B reaches
// after its dQ GEMM of block i (the last reader of that buffer) is complete.
// smem_k: the K tile (the persistent scheduler's kEarlyKV alternates two); on_kv_in_regs(): called once K and V
// are in registers (kKVInRegs), after which the V buffer may be refilled.
// mask: the item's batch entry's (keys past seqlen_k, causal future).
template <class Traits, class Pipeline, class AccKV, class MAt, class OnKV>
__device__ __forceinline__ void bwd_mainloop_swapped(typename Traits::Params const& params,
                                                     typename Traits::SharedStorage& shared,
                                                     Pipeline& pipeline_q, Pipeline& pipeline_do, int g_begin,
                                                     int g_end, MAt const& m_at, typename Traits::MaskT const& mask,
                                                     int col0, int tidx, AccKV& tdKrdK,
                                                     AccKV& tdVrdV, typename Traits::PipelineState& read_q,
                                                     typename Traits::PipelineState& read_do,
                                                     typename Traits::Element* smem_k, OnKV const& on_kv_in_regs) {
  using Element = typename Traits::Element;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileSt = Shape<Int<kBlockN>, Int<kBlockM>>;
  Tensor sQ = make_tensor(make_smem_ptr(shared.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.smem_do.data()), typename Traits::SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.smem_v.data()), typename Traits::SmemLayoutV{});
  Tensor sQt = make_tensor(make_smem_ptr(shared.smem_q.data()), typename Traits::SmemLayoutQt{});
  Tensor sdOt = make_tensor(make_smem_ptr(shared.smem_do.data()), typename Traits::SmemLayoutdOt{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Traits::SmemLayoutKt{});
  Tensor sdStStore = make_tensor(make_smem_ptr(shared.smem_pds.data()), typename Traits::SmemLayoutdStStore{});
  Tensor sdSView = make_tensor(make_smem_ptr(shared.smem_pds.data()), typename Traits::SmemLayoutdSView{});

  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadKV mma_dkv;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  // The shared-memory operands' descriptors from the warpgroup's first thread (common/wgmma.h).
  const int tidx_wg = warpgroup_first_thread(tidx);
  auto thr_sdp_wg = mma_sdp.get_thread_slice(tidx_wg);
  auto thr_dkv_wg = mma_dkv.get_thread_slice(tidx_wg);
  auto thr_dq_wg = mma_dq.get_thread_slice(bwd_dq_frag_thread<Traits>(tidx_wg));
  Tensor tSrK = thr_sdp_wg.partition_fragment_A(sK);       // (MMA, M, K): descriptors, or registers
  Tensor tSrQ = thr_sdp_wg.partition_fragment_B(sQ);       // (MMA, N, K, stage)
  Tensor tdPrV = thr_sdp_wg.partition_fragment_A(sV);
  if constexpr (Traits::kKVInRegs) {
    // This warpgroup's 64 keys of K and V into registers once (ldmatrix), for all query blocks.
    auto smem_copy_kv = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_sdp);
    auto thr_copy_kv = smem_copy_kv.get_thread_slice(tidx);
    copy(smem_copy_kv, thr_copy_kv.partition_S(sK), thr_copy_kv.retile_D(tSrK));
    copy(smem_copy_kv, thr_copy_kv.partition_S(sV), thr_copy_kv.retile_D(tdPrV));
    on_kv_in_regs();
  }
  Tensor tdPrdO = thr_sdp_wg.partition_fragment_B(sdO);    // (MMA, N, K, stage)
  Tensor tdVrdOt = thr_dkv_wg.partition_fragment_B(sdOt);  // (MMA, N, K, stage)
  Tensor tdKrQt = thr_dkv_wg.partition_fragment_B(sQt);    // (MMA, N, K, stage)
  Tensor tdQrdS = thr_dq_wg.partition_fragment_A(sdSView);  // (MMA, M, K, dS stage)
  Tensor tdQrKt = thr_dq_wg.partition_fragment_B(sKt);

  Tensor tSrS = partition_fragment_C(mma_sdp, TileSt{});
  Tensor tdPrdP = partition_fragment_C(mma_sdp, TileSt{});
  Tensor tdQrdQ = partition_fragment_C(mma_dq, TileQ{});
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(TileSt{}));
  // P^T and dS^T in 16 bits, as the A operands (registers) of the dV and dK GEMMs.
  Tensor tPrP = make_tensor<Element>(acc_layout_as_a_operand(tSrS.layout()));
  Tensor tPrdS = make_tensor<Element>(acc_layout_as_a_operand(tSrS.layout()));
  Tensor tPrP_rc = make_tensor(tPrP.data(), acc_layout_rowcol(tSrS.layout()));
  // Softcap: P^T (1 - t^2) in FP16 (compute_p, compute_ds).
  Tensor tPQ = make_tensor<cutlass::half_t>(tSrS.layout());
  Tensor tPQ_rc = make_tensor(tPQ.data(), acc_layout_rowcol(tSrS.layout()));
  // dS^T leaves the registers with stmatrix into the swizzled (kBlockN, kBlockM) tile.
  auto smem_copy_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
  auto thr_copy_ds = smem_copy_ds.get_thread_slice(tidx);
  Tensor tdSsdS = thr_copy_ds.partition_D(sdStStore);  // (CPY, CPY_M, CPY_N, dS stage)
  Tensor tdSrdS = make_tensor(tPrdS.data(), tSrS.layout());  // the same registers, C layout
  Tensor tdSrdS_cpy = thr_copy_ds.retile_S(tdSrdS);          // (CPY, CPY_M, CPY_N)
  // kDsAddrOnce (the general kernels without softcap): dS^T's stmatrix addresses of stage 0 are
  // formed once; stage s lies s x kDSStageBytes further on (the stage is the layout's outermost
  // mode, its stride a multiple of the swizzle's period, at most 1024 elements, so the swizzle
  // leaves that offset alone). Elsewhere CuTe's copy forms them from the tensor at each visit.
  // NOTES: each address from the tensor is a 64-bit add and the swizzle's three logic ops, a
  // dependent chain that ptxas placed between the dV GEMM's WGMMAs in the general kernels (ncu
  // source counters at head dim 128: their loop ran the default kernel's instructions but took 6%
  // more samples, most of them there); formed once: varlen, window and packed documents backward
  // +1.2-3.7% (docs/perf-log.md B116). In the default kernels the four addresses spilled (head dim
  // 128 non-causal 5% slower), and in the softcap kernels one more value spilled in the loop.
  // tdSsdS: (CPY = (the 8 values of one stmatrix x4, the 4 of them), 1, 1): this warpgroup's
  // 64 x 64 of dS^T.
  static_assert(decltype(size<0, 0>(tdSsdS))::value * sizeof(Element) == 16 && decltype(size<1>(tdSsdS))::value == 1 &&
                decltype(size<2>(tdSsdS))::value == 1);
  constexpr int kDsCopies = decltype(size<0, 1>(tdSsdS))::value;
  constexpr uint32_t kDSStageBytes = kBlockN * kBlockM * sizeof(Element);
  static_assert(cosize_v<typename Traits::SmemLayoutdStStore> == Traits::kDSStages * kBlockN * kBlockM &&
                kBlockN * kBlockM % 1024 == 0);
  constexpr bool kDsAddrOnce = Traits::kGeneral && !Traits::kSoftcap;
  uint32_t ds_addr[kDsCopies];
  if constexpr (kDsAddrOnce) {
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < kDsCopies; ++k) ds_addr[k] = cute::cast_smem_ptr_to_uint(&tdSsdS(make_coord(0, k), 0, 0, 0));
  }

  // (row, col) = (key, query) views: each thread's queries are the columns.
  Tensor tSrS_rc = make_tensor(tSrS.data(), acc_layout_rowcol(tSrS.layout()));
  Tensor tdPrdP_rc = make_tensor(tdPrdP.data(), acc_layout_rowcol(tdPrdP.layout()));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_layout_rowcol(tScS.layout()));
  constexpr int kRows = decltype(size<0>(tSrS_rc))::value;
  constexpr int kCols = decltype(size<1>(tSrS_rc))::value;

  // One tile GEMM, committed as one group and not waited for (operand fences right after the
  // commit).
  auto gemm = [&](auto zero_init, auto& mma, auto&& tA, auto const& tB, auto& tC) __attribute__((always_inline)) {
    warpgroup_gemm<decltype(zero_init)::value, -1>(mma, tA, tB, tC);
  };
  // S^T = K Q_m^T and dP^T = V dO_m^T (two commit groups).
  auto issue_sdp = [&](PipelineState const& rq, PipelineState const& rdo) __attribute__((always_inline)) {
    pipeline_q.consumer_wait(rq);
    gemm(cute::true_type{}, mma_sdp, tSrK, tSrQ(_, _, _, rq.index()), tSrS);
    pipeline_do.consumer_wait(rdo);
    gemm(cute::true_type{}, mma_sdp, tdPrV, tdPrdO(_, _, _, rdo.index()), tdPrdP);
  };
  const auto unmasked = mask.template unmasked_m_blocks<kBlockM, kBlockN>(col0);
  // softcap: Int<0> none, Int<1> softcap.
  auto softcap_on = [&](auto softcap) __attribute__((always_inline)) { return decltype(softcap)::value == 1; };
  auto compute_p = [&](int m, int stage, auto softcap) __attribute__((always_inline)) {
    // P^T = exp2(S^T * scale_log2 - lse) in place, 0 where masked (keys past seqlen_k, or in the
    // causal future: S = -inf first). Query columns past seqlen_q have lse = +inf (and dO = 0):
    // P = dS = 0. NOTES: with the mask test inside the exponential loop, ptxas kept both
    // versions of every column alive and spilled 120+ registers at head dim 64.
    const int row0 = m * kBlockM;
    const float* lse = shared.smem_lse + stage * kBlockM;
    if (softcap_on(softcap)) apply_softcap(tSrS, params.softcap_coef);  // t = tanh(coef S)
    if (unmasked.masks(m)) mask.apply_transposed(tSrS_rc, tScS_rc, row0, col0);
    if (softcap_on(softcap)) {
      // Softcap: P^T to 16 bits now, and P^T (1 - t^2) in FP16 beside it (softcap_pdt).
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kCols; j += 2) {
        const float lse0 = lse[get<1>(tScS_rc(0, j))], lse1 = lse[get<1>(tScS_rc(0, j + 1))];
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          softcap_p_pdt_pair(tSrS_rc(r, j), tSrS_rc(r, j + 1), params.scale_log2, lse0, lse1, &tPrP_rc(r, j),
                             &tPQ_rc(r, j));
        }
      }
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kCols; ++j) {
        const float col_lse = lse[get<1>(tScS_rc(0, j))];
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) tSrS_rc(r, j) = fast_exp2(tSrS_rc(r, j) * params.scale_log2 - col_lse);
      }
    }
  };
  auto compute_ds = [&](int stage, auto softcap) __attribute__((always_inline)) {
    // dS^T = P^T (dP^T - D) in place of dP^T, and P^T to 16 bits in the same pass (S^T dies
    // as it goes). Columns 2k, 2k+1 of a row are adjacent registers: one packed conversion.
    const float* dpsum = shared.smem_dpsum + stage * kBlockM;
    cutlass::NumericArrayConverter<Element, float, 2> cvt2;
    if (softcap_on(softcap)) {
      // Softcap: dS^T = P^T (1 - t^2) (dP^T - D), the first factor from compute_p (unscaled
      // through dP^T - D).
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kCols; ++j) {
        const float d = softcap_d(dpsum[get<1>(tScS_rc(0, j))]);
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) tdPrdP_rc(r, j) = softcap_ds(tPQ_rc(r, j), tdPrdP_rc(r, j), d);
      }
    } else {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kCols; j += 2) {
        const float2 d = *reinterpret_cast<const float2*>(dpsum + get<1>(tScS_rc(0, j)));
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          cutlass::Array<float, 2> p2;
          p2[0] = tSrS_rc(r, j);
          p2[1] = tSrS_rc(r, j + 1);
          tdPrdP_rc(r, j) = p2[0] * (tdPrdP_rc(r, j) - d.x);
          tdPrdP_rc(r, j + 1) = p2[1] * (tdPrdP_rc(r, j + 1) - d.y);
          *reinterpret_cast<cutlass::Array<Element, 2>*>(&tPrP_rc(r, j)) = cvt2(p2);
        }
      }
    }
  };
  // dV += P^T dO_m; dS^T to shared memory; once both warpgroups' dS^T are stored, dQ_m = dS K;
  // dK += dS^T Q_m (three commit groups).
  // kDQAlternate: the warpgroup whose turn it is (`mine`: visit parity) waits for the other's
  // dS^T and computes dQ_m whole (m64n64 atoms over all 128 keys); the other only signals that
  // its dS^T is stored and goes on (two commit groups). Barriers by parity (kBwdBarPReady,
  // kBwdBarPFree, unused here otherwise), so that the signalling warpgroup's arrival for visit
  // i + 2 cannot complete visit i's barrier. The two dS^T buffers stay safe: buffer i % 2 is read
  // by visit i's dQ GEMM alone, which its warpgroup waits for before arriving at visit i + 1's
  // barrier, which the other warpgroup passes before it stores visit i + 2's dS^T there.
  // NOTES: measured (docs/perf-log.md B38) at head dim 64: +6-9% without a mask, +1-9% causal.
  // kDQAlternate stores dS^T (and signals it) before issuing dV, so that the other warpgroup's dQ
  // GEMM no longer waits behind this warpgroup's dV issue, which stalls while the tensor pipe is
  // busy (docs/perf-log.md B49: +1-3% at head dim 64; the same order at head dim 128, where both
  // warpgroups meet at the barrier, measured 1-5% slower).
  auto store_ds = [&](int ds_stage) __attribute__((always_inline)) {
    convert_into<Element>(tdPrdP, tPrdS);
    if constexpr (kDsAddrOnce) {
      const uint32_t stage_offset = uint32_t(ds_stage) * kDSStageBytes;
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kDsCopies; ++k) {
        Tensor v = recast<uint32_t>(tdSrdS_cpy(make_coord(_, k), 0, 0));
        stmatrix_x4(ds_addr[k] + stage_offset, v(0), v(1), v(2), v(3));
      }
    } else {
      copy(smem_copy_ds, tdSrdS_cpy, tdSsdS(_, _, _, ds_stage));
    }
    cutlass::arch::fence_view_async_shared();  // stmatrix -> WGMMA (async proxy)
  };
  // Default kernels without dQ turns: dO is released as soon as dV is complete, before dK runs
  // (FlashAttention-3's release point; +0.2%, docs/perf-log.md B109).
  constexpr bool kEarlyReleaseDo = !Traits::kDQAlternate && !Traits::kGeneral;
  auto issue_grads = [&](int i, bool mine, int stage_q, PipelineState const& rdo) __attribute__((always_inline)) {
    const int stage_do = rdo.index();
    const int ds_stage = i % Traits::kDSStages;
    if constexpr (Traits::kDQAlternate) {
      store_ds(ds_stage);
      if (!mine) named_barrier_arrive(Traits::kNumConsumerThreads, kBwdBarPReady + (i & 1));
    }
    gemm(cute::false_type{}, mma_dkv, tPrP, tdVrdOt(_, _, _, stage_do), tdVrdV);  // last read of dO_m
    if constexpr (Traits::kDQAlternate) {
      if (mine) {
        named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarPReady + (i & 1));
        gemm(cute::true_type{}, mma_dq, tdQrdS(_, _, _, ds_stage), tdQrKt, tdQrdQ);
      }
    } else {
      store_ds(ds_stage);
      named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarPReady);
      gemm(cute::true_type{}, mma_dq, tdQrdS(_, _, _, ds_stage), tdQrKt, tdQrdQ);
      // Default kernels: dV complete before dK is issued (FlashAttention-3's order; measured
      // +1.2% at 8k-16k without a mask, up to +1.8% on the GQA shapes; the general kernels lost
      // 1-1.5% with it: docs/perf-log.md B105).
      if constexpr (!Traits::kGeneral) warpgroup_wait<1>();
      if constexpr (kEarlyReleaseDo) pipeline_do.consumer_release(rdo);
    }
    gemm(cute::false_type{}, mma_dkv, tPrdS, tdKrQt(_, _, _, stage_q), tdKrdK);  // last read of Q_m
  };

  // NOTES: in order, one query block at a time, with FlashAttention-3's order of the gradient
  // GEMMs: dV, dQ, dK, so that dQ_m goes to shared memory while dK still runs; measured
  // (docs/perf-log.md B26, B27) +3-7% at head dim 128 over dV, dK, dQ, and at head dim 64 +4-7%
  // over the overlapped schedule it replaced (block i+1's S^T, dP^T GEMMs issued behind block
  // i's gradient GEMMs, B10). (Issuing block i+1's S^T GEMM behind block i's gradient GEMMs at
  // head dim 128: ptxas serialized the WGMMAs, C7512, and spilled 80 bytes; B11.)
  // Visits g_begin.. g_end - 1 of this block (static: 0.. m_count - 1; persistent: counted on
  // across the block's items, so that the dS^T and dQ buffers and their barriers go on in turn).
  // The general kernel's loop with softcap or without: one of two copies chosen per call
  // (kSoftcapOwnLoop, bwd_config.h), or the kernel's own (kSoftcapOwnKernel).
  auto visits = [&](auto softcap) __attribute__((always_inline)) {
    for (int i = g_begin; i < g_end; ++i) {
      issue_sdp(read_q, read_do);
      warpgroup_wait<1>();  // S^T
      compute_p(m_at(i), read_q.index(), softcap);
      warpgroup_wait<0>();  // dP^T
      compute_ds(read_do.index(), softcap);
      const bool mine = !Traits::kDQAlternate || (i & 1) == tidx / 128;  // this warpgroup computes dQ_m
      issue_grads(i, mine, read_q.index(), read_do);
      warpgroup_wait<1>();  // dV and (if mine) dQ_m (dV already, where waited for in issue_grads)
      if constexpr (!kEarlyReleaseDo) pipeline_do.consumer_release(read_do);
      if (mine) bwd_store_dq<Traits>(shared, tdQrdQ, i, tidx);
      warpgroup_wait<0>();  // dK
      pipeline_q.consumer_release(read_q);
      ++read_q;
      ++read_do;
    }
  };
  static_assert(!Traits::kGeneral || Traits::Config::kSoftcapOwnLoop || Traits::Config::kSoftcapOwnKernel,
                "the swapped general loop: softcap by a copy of the loop or a kernel of its own");
  if constexpr (!Traits::kGeneral || Traits::Config::kSoftcapOwnKernel) {
    visits(cute::Int<Traits::kSoftcap ? 1 : 0>{});
  } else if (params.softcap_coef != 0.f) {
    visits(cute::Int<1>{});
  } else {
    visits(cute::Int<0>{});
  }
}

}  // namespace flash3::detail

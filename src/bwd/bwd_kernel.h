// flash3: the backward pass, Algorithm 3 of the FlashAttention-3 paper (shared/paper, Appendix
// B.1), as three kernels:
//   bwd_preprocess  D = rowsum(dO * O), lse * log2(e) (both padded per query tile), and the dQ
//                   accumulator cleared, or only its tiles' counters where the first add into a
//                   tile is a store (bwd_config.h, bwd_dq_store_first);
//   bwd_kernel      one block per (kBlockN keys, head, batch), warp-specialized:
//                     warp 0      producer: TMA loads K_j, V_j once, then streams Q_i, dO_i (with
//                                 their lse and D) through a kStages-deep ring of buffers;
//                     warps 1, 2  dQ writers (alternate tiles): add each tile's dQ_i (FP32,
//                                 from one of kDQStages shared-memory buffers) into the global
//                                 accumulator with one bulk reduce-add (TMA), so the consumers
//                                 never wait on that traffic;
//                     WGs 1, 2    consumers: S = Q_i K_j^T, dP = dO_i V_j^T, P = exp(S - lse),
//                                 dS = P * (dP - D), dV_j += P^T dO_i, dK_j += dS^T Q_i,
//                                 dQ_i = dS K_j, all with WGMMA; dK_j, dV_j stay in registers
//                                 (bwd_mainloop_swapped at head dims 64, 128: S^T, dP^T, with
//                                 P^T, dS^T as register operands; bwd_mainloop_ss at 256);
//   bwd_postprocess dQ = scale * accumulator in the input dtype; for GQA/MQA dK, dV summed over
//                   the query heads of each kv head.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include <cmath>

#include "bwd/bwd_traits.h"
#include "common/block_order.h"
#include "common/ptx.h"
#include "common/wgmma.h"
#include "common/tile_stream.h"

namespace flash3::detail {

// Named barriers of the backward kernel (id 0 is __syncthreads).
// dQ buffer b uses kBwdBarDQFull + b and kBwdBarDQEmpty + b.
enum : int { kBwdBarPReady = 1, kBwdBarPFree = 2, kBwdBarDQFull = 3, kBwdBarDQEmpty = 7,  // up to 4 dQ buffers
             kBwdBarEpilogue = 11 };

// The query blocks [m_begin, m_end) that key block n_block must visit: causal skips the query
// blocks whose rows all lie before the block's first key (bottom-right aligned mask).
template <class Traits>
__device__ __forceinline__ void query_block_range(int n_block, int seqlen_q, int seqlen_k,
                                                  int& m_begin, int& m_end) {
  m_end = (seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  m_begin = 0;
  if constexpr (Traits::kCausal) {
    // Row i sees key j iff j <= i + seqlen_k - seqlen_q: the first row to see key n*kBlockN.
    const int first_row = n_block * Traits::kBlockN - (seqlen_k - seqlen_q);
    m_begin = first_row <= 0 ? 0 : min(first_row / Traits::kBlockM, m_end);
  }
}

// Block index -> (n_block, head, batch). Non-causal: n_block fastest (the blocks of one head
// run together and share its Q, dO in L2). Causal: longest-processing-time first (n_block 0
// visits every query block, the last one the fewest), within sections of (head, batch) pairs
// whose Q and dO fit in half the L2 (the first l2_big of l2_section + 1 pairs, then of
// l2_section: causal_order.h, bwd_sections): n_block slowest inside a section. (With
// n_block slowest over all heads, 132 blocks streamed 132 heads' Q, dO at once: at 16k, hdim
// 256 that is ~2 GB, from DRAM.) Both orders dispatch block (n-1, h, b) before (n, h, b), which
// the deterministic mode relies on.
template <bool kCausal>
__device__ __forceinline__ void bwd_block_coords(int n_blocks, int nheads, int batches, int l2_section,
                                                 int l2_big, int& n_block, int& head, int& batch) {
  const int bid = blockIdx.x;
  int bh;
  if constexpr (kCausal) {
    bwd_causal_block(bid, n_blocks, nheads * batches, l2_section, l2_big, n_block, bh);  // causal_order.h
  } else {
    n_block = bid % n_blocks;
    bh = bid / n_blocks;
  }
  head = bh % nheads;
  batch = bh / nheads;
}

// The query block of a key block's i-th visit: |m_base - i| is m_begin + i with m_base =
// -m_begin, and m_end - 1 - i with m_base = m_end - 1 (see the kernel).
__device__ __forceinline__ int bwd_m_at(int m_base, int i) { return abs(m_base - i); }

// The thread of the dQ GEMM (TiledMmadQ) that consumer (or postprocess) thread `thread` stands
// for: all 256 split the GEMM, or, with kDQAlternate, each warpgroup's 128 hold a whole one.
template <class Traits>
__device__ __forceinline__ int bwd_dq_frag_thread(int thread) {
  return Traits::kDQAlternate ? thread % 128 : thread;
}

// dQ of the i-th visited query block to shared memory for the dQ writer, in register order:
// value pair j of the dQ GEMM's thread t at float2 index j * kDQFragThreads + t (256 threads, or
// the 128 of one warpgroup with kDQAlternate; conflict-free; bwd_postprocess_dq undoes the
// order).
template <class Traits, class AccQ>
__device__ __forceinline__ void bwd_store_dq(typename Traits::SharedStorage& shared, AccQ const& tdQrdQ, int i,
                                             int tidx) {
  const int buf = i % Traits::kDQStages;
  if (i >= Traits::kDQStages) named_barrier_sync(Traits::kDQBarThreads, kBwdBarDQEmpty + buf);
  float2* dq_tile = reinterpret_cast<float2*>(shared.smem_dq + buf * Traits::kDQElems);
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < size(tdQrdQ) / 2; ++j) {
    dq_tile[j * Traits::kDQFragThreads + bwd_dq_frag_thread<Traits>(tidx)] = make_float2(tdQrdQ(2 * j), tdQrdQ(2 * j + 1));
  }
  cutlass::arch::fence_view_async_shared();  // st.shared -> bulk reduce (async proxy)
  named_barrier_arrive(Traits::kDQBarThreads, kBwdBarDQFull + i % Traits::kDQFullBars);
}

// The consumers' main loop, not swapped (head dim 256): S, dP as (kBlockM, kBlockN); P and dS
// through shared memory; every GEMM reads both operands from shared memory.
// m_at(i): the query block of the i-th visit (the kernel's one mapping, shared with the producer
// and the dQ writers).
template <class Traits, class Pipeline, class AccKV, class MAt>
__device__ __forceinline__ void bwd_mainloop_ss(typename Traits::Params const& params,
                                                typename Traits::SharedStorage& shared, Pipeline& pipeline_q,
                                                Pipeline& pipeline_do, int m_count, MAt const& m_at, int col0,
                                                int tidx, AccKV& tdKrdK, AccKV& tdVrdV) {
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
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  typename Traits::TiledMmaSdP mma_sdp;
  typename Traits::TiledMmadQ mma_dq;
  auto thr_sdp = mma_sdp.get_thread_slice(tidx);
  auto thr_dq = mma_dq.get_thread_slice(tidx);

  Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);     // (MMA, M, K, stage)
  Tensor tSrK = thr_sdp.partition_fragment_B(sK);     // (MMA, N, K)
  Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);  // (MMA, M, K, stage)
  Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
  Tensor tdVrPt = thr_dkv.partition_fragment_A(sPt);
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, N, K, stage)
  Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdSt);
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);    // (MMA, N, K, stage)
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);

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

  const int row_shift = params.seqlen_k - params.seqlen_q;  // causal: key j visible iff j <= i + shift

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
  auto compute_p = [&](int m, int stage) {
    const int row0 = m * kBlockM;
    const float* lse = shared.smem_lse + stage * kBlockM;
    bool need_mask = col0 + kBlockN > params.seqlen_k;
    if constexpr (Traits::kCausal) need_mask |= col0 + kBlockN - 1 > row0 + row_shift;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int r = get<0>(tScS_rc(i, 0));
      const float row_lse = lse[r];
      if (need_mask) {
        // Key columns visible to this row: [0, limit) relative to col0.
        int limit = params.seqlen_k - col0;
        if constexpr (Traits::kCausal) limit = min(limit, row0 + r + row_shift + 1 - col0);
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kCols; ++j) {
          const bool masked = get<1>(tScS_rc(0, j)) >= limit;
          tSrS_rc(i, j) = masked ? 0.0f : fast_exp2(tSrS_rc(i, j) * params.scale_log2 - row_lse);
        }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kCols; ++j) tSrS_rc(i, j) = fast_exp2(tSrS_rc(i, j) * params.scale_log2 - row_lse);
      }
    }
  };
  // dS = P * (dP - D) in place of dP.
  auto compute_ds = [&](int stage) {
    const float* dpsum = shared.smem_dpsum + stage * kBlockM;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float row_d = dpsum[get<0>(tScS_rc(i, 0))];
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kCols; ++j) tdPrdP_rc(i, j) = tSrS_rc(i, j) * (tdPrdP_rc(i, j) - row_d);
    }
  };
  // P and dS to shared memory for the second-stage GEMMs of both warpgroups.
  auto write_p_ds = [&](bool wait_free) {
    convert_into<Element>(tSrS, tPrP);
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

// The consumers' main loop, swapped (head dims 64, 128; traits: kSdPSwapAB): per query block
//   S^T = K Q_m^T, dP^T = V dO_m^T        (kBlockN x kBlockM; warpgroup w: keys 64w..64w+63)
//   P^T = exp2(S^T * scale - lse), dS^T = P^T (dP^T - D)      (lse, D per column = query)
//   dV += P^T dO_m   (A = P^T from registers)
//   dS^T -> shared memory (stmatrix), dK += dS^T Q_m   (A from registers)
//   both warpgroups' dS^T stored (named barrier), dQ_m = dS K   (dS read MN-major)
// NOTES: dS^T has two buffers, so the one barrier per block suffices: warpgroup A stores block
// i+2's dS^T into buffer i%2 only after passing block i+1's barrier, which warpgroup B reaches
// after its dQ GEMM of block i (the last reader of that buffer) is complete.
// smem_k: the K tile (the persistent kernel alternates two); on_kv_in_regs(): called once K and V
// are in registers (kKVInRegs), after which the V buffer may be refilled.
template <class Traits, class Pipeline, class AccKV, class MAt, class OnKV>
__device__ __forceinline__ void bwd_mainloop_swapped(typename Traits::Params const& params,
                                                     typename Traits::SharedStorage& shared,
                                                     Pipeline& pipeline_q, Pipeline& pipeline_do, int g_begin,
                                                     int g_end, MAt const& m_at, int col0, int tidx, AccKV& tdKrdK,
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
  auto thr_dkv = mma_dkv.get_thread_slice(tidx);
  auto thr_dq = mma_dq.get_thread_slice(bwd_dq_frag_thread<Traits>(tidx));
  Tensor tSrK = thr_sdp.partition_fragment_A(sK);       // (MMA, M, K): descriptors, or registers
  Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);       // (MMA, N, K, stage)
  Tensor tdPrV = thr_sdp.partition_fragment_A(sV);
  if constexpr (Traits::kKVInRegs) {
    // This warpgroup's 64 keys of K and V into registers once (ldmatrix), for all query blocks.
    auto smem_copy_kv = make_tiled_copy_A(Copy_Atom<SM75_U32x4_LDSM_N, Element>{}, mma_sdp);
    auto thr_copy_kv = smem_copy_kv.get_thread_slice(tidx);
    copy(smem_copy_kv, thr_copy_kv.partition_S(sK), thr_copy_kv.retile_D(tSrK));
    copy(smem_copy_kv, thr_copy_kv.partition_S(sV), thr_copy_kv.retile_D(tdPrV));
    on_kv_in_regs();
  }
  Tensor tdPrdO = thr_sdp.partition_fragment_B(sdO);    // (MMA, N, K, stage)
  Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, N, K, stage)
  Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);    // (MMA, N, K, stage)
  Tensor tdQrdS = thr_dq.partition_fragment_A(sdSView);  // (MMA, M, K, dS stage)
  Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);

  Tensor tSrS = partition_fragment_C(mma_sdp, TileSt{});
  Tensor tdPrdP = partition_fragment_C(mma_sdp, TileSt{});
  Tensor tdQrdQ = partition_fragment_C(mma_dq, TileQ{});
  Tensor tScS = thr_sdp.partition_C(make_identity_tensor(TileSt{}));
  // P^T and dS^T in 16 bits, as the A operands (registers) of the dV and dK GEMMs.
  Tensor tPrP = make_tensor<Element>(acc_layout_as_a_operand(tSrS.layout()));
  Tensor tPrdS = make_tensor<Element>(acc_layout_as_a_operand(tSrS.layout()));
  // dS^T leaves the registers with stmatrix into the swizzled (kBlockN, kBlockM) tile.
  auto smem_copy_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
  auto thr_copy_ds = smem_copy_ds.get_thread_slice(tidx);
  Tensor tdSsdS = thr_copy_ds.partition_D(sdStStore);  // (CPY, CPY_M, CPY_N, dS stage)
  Tensor tdSrdS = make_tensor(tPrdS.data(), tSrS.layout());  // the same registers, C layout

  const int row_shift = params.seqlen_k - params.seqlen_q;  // causal: key j visible iff j <= i + shift
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
  auto compute_p = [&](int m, int stage) __attribute__((always_inline)) {
    // P^T = exp2(S^T * scale_log2 - lse) in place, 0 where masked (keys past seqlen_k, or in the
    // causal future: S = -inf first). Query columns past seqlen_q have lse = +inf (and dO = 0):
    // P = dS = 0. NOTES: with the mask test inside the exponential loop, ptxas kept both
    // versions of every column alive and spilled 120+ registers at head dim 64.
    const int row0 = m * kBlockM;
    const float* lse = shared.smem_lse + stage * kBlockM;
    bool need_mask = col0 + kBlockN > params.seqlen_k;
    if constexpr (Traits::kCausal) need_mask |= col0 + kBlockN - 1 > row0 + row_shift;
    if (need_mask) {
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kCols; ++j) {
        // Keys visible to query c: [0, limit) relative to col0.
        int limit = params.seqlen_k - col0;
        if constexpr (Traits::kCausal) limit = min(limit, row0 + get<1>(tScS_rc(0, j)) + row_shift + 1 - col0);
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) {
          if (get<0>(tScS_rc(r, 0)) >= limit) tSrS_rc(r, j) = -INFINITY;
        }
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kCols; ++j) {
      const float col_lse = lse[get<1>(tScS_rc(0, j))];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) tSrS_rc(r, j) = fast_exp2(tSrS_rc(r, j) * params.scale_log2 - col_lse);
    }
  };
  auto compute_ds = [&](int stage) __attribute__((always_inline)) {
    // dS^T = P^T (dP^T - D) in place of dP^T, and P^T to 16 bits in the same pass (S^T dies
    // as it goes). Columns 2k, 2k+1 of a row are adjacent registers: one packed conversion.
    const float* dpsum = shared.smem_dpsum + stage * kBlockM;
    Tensor tPrP_rc = make_tensor(tPrP.data(), acc_layout_rowcol(tSrS.layout()));
    cutlass::NumericArrayConverter<Element, float, 2> cvt2;
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
    copy(smem_copy_ds, thr_copy_ds.retile_S(tdSrdS), tdSsdS(_, _, _, ds_stage));
    cutlass::arch::fence_view_async_shared();  // stmatrix -> WGMMA (async proxy)
  };
  auto issue_grads = [&](int i, bool mine, int stage_q, int stage_do) __attribute__((always_inline)) {
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
    }
    gemm(cute::false_type{}, mma_dkv, tPrdS, tdKrQt(_, _, _, stage_q), tdKrdK);  // last read of Q_m
  };

  // NOTES: in order, one query block at a time, with FlashAttention-3's order of the gradient
  // GEMMs: dV, dQ, dK, so that dQ_m goes to shared memory while dK still runs; measured
  // (docs/perf-log.md B26, B27) +3-7% at head dim 128 over dV, dK, dQ, and at head dim 64 +4-7%
  // over the overlapped schedule it replaced (block i+1's S^T, dP^T GEMMs issued behind block
  // i's gradient GEMMs, B10). (Issuing block i+1's S^T GEMM behind block i's gradient GEMMs at
  // head dim 128: ptxas serialized the WGMMAs, C7512, and spilled 80 bytes; B11.)
  // Visits g_begin.. g_end - 1 of this block (bwd_kernel: 0.. m_count - 1; the persistent kernel
  // counts on across its items, so that the dS^T and dQ buffers and their barriers go on in turn).
  for (int i = g_begin; i < g_end; ++i) {
    issue_sdp(read_q, read_do);
    warpgroup_wait<1>();  // S^T
    compute_p(m_at(i), read_q.index());
    warpgroup_wait<0>();  // dP^T
    compute_ds(read_do.index());
    const bool mine = !Traits::kDQAlternate || (i & 1) == tidx / 128;  // this warpgroup computes dQ_m
    issue_grads(i, mine, read_q.index(), read_do.index());
    warpgroup_wait<1>();  // dV and (if mine) dQ_m
    pipeline_do.consumer_release(read_do);
    if (mine) bwd_store_dq<Traits>(shared, tdQrdQ, i, tidx);
    warpgroup_wait<0>();  // dK
    pipeline_q.consumer_release(read_q);
    ++read_q;
    ++read_do;
  }
}

// Both kernels' start: thread 0 initializes the K/V barrier (and, through `more`, the persistent
// kernel's own) and prefetches the TMA descriptors; the Q and dO pipelines' parameters, warpgroup 0
// producing.
template <class Traits, class More>
__device__ __forceinline__ typename Traits::Pipeline::Params bwd_init_block(typename Traits::Params const& params,
                                                                            typename Traits::SharedStorage& shared,
                                                                            int warpgroup, More const& more) {
  using Pipeline = typename Traits::Pipeline;
  typename Pipeline::Params pipe_params;
  pipe_params.transaction_bytes = Traits::kTmaBytesQ;
  pipe_params.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pipe_params.is_leader = threadIdx.x == 0;
  pipe_params.num_consumers = Traits::kNumConsumerThreads;
  if (threadIdx.x == 0) {
    shared.barrier_kv.init(1);
    more();
    cutlass::arch::fence_barrier_init();
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  }
  return pipe_params;
}

// The producer's loads for one visit, query block m: Q with its log-sum-exps and dO with its D
// (lse, dpsum: the pair's rows), each into the next stage of its pipeline.
template <class Traits, class Pipeline, class State, class QParts, class DOParts>
__device__ __forceinline__ void bwd_load_visit(typename Traits::Params const& params,
                                               typename Traits::SharedStorage& shared, Pipeline& pipeline_q,
                                               Pipeline& pipeline_do, State& write_q, State& write_do,
                                               QParts const& q_parts, DOParts const& do_parts, int m,
                                               const float* lse, const float* dpsum) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr uint32_t kRowBytes = kBlockM * sizeof(float);
  pipeline_q.producer_acquire(write_q);
  uint64_t* bar_q = pipeline_q.producer_get_barrier(write_q);
  copy(params.tma_q.with(*bar_q), get<0>(q_parts)(_, m), get<1>(q_parts)(_, write_q.index()));
  bulk_load_1d(shared.smem_lse + write_q.index() * kBlockM, lse + m * kBlockM, kRowBytes, bar_q);
  ++write_q;
  pipeline_do.producer_acquire(write_do);
  uint64_t* bar_do = pipeline_do.producer_get_barrier(write_do);
  copy(params.tma_do.with(*bar_do), get<0>(do_parts)(_, m), get<1>(do_parts)(_, write_do.index()));
  bulk_load_1d(shared.smem_dpsum + write_do.index() * kBlockM, dpsum + m * kBlockM, kRowBytes, bar_do);
  ++write_do;
}

// A gpu-scope acquire load of a counter (the dQ chain's dq_sem, the pairs' dq_done).
__device__ __forceinline__ int ld_acquire_gpu(const int* counter) {
  int seen;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
  return seen;
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
// Visits g_begin.. g_end - 1 (bwd_kernel: 0.. m_count - 1; the persistent kernel counts on across
// its items, kContinued: then every buffer is handed back, since a later item's visit may wait
// for it).
template <class Traits, bool kContinued = false, class MAt>
__device__ __forceinline__ void bwd_dq_writer(typename Traits::Params const& params,
                                              typename Traits::SharedStorage& shared, int writer, int lane,
                                              int64_t bh, int n_block, int g_begin, int g_end, MAt const& m_at) {
  // Deterministic mode: this key block adds into copy `group` of each tile, as the
  // `turn`-th (bwd_config.h, bwd_dq_groups); copies are [tile][group], groups = 1 otherwise.
  const int groups = params.dq_groups, group = n_block % groups, turn = n_block / groups;
  float* dq_accum = params.dq_accum + (bh * params.m_blocks * groups + group) * Traits::kDQElems;
  int* sem = params.dq_sem != nullptr ? params.dq_sem + bh * params.m_blocks * groups + group : nullptr;
  const int first = g_begin + ((writer - g_begin) % Traits::kDQWriters + Traits::kDQWriters) % Traits::kDQWriters;
  for (int i = first; i < g_end; i += Traits::kDQWriters) {
    const int m = m_at(i), buf = i % Traits::kDQStages;
    named_barrier_sync(Traits::kDQBarThreads, kBwdBarDQFull + i % Traits::kDQFullBars);
    if (lane == 0) {
      float* dst = dq_accum + int64_t(m) * groups * Traits::kDQElems;
      const float* src = shared.smem_dq + buf * Traits::kDQElems;
      if (sem != nullptr && turn > 0) {
        // Turn 0 stores (the tiles are not cleared, bwd_config.h). Deterministic: the key
        // blocks of a group add into query tile m's copy in the order of their turns 0, 1,
        // 2, ...; default: in any order once turn 0 (key block 0) has stored the tile.
        // NOTES: a short sleep between polls, so that the polling of the writers waiting on
        // a tile does not compete in L2 with the adds they wait for.
        for (;;) {
          const int seen = ld_acquire_gpu(sem + m * groups);
          if (params.dq_ordered ? seen == turn : seen > 0) break;
          __nanosleep(128);
        }
        // The acquired store (or adds) before this thread's bulk add (async proxy).
        asm volatile("fence.proxy.async.global;" ::: "memory");
      }
      if (sem != nullptr && turn == 0) {
        bulk_store_f32(dst, src, Traits::kDQElems * sizeof(float));
      } else {
        bulk_reduce_add_f32(dst, src, Traits::kDQElems * sizeof(float));
      }
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");  // smem read
    }
    __syncwarp();
    if (kContinued || i + Traits::kDQStages < g_end) named_barrier_arrive(Traits::kDQBarThreads, kBwdBarDQEmpty + buf);
    if (sem != nullptr && lane == 0 && (params.dq_ordered || turn == 0)) bwd_count_bulk_done(sem + m * groups);
    __syncwarp();
  }
  // This writer is done with the pair's dQ for this key block: once its adds are complete, one
  // more on the pair's count, which the postprocess waits for (bwd_postprocess_dq), as above.
  if (params.dq_done != nullptr && lane == 0) bwd_count_bulk_done(params.dq_done + bh);
}

// dK (scaled) and dV of one block of work (keys col0.., pair bh) out of the registers: to the
// outputs, or (GQA, dk_accum) to the FP32 per-query-head buffers. The 16-bit tiles go through
// shared memory at sdk and sdv (each kBlockN x kHeadDim, free once every consumer thread is here).
// NOTES: so that each warp then writes whole row segments (32 lanes x 4 bytes contiguous) instead
// of 16 bytes in each of 8 rows per store; 16-byte chunks XOR-swizzled by row (chunk ^ row % 8):
// both the accumulator-order writes (8 rows, one chunk) and the row reads (one row, 8 chunks) hit
// 32 distinct banks.
template <class Traits, class AccKV>
__device__ __forceinline__ void bwd_store_dkdv(typename Traits::Params const& params, AccKV& tdKrdK, AccKV& tdVrdV,
                                               int tidx, int col0, int head_kv, int batch, int64_t bh,
                                               typename Traits::Element* sdk, typename Traits::Element* sdv) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  warpgroup_fence_operand(tdKrdK);
  warpgroup_fence_operand(tdVrdV);
  typename Traits::TiledMmadKV mma_dkv;
  Tensor tdKcdK = mma_dkv.get_thread_slice(tidx).partition_C(make_identity_tensor(TileKV{}));
  if (params.dk_accum == nullptr) {
    using Pair = cutlass::Array<Element, 2>;
    auto swz = [](int r, int c) { return xor_swizzled_offset<kHeadDim>(r, c); };
    named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);  // the staging buffers are free
    cutlass::NumericArrayConverter<Element, float, 2> cvt;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size(tdKrdK) / 2; ++j) {
      const int r = get<0>(tdKcdK(2 * j)), c = get<1>(tdKcdK(2 * j));
      cutlass::Array<float, 2> k2, v2;
      k2[0] = tdKrdK(2 * j) * params.softmax_scale;
      k2[1] = tdKrdK(2 * j + 1) * params.softmax_scale;
      v2[0] = tdVrdV(2 * j);
      v2[1] = tdVrdV(2 * j + 1);
      *reinterpret_cast<Pair*>(sdk + swz(r, c)) = cvt(k2);
      *reinterpret_cast<Pair*>(sdv + swz(r, c)) = cvt(v2);
    }
    named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);
    Element* dk = params.dk + batch * params.dk_batch_stride + head_kv * params.dk_head_stride;
    Element* dv = params.dv + batch * params.dv_batch_stride + head_kv * params.dv_head_stride;
    const int warp = tidx / 32, lane = tidx % 32;
    for (int r = warp; r < kBlockN; r += Traits::kNumConsumerThreads / 32) {
      const int row = col0 + r;
      if (row >= params.seqlen_k) break;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 2 * lane; c < kHeadDim; c += 64) {
        *reinterpret_cast<Pair*>(dk + row * params.dk_row_stride + c) = *reinterpret_cast<const Pair*>(sdk + swz(r, c));
        *reinterpret_cast<Pair*>(dv + row * params.dv_row_stride + c) = *reinterpret_cast<const Pair*>(sdv + swz(r, c));
      }
    }
  } else {
    float* dk = params.dk_accum + bh * params.seqlen_k_pad * kHeadDim;
    float* dv = params.dv_accum + bh * params.seqlen_k_pad * kHeadDim;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size(tdKrdK) / 2; ++j) {
      const int r = get<0>(tdKcdK(2 * j)), c = get<1>(tdKcdK(2 * j));
      const int64_t at = int64_t(col0 + r) * kHeadDim + c;
      *reinterpret_cast<float2*>(dk + at) = make_float2(tdKrdK(2 * j), tdKrdK(2 * j + 1));
      *reinterpret_cast<float2*>(dv + at) = make_float2(tdVrdV(2 * j), tdVrdV(2 * j + 1));
    }
  }
}

// dK (scaled) and dV of one block of work (MHA, Traits::kTmaEpilogue): into the SmemLayoutK
// tiles at sdk_stage and sdv_stage (stmatrix; free once every consumer thread is here), then out
// by two TMA stores that thread 0 issues and commits as one group; the stores clip the rows past
// seqlen_k. Thread 0 waits for the group's shared-memory reads (tma_store_wait) before anything
// writes the tiles again, or before the block exits.
// NOTES: the row-by-row stores of bwd_store_dkdv kept the consumers ~1.5 us per block with the
// tensor pipe idle (docs/perf-log.md B54); here they go on as soon as the tiles are in shared
// memory (B56, B57).
template <class Traits, class AccKV>
__device__ __forceinline__ void bwd_store_dkdv_tma(typename Traits::Params const& params, AccKV& tdKrdK,
                                                   AccKV& tdVrdV, int tidx, int n_block, int head_kv, int batch,
                                                   typename Traits::Element* sdk_stage,
                                                   typename Traits::Element* sdv_stage) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using SmemLayoutK = typename Traits::SmemLayoutK;
  warpgroup_fence_operand(tdKrdK);
  warpgroup_fence_operand(tdVrdV);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= params.softmax_scale;
  Tensor tdKrOut = make_tensor<Element>(tdKrdK.layout());
  Tensor tdVrOut = make_tensor<Element>(tdVrdV.layout());
  convert_into<Element>(tdKrdK, tdKrOut);
  convert_into<Element>(tdVrdV, tdVrOut);
  Tensor sdK = make_tensor(make_smem_ptr(sdk_stage), SmemLayoutK{});
  Tensor sdV = make_tensor(make_smem_ptr(sdv_stage), SmemLayoutK{});
  typename Traits::TiledMmadKV mma_dkv;
  auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dkv);
  auto thr_copy = smem_copy.get_thread_slice(tidx);
  if (tidx == 0) tma_store_wait<0>();  // the last stores from these tiles have read them
  named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);  // the staging tiles are free
  copy(smem_copy, thr_copy.retile_S(tdKrOut), thr_copy.partition_D(sdK));
  copy(smem_copy, thr_copy.retile_S(tdVrOut), thr_copy.partition_D(sdV));
  cutlass::arch::fence_view_async_shared();  // stmatrix -> TMA (async proxy)
  named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);
  if (tidx == 0) {
    Tensor mdK = params.tma_dk.get_tma_tensor(params.layout_k.shape());
    Tensor mdV = params.tma_dv.get_tma_tensor(params.layout_k.shape());
    Tensor gdK = local_tile(mdK(_, _, head_kv, batch), TileKV{}, make_coord(n_block, _0{}));
    Tensor gdV = local_tile(mdV(_, _, head_kv, batch), TileKV{}, make_coord(n_block, _0{}));
    auto dk_parts = tma_partition(params.tma_dk, group_modes<0, 2>(sdK), group_modes<0, 2>(gdK));
    auto dv_parts = tma_partition(params.tma_dv, group_modes<0, 2>(sdV), group_modes<0, 2>(gdV));
    copy(params.tma_dk, get<1>(dk_parts), get<0>(dk_parts));
    copy(params.tma_dv, get<1>(dv_parts), get<0>(dv_parts));
    tma_store_arrive();
  }
}

// The main kernel's producer thread: wait for the preprocess, then let the postprocess launch.
// NOTES: the postprocess launches once every block of the main kernel has been here (or has
// ended), so the preprocess is complete by then: the postprocess reads the pair counts the
// preprocess zeroed (dq_done) without a wait of its own (bwd_postprocess_dq). (One thread's
// launch_dependents counts for its block.)
__device__ __forceinline__ void bwd_pdl_wait_then_launch() {
  pdl_wait();
  pdl_launch_dependents();
}

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    bwd_kernel(const __grid_constant__ typename Traits::Params params) {
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);
  // Programmatic dependent launch (bwd_launch.h): the producer and the dQ writers wait for the
  // preprocess where they first read its output (pdl_wait below); the consumers read only what
  // the producer loaded after its wait, and write dK, dV, which the preprocess does not touch.
  // The producer lets the postprocess launch once past its wait (bwd_pdl_wait_then_launch).

  int n_block, head, batch;
  bwd_block_coords<Traits::kCausal>(params.n_blocks, params.nheads, params.batch, params.l2_section, params.l2_big,
                                    n_block, head, batch);
  const int head_kv = head / params.nheads_per_kv;
  int m_begin, m_end;
  query_block_range<Traits>(n_block, params.seqlen_q, params.seqlen_k, m_begin, m_end);
  // The i-th query block this block visits: first to last, but last to first where causal.
  // NOTES: causal, the blocks running at the same time (consecutive key blocks of one head,
  // whose first query blocks differ) then all start at the last query block and move in step,
  // reading each Q, dO tile from L2 together and adding into the same dQ tile one after another,
  // as in the non-causal case; first to last, block n runs one query block ahead of block n + 1,
  // so the blocks of a head stream the whole head's Q, dO and dQ accumulator through L2 at once,
  // and in the deterministic mode each block waits a step for its predecessor. Measured
  // (docs/perf-log.md B8, B28): last to first +50% at head dim 256 at 8k-16k, and since the
  // in-order loop of B26-B27 also at head dims 64 and 128 (+2-8% at 512-2k, with the store-first
  // of bwd_dq_store_first it allows; within 3% either way from 4k).
  // kSpreadVisits (bwd_config.h), where the adds into a tile may come in any order (the default
  // mode without store-first: no dq_sem): the blocks of a head no longer move in step but are
  // spread over the query blocks: causal first to last (each from its own first block), non-causal
  // key block n from query block n * m_count / n_blocks on, wrapping around. Measured at head
  // dim 256 (docs/perf-log.md B39): +1-3% (so B8's +50% for last to first there no longer holds
  // since the L2 sections and the in-order loop); at head dims 64 and 128 no difference.
  const int m_count = m_end - m_begin;
  const bool spread = Traits::kSpreadVisits && params.dq_sem == nullptr;
  // One register for both orders: |base - i| is m_end - 1 - i with base = m_end - 1, and
  // m_begin + i with base = -m_begin. (A flag and both bounds cost a spill at head dim 128.)
  const int m_base = Traits::kCausal && !spread ? m_end - 1 : -m_begin;
  // (64-bit: n_block x m_count may pass 2^31 at a few million tokens.)
  const int m_rot = !Traits::kCausal && spread ? int(int64_t(n_block) * m_count / params.n_blocks) : 0;
  auto m_at = [&](int i) {
    int m = bwd_m_at(m_base, i);
    if constexpr (!Traits::kCausal && Traits::kSpreadVisits) {
      m += m_rot;
      if (m >= m_end) m -= m_count;
    }
    return m;
  };
  const int64_t bh = int64_t(batch) * params.nheads + head;

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const bool is_producer_thread = threadIdx.x == 0;

  const typename Pipeline::Params pipe_params = bwd_init_block<Traits>(params, shared, warpgroup, [] {});
  Pipeline pipeline_q(shared.pipeline_q, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_do(shared.pipeline_do, pipe_params, Shape<_1, _1, _1>{});
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(shared.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.smem_do.data()), typename Traits::SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(shared.smem_k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.smem_v.data()), typename Traits::SmemLayoutV{});

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp_in_wg == 0) {
      // ====================================== producer =====================================
      if (!is_producer_thread) return;
      Tensor mQ = params.tma_q.get_tma_tensor(params.layout_q.shape());
      Tensor mdO = params.tma_do.get_tma_tensor(params.layout_q.shape());
      Tensor mK = params.tma_k.get_tma_tensor(params.layout_k.shape());
      Tensor mV = params.tma_v.get_tma_tensor(params.layout_k.shape());
      Tensor gQ = local_tile(mQ(_, _, head, batch), TileQ{}, make_coord(_, _0{}));  // (M, D, m)
      Tensor gdO = local_tile(mdO(_, _, head, batch), TileQ{}, make_coord(_, _0{}));
      Tensor gK = local_tile(mK(_, _, head_kv, batch), TileKV{}, make_coord(n_block, _0{}));
      Tensor gV = local_tile(mV(_, _, head_kv, batch), TileKV{}, make_coord(n_block, _0{}));
      auto q_parts = tma_partition(params.tma_q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto do_parts = tma_partition(params.tma_do, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      auto k_parts = tma_partition(params.tma_k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto v_parts = tma_partition(params.tma_v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      uint64_t& kv_bar = reinterpret_cast<uint64_t&>(shared.barrier_kv);
      shared.barrier_kv.arrive_and_expect_tx(Traits::kTmaBytesKV);
      copy(params.tma_k.with(kv_bar), get<0>(k_parts), get<1>(k_parts));
      copy(params.tma_v.with(kv_bar), get<0>(v_parts), get<1>(v_parts));
      bwd_pdl_wait_then_launch();  // the preprocess's lse, D (K, V are inputs: loaded before)
      const float* lse = params.lse_log2 + bh * params.seqlen_q_pad;
      const float* dpsum = params.dpsum + bh * params.seqlen_q_pad;
      PipelineState write_q = cutlass::make_producer_start_state<Pipeline>();
      PipelineState write_do = cutlass::make_producer_start_state<Pipeline>();
      // NOTES: with 24 registers (head dims 64, 128) ptxas's 4-way unrolled copy spilled its
      // loop counters, so it is not unrolled there; at head dim 256 (40 registers, one stage:
      // every load waits for the consumers' release) the rolled loop measured 5-32% slower on
      // the causal sweep, so it stays unrolled as ptxas chose (4).
#pragma unroll(Traits::kProducerRegs < 32 ? 1 : 4)
      for (int i = 0; i < m_count; ++i) {
        bwd_load_visit<Traits>(params, shared, pipeline_q, pipeline_do, write_q, write_do, q_parts, do_parts, m_at(i),
                               lse, dpsum);
      }
    } else if (warp_in_wg <= Traits::kDQWriters) {
      // ==================================== dQ writers =====================================
      // (The dQ writers: bwd_dq_writer.)
      const int writer = warp_in_wg - 1;
      pdl_wait();  // the preprocess's clear of the accumulator, or of its counters
      bwd_dq_writer<Traits>(params, shared, writer, lane, bh, n_block, 0, m_count, m_at);
    }
    return;
  }

  // ======================================= consumers ========================================
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int tidx = threadIdx.x - 128;
  typename Traits::TiledMmadKV mma_dkv;
  Tensor tdVrdV = partition_fragment_C(mma_dkv, TileKV{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, TileKV{});
  clear(tdVrdV);
  clear(tdKrdK);
  const int col0 = n_block * kBlockN;
  shared.barrier_kv.wait(0);
  if constexpr (Traits::kSdPSwapAB) {
    PipelineState read_q, read_do;
    bwd_mainloop_swapped<Traits>(params, shared, pipeline_q, pipeline_do, 0, m_count, m_at, col0, tidx,
                                 tdKrdK, tdVrdV, read_q, read_do, shared.smem_k.data(), [] {});
  } else {
    bwd_mainloop_ss<Traits>(params, shared, pipeline_q, pipeline_do, m_count, m_at, col0, tidx,
                            tdKrdK, tdVrdV);
  }

  // ---- epilogue: dK (scaled), dV: straight to the outputs (MHA) or per query head (GQA) -------
  // Staged in the Q and dO buffers, free once both warpgroups' last GEMMs are done.
  static_assert(cosize_v<typename Traits::SmemLayoutQ> >= cosize_v<typename Traits::SmemLayoutK>);
  if constexpr (Traits::kTmaEpilogue) {
    if (params.dkv_tma) {
      // MHA: by TMA stores; the block's shared memory stays until they have read it.
      bwd_store_dkdv_tma<Traits>(params, tdKrdK, tdVrdV, tidx, n_block, head_kv, batch, shared.smem_q.data(),
                                 shared.smem_do.data());
      if (tidx == 0) tma_store_wait<0>();
      return;
    }
  }
  bwd_store_dkdv<Traits>(params, tdKrdK, tdVrdV, tidx, col0, head_kv, batch, bh, shared.smem_q.data(),
                         shared.smem_do.data());
}

// ------------------------------------------------------------------------------------------
// The persistent backward (Traits::kPersistent: swapped loop, where bwd_config.h's
// kPersistentCausal or kPersistentNonCausal is set).
// One block per SM (bwd_persistent_grid) takes blocks of work (key block, head, batch) in
// bwd_kernel's order (causal: bwd_causal_block's) from a counter (TileStream: a scheduler
// thread, warp 3 of the producer warpgroup, draws the next one when asked, and hands it to the
// producer, the dQ writers and the consumers through a two-slot ring). The next block's first Q, dO
// and K, V load while this one finishes. With K, V in registers (kEarlyKV, head dim 64) the next
// item is asked for when this one starts and its K, V load once this item's first loads are out: K
// into the second of two buffers, V once the consumers hold this item's in registers; the dK, dV
// epilogue stages in a buffer of its own. Otherwise K, V load as soon as the consumers' last GEMMs
// are done (barrier_kv_free), under the epilogue, which stages through the dS^T buffers (the Q, dO
// buffers already hold the next block's tiles). MHA: dK, dV leave by TMA stores
// (bwd_store_dkdv_tma). The visits are counted on across the items, so that the dS^T and dQ buffers
// and their barriers go on in turn: a visit waits only for the one dQ buffer it reuses, not for the
// writers to finish the previous item.
// NOTES: docs/perf-log.md B51 measured 1.7-3.2 us before K, V land and 2.1-2.9 us of epilogue per
// block of the one-block-per-item kernel, 14-17% of a causal block at seqlen 2k.

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    bwd_kernel_persistent(const __grid_constant__ typename Traits::Params params) {
  static_assert(Traits::kPersistent && Traits::kSdPSwapAB && !Traits::kSpreadVisits);
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  constexpr int kRingReaders = 1 + 32 * Traits::kDQWriters + Traits::kNumConsumerThreads;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const TileStream<true> items{params.tile_counter, params.num_items};
  // Work item t: its key block, (head, batch) pair and query blocks, visited last to first.
  struct Item {
    int n_block, head, batch, m_count, m_base;
    int64_t bh;
  };
  auto item_at = [&](int t) {
    Item it;
    int pair;
    if constexpr (Traits::kCausal) {
      bwd_causal_block(t, params.n_blocks, params.nheads * params.batch, params.l2_section, params.l2_big,
                       it.n_block, pair);
    } else {
      it.n_block = t % params.n_blocks;
      pair = t / params.n_blocks;
    }
    it.head = pair % params.nheads;
    it.batch = pair / params.nheads;
    it.bh = pair;
    int m_begin, m_end;
    query_block_range<Traits>(it.n_block, params.seqlen_q, params.seqlen_k, m_begin, m_end);
    it.m_count = m_end - m_begin;
    it.m_base = Traits::kCausal ? m_end - 1 : -m_begin;  // bwd_m_at
    return it;
  };

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int warp_in_wg = (threadIdx.x / 32) % 4;
  const int lane = threadIdx.x % 32;
  const bool is_producer_thread = threadIdx.x == 0;

  const typename Pipeline::Params pipe_params = bwd_init_block<Traits>(params, shared, warpgroup, [&] {
    shared.barrier_kv_free.init(Traits::kNumConsumerThreads);
    shared.barrier_v_free.init(Traits::kNumConsumerThreads);
    shared.barrier_k_free[0].init(Traits::kNumConsumerThreads);
    shared.barrier_k_free[1].init(Traits::kNumConsumerThreads);
    for (int i = 0; i < 2; ++i) {
      shared.tile_full[i].init(1);
      shared.tile_empty[i].init(kRingReaders);
    }
    shared.tile_request.init(1);
  });
  Pipeline pipeline_q(shared.pipeline_q, pipe_params, Shape<_1, _1, _1>{});
  Pipeline pipeline_do(shared.pipeline_do, pipe_params, Shape<_1, _1, _1>{});
  __syncthreads();

  Tensor sQ = make_tensor(make_smem_ptr(shared.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.smem_do.data()), typename Traits::SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(shared.smem_k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.smem_v.data()), typename Traits::SmemLayoutV{});

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (warp_in_wg == 0) {
      // ====================================== producer =====================================
      if (!is_producer_thread) return;
      Tensor mQ = params.tma_q.get_tma_tensor(params.layout_q.shape());
      Tensor mdO = params.tma_do.get_tma_tensor(params.layout_q.shape());
      Tensor mK = params.tma_k.get_tma_tensor(params.layout_k.shape());
      Tensor mV = params.tma_v.get_tma_tensor(params.layout_k.shape());
      uint64_t& kv_bar = reinterpret_cast<uint64_t&>(shared.barrier_kv);
      PipelineState write_q = cutlass::make_producer_start_state<Pipeline>();
      PipelineState write_do = cutlass::make_producer_start_state<Pipeline>();
      if constexpr (Traits::kEarlyKV) {
        // The next item is requested as soon as this one is known, and its K, V are loaded once
        // this item's first loads are out (as many as there are stages), the consumers have
        // copied this item's V into registers, and the K buffer's previous item is done. With
        // params.late_request (deterministic, and non-causal: bwd_launch.h) the next item is
        // requested, and its K, V loaded, only once this item's last load is out.
        // NOTES: an item drawn early waits, drawn but not started, for up to an item's length
        // while its SM finishes the current one; in the deterministic mode the key blocks whose
        // adds wait for its adds stall (head dim 64 0.55-0.83x the default from 2k, B59).
        auto load_kv = [&](const Item& nx, int k_next) {
          const int hk = nx.head / params.nheads_per_kv;
          Tensor gK = local_tile(mK(_, _, hk, nx.batch), TileKV{}, make_coord(nx.n_block, _0{}));
          Tensor gV = local_tile(mV(_, _, hk, nx.batch), TileKV{}, make_coord(nx.n_block, _0{}));
          Tensor sKb = make_tensor(make_smem_ptr((k_next & 1) ? shared.smem_k_alt.data() : shared.smem_k.data()),
                                   typename Traits::SmemLayoutK{});
          auto k_parts = tma_partition(params.tma_k, group_modes<0, 2>(sKb), group_modes<0, 2>(gK));
          auto v_parts = tma_partition(params.tma_v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
          shared.barrier_kv.arrive_and_expect_tx(Traits::kTmaBytesKV);
          copy(params.tma_k.with(kv_bar), get<0>(k_parts), get<1>(k_parts));
          copy(params.tma_v.with(kv_bar), get<0>(v_parts), get<1>(v_parts));
        };
        int t = items.tile(0, shared);
        if (t < params.num_items) {
          load_kv(item_at(t), 0);
          bwd_pdl_wait_then_launch();  // the preprocess's lse, D (K, V are inputs: loaded before)
        }
        for (int k = 0; t < params.num_items; ++k) {
          const Item it = item_at(t);
          const bool late = params.late_request;
          if (!late) shared.tile_request.arrive();  // the next item, please (drawn while this one loads)
          Tensor gQ = local_tile(mQ(_, _, it.head, it.batch), TileQ{}, make_coord(_, _0{}));  // (M, D, m)
          Tensor gdO = local_tile(mdO(_, _, it.head, it.batch), TileQ{}, make_coord(_, _0{}));
          auto q_parts = tma_partition(params.tma_q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
          auto do_parts = tma_partition(params.tma_do, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
          const float* lse = params.lse_log2 + it.bh * params.seqlen_q_pad;
          const float* dpsum = params.dpsum + it.bh * params.seqlen_q_pad;
          int t_next = params.num_items;
          auto prefetch = [&]() {
            if (late) shared.tile_request.arrive();
            t_next = items.tile(k + 1, shared);
            if (t_next >= params.num_items) return;
            shared.barrier_v_free.wait(k & 1);  // this item's V is in registers
            if (k + 1 >= 2) shared.barrier_k_free[(k + 1) & 1].wait((((k + 1) >> 1) - 1) & 1);  // item k - 1
            load_kv(item_at(t_next), k + 1);
          };
          const int at = (late || it.m_count < Traits::kStages ? it.m_count : Traits::kStages) - 1;
          if (at < 0) prefetch();
#pragma unroll 1
          for (int i = 0; i < it.m_count; ++i) {
            bwd_load_visit<Traits>(params, shared, pipeline_q, pipeline_do, write_q, write_do, q_parts, do_parts,
                                   bwd_m_at(it.m_base, i), lse, dpsum);
            if (i == at) prefetch();
          }
          t = t_next;
        }
      } else
      for (int k = 0;; ++k) {
        const int t = items.tile(k, shared);
        if (t >= params.num_items) break;
        const Item it = item_at(t);
        const int head_kv = it.head / params.nheads_per_kv;
        Tensor gQ = local_tile(mQ(_, _, it.head, it.batch), TileQ{}, make_coord(_, _0{}));  // (M, D, m)
        Tensor gdO = local_tile(mdO(_, _, it.head, it.batch), TileQ{}, make_coord(_, _0{}));
        Tensor gK = local_tile(mK(_, _, head_kv, it.batch), TileKV{}, make_coord(it.n_block, _0{}));
        Tensor gV = local_tile(mV(_, _, head_kv, it.batch), TileKV{}, make_coord(it.n_block, _0{}));
        auto q_parts = tma_partition(params.tma_q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
        auto do_parts = tma_partition(params.tma_do, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
        // K, V once the consumers are done with the previous block's (its epilogue then runs
        // while they load).
        auto load_kv = [&]() {
          if (k > 0) shared.barrier_kv_free.wait((k - 1) & 1);
          auto k_parts = tma_partition(params.tma_k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
          auto v_parts = tma_partition(params.tma_v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
          shared.barrier_kv.arrive_and_expect_tx(Traits::kTmaBytesKV);
          copy(params.tma_k.with(kv_bar), get<0>(k_parts), get<1>(k_parts));
          copy(params.tma_v.with(kv_bar), get<0>(v_parts), get<1>(v_parts));
        };
        if (k == 0) {
          load_kv();
          bwd_pdl_wait_then_launch();  // the preprocess's lse, D (K, V are inputs: loaded before)
        }
        const float* lse = params.lse_log2 + it.bh * params.seqlen_q_pad;
        const float* dpsum = params.dpsum + it.bh * params.seqlen_q_pad;
#pragma unroll 1
        for (int i = 0; i < it.m_count; ++i) {
          bwd_load_visit<Traits>(params, shared, pipeline_q, pipeline_do, write_q, write_do, q_parts, do_parts,
                                 bwd_m_at(it.m_base, i), lse, dpsum);
          if (k > 0 && i == 0) load_kv();
        }
        if (k > 0 && it.m_count == 0) load_kv();
        shared.tile_request.arrive();  // the next block, please
      }
    } else if (warp_in_wg <= Traits::kDQWriters) {
      // ==================================== dQ writers =====================================
      // As in bwd_kernel, per block, the visits counted on.
      const int writer = warp_in_wg - 1;
      pdl_wait();  // the preprocess's clear of the accumulator, or of its counters
      int g = 0;   // this block's visits so far
      for (int k = 0;; ++k) {
        const int t = items.tile(k, shared);
        if (t >= params.num_items) break;
        const Item it = item_at(t);
        bwd_dq_writer<Traits, true>(params, shared, writer, lane, it.bh, it.n_block, g, g + it.m_count,
                                    [base = it.m_base + g](int i) { return bwd_m_at(base, i); });
        g += it.m_count;
      }
    } else if (warp_in_wg == 3 && lane == 0) {
      // ===================================== scheduler =====================================
      for (int k = 0;; ++k) {
        if (k > 0) shared.tile_request.wait((k - 1) & 1);
        const int t = items.draw(k);
        items.publish(k, t, shared.tile_ring, shared.tile_full, shared.tile_empty);
        if (t >= params.num_items) break;
      }
    }
    return;
  }

  // ======================================= consumers ========================================
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
  const int tidx = threadIdx.x - 128;
  typename Traits::TiledMmadKV mma_dkv;
  Tensor tdVrdV = partition_fragment_C(mma_dkv, TileKV{});
  Tensor tdKrdK = partition_fragment_C(mma_dkv, TileKV{});
  PipelineState read_q, read_do;
  int g = 0;  // this block's visits so far
  for (int k = 0;; ++k) {
    const int t = items.tile(k, shared);
    if (t >= params.num_items) break;
    const Item it = item_at(t);
    const int col0 = it.n_block * kBlockN;
    const int base = it.m_base + g;
    auto m_at = [base](int i) { return bwd_m_at(base, i); };
    clear(tdVrdV);
    clear(tdKrdK);
    // The previous item's dK, dV stores have read their staging tiles, where those were the dS^T
    // buffers: not with kEarlyKV, whose MHA epilogue stages in a buffer of its own (kTmaEpilogue
    // at head dim 64) and whose GQA epilogue stages nothing.
    bool staged_in_pds = !Traits::kEarlyKV;
#ifdef FLASH3_EXP_PERSIST_AB
    staged_in_pds |= !params.dkv_tma && params.dk_accum == nullptr;  // FLASH3_EXP_TMA_EPI=0, MHA
#endif
    if (staged_in_pds && k > 0) {
      if (tidx == 0) tma_store_wait<0>();
      named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);
    }
    shared.barrier_kv.wait(k & 1);
    typename Traits::Element* k_tile = shared.smem_k.data();
    if constexpr (Traits::kEarlyKV) {
      if (k & 1) k_tile = shared.smem_k_alt.data();
    }
    bwd_mainloop_swapped<Traits>(params, shared, pipeline_q, pipeline_do, g, g + it.m_count, m_at, col0, tidx,
                                 tdKrdK, tdVrdV, read_q, read_do, k_tile, [&] {
                                   if constexpr (Traits::kEarlyKV) shared.barrier_v_free.arrive();
                                 });
    g += it.m_count;
    // This thread's GEMMs, the last readers of K (and V), are done.
    if constexpr (Traits::kEarlyKV) {
      shared.barrier_k_free[k & 1].arrive();
    } else {
      shared.barrier_kv_free.arrive();
    }

    // ---- epilogue: dK (scaled), dV, as in bwd_kernel, but staged in a buffer of their own -----
    // (kEarlyKV; the next epilogue waits for the stores' reads) or in the two dS^T buffers (the Q
    // and dO buffers hold the next block's first tiles; the consumers meet at the next item's
    // start, after the stores have read them, before any stores the next dS^T).
    // The item and the thread index again from opaque copies: otherwise ptxas keeps the item's
    // output pointers and the epilogue's 64 shared-memory addresses, which do not depend on the
    // item, live across the main loop (108 bytes spilled at head dim 128, reloaded in the row loop).
    static_assert(2 * kBlockN * kHeadDim <= int(cosize_v<typename Traits::SmemLayoutdStStore>));
    int t_after, tidx_after;
    asm volatile("mov.b32 %0, %1;" : "=r"(t_after) : "r"(t));
    asm volatile("mov.b32 %0, %1;" : "=r"(tidx_after) : "r"(tidx));
    const Item ie = item_at(t_after);
    if (params.dkv_tma) {
      // Staged in a buffer of their own (kEarlyKV), or else in the dS^T buffers.
      typename Traits::Element* stage = shared.smem_pds.data();
      if constexpr (Traits::kEarlyKV) stage = shared.smem_dkv_stage.data();
      bwd_store_dkdv_tma<Traits>(params, tdKrdK, tdVrdV, tidx_after, ie.n_block, ie.head / params.nheads_per_kv,
                                 ie.batch, stage, stage + cosize_v<typename Traits::SmemLayoutK>);
    } else {
      bwd_store_dkdv<Traits>(params, tdKrdK, tdVrdV, tidx_after, ie.n_block * kBlockN, ie.head / params.nheads_per_kv,
                             ie.batch, ie.bh, shared.smem_pds.data(), shared.smem_pds.data() + kBlockN * kHeadDim);
    }
  }
  if (tidx == 0) tma_store_wait<0>();  // the last stores' reads, before the block's shared memory goes
}

// ------------------------------------------------------------------------------------------
// Pre- and post-processing. One block of 256 threads per (query tile, head, batch).
struct BwdAuxParams {
  const void* out;
  const void* dout;
  const float* lse;
  void* dq;
  int64_t out_row, out_head, out_batch;
  int64_t dout_row, dout_head, dout_batch;
  int64_t lse_head, lse_batch;
  int64_t dq_row, dq_head, dq_batch;
  float* lse_log2;
  float* dpsum;
  float* dq_accum;
  int* dq_sem;
  int dq_groups;
  int batch, seqlen_q, nheads, head_dim, m_blocks;
  int64_t seqlen_q_pad;
  float softmax_scale;
  int* dq_done = nullptr;  // per pair: the main kernel's writers done (bwd_config.h); null: see below
  int dq_done_target = 0;  // ... their number: key blocks x writers
};

// Block -> (query tile, head, batch), the last (head, batch) first, or the first (`forward`).
// NOTES: the main kernel starts with the first (head, batch) pairs and ends with the last, so
// the preprocess, in reverse, leaves the first pairs' dO and cleared dQ tiles (or counters) in
// L2 for the main kernel's start. The postprocess, where it waits for the whole main kernel,
// in reverse reads the tiles the main kernel added into last while they are still in L2 (50 MB,
// about a third of the FP32 dQ at 16k tokens x hidden 2048; with programmatic dependent launch,
// bwd_launch.h: +0.3-2% at 512-4k, docs/perf-log.md B31); where it waits per pair (dq_done), it
// goes first to last, in the order the main kernel finishes the pairs.
__device__ __forceinline__ void aux_block_coords(int m_blocks, int nheads, int& m, int& head, int& batch,
                                                 bool forward = false) {
  const int b = forward ? int(blockIdx.x) : int(gridDim.x) - 1 - int(blockIdx.x);
  m = b % m_blocks;
  head = (b / m_blocks) % nheads;
  batch = (b / m_blocks) / nheads;
}

// 16 bytes of 16-bit elements as 8 floats, and back.
template <class Element>
__device__ __forceinline__ void load8(const Element* src, float (&x)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  cutlass::NumericArrayConverter<float, Element, 8> cvt;
  const cutlass::Array<float, 8> f = cvt(*reinterpret_cast<const cutlass::Array<Element, 8>*>(&raw));
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 8; ++i) x[i] = f[i];
}

// NOTES: one thread per 16 bytes of a row (kHeadDim / 8 threads per row): 16-byte loads, the
// row's dot product reduced over those threads with shuffles. (Per-lane 4-byte loads, one row
// per warp, measured 81 us at 16k tokens x 16 heads x 128, against 71 us for cuDNN's.)
template <class Element, int kBlockM, int kHeadDim>
__global__ void __launch_bounds__(256) bwd_preprocess(const BwdAuxParams p) {
  pdl_launch_dependents();
  int m, head, batch;
  aux_block_coords(p.m_blocks, p.nheads, m, head, batch);
  const int64_t bh = int64_t(batch) * p.nheads + head;
  constexpr int kThreadsPerRow = kHeadDim / 8, kRowsPerPass = 256 / kThreadsPerRow;
  static_assert(kBlockM % kRowsPerPass == 0);
  const int col = (threadIdx.x % kThreadsPerRow) * 8;
  const Element* out = static_cast<const Element*>(p.out) + batch * p.out_batch + head * p.out_head + col;
  const Element* dout = static_cast<const Element*>(p.dout) + batch * p.dout_batch + head * p.dout_head + col;
  float d[kBlockM / kRowsPerPass];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kBlockM / kRowsPerPass; ++i) {  // all loads first, then the reductions
    const int row = m * kBlockM + i * kRowsPerPass + int(threadIdx.x) / kThreadsPerRow;
    d[i] = 0.0f;
    if (row < p.seqlen_q) {
      float o[8], g[8];
      load8(out + row * p.out_row, o);
      load8(dout + row * p.dout_row, g);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 8; ++e) d[i] = fmaf(o[e], g[e], d[i]);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kBlockM / kRowsPerPass; ++i) {
    CUTLASS_PRAGMA_UNROLL
    for (int mask = 1; mask < kThreadsPerRow; mask *= 2) d[i] += __shfl_xor_sync(0xffffffffu, d[i], mask);
    const int row = m * kBlockM + i * kRowsPerPass + int(threadIdx.x) / kThreadsPerRow;
    if (threadIdx.x % kThreadsPerRow == 0) {
      const int64_t at = bh * p.seqlen_q_pad + row;
      p.dpsum[at] = d[i];
      // Padding rows get +inf, so that P = exp2(S - lse) = 0 there; rows that saw no key in the
      // forward pass already have lse = +inf.
      p.lse_log2[at] = row < p.seqlen_q
                           ? p.lse[batch * p.lse_batch + head * p.lse_head + row] * float(M_LOG2E)
                           : INFINITY;
    }
  }
  if (p.dq_done != nullptr && m == 0 && threadIdx.x == 0) p.dq_done[bh] = 0;
  if (p.dq_sem != nullptr) {  // each copy's first add is a store (bwd_config.h)
    if (int(threadIdx.x) < p.dq_groups) p.dq_sem[(bh * p.m_blocks + m) * p.dq_groups + threadIdx.x] = 0;
  } else {
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + (bh * p.m_blocks + m) * kBlockM * kHeadDim);
    CUTLASS_PRAGMA_UNROLL
    for (int i = threadIdx.x; i < kBlockM * kHeadDim / 4; i += 256) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

// dQ = scale * accumulator, from the register order the main kernel stored it in.
// NOTES: the tile goes through shared memory, row-major with rows padded by 8 floats (the
// float2 stores of a half-warp, 4 rows x 4 threads, then hit 32 distinct banks), so that each
// thread writes 16 contiguous bytes of dQ. (Writing 4 bytes per thread straight from the
// register order scattered every warp store over 8 rows: 177 us where cuDNN's conversion
// takes 57, at 16k tokens x 16 heads x 128.)
// NOTES: with dq_done, a block waits only for its own pair's key blocks (all their writers have
// counted their adds complete, bwd_dq_writer), so that the postprocess runs on the SMs the main
// kernel's last wave leaves idle: the postprocess launches under the main kernel (programmatic
// dependent launch, once the preprocess is complete: bwd_pdl_wait_then_launch) and its blocks
// take SMs as the main kernel's blocks end. The grid's last block still waits for the whole main
// kernel, so that the postprocess ends after it (its dK, dV, and the GQA postprocess's FP32
// inputs, are complete when the stream moves on). Without dq_done (no main kernel: seqlen_k = 0;
// or an experiment switch, bwd_launch.h), every block waits for the main kernel to end.
template <class Traits>
__global__ void __launch_bounds__(256) bwd_postprocess_dq(const BwdAuxParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim, kStride = kHeadDim + 8;
  extern __shared__ float4 smem_dq_raw[];
  float* tile_s = reinterpret_cast<float*>(smem_dq_raw);
  const bool per_pair = p.dq_done != nullptr;
  int m, head, batch;
  aux_block_coords(p.m_blocks, p.nheads, m, head, batch, per_pair);
  const int64_t bh = int64_t(batch) * p.nheads + head;
  if (!per_pair || blockIdx.x == gridDim.x - 1) pdl_wait();  // the whole main kernel
  if (per_pair) {
    if (threadIdx.x == 0) {
      for (int sleep = 64;;) {
        if (ld_acquire_gpu(p.dq_done + bh) >= p.dq_done_target) break;
        __nanosleep(sleep);
        sleep = sleep < 2048 ? 2 * sleep : sleep;
      }
    }
    __syncthreads();  // the acquire above, for the whole block
  }
  // Fragment thread t (bwd_dq_frag_thread), its pairs j0 .. j0 + kPairs - 1 (all of them where
  // the dQ GEMM has 256 threads; half where it has 128, kDQAlternate).
  constexpr int kFrag = Traits::kDQFragThreads;
  typename Traits::TiledMmadQ mma;
  const int t = bwd_dq_frag_thread<Traits>(threadIdx.x);
  auto thr = mma.get_thread_slice(t);
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  const int64_t tile_at = (bh * p.m_blocks + m) * p.dq_groups;
  const float2* tile = reinterpret_cast<const float2*>(p.dq_accum + tile_at * kBlockM * kHeadDim);
  constexpr int kPairs = decltype(size(coords))::value / 2 * kFrag / 256;
  const int j0 = kFrag == 256 ? 0 : int(threadIdx.x) / kFrag * kPairs;
  float2 v[kPairs];
  if (p.dq_sem == nullptr) {
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kPairs; ++j) v[j] = tile[(j0 + j) * kFrag + t];
  } else {
    // The sum of the copies that were written, in order (bwd_config.h); 0 where none was.
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kPairs; ++j) v[j] = make_float2(0.f, 0.f);
    for (int g = 0; g < p.dq_groups; ++g) {
      if (p.dq_sem[tile_at + g] == 0) continue;
      const float2* copy = tile + g * (kBlockM * kHeadDim / 2);
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kPairs; ++j) {
        const float2 x = copy[(j0 + j) * kFrag + t];
        v[j].x += x.x;
        v[j].y += x.y;
      }
    }
  }
  // With j0 known at compile time (the coordinates are then constants plus the thread's offset).
  auto scatter = [&](auto j0_c) {
    constexpr int kJ0 = decltype(j0_c)::value;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kPairs; ++j) {
      const int r = get<0>(coords(2 * (kJ0 + j))), c = get<1>(coords(2 * (kJ0 + j)));
      *reinterpret_cast<float2*>(tile_s + r * kStride + c) = v[j];
    }
  };
  if (j0 == 0) {
    scatter(Int<0>{});
  } else {
    scatter(Int<kPairs>{});
  }
  __syncthreads();
  constexpr int kThreadsPerRow = kHeadDim / 8, kRowsPerPass = 256 / kThreadsPerRow;
  const int col = (threadIdx.x % kThreadsPerRow) * 8;
  Element* dq = static_cast<Element*>(p.dq) + batch * p.dq_batch + head * p.dq_head + col;
  cutlass::NumericArrayConverter<Element, float, 8> cvt;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kBlockM / kRowsPerPass; ++i) {
    const int r = i * kRowsPerPass + int(threadIdx.x) / kThreadsPerRow, row = m * kBlockM + r;
    if (row >= p.seqlen_q) continue;
    const float4 a = *reinterpret_cast<const float4*>(tile_s + r * kStride + col);
    const float4 b = *reinterpret_cast<const float4*>(tile_s + r * kStride + col + 4);
    cutlass::Array<float, 8> x;
    x[0] = a.x * p.softmax_scale; x[1] = a.y * p.softmax_scale;
    x[2] = a.z * p.softmax_scale; x[3] = a.w * p.softmax_scale;
    x[4] = b.x * p.softmax_scale; x[5] = b.y * p.softmax_scale;
    x[6] = b.z * p.softmax_scale; x[7] = b.w * p.softmax_scale;
    const cutlass::Array<Element, 8> y = cvt(x);
    *reinterpret_cast<uint4*>(dq + row * p.dq_row) = *reinterpret_cast<const uint4*>(&y);
  }
}
template <class Traits>
constexpr int bwd_postprocess_dq_smem() {
  return Traits::kBlockM * (Traits::kHeadDim + 8) * int(sizeof(float));
}

// GQA/MQA: dK = scale * sum over the query heads of a kv head, dV likewise, in head order.
// One thread per pair of adjacent elements of (batch, seqlen_k, nheads_kv, head_dim).
template <class Element>
__global__ void bwd_postprocess_dkv(const float* dk_accum, const float* dv_accum, Element* dk,
                                    Element* dv, int64_t dk_row, int64_t dk_head, int64_t dk_batch,
                                    int64_t dv_row, int64_t dv_head, int64_t dv_batch, int batch,
                                    int seqlen_k, int nheads_kv, int group, int head_dim,
                                    int64_t seqlen_k_pad, float softmax_scale) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int pairs = head_dim / 2;
  const int64_t total = int64_t(batch) * seqlen_k * nheads_kv * pairs;
  if (i >= total) return;
  const int c = int(i % pairs) * 2;
  const int hk = int((i / pairs) % nheads_kv);
  const int row = int((i / pairs / nheads_kv) % seqlen_k);
  const int b = int(i / pairs / nheads_kv / seqlen_k);
  float k0 = 0.f, k1 = 0.f, v0 = 0.f, v1 = 0.f;
  for (int g = 0; g < group; ++g) {
    const int64_t h = int64_t(b) * nheads_kv * group + int64_t(hk) * group + g;
    const int64_t at = (h * seqlen_k_pad + row) * head_dim + c;
    const float2 kk = *reinterpret_cast<const float2*>(dk_accum + at);
    const float2 vv = *reinterpret_cast<const float2*>(dv_accum + at);
    k0 += kk.x;
    k1 += kk.y;
    v0 += vv.x;
    v1 += vv.y;
  }
  cutlass::NumericArrayConverter<Element, float, 2> cvt;
  cutlass::Array<float, 2> x;
  x[0] = k0 * softmax_scale;
  x[1] = k1 * softmax_scale;
  *reinterpret_cast<cutlass::Array<Element, 2>*>(dk + b * dk_batch + row * dk_row + hk * dk_head + c) = cvt(x);
  x[0] = v0;
  x[1] = v1;
  *reinterpret_cast<cutlass::Array<Element, 2>*>(dv + b * dv_batch + row * dv_row + hk * dv_head + c) = cvt(x);
}

}  // namespace flash3::detail

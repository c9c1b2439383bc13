// flash3: compile-time description of one backward kernel: tiles, warp roles, shared-memory
// layouts, the three WGMMA tilings, TMA types, parameters and shared storage.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "bwd/bwd_config.h"

namespace flash3::detail {

using namespace cute;

template <class Element_, int kHeadDim_, bool kCausal_>
struct BwdTraits {
  using Element = Element_;
  using Config = BwdTileConfig<kHeadDim_>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  static constexpr bool kCausal = kCausal_;
  // The overlapped loop schedule (bwd_kernel.h); needs two stages.
  static constexpr bool kOverlapBlocks = kHeadDim == 64;
  static_assert(!kOverlapBlocks || kStages >= 2);

  // Warpgroup 0: warp 0 is the producer (TMA), warp 1 the dQ writer; warpgroups 1 and 2 are the
  // consumers, which split every GEMM between them.
  static constexpr int kNumConsumerThreads = 256;
  static constexpr int kNumThreads = 128 + kNumConsumerThreads;
  // NOTES: setmaxnreg moves registers within the pool the block got at launch, 168 x 384 =
  // 64512 (ptxas's per-thread cap for 384 threads); an increase past what the decreases freed
  // waits forever. 40 x 128 + 232 x 256 = 64512. (The producer spilled at 32.)
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kNumConsumerThreads <= 168 * kNumThreads);

  // ---- WGMMA tilings (two warpgroups each; a warpgroup's atom is 64 rows) -------------------
  // NOTES: a 128-row GEMM is split along M (one 64-row atom per warpgroup); a 64-row GEMM is
  // split along N (each warpgroup takes half the columns).
  template <int M, int N>
  using Split = Layout<Shape<Int<M == 128 ? 2 : 1>, Int<M == 128 ? 1 : 2>, _1>>;
  template <int M, int N, int K>
  using AtomTile = Shape<_64, Int<M == 128 ? N : N / 2>, Int<K>>;
  // S = Q K^T and dP = dO V^T: (kBlockM, kBlockN, d), both operands K-major.
  using TiledMmaSdP = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, AtomTile<kBlockM, kBlockN, kHeadDim>>(),
      Split<kBlockM, kBlockN>{}));
  // dV += P^T dO and dK += dS^T Q: (kBlockN, d, kBlockM), both operands MN-major (transposed
  // views of the row-major tiles in shared memory).
  using TiledMmadKV = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, AtomTile<kBlockN, kHeadDim, kBlockM>,
                           GMMA::Major::MN, GMMA::Major::MN>(),
      Split<kBlockN, kHeadDim>{}));
  // dQ = dS K: (kBlockM, d, kBlockN), dS K-major, K^T MN-major.
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, AtomTile<kBlockM, kHeadDim, kBlockN>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Split<kBlockM, kHeadDim>{}));

  // ---- shared memory: row-major tiles with the 128-byte swizzle -----------------------------
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ =
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutdO = SmemLayoutQ;
  using SmemLayoutK = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutP = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutdS = SmemLayoutP;
  // Transposed views (the same bytes): Q^T, dO^T as (d, kBlockM, stage), K^T as (d, kBlockN),
  // P^T, dS^T as (kBlockN, kBlockM).
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{},
      make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutdOt = SmemLayoutQt;
  using SmemLayoutKt = decltype(composition(
      SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  using SmemLayoutPt = decltype(composition(
      SmemLayoutP{}, make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Step<_2, _1>{})));
  using SmemLayoutdSt = SmemLayoutPt;

  // ---- global tensors: (seqlen, head_dim, heads, batch), head dim contiguous ---------------
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using LayoutQKV = Layout<ShapeQKV, StrideQKV>;

  static auto make_tma_q(Element const* ptr, LayoutQKV layout) {  // also dO
    return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), layout),
                         take<0, 2>(SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
  }
  static auto make_tma_kv(Element const* ptr, LayoutQKV layout) {
    return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), layout), SmemLayoutK{},
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
  }
  using TmaQ = decltype(make_tma_q(nullptr, LayoutQKV{}));
  using TmaKV = decltype(make_tma_kv(nullptr, LayoutQKV{}));

  // One stage: a Q (or dO) tile plus its kBlockM log-sum-exps (or D values).
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element) + kBlockM * sizeof(float);
  static constexpr uint32_t kTmaBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);
  static constexpr int kDQElems = kBlockM * kHeadDim;  // one FP32 dQ tile
  // dQ tiles in shared memory: two where they fit, so the consumers rarely wait for the writer
  // (in deterministic mode the writer waits for the previous key block's adds).
  static constexpr int kDQStages = Config::kDQStages;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename cutlass::PipelineState<kStages>;

  struct Params {
    TmaQ tma_q, tma_do;
    TmaKV tma_k, tma_v;
    LayoutQKV layout_q, layout_k;  // logical shapes (TMA bounds)
    const float* lse_log2;         // workspace (bwd_config.h)
    const float* dpsum;
    float* dq_accum;
    int* dq_sem;                   // deterministic mode, else null
    float* dk_accum;               // GQA/MQA: per-query-head FP32 dK, dV; else null
    float* dv_accum;
    Element* dk;                   // MHA: written directly
    Element* dv;
    int64_t dk_row_stride, dk_head_stride, dk_batch_stride;
    int64_t dv_row_stride, dv_head_stride, dv_batch_stride;
    int batch, seqlen_q, seqlen_k, nheads, nheads_per_kv;
    int m_blocks, n_blocks;
    int l2_section;  // causal block order: (head, batch) pairs per L2 section
    int last_to_first;  // causal: visit the query blocks last to first (see bwd_kernel.h)
    int64_t seqlen_q_pad, seqlen_k_pad;
    float softmax_scale, scale_log2;
  };

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdO>, 1024> smem_do;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutP>, 1024> smem_p;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutdS>, 1024> smem_ds;
    alignas(128) float smem_dq[kDQStages * kDQElems];
    alignas(16) float smem_lse[kStages * kBlockM];
    alignas(16) float smem_dpsum[kStages * kBlockM];
    cutlass::arch::ClusterTransactionBarrier barrier_kv;
    typename Pipeline::SharedStorage pipeline_q;
    typename Pipeline::SharedStorage pipeline_do;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "backward tile config exceeds 227 KB of shared memory");
};

}  // namespace flash3::detail

// flash3: compile-time description of one FP8 (e4m3) forward kernel, the counterpart of
// fwd_traits.h's FwdTraits for the same kernel (fwd_kernel.h), scheduler, load and epilogue:
// e4m3 tiles with the swizzle their rows allow, both GEMMs in e4m3, a second V ring (Vt) that
// the producer warpgroup's transposer warps fill, O out in bfloat16.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/mask.h"
#include "common/seqlen.h"
#include "fwd/fwd_config.h"
#include "fwd/fwd_epilogue.h"
#include "fwd/fwd_fp8_mainloop.h"
#include "fwd/fwd_fp8_transpose.h"
#include "fwd/fwd_load.h"
#include "fwd/fwd_scheduler.h"
#include "fwd/fwd_traits.h"

namespace flash3::detail {

using namespace cute;

template <int kHeadDim_, bool kCausal_>
struct FwdFp8Traits {
  using Element = cutlass::float_e4m3_t;
  using ElementOut = cutlass::bfloat16_t;
  using Config = FwdFp8TileConfig<kHeadDim_>;
  static constexpr bool kFp8 = true;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Config::kBlockM;
  static constexpr int kBlockN = Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  static constexpr int kStagesV = Config::kStages;
  static constexpr bool kCausal = kCausal_;
  static constexpr bool kGeneral = false;  // neither is built for FP8
  static constexpr bool kUniformDescriptors = false;
  using MaskT = Mask<kCausal, false>;
  static constexpr bool kDynamicTiles = kCausal;
  static constexpr bool kPingpong = true;
  static constexpr bool kIntraWGOverlap = true;
  static constexpr bool kThreeStage = false;
  static constexpr bool kTailPieces = false;

  // Warpgroup 0: thread 0 issues the TMA loads, thread 32 draws tiles (causal), warps 2 and 3
  // transpose V (fwd_fp8_transpose.h); warpgroups 1.. are consumers, 64 query rows each.
  static constexpr int kNumConsumerWG = kBlockM / 64;
  static constexpr int kNumConsumerThreads = 128 * kNumConsumerWG;
  static constexpr int kNumThreads = 128 + kNumConsumerThreads;
  static constexpr int kTransposeWarps = 2;
  // NOTES: setmaxnreg moves registers within the block's launch allocation: 168 x 384 = 64512
  // with two consumer warpgroups, 128 x 512 = 65536 with three. 40 x 128 + 232 x 256 and
  // 56 x 128 + 152 x 384 fill them exactly. 240 for two consumer warpgroups (the 16-bit kernel's,
  // with 24 for the producer) would leave the transposers 24, and 40 + 240 would wait forever
  // for registers the block does not have. The transposers need their 40: with 32 they spilled
  // their pipeline state.
  static constexpr int kProducerRegs = kNumConsumerWG == 2 ? 40 : 56;
  static constexpr int kConsumerRegs = kNumConsumerWG == 2 ? 232 : 152;
  static constexpr bool kLastPvOwnTurn = kNumConsumerWG != 2;
  static_assert(kNumConsumerWG == 2 || kNumConsumerWG == 3);
  static_assert(kProducerRegs * 128 + kConsumerRegs * kNumConsumerThreads <= 65536);

  using AtomLayoutMNK = Layout<Shape<Int<kNumConsumerWG>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(), AtomLayoutMNK{}));
  // P from registers, V^T k-major (keys contiguous): FP8 WGMMA reads no MN-major operand.
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>, GMMA::Major::K,
                           GMMA::Major::K>(),
      AtomLayoutMNK{}));

  // Rows of head_dim bytes (Q, K, V) and of kBlockN bytes (Vt): the widest swizzle each allows.
  using SmemAtomQKV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                               GMMA::Major::K, Element, Int<kBlockN>, Int<kHeadDim>>());
  using SmemAtomVt = decltype(cutlass::gemm::collective::detail::ss_smem_selector<
                              GMMA::Major::K, Element, Int<kHeadDim>, Int<kBlockN>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtomQKV{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(tile_to_shape(SmemAtomQKV{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutV = SmemLayoutK;
  using SmemLayoutVt = decltype(tile_to_shape(SmemAtomVt{}, Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStagesV>>{}));

  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using LayoutQKV = Layout<ShapeQKV, StrideQKV>;

  static auto make_tma_q(Element const* ptr, LayoutQKV layout) {
    return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), layout), SmemLayoutQ{},
                         Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
  }
  static auto make_tma_kv(Element const* ptr, LayoutQKV layout) {
    return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), layout), take<0, 2>(SmemLayoutK{}),
                         Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
  }
  // O leaves from registers (no TMA store); a placeholder type for the epilogue's parameters.
  static auto make_tma_o(ElementOut* ptr, LayoutQKV layout) {
    using AtomO = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<ElementOut>{}, Shape<_64, Int<kHeadDim>>{}));
    return make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(ptr), layout), AtomO{},
                         Shape<_64, Int<kHeadDim>>{}, _1{});
  }
  using TmaQ = decltype(make_tma_q(nullptr, LayoutQKV{}));
  using TmaKV = decltype(make_tma_kv(nullptr, LayoutQKV{}));
  using TmaO = decltype(make_tma_o(nullptr, LayoutQKV{}));
  static constexpr bool kStageOInQ = false;
  static constexpr int kQFreeArrivals = kNumConsumerThreads;

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim;
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim;

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename cutlass::PipelineState<kStages>;
  using PipelineV = Fp8VPipeline<kStagesV, kTransposeWarps, kNumConsumerThreads>;
  using PipelineStateV = typename cutlass::PipelineState<kStagesV>;
  using Mainloop = FwdFp8Mainloop<FwdFp8Traits>;
  using Params = FwdParams<ElementOut, TmaQ, TmaKV, TmaO, LayoutQKV, FwdFp8MainloopParams>;

  static constexpr bool kOStageWarp = Config::kOStageWarp;
  static constexpr int kOStageCols = 64;
  static constexpr int kOStageElems = !kOStageWarp ? 8 : (kNumConsumerThreads / 32) * 16 * kOStageCols;
  static constexpr int kSplitSlotFloats = kBlockM * kHeadDim + 2 * kNumConsumerThreads;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutVt>, 1024> smem_vt;
    FwdLoadBarriers load;
    FwdSchedulerStorage scheduler;
    FwdMainloopStorage<kNumConsumerThreads> mainloop;
    FwdEpilogueStorage<ElementOut, kOStageElems> epilogue;
    typename Pipeline::SharedStorage pipeline_k;
    typename PipelineV::SharedStorage pipeline_v;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile config exceeds 227 KB of shared memory");
};

}  // namespace flash3::detail

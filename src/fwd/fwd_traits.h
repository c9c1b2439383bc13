// flash3: compile-time description of one forward kernel: tile shapes, warpgroup roles,
// shared-memory layouts, WGMMA tilings, TMA types, and the parameters and shared storage
// composed of its parts' (load, mainloop, epilogue, scheduler, combine).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "common/seqlen.h"
#include "fwd/fwd_combine.h"
#include "fwd/fwd_config.h"
#include "fwd/fwd_epilogue.h"
#include "fwd/fwd_load.h"
#include "fwd/fwd_mainloop.h"
#include "fwd/fwd_scheduler.h"

namespace flash3::detail {

using namespace cute;

// The kernel's parameters: each part's own, and the sequence lengths they share. One type for
// every kernel of a (dtype, tile shape): the tail kernel's parameters are the main kernel's.
template <class Element, class TmaQ, class TmaKV, class TmaO, class LayoutQKV,
          class MainloopParams = FwdMainloopParams>
struct FwdParams {
  FwdLoadParams<TmaQ, TmaKV, LayoutQKV> load;
  MainloopParams mainloop;
  FwdEpilogueParams<Element, TmaO, LayoutQKV> epilogue;
  FwdSchedulerParams scheduler;
  FwdCombineParams combine;
  SeqLens seqlens;
  MaskOffsets mask;   // the sliding window (common/mask.h)
  int nheads_per_kv;  // GQA/MQA: query heads per K/V head
};

template <class Element_, int kHeadDim_, bool kCausal_, class Variant = FwdDefaultVariant>
struct FwdTraits {
  using Element = Element_;
  using ElementOut = Element_;
  using Config = FwdTileConfig<kHeadDim_, kCausal_>;
  static constexpr bool kFp8 = false;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = Variant::kBlockM > 0 ? Variant::kBlockM : Config::kBlockM;
  static constexpr int kBlockN = Variant::kBlockN > 0 ? Variant::kBlockN : Config::kBlockN;
  static constexpr int kStages = Config::kStages;
  // V's ring may be deeper than K's (not with a variant's wider tiles: shared memory)
  static constexpr int kStagesV = Variant::kBlockN > Config::kBlockN ? kStages : Config::kStagesV;
  static constexpr bool kCausal = kCausal_;
  // Causal tiles, and those of sequences of different lengths, differ in length: they are
  // handed out by the dynamic scheduler (fwd_scheduler.h).
  static constexpr bool kDynamicTiles = kCausal || Variant::kGeneral;
  static constexpr bool kPingpong =
      Variant::kPingpong < 0 ? Config::kPingpong : bool(Variant::kPingpong);
  static constexpr bool kIntraWGOverlap =
      Variant::kIntraWGOverlap < 0 ? Config::kIntraWGOverlap : bool(Variant::kIntraWGOverlap);
  static constexpr bool kThreeStage = Variant::kThreeStage;
  // The tail kernel of the non-causal split: pieces of tiles (tail_split.h), combined in FP32.
  static constexpr bool kTailPieces = Variant::kTailPieces;
  // Variable lengths, sliding windows and softcap (fwd_config.h, FwdGeneral).
  static constexpr bool kGeneral = Variant::kGeneral;
  using MaskT = Mask<kCausal, kGeneral>;
  // The consumers' WGMMA descriptors from a warp-uniform warpgroup index (fwd_mainloop_views),
  // and the softmax's chains per row (FwdMainloop; the default kernels only: the general ones
  // lost 2-3% with two chains).
  static constexpr bool kUniformDescriptors = kGeneral && Config::kGeneralUniformDescriptors;
  static constexpr int kSoftmaxChains = kGeneral ? 1 : Config::kSoftmaxChains;

  // Warpgroup 0 is the producer (TMA); warpgroups 1.. are consumers, 64 query rows each.
  static constexpr int kNumConsumerWG = kBlockM / 64;
  static constexpr int kNumConsumerThreads = 128 * kNumConsumerWG;
  static constexpr int kNumThreads = 128 + kNumConsumerThreads;
  // NOTES: setmaxnreg budget: 65536 registers per SM, one block per SM.
  // 2 consumers: 24 x 128 + 240 x 256 = 64512; 3 consumers: 32 x 128 + 160 x 384 = 65536.
  static constexpr int kProducerRegs = kNumConsumerWG == 2 ? 24 : 32;
  // The tile's last PV GEMM in a pingpong turn of its own (fwd_mainloop.h; three warpgroups).
  static constexpr bool kLastPvOwnTurn = kNumConsumerWG != 2;
  static constexpr int kConsumerRegs = kNumConsumerWG == 2 ? 240 : 160;
  static_assert(kBlockM % 64 == 0 && kHeadDim % 64 == 0 && kBlockN % 16 == 0);

  // ---- WGMMA tilings: warpgroups stacked along M ----------------------------------------
  using AtomLayoutMNK = Layout<Shape<Int<kNumConsumerWG>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockN>, Int<kHeadDim>>>(),
      AtomLayoutMNK{}));
  // P comes from registers (RS), V^T from shared memory, MN-major (head dim contiguous).
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      AtomLayoutMNK{}));

  // ---- shared memory: K-major tiles with the 128-byte swizzle ------------------------------
  // NOTES: head dims are multiples of 64 elements = 128 bytes, the SW128 atom's width, so every
  // row of Q, K and V is whole swizzle atoms; TMA writes them swizzled and WGMMA reads them.
  using SmemAtom = GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutQ = decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutK =
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutV =
      decltype(tile_to_shape(SmemAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStagesV>>{}));
  // V viewed as (head dim, key, stage): the B operand of O += P V.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutV{},
      make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStagesV>>{}, Step<_2, _1, _3>{})));

  // ---- global tensors: (seqlen, head_dim, heads, batch), head dim contiguous ---------------
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQKV = Stride<int64_t, _1, int64_t, int64_t>;
  using LayoutQKV = Layout<ShapeQKV, StrideQKV>;

  static auto make_tma_q(Element const* ptr, LayoutQKV layout) {
    return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), layout), SmemLayoutQ{},
                         Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
  }
  static auto make_tma_kv(Element const* ptr, LayoutQKV layout) {
    return make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(ptr), layout),
                         take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
  }
  // With kStageOInQ, O goes out through the Q buffer and one TMA store.
  static auto make_tma_o(Element* ptr, LayoutQKV layout) {
    return make_tma_copy(SM90_TMA_STORE{}, make_tensor(make_gmem_ptr(ptr), layout), SmemLayoutQ{},
                         Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
  }
  using TmaQ = decltype(make_tma_q(nullptr, LayoutQKV{}));
  using TmaO = decltype(make_tma_o(nullptr, LayoutQKV{}));
  static constexpr bool kStageOInQ = Config::kStageOInQ;
  // Arrivals that free the Q buffer: every consumer thread after its last S GEMM, or the one
  // thread that waited for the O store.
  static constexpr int kQFreeArrivals = kStageOInQ ? 1 : kNumConsumerThreads;
  using TmaKV = decltype(make_tma_kv(nullptr, LayoutQKV{}));

  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = typename cutlass::PipelineState<kStages>;
  using PipelineV = cutlass::PipelineTmaAsync<kStagesV>;
  using PipelineStateV = typename cutlass::PipelineState<kStagesV>;

  // One type for every variant with the same tiles: the tail kernel's parameters are the main
  // kernel's (fwd_launch.h).
  using Params = FwdParams<Element, TmaQ, TmaKV, TmaO, LayoutQKV>;
  using Mainloop = FwdMainloop<FwdTraits>;

  // kOStageWarp (O from registers): each consumer warp stages its 16 rows of O, kOStageCols
  // columns at a time, in a buffer of its own, so that the global stores write whole row
  // segments (fwd_epilogue.h).
  // (Two consumer warpgroups only: with three, at 160 registers, staging measured slower.)
  static constexpr bool kOStageWarp = !kStageOInQ && Config::kOStageWarp && kNumConsumerWG == 2;
  static constexpr int kOStageCols = kHeadDim < 64 ? kHeadDim : 64;
  static constexpr int kOStageElems = !kOStageWarp ? 8 : (kNumConsumerThreads / 32) * 16 * kOStageCols;

  // One slot of a cut tile's piece: its normalized O (FP32) and log-sum-exps, in the consumer
  // threads' register order (element-major, so that a warp's accesses are contiguous).
  static constexpr int kSplitSlotFloats = kBlockM * kHeadDim + 2 * kNumConsumerThreads;
  static_assert(!kTailPieces || (kIntraWGOverlap && !kThreeStage && !kCausal),
                "the tail kernel is the default non-causal pipeline");

  // The parts' shared storage. NOTES: the order (tiles, Q barriers, scheduler ring, softmax
  // pins, O staging, pipelines) is the one the tile shapes were tuned with: shifting the layout
  // (one more shared int) once made ptxas spill 48 bytes.
  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutQ>, 1024> smem_q;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutK>, 1024> smem_k;
    alignas(1024) cute::array_aligned<Element, cosize_v<SmemLayoutV>, 1024> smem_v;
    FwdLoadBarriers load;
    FwdSchedulerStorage scheduler;
    FwdMainloopStorage<kNumConsumerThreads> mainloop;
    FwdEpilogueStorage<Element, kOStageElems> epilogue;
    typename Pipeline::SharedStorage pipeline_k;
    typename PipelineV::SharedStorage pipeline_v;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage));
  static_assert(kSmemBytes <= 227 * 1024, "tile config exceeds 227 KB of shared memory");
};

}  // namespace flash3::detail

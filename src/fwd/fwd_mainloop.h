// flash3: the forward's mainloop, the consumers of Algorithm 1 (lines 12-24): per key block,
// S = Q K_j^T (WGMMA, both operands from shared memory), the mask (common/mask.h), the online
// softmax in FP32 (common/softmax.h), O += P V_j (WGMMA, P from registers), and at the end
// O / rowsum and the log-sum-exp. Consumer warpgroups own 64 query rows each and take turns at
// the tensor cores (pingpong, §3.1); within a warpgroup the PV GEMM of block j overlaps the
// softmax of block j+1 (Algorithm 2, §3.2). The ablation variants (fwd_ablation.h) turn each
// technique off, or run Appendix B.3's 3-stage pipeline instead.
#pragma once

#include <cute/tensor.hpp>

#include "common/ptx.h"
#include "common/softmax.h"
#include "common/wgmma.h"
#include "fwd/fwd_barriers.h"

namespace flash3::detail {

using namespace cute;

struct FwdMainloopParams {
  float softmax_scale, scale_log2;  // scale_log2 = softmax_scale * log2(e)
  // Softcap (common/softmax.h): scale / softcap, and then softmax_scale = softcap; 0: none.
  float softcap_coef;
  // BF16 with softcap <= kSoftcapBoundedMax, where the config has kSoftcapBounded: the softmax's
  // reference max fixed at 0 (OnlineSoftmax::step_bounded).
  bool softcap_bounded;
};

template <int kConsumerThreads>
struct FwdMainloopStorage {
  float softmax_pin[kConsumerThreads];  // see pin_before_wait (common/ptx.h)
};

// Pingpong (§3.1): consumer warpgroups take turns issuing their GEMMs, so that one warpgroup's
// softmax runs while another's GEMMs run. Warpgroup w waits on barrier (base + w) before
// issuing, and after issuing lets warpgroup (w + 1) % n go. Warpgroup 0 holds the first turn.
// Every warpgroup of a block issues the same number of GEMM batches, so the turns stay matched.
template <class Traits>
struct FwdPingpong {
  int wg;
  __device__ explicit FwdPingpong(int consumer_wg) : wg(consumer_wg) {
    if constexpr (Traits::kPingpong) {
      if (wg == 0) named_barrier_arrive(256, kFwdBarrierPingpongBase);
    }
  }
  __device__ __forceinline__ void before_gemms() const {
    if constexpr (Traits::kPingpong) named_barrier_sync(256, kFwdBarrierPingpongBase + wg);
  }
  __device__ __forceinline__ void after_gemms() const {
    if constexpr (Traits::kPingpong) {
      named_barrier_arrive(256, kFwdBarrierPingpongBase + (wg + 1) % Traits::kNumConsumerWG);
    }
  }
};

// The consumer thread's views, made once per kernel: the WGMMA descriptors of Q, K and V^T (at
// vt) in shared memory and the (row, col) coordinates of its scores inside a tile.
template <class Traits, class ElementVt>
__device__ __forceinline__ auto fwd_mainloop_views(typename Traits::SharedStorage& shared, ElementVt* vt, int tidx) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  Tensor sQ = make_tensor(make_smem_ptr(shared.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.smem_k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(vt), typename Traits::SmemLayoutVt{});
  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  // kUniformDescriptors: the descriptors from the warpgroup's first thread (common/wgmma.h).
  const int tidx_wg = Traits::kUniformDescriptors ? warpgroup_first_thread(tidx) : tidx;
  auto thr_qk_wg = mma_qk.get_thread_slice(tidx_wg);
  auto thr_pv_wg = mma_pv.get_thread_slice(tidx_wg);
  Tensor tSrQ = thr_qk_wg.partition_fragment_A(sQ);   // descriptors into shared memory
  Tensor tSrK = thr_qk_wg.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrV = thr_pv_wg.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tScS = mma_qk.get_thread_slice(tidx).partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_layout_rowcol(tScS.layout()));
  return cute::make_tuple(tSrQ, tSrK, tOrV, tScS_rc);
}

template <class Traits>
struct FwdMainloop {
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineV = typename Traits::PipelineV;
  using PipelineState = typename Traits::PipelineState;
  using PipelineStateV = typename Traits::PipelineStateV;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  // Accumulator rows per thread: rows r and r + 8 of its warp's 16 (m64 WGMMA tiles).
  static constexpr int kRows = 2;

  // The consumer thread's views (fwd_mainloop_views); V^T is the V ring seen transposed.
  __device__ __forceinline__ static auto make_views(typename Traits::SharedStorage& shared, int tidx) {
    return fwd_mainloop_views<Traits>(shared, shared.smem_v.data(), tidx);
  }

  // One piece of work (fwd_scheduler.h): key blocks n_block_max - 1 down to n_lo of the tile
  // whose first query row is row0. Leaves O / rowsum in tOrO and the log-sum-exp in lse.
  // tiles_done: the pieces this block has computed before (the parity of the Q barrier).
  template <class Views, class MaskT, class TensorO>
  __device__ __forceinline__ static void run(const FwdMainloopParams& p, typename Traits::SharedStorage& shared,
                                             Pipeline& pipeline_k, PipelineV& pipeline_v, PipelineState& read_k,
                                             PipelineStateV& read_v, const FwdPingpong<Traits>& turns, int tidx,
                                             int tiles_done, const Views& views, const MaskT& mask, int row0,
                                             int n_lo, int n_block_max, TensorO& tOrO, float (&lse)[kRows],
                                             int /*batch*/, int /*head*/, int /*head_kv*/) {
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto const& tSrQ = get<0>(views);
    auto const& tSrK = get<1>(views);
    auto const& tOrV = get<2>(views);
    auto const& tScS_rc = get<3>(views);
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tSrS_rc = make_tensor(tSrS.data(), acc_layout_rowcol(tSrS.layout()));
    Tensor tOrO_rc = make_tensor(tOrO.data(), acc_layout_rowcol(tOrO.layout()));
    // P in the input precision, laid out as the A operand of the PV WGMMA.
    Tensor tOrP = make_tensor<Element>(acc_layout_as_a_operand(tSrS.layout()));
    static_assert(decltype(size<0>(tSrS_rc))::value == kRows);

    OnlineSoftmax<kRows, Traits::kSoftmaxChains> softmax(p.scale_log2);  // line 13
    clear(tOrO);
    constexpr bool kBounded = Traits::kGeneral && Traits::Config::kSoftcapBounded &&
                              cute::is_same_v<Element, cutlass::bfloat16_t>;
    float sum_exact[kRows];  // OnlineSoftmax::step_bounded's
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) sum_exact[m] = 0.f;

    // S = Q K_j^T landed in tSrS: softcap it (if on), mask it where the block crosses the end of
    // the keys or the window (causal: the diagonal), then the online softmax (lines 18-19), which gives the O rescale factors
    // and whether any row of the warp needs them (softmax.h).
    const auto unmasked = mask.template unmasked_n_blocks<kBlockM, kBlockN>(row0);
    auto softmax_step_on = [&](decltype(tSrS_rc)& s_rc, int n_block, float (&rescale)[kRows]) -> bool {
      auto mask_block = [&]() {
        if (unmasked.masks(n_block)) mask.apply(s_rc, tScS_rc, row0, n_block * kBlockN);
      };
      auto mask_and_step = [&]() -> bool {
        mask_block();
        return softmax.step(s_rc, rescale);
      };
      if constexpr (Traits::kGeneral) {
        if constexpr (Traits::Config::kSoftcapOwnStep) {
          if (p.softcap_coef != 0.f) {
            // The softcap path's own step (fwd_config.h), with the row maxima of t taken in the
            // tanh's pass (softcap_with_max), again after the mask where the block is masked.
            float mx[kRows];
            softmax.softcap_with_max(s_rc, p.softcap_coef, mx);
            if (unmasked.masks(n_block)) {
              mask.apply(s_rc, tScS_rc, row0, n_block * kBlockN);
              softmax.block_max(s_rc, mx);
            }
            return softmax.step_with_max(s_rc, rescale, mx);
          }
        }
        if (p.softcap_coef != 0.f) {
          apply_softcap(s_rc, p.softcap_coef);
          if constexpr (kBounded) {
            if (p.softcap_bounded) {
              mask_block();
              softmax.step_bounded(s_rc, sum_exact);
              return false;
            }
          }
        }
      }
      return mask_and_step();
    };
    auto softmax_step = [&](int n_block, float (&rescale)[kRows]) -> bool {
      return softmax_step_on(tSrS_rc, n_block, rescale);
    };
    auto gemm_qk_into = [&](decltype(tSrS)& s) {
      warpgroup_gemm</*zero_init=*/true, /*wait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), s);
    };
    auto gemm_qk = [&]() { gemm_qk_into(tSrS); };
    // The same without fences after the commit (the 3-stage pipeline fences the tile after the
    // wait that completes it: a fence on a tile still in flight serializes every WGMMA, C7514).
    auto gemm_qk_async_into = [&](decltype(tSrS)& s) {
      warpgroup_gemm_async</*zero_init=*/true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), s);
    };
    auto gemm_pv = [&]() {
      warpgroup_gemm</*zero_init=*/false, /*wait=*/-1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
    };
    // One GEMM on its own, waited for (the pingpong turn taken around its issue).
    auto qk_alone = [&]() {
      pipeline_k.consumer_wait(read_k);
      turns.before_gemms();
      gemm_qk();
      turns.after_gemms();
      warpgroup_wait<0>();
      pipeline_k.consumer_release(read_k);
      ++read_k;
    };
    auto pv_alone = [&]() {
      pipeline_v.consumer_wait(read_v);
      turns.before_gemms();
      gemm_pv();
      turns.after_gemms();
      warpgroup_wait<0>();
      pipeline_v.consumer_release(read_v);
      ++read_v;
    };
    auto release_q = [&]() {
      if constexpr (!Traits::kStageOInQ) shared.load.barrier_q_free.arrive();
    };

    float inv_sum[kRows];
    auto finalize = [&]() {
      softmax.finalize(p.softmax_scale, inv_sum, lse);
      if constexpr (kBounded) {
        if (p.softcap_coef != 0.f && p.softcap_bounded) softmax.bounded_lse(sum_exact, lse);
      }
    };
    bool finalized = false;
    shared.load.barrier_q.wait(tiles_done & 1);  // line 14
    if (n_block_max <= n_lo) release_q();
    if (n_block_max > n_lo) {
      if constexpr (Traits::kThreeStage) {
        // Appendix B.3 (Algorithm 4): while the softmax of block j runs, the tensor cores run
        // both S_{j-1} = Q K_{j-1}^T and O += P_{j+1} V_{j+1}. Two score tiles alternate roles
        // (the loop is unrolled by two, so no register copies).
        // The second score tile (S_{j-1} in flight while S_j is under softmax).
        Tensor tSrS2 = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
        Tensor tSrS2_rc = make_tensor(tSrS2.data(), acc_layout_rowcol(tSrS2.layout()));
        float rescale[kRows];
        qk_alone();
        if (n_block_max == 1) release_q();
        softmax_step(n_block_max - 1, rescale);  // O is 0: no rescale needed
        convert_into<Element>(tSrS, tOrP);
        PipelineState k_cur = read_k;  // the stage of the K whose S GEMM is in flight
        auto issue_second = [&]() {
          pipeline_k.consumer_wait(read_k);
          turns.before_gemms();
          gemm_qk_async_into(tSrS2);
          turns.after_gemms();
          ++read_k;
        };
        // s_cur: S_j (in flight), s_next: receives S_{j-1}; tOrP holds P_{j+1}.
        // NOTES: forced inline: called from three places, it was otherwise compiled as a function
        // taking the score tiles by reference, i.e. through local memory.
        // `more` (compile time): an S GEMM for block j - 1 is issued (j > 0). NOTES: as a run-time
        // flag ptxas serialized every WGMMA of the kernel (C7514).
        auto step = [&](auto more_c, decltype(tSrS)& s_cur, decltype(tSrS_rc)& s_cur_rc, decltype(tSrS)& s_next,
                        int j) __attribute__((always_inline)) {
          constexpr bool more = decltype(more_c)::value;
          PipelineState k_next = read_k;
          if constexpr (more) pipeline_k.consumer_wait(read_k);
          pipeline_v.consumer_wait(read_v);
          turns.before_gemms();
          if constexpr (more) gemm_qk_async_into(s_next);
          warpgroup_fence_operand(tOrP);
          warpgroup_gemm_async</*zero_init=*/false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
          turns.after_gemms();
          if constexpr (more) {
            ++read_k;
            warpgroup_wait<2>();  // S_j is ready; S_{j-1} and O += P_{j+1} V_{j+1} may still run
          } else {
            warpgroup_wait<1>();
          }
          warpgroup_fence_operand(s_cur);
          pipeline_k.consumer_release(k_cur);
          k_cur = k_next;
          if (j == 0) release_q();
          const bool rescale_o = softmax_step_on(s_cur_rc, j, rescale);
          pin_before_wait(&shared.mainloop.softmax_pin[tidx], softmax.row_sum);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          warpgroup_fence_operand(tOrP);
          pipeline_v.consumer_release(read_v);
          ++read_v;
          if (rescale_o) scale_rows(tOrO_rc, rescale);
          convert_into<Element>(s_cur, tOrP);
        };
        if (n_block_max > 1) {
          issue_second();
          int j = n_block_max - 2;
          for (; j >= 2; j -= 2) {
            step(cute::true_type{}, tSrS2, tSrS2_rc, tSrS, j);
            step(cute::true_type{}, tSrS, tSrS_rc, tSrS2, j - 1);
          }
          if (j == 1) {
            step(cute::true_type{}, tSrS2, tSrS2_rc, tSrS, 1);
            step(cute::false_type{}, tSrS, tSrS_rc, tSrS2, 0);
          } else {
            step(cute::false_type{}, tSrS2, tSrS2_rc, tSrS, 0);
          }
        }
        pv_alone();
      } else if constexpr (!Traits::kIntraWGOverlap) {
        // Algorithm 1 as written: each GEMM is waited for before the softmax that follows it.
        for (int n_block = n_block_max - 1; n_block >= 0; --n_block) {
          qk_alone();  // lines 16-17
          if (n_block == 0) release_q();
          float rescale[kRows];
          if (softmax_step(n_block, rescale)) scale_rows(tOrO_rc, rescale);
          convert_into<Element>(tSrS, tOrP);
          pv_alone();  // lines 20-22
        }
      } else {
        // Algorithm 2: the PV GEMM of block j runs on the tensor cores while the softmax of
        // block j+1 runs on the FP32 and exp units. The first S is computed alone.
        float rescale[kRows];
        qk_alone();
        if (n_block_max - n_lo == 1) release_q();
        softmax_step(n_block_max - 1, rescale);  // O is 0: no rescale needed
        convert_into<Element>(tSrS, tOrP);
        for (int n_block = n_block_max - 2; n_block >= n_lo; --n_block) {
          pipeline_k.consumer_wait(read_k);
          turns.before_gemms();
          gemm_qk();
          pipeline_v.consumer_wait(read_v);
          gemm_pv();
          turns.after_gemms();
          warpgroup_wait<1>();  // S_{j+1} is ready; O += P_j V_j may still be running
          pipeline_k.consumer_release(read_k);
          ++read_k;
          if (n_block == n_lo) release_q();
          const bool rescale_o = softmax_step(n_block, rescale);
          // NOTES: pin the softmax before the wait below; otherwise ptxas (13.0) hoists
          // wgmma.wait_group 0 above the exponentials and the overlap of Algorithm 2 is gone
          // (seen in the SASS: WARPGROUP.DEPBAR.LE gsb0, 0x0 ahead of every MUFU.EX2; the
          // order in the PTX was right). A shared-memory store of the row sum, which needs
          // every exponential of the row, is kept before the wait by ptxas.
          pin_before_wait(&shared.mainloop.softmax_pin[tidx], softmax.row_sum);
          warpgroup_wait<0>();  // O += P_j V_j is done: P_j's registers are free
          pipeline_v.consumer_release(read_v);
          ++read_v;
          if (rescale_o) scale_rows(tOrO_rc, rescale);
          convert_into<Element>(tSrS, tOrP);
        }
        if constexpr (Traits::kLastPvOwnTurn) {
          pv_alone();
        } else {
          // NOTES: with two consumer warpgroups the tile's last PV GEMM takes no pingpong turn
          // (as in FlashAttention-3), and the softmax's final sums (line 24) are computed while
          // it runs: the warpgroup goes on to its epilogue without waiting for the other's
          // turn. Each warpgroup then takes n_block_max turns per tile, so the turns stay
          // matched across tiles. Measured +2-4% at head dims 128 and 256 for seqlen <= 2k, even
          // beyond; with three warpgroups (head dim 64) 4-8% slower, so not there
          // (docs/perf-log.md, step 17).
          pipeline_v.consumer_wait(read_v);
          gemm_pv();
          finalize();
          warpgroup_wait<0>();
          pipeline_v.consumer_release(read_v);
          ++read_v;
          finalized = true;
        }
      }
    }

    // Line 24: O / rowsum, LSE = m + log(rowsum).
    if (!finalized) finalize();
    scale_rows(tOrO_rc, inv_sum);
  }
};

}  // namespace flash3::detail

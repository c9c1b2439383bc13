// flash3: the FP8 forward's mainloop (§3.3): the consumers of Algorithm 1 with both GEMMs in
// e4m3 (FP32 accumulation), pingpong and the Algorithm 2 overlap as in the 16-bit mainloop.
// What differs:
//   - P goes to the PV GEMM's A operand in e4m3 with its columns packed in the order that
//     fp8_key_of_k (fwd_fp8_transpose.h) gives V's rows in Vt: no shuffles between threads;
//   - V^T is the transposed copy the producer warps wrote (Fp8VPipeline's consumer side);
//   - scales: q's per 64-row block (one per consumer warpgroup), k's and v's per key block,
//     or one per (batch, kv head). k's multiply the softmax's exponent coefficient of their
//     block (the max is kept in scaled log2 units, so blocks of different scales compare);
//     v's rescale O when they change from one block to the next (O is kept in units of the
//     last block's v scale), so neither costs a GEMM or a pass over the scores.
#pragma once

#include <cfloat>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>

#include "common/ptx.h"
#include "flash3/flash3.h"
#include "common/wgmma.h"
#include "fwd/fwd_barriers.h"
#include "fwd/fwd_fp8_transpose.h"
#include "fwd/fwd_mainloop.h"

namespace flash3::detail {

using namespace cute;

// One scale tensor of the FP8 forward: value(batch, head, block), 1 where ptr is null. A scale
// per (batch, kv head) has block_stride 0.
struct Fp8Scale {
  const float* ptr;
  int64_t batch_stride, head_stride, block_stride;
  __device__ __forceinline__ float value(int batch, int head, int block) const {
    return ptr == nullptr ? 1.f : __ldg(ptr + batch * batch_stride + head * head_stride + block * block_stride);
  }
};

struct FwdFp8MainloopParams : FwdMainloopParams {
  Fp8Scale q, k, v;
  bool q_per_kv_head;  // q's scale is indexed by the kv head (FlashAttention-3's q_descale)
};

// The online softmax with a coefficient per key block (softmax_scale x log2 e x the block's q and
// k scales): the row max is kept in scaled log2 units. Unlike common/softmax.h's step, the max
// moves with every rise, so that a row's largest P is exactly 1 in e4m3.
// NOTES: with the 16-bit kernel's rule (move only by more than 8 in log2 units, P <= 2^8) the
// largest P of a row is 2^x for a fractional x and rounds by up to 2^-4 in e4m3; it dominates
// the output, and the error doubled against P rounded under the exact max (measured: max error
// 0.035 vs 0.016 at head dim 64, causal; the same in a CPU emulation of both rules).
template <int kRows>
struct Fp8Softmax {
  float row_max[kRows];  // log2 units, scaled
  float row_sum[kRows];

  __device__ Fp8Softmax() {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) { row_max[m] = -INFINITY; row_sum[m] = 0.f; }
  }

  template <class TensorS>
  __device__ __forceinline__ bool step(TensorS& s, float coef, float (&rescale)[kRows]) {
    bool moved = false;
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      float mx = -INFINITY;
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(s); ++n) mx = fmaxf(mx, s(m, n));
      mx = quad_max(mx) * coef;
      const bool move = mx > row_max[m];
      const float ref = move ? mx : row_max[m];
      const float offset = ref == -INFINITY ? 0.f : ref;
      rescale[m] = move ? fast_exp2(row_max[m] - offset) : 1.f;
      row_max[m] = ref;
      moved |= move;
      float sum = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(s); ++n) {
        s(m, n) = fast_exp2(fmaf(s(m, n), coef, -offset));
        sum += s(m, n);
      }
      row_sum[m] = row_sum[m] * rescale[m] + sum;
    }
    return __any_sync(0xffffffffu, moved);
  }

  // inv_sum folds in o_unit (O's accumulator is in units of the last v scale); lse in natural log.
  __device__ __forceinline__ void finalize(float o_unit, float (&inv_sum)[kRows], float (&lse)[kRows]) {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      const float sum = quad_sum(row_sum[m]);
      const bool empty = sum == 0.f || sum != sum;
      inv_sum[m] = empty ? 1.f : o_unit / sum;
      lse[m] = empty ? INFINITY : row_max[m] * float(M_LN2) + __logf(sum);
    }
  }
};

// P (FP32 scores after the softmax, accumulator order) -> e4m3 in the A operand's register
// order. Per 32 columns the thread holds accumulator values c + 2 r + 4 g (column pair c, row
// half r, 8-column group g = 0..3) and the operand wants j + 4 r + 8 h (k = 4 q + j + 16 h):
// value j + 4 r + 8 h is accumulator value (j % 2) + 2 r + 4 (j / 2 + 2 h).
template <class TensorS, class TensorP>
__device__ __forceinline__ void fp8_pack_p(const TensorS& s, TensorP& p) {
  constexpr int kValues = decltype(size(s))::value;
  static_assert(kValues % 16 == 0 && decltype(size(p))::value == kValues);
  using Convert = cutlass::NumericArrayConverter<cutlass::float_e4m3_t, float, 16, cutlass::FloatRoundStyle::round_to_nearest>;
  CUTLASS_PRAGMA_UNROLL
  for (int kb = 0; kb < kValues / 16; ++kb) {
    cutlass::Array<float, 16> f;
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < 16; ++v) {
      const int j = v % 4, r = (v / 4) % 2, h = v / 8;
      f[v] = s(16 * kb + (j % 2) + 2 * r + 4 * (j / 2 + 2 * h));
    }
    reinterpret_cast<cutlass::Array<cutlass::float_e4m3_t, 16>*>(p.data())[kb] = Convert{}(f);
  }
}

template <class Traits>
struct FwdFp8Mainloop {
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineV = typename Traits::PipelineV;
  using PipelineState = typename Traits::PipelineState;
  using PipelineStateV = typename Traits::PipelineStateV;
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  static constexpr int kRows = 2;
  static constexpr int kBlockKV = fp8_block_kv(kHeadDim);
  static_assert(kBlockN % 32 == 0 && kBlockKV % kBlockN == 0, "a key block lies in one k/v scale block");

  // The consumer thread's views (fwd_mainloop_views); V^T is the transposers' ring.
  __device__ __forceinline__ static auto make_views(typename Traits::SharedStorage& shared, int tidx) {
    return fwd_mainloop_views<Traits>(shared, shared.smem_vt.data(), tidx);
  }

  template <class Views, class MaskT, class TensorO>
  __device__ __forceinline__ static void run(const FwdFp8MainloopParams& p, typename Traits::SharedStorage& shared,
                                             Pipeline& pipeline_k, PipelineV& pipeline_v, PipelineState& read_k,
                                             PipelineStateV& read_v, const FwdPingpong<Traits>& turns, int tidx,
                                             int tiles_done, const Views& views, const MaskT& mask, int row0,
                                             int n_lo, int n_block_max, TensorO& tOrO, float (&lse)[kRows],
                                             int batch, int head, int head_kv) {
    typename Traits::TiledMmaQK mma_qk;
    typename Traits::TiledMmaPV mma_pv;
    auto const& tSrQ = get<0>(views);
    auto const& tSrK = get<1>(views);
    auto const& tOrV = get<2>(views);
    auto const& tScS_rc = get<3>(views);
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor tSrS_rc = make_tensor(tSrS.data(), acc_layout_rowcol(tSrS.layout()));
    Tensor tOrO_rc = make_tensor(tOrO.data(), acc_layout_rowcol(tOrO.layout()));
    // P in e4m3 as the A operand of the m64nNk32 WGMMA: ((4, 2, 2), 1, kBlockN / 32).
    Tensor tOrP = make_tensor<Element>(Layout<Shape<Shape<_4, _2, _2>, _1, Int<kBlockN / 32>>>{});

    // The scales of this tile: q's for this warpgroup's 64 rows; k's and v's per key block.
    const int q_block = row0 / kFp8BlockQ + tidx / 128;
    const float q_scale = p.q.value(batch, p.q_per_kv_head ? head_kv : head, q_block);
    const float q_coef = p.scale_log2 * q_scale;
    auto kv_block = [](int n_block) { return n_block * kBlockN / kBlockKV; };
    // NOTES: a zero (or NaN) scale would make masked scores -inf * 0 = NaN: the coefficient and
    // the v unit stay positive.
    auto k_coef = [&](int n_block) { return fmaxf(q_coef * p.k.value(batch, head_kv, kv_block(n_block)), FLT_MIN); };
    auto v_unit = [&](int n_block) { return fmaxf(p.v.value(batch, head_kv, kv_block(n_block)), 1e-30f); };

    Fp8Softmax<kRows> softmax;
    clear(tOrO);
    float o_unit = 1.f;

    const auto unmasked = mask.template unmasked_n_blocks<kBlockM, kBlockN>(row0);
    auto softmax_step = [&](int n_block, float coef, float (&rescale)[kRows]) -> bool {
      if (unmasked.masks(n_block)) mask.apply(tSrS_rc, tScS_rc, row0, n_block * kBlockN);
      return softmax.step(tSrS_rc, coef, rescale);
    };
    auto gemm_qk = [&]() {
      warpgroup_gemm</*zero_init=*/true, /*wait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), tSrS);
    };
    auto gemm_pv = [&]() {
      warpgroup_gemm</*zero_init=*/false, /*wait=*/-1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
    };
    auto release_q = [&]() { shared.load.barrier_q_free.arrive(); };

    float inv_sum[kRows];
    bool finalized = false;
    shared.load.barrier_q.wait(tiles_done & 1);
    if (n_block_max <= n_lo) release_q();
    if (n_block_max > n_lo) {
      float rescale[kRows];
      // The first S alone.
      float coef = k_coef(n_block_max - 1);
      o_unit = v_unit(n_block_max - 1);
      pipeline_k.consumer_wait(read_k);
      turns.before_gemms();
      gemm_qk();
      turns.after_gemms();
      warpgroup_wait<0>();
      pipeline_k.consumer_release(read_k);
      ++read_k;
      if (n_block_max - n_lo == 1) release_q();
      softmax_step(n_block_max - 1, coef, rescale);  // O is 0: no rescale needed
      fp8_pack_p(tSrS, tOrP);
      for (int n_block = n_block_max - 2; n_block >= n_lo; --n_block) {
        // Scales per (batch, kv head) (block stride 0) are read once, at the first block.
        if (p.k.block_stride != 0) coef = k_coef(n_block);
        const float unit = p.v.block_stride != 0 ? v_unit(n_block) : o_unit;
        pipeline_k.consumer_wait(read_k);
        turns.before_gemms();
        bool moved;
        if constexpr (Traits::Config::kSerialPvQk) {
          pipeline_v.consumer_wait(read_v);
          gemm_pv();
          warpgroup_wait<0>();  // P_{j+1}'s registers are free for S_j
          pipeline_v.consumer_release(read_v);
          ++read_v;
          gemm_qk();
          turns.after_gemms();
          warpgroup_wait<0>();
          pipeline_k.consumer_release(read_k);
          ++read_k;
          if (n_block == n_lo) release_q();
          moved = softmax_step(n_block, coef, rescale);
        } else {
          gemm_qk();
          pipeline_v.consumer_wait(read_v);
          gemm_pv();
          turns.after_gemms();
          warpgroup_wait<1>();  // S_j is ready; O += P_{j+1} V_{j+1} may still be running
          pipeline_k.consumer_release(read_k);
          ++read_k;
          if (n_block == n_lo) release_q();
          moved = softmax_step(n_block, coef, rescale);
          pin_before_wait(&shared.mainloop.softmax_pin[tidx], softmax.row_sum);
          warpgroup_wait<0>();
          pipeline_v.consumer_release(read_v);
          ++read_v;
        }
        // O to the units of block j's v scale, with the softmax's rescale.
        if (moved || unit != o_unit) {
          const float ratio = o_unit / unit;
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < kRows; ++m) rescale[m] *= ratio;
          scale_rows(tOrO_rc, rescale);
          o_unit = unit;
        }
        fp8_pack_p(tSrS, tOrP);
      }
      if constexpr (Traits::kLastPvOwnTurn) {
        pipeline_v.consumer_wait(read_v);
        turns.before_gemms();
        gemm_pv();
        turns.after_gemms();
        warpgroup_wait<0>();
        pipeline_v.consumer_release(read_v);
        ++read_v;
      } else {
        pipeline_v.consumer_wait(read_v);
        gemm_pv();
        softmax.finalize(o_unit, inv_sum, lse);
        warpgroup_wait<0>();
        pipeline_v.consumer_release(read_v);
        ++read_v;
        finalized = true;
      }
    }
    if (!finalized) softmax.finalize(o_unit, inv_sum, lse);
    scale_rows(tOrO_rc, inv_sum);
  }
};

}  // namespace flash3::detail

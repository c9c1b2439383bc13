// flash3: the online softmax of Algorithm 1 (lines 18-19 and 24), in FP32, over score blocks
// held in WGMMA accumulator registers in (row, col) view.
#pragma once

#include "common/ptx.h"
#include "common/wgmma.h"

namespace flash3::detail {

// Softcap (FlashAttention-3's softcap > 0): the logit softcap * tanh(scale * S / softcap) replaces
// scale * S. The kernels keep t = tanh(coef * S), coef = scale / softcap, in place of S and run
// the softmax with softcap as its scale; the backward multiplies dS by 1 - t^2.
// t by tanh.approx.f32 (one MUFU operation; relative error 2^-11, as FlashAttention-3's): a logit's
// error is then up to softcap x 2^-11, the size of the 16-bit rounding of the logit that plain
// attention in the input dtype makes (the tests' yardstick, tests/reference.h), which the tests
// hold at softcap 1 to 50.
// NOTES: an exact tanh, (1 - e) / (1 + e) with e = exp(-2|coef x|), takes two MUFU operations (ex2,
// rcp) besides the softmax's own ex2, one per score already being the tensor cores' pace at head
// dim 128: softcap then cost 1.5-1.9x there, against 1.2-1.5x now; e on the FMA pipe instead
// (a polynomial) was slower still (docs/perf-log.md, W2-W3).
__device__ __forceinline__ float softcap_tanh(float x, float coef) {
  float t;
  asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(x * coef));
  return t;
}

// The largest softcap for OnlineSoftmax::step_bounded (e^50 = 2^72.1; Gemma 2's cap is 50).
constexpr float kSoftcapBoundedMax = 50.f;

// kChains: the row max and the row sum of a block each as kChains interleaved chains (columns
// n % kChains), combined at the end: shorter dependency chains for the scheduler to interleave.
template <int kRows, int kChains = 1>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];  // per-thread partial sums; reduced across the quad in finalize()
  float scale_log2;      // softmax_scale * log2(e)

  __device__ explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) { row_max[m] = -INFINITY; row_sum[m] = 0.f; }
  }

  // The reference max moves only by more than this (log2 units): see step().
  static constexpr float kMoveThreshold = 8.f;

  // S -> P = exp(scale * (S - m)) in place, m the row's reference max; returns whether the
  // running output of any row of this warp must be rescaled (the same for the whole warp), and
  // per row the factor (exp(scale * (m_old - m_new)), 1 where m stays).
  // NOTES: as in FlashAttention-4, m moves only when the block's max exceeds it by more than
  // kMoveThreshold = 8 (log2 units): P then stays <= 2^8, which FP32 sums and 16-bit P hold
  // without loss (a float format: the relative rounding is the same at any size), and the final
  // 1 / rowsum and lse = m + log(rowsum) are exact for any m. Once the max has settled, most
  // blocks skip the O rescale (a multiply per output register) and its latency between the
  // PV GEMM's wait and the next GEMM issue.
  // NOTES: P = exp2(fma(S, scale_log2, -offset)) with offset = m * scale_log2 rounded to FP32:
  // the FMA takes the exact product, so at S = m the exponent is offset's rounding error, up to
  // 2^-24 |offset|: exact enough while |offset| < 2^20, which validation keeps for unit-scale
  // data by bounding softmax_scale (validate.cpp, kMaxSoftmaxScale). A warp-uniform branch to an
  // exact path for huge scales added spills at head dim 128 (docs/perf-log.md, R3).
  template <class TensorS>
  __device__ __forceinline__ bool step(TensorS& s, float (&rescale)[kRows]) {
    bool moved = false;
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) moved |= step_row(s, m, thread_max(s, m), rescale[m]);
    return __any_sync(0xffffffffu, moved);
  }

  // step() with each row's maxima over this thread's scores given (block_max, softcap_with_max).
  template <class TensorS>
  __device__ __forceinline__ bool step_with_max(TensorS& s, float (&rescale)[kRows], const float (&mx)[kRows]) {
    bool moved = false;
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) moved |= step_row(s, m, mx[m], rescale[m]);
    return __any_sync(0xffffffffu, moved);
  }

  template <class TensorS>
  __device__ __forceinline__ void block_max(TensorS const& s, float (&mx)[kRows]) const {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) mx[m] = thread_max(s, m);
  }

  // Softcap's t = tanh(coef S) in place (softcap_tanh), with block_max's maxima of t in the same
  // pass: the max interleaves with the tanh's MUFU operations.
  template <class TensorS>
  __device__ __forceinline__ void softcap_with_max(TensorS& s, float coef, float (&mx)[kRows]) const {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      constexpr int kCols = decltype(size<1>(s))::value;
      float mxc[kChains];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kChains; ++c) mxc[c] = row_max[m];
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < kCols; ++n) {
        s(m, n) = softcap_tanh(s(m, n), coef);
        mxc[n % kChains] = fmaxf(mxc[n % kChains], s(m, n));
      }
      mx[m] = combine_max(mxc);
    }
  }

 private:
  __device__ __forceinline__ static float combine_max(const float (&mxc)[kChains]) {
    float mx = mxc[0];
    CUTLASS_PRAGMA_UNROLL
    for (int c = 1; c < kChains; ++c) mx = fmaxf(mx, mxc[c]);
    return mx;
  }

  // Row m's max over row_max and this thread's scores of the block (kChains chains).
  template <class TensorS>
  __device__ __forceinline__ float thread_max(TensorS const& s, int m) const {
    static_assert(decltype(size<0>(s))::value == kRows);
    constexpr int kCols = decltype(size<1>(s))::value;
    static_assert(kCols % kChains == 0);
    float mxc[kChains];
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kChains; ++c) mxc[c] = row_max[m];
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < kCols; ++n) mxc[n % kChains] = fmaxf(mxc[n % kChains], s(m, n));
    return combine_max(mxc);
  }

  // Row m of step(), mx_thread its max over this thread's scores; returns whether it moved.
  template <class TensorS>
  __device__ __forceinline__ bool step_row(TensorS& s, int m, float mx_thread, float& rescale) {
    constexpr int kCols = decltype(size<1>(s))::value;
    const float mx = quad_max(mx_thread);
    // -inf to finite: +inf > threshold, moves; -inf to -inf: NaN, stays.
    const bool move = (mx - row_max[m]) * scale_log2 > kMoveThreshold;
    const float ref = move ? mx : row_max[m];
    // NOTES: a row that has seen only masked keys keeps max = -inf; use 0 as its offset so
    // that exp2(-inf - offset) = 0 instead of NaN.
    const float offset = ref == -INFINITY ? 0.f : ref * scale_log2;
    rescale = move ? fast_exp2(row_max[m] * scale_log2 - offset) : 1.f;
    row_max[m] = ref;
    float sumc[kChains];
    CUTLASS_PRAGMA_UNROLL
    for (int c = 0; c < kChains; ++c) sumc[c] = 0.f;
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < kCols; ++n) {
      s(m, n) = fast_exp2(fmaf(s(m, n), scale_log2, -offset));
      sumc[n % kChains] += s(m, n);
    }
    float sum = sumc[0];
    CUTLASS_PRAGMA_UNROLL
    for (int c = 1; c < kChains; ++c) sum += sumc[c];
    row_sum[m] = row_sum[m] * rescale + sum;
    return move;
  }

 public:
  // Softcap's step where P's type keeps FP32's exponent range (BF16; FwdMainloopParams::
  // softcap_bounded): the softcapped scores t = tanh(.) lie in [-1, 1], so every row takes 0 as
  // its reference max from the start: P = exp2(t * scale_log2) in place, no row max and no O
  // rescale (the tanh's and the exponentials' MUFU operations no longer wait for a max between
  // them). P lies in [e^-softcap, e^softcap], within 2^+-72 for softcap <= kSoftcapBoundedMax:
  // normal FP32 and BF16 numbers, with room for the row sums and P V in FP32.
  // Each P is cut to BF16 (its low 16 bits cleared) before the row sum, so that the PV GEMM's
  // weights and the sum that divides them are the same numbers: without a row max a row's largest
  // P is not the exact 1 it is otherwise, and P rounded for the GEMM but summed unrounded was off
  // by up to 2^-9 where one key dominates a row. The cut P sum up to 2^-8 short, though, so the
  // log-sum-exp takes the uncut P's sums, kept in sum_exact (bounded_lse; docs/perf-log.md W13, W14).
  template <class TensorS>
  __device__ __forceinline__ void step_bounded(TensorS& s, float (&sum_exact)[kRows]) {
    static_assert(decltype(size<0>(s))::value == kRows);
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      constexpr int kCols = decltype(size<1>(s))::value;
      row_max[m] = 0.f;
      float sumc[kChains], sume[kChains];
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kChains; ++c) sumc[c] = sume[c] = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < kCols; ++n) {
        const float p = fast_exp2(s(m, n) * scale_log2);
        sume[n % kChains] += p;
        s(m, n) = __uint_as_float(__float_as_uint(p) & 0xffff0000u);
        sumc[n % kChains] += s(m, n);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int c = 0; c < kChains; ++c) { row_sum[m] += sumc[c]; sum_exact[m] += sume[c]; }
    }
  }

  // After finalize() for rows stepped by step_bounded: the log-sum-exp from the uncut P's sums.
  __device__ __forceinline__ void bounded_lse(const float (&sum_exact)[kRows], float (&lse)[kRows]) {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      const float sum = quad_sum(sum_exact[m]);
      if (sum != 0.f) lse[m] = __logf(sum);
    }
  }

  // Line 24: the final 1 / rowsum and the log-sum-exp (natural log) of the scaled scores.
  // Rows that saw no visible key: inv_sum = 1 (their output is 0) and lse = +inf.
  __device__ __forceinline__ void finalize(float softmax_scale, float (&inv_sum)[kRows],
                                           float (&lse)[kRows]) {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      const float sum = quad_sum(row_sum[m]);
      const bool empty = sum == 0.f || sum != sum;
      inv_sum[m] = empty ? 1.f : 1.f / sum;
      lse[m] = empty ? INFINITY : row_max[m] * softmax_scale + __logf(sum);
    }
  }
};

// t = tanh(coef * S) in place over a tensor of scores.
template <class TensorS>
__device__ __forceinline__ void apply_softcap(TensorS& s, float coef) {
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(s); ++i) s(i) = softcap_tanh(s(i), coef);
}

// The backward's factor of dS besides dP - D for a softcapped score, P (1 - t^2), computed with P
// from t (t = -inf where masked: P = 0, factor 0) and kept in FP16 in place of the FP32 P (which
// leaves in 16 bits at once), times kSoftcapPdtScale so that values down to 2^-26 stay normal;
// dS = factor * (dP - D) / kSoftcapPdtScale.
// NOTES: t recovered from P and the lse by one lg2 per score in dS instead cost the backward
// 17-37% with softcap at head dims 64 and 128 (docs/perf-log.md B112).
constexpr float kSoftcapPdtScale = 4096.f;
__device__ __forceinline__ float softcap_pdt(float p, float t) {
  return p * fmaxf(fmaf(-t, t, 1.f), 0.f) * kSoftcapPdtScale;
}

// dS from the factor above, dP and D / kSoftcapPdtScale (softcap_d, once per row or column).
__device__ __forceinline__ float softcap_d(float d) { return d * (1.f / kSoftcapPdtScale); }
__device__ __forceinline__ float softcap_ds(cutlass::half_t pdt, float dp, float d_scaled) {
  return float(pdt) * fmaf(dp, 1.f / kSoftcapPdtScale, -d_scaled);
}

// The backward's P and P (1 - t^2) for two softcapped scores t0, t1 adjacent in registers
// (columns 2k, 2k + 1 of a row): P = exp2(t * scale_log2 - lse) to 16 bits at p16[0..1], the
// factor (softcap_pdt) to FP16 at pdt16[0..1].
template <class Element>
__device__ __forceinline__ void softcap_p_pdt_pair(float t0, float t1, float scale_log2, float lse0, float lse1,
                                                   Element* p16, cutlass::half_t* pdt16) {
  cutlass::Array<float, 2> p2, q2;
  p2[0] = fast_exp2(t0 * scale_log2 - lse0);
  p2[1] = fast_exp2(t1 * scale_log2 - lse1);
  q2[0] = softcap_pdt(p2[0], t0);
  q2[1] = softcap_pdt(p2[1], t1);
  *reinterpret_cast<cutlass::Array<Element, 2>*>(p16) = cutlass::NumericArrayConverter<Element, float, 2>{}(p2);
  *reinterpret_cast<cutlass::Array<cutlass::half_t, 2>*>(pdt16) =
      cutlass::NumericArrayConverter<cutlass::half_t, float, 2>{}(q2);
}

// Multiplies each row of a (row, col) view by a per-row factor.
template <int kRows, class TensorO>
__device__ __forceinline__ void scale_rows(TensorO& o, const float (&factor)[kRows]) {
  CUTLASS_PRAGMA_UNROLL
  for (int m = 0; m < kRows; ++m) {
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < size<1>(o); ++n) o(m, n) *= factor[m];
  }
}

}  // namespace flash3::detail

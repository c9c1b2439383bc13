// flash3: the online softmax of Algorithm 1 (lines 18-19 and 24), in FP32, over score blocks
// held in WGMMA accumulator registers in (row, col) view.
#pragma once

#include "fwd/utils.h"

namespace flash3::detail {

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];  // per-thread partial sums; reduced across the quad in finalize()
  float scale_log2;      // softmax_scale * log2(e)

  __device__ explicit OnlineSoftmax(float scale_log2_) : scale_log2(scale_log2_) {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) { row_max[m] = -INFINITY; row_sum[m] = 0.f; }
  }

  // S -> P = exp(scale * (S - rowmax)) in place; returns, per row, the factor by which the
  // running output must be rescaled (exp(scale * (m_old - m_new))).
  template <class TensorS>
  __device__ __forceinline__ void step(TensorS& s, float (&rescale)[kRows]) {
    static_assert(decltype(size<0>(s))::value == kRows);
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < kRows; ++m) {
      float mx = row_max[m];
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(s); ++n) mx = fmaxf(mx, s(m, n));
      mx = quad_max(mx);
      // NOTES: a row that has seen only masked keys keeps max = -inf; use 0 as its offset so
      // that exp2(-inf - offset) = 0 instead of NaN.
      const float offset = mx == -INFINITY ? 0.f : mx * scale_log2;
      rescale[m] = fast_exp2(row_max[m] * scale_log2 - offset);
      row_max[m] = mx;
      float sum = 0.f;
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < size<1>(s); ++n) {
        s(m, n) = fast_exp2(fmaf(s(m, n), scale_log2, -offset));
        sum += s(m, n);
      }
      row_sum[m] = row_sum[m] * rescale[m] + sum;
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

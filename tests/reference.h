// CPU reference attention for the flash3 tests, and float16 / bfloat16 conversion helpers.
// Pure C++: no CUDA header is needed to build it.
#pragma once

#include <cstdint>
#include <vector>

namespace flash3 {
enum class DType : int;  // defined in flash3/flash3.h (codes as FLASH3_* in flash3/flash3_c.h)
}

namespace flash3::ref {

struct Problem {
  int batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim;
  double scale;
  bool causal;  // bottom-right aligned: key j is visible to query i iff j <= i + seqlen_k - seqlen_q
};

// q: [b][sq][h][d], k, v: [b][sk][hk][d], contiguous; out: [b][sq][h][d]; lse: [b][h][sq] (may be
// null). Query head h reads kv head h / (nheads / nheads_kv). A row that sees no key gets
// out = 0 and lse = +inf. rows: if non-null, only these query rows (in [0, sq)) are computed,
// for every batch and head; the other entries of out and lse are left untouched.
// Runs on all hardware threads.
void attention_fwd_fp64(const Problem& p, const double* q, const double* k, const double* v,
                        double* out, double* lse, const std::vector<int>* rows = nullptr);

// "Plain same-precision attention", as a framework computes it in the input dtype (used to size
// test tolerances), with rnd() rounding to dtype (float16 or bfloat16):
//   qs = rnd(q * scale); S = rnd(qs k^T accumulated in float32);
//   P = rnd(softmax(S) in float32); out = rnd(P v accumulated in float32);
//   lse = log-sum-exp of the rounded S, in float32.
void attention_fwd_lowp(const Problem& p, DType dtype, const double* q, const double* k,
                        const double* v, double* out, double* lse,
                        const std::vector<int>* rows = nullptr);

// Round to nearest even; NaN and infinities are kept, float16 subnormals handled.
uint16_t float_to_half_bits(float f);
float half_bits_to_float(uint16_t h);
uint16_t float_to_bf16_bits(float f);
float bf16_bits_to_float(uint16_t b);

// x rounded (to nearest even, once) to the nearest value of dtype: float16, bfloat16 or float32.
double round_to(DType dtype, double x);

}  // namespace flash3::ref

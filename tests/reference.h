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
  // Sliding window (FlashAttention-3's window_size): query i sees key j iff
  //   i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right,
  // -1 leaving that side unbounded; causal makes window_right 0.
  int window_left = -1, window_right = -1;
  // > 0: the scores S (scale included) become softcap * tanh(S / softcap) before the softmax.
  double softcap = 0;
};
// Variable-length batches are the fixed-length reference run per sequence, on its slices.

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
//   softcap: S = rnd(softcap * tanh(S / softcap)) in float32;
//   P = rnd(softmax(S) in float32); out = rnd(P v accumulated in float32);
//   lse = log-sum-exp of the rounded S, in float32.
void attention_fwd_lowp(const Problem& p, DType dtype, const double* q, const double* k,
                        const double* v, double* out, double* lse,
                        const std::vector<int>* rows = nullptr);

// The FP8 forward's "plain" computation (its tests' error yardstick), on the dequantized inputs
// (exact in float32: e4m3 values times float32 scales): S = (q k^T in float32) * scale;
// P = exp(S - rowmax) in float32, rounded to e4m3 before P v (accumulated in float32); out =
// rnd_bf16(P v / rowsum of the unrounded P); lse in float32.
void attention_fwd_fp8_plain(const Problem& p, const double* q, const double* k, const double* v, double* out,
                             double* lse, const std::vector<int>* rows = nullptr);

// e4m3 (float8_e4m3fn): x rounded to nearest even (saturating at +-448), and its bits; the value
// of a bit pattern (not NaN: 0x7f / 0xff).
double round_e4m3(double x);
uint8_t double_to_e4m3_bits(double x);
double e4m3_bits_to_double(uint8_t b);

// Backward of attention_fwd_fp64 for the loss sum(dout * out), in double:
//   P = softmax(scale q k^T, capped, masked), dV = P^T dO, dP = dO V^T, D = rowsum(dO o O)
//   (computed as rowsum(P o dP), the same number in exact arithmetic), dS = P o (dP - D) (times
//   1 - tanh^2(S / softcap) with softcap),
//   dQ = scale dS K, dK = scale dS^T Q.
// q, dout, dq: [b][sq][h][d]; k, v, dk, dv: [b][sk][hk][d], contiguous. GQA/MQA: dk, dv of a
// kv head are summed over the query heads that read it. Rows that see no key contribute
// nothing and get dq = 0; with seqlen_q == 0, dk = dv = 0. Every element of dq, dk, dv is
// written. Runs on all hardware threads; holds two seqlen_q x seqlen_k matrices (P and dS of
// one head) at a time.
void attention_bwd_fp64(const Problem& p, const double* q, const double* k, const double* v,
                        const double* dout, double* dq, double* dk, double* dv);

// The same backward "done plainly in the input precision", as PyTorch autograd computes it
// through the math attention of attention_fwd_lowp with tensors of dtype (float16 or bfloat16):
// every GEMM accumulates in float32 and rounds its output to dtype once (rnd), elementwise ops
// run in float32 on dtype operands and round their output:
//   forward, as attention_fwd_lowp:  qs = rnd(q * scale); S = rnd(qs k^T); P = rnd(softmax(S))
//   dV_h  = rnd(P^T dO)                       (per query head h)
//   dP    = rnd(dO V^T)
//   D     = rowsum(P o dP) in float32          (softmax backward, not rounded)
//   dS    = rnd(P o (dP - D)) in float32       (masked entries: 0)
//   softcap: dS = rnd(dS o (1 - t^2)), t = tanh(S / softcap) in float32 of the uncapped S
//   dqs   = rnd(dS K);  dq = rnd(dqs * scale)  (backward of qs = q * scale)
//   dK_h  = rnd(dS^T qs)
//   dk, dv = rnd(sum over the query heads h of a kv head of dK_h, dV_h), the sum in float32 in
//   head order (the backward of repeating k, v over the group); for MHA simply dK_h, dV_h.
// Rows that see no key give dq = 0 and contribute nothing (PyTorch would give NaN there).
// Its error against attention_bwd_fp64 sizes the tolerance of the GPU tests.
void attention_bwd_lowp(const Problem& p, DType dtype, const double* q, const double* k,
                        const double* v, const double* dout, double* dq, double* dk, double* dv);

// Round to nearest even; NaN and infinities are kept, float16 subnormals handled.
uint16_t float_to_half_bits(float f);
float half_bits_to_float(uint16_t h);
uint16_t float_to_bf16_bits(float f);
float bf16_bits_to_float(uint16_t b);

// x rounded (to nearest even, once) to the nearest value of dtype: float16, bfloat16 or float32.
double round_to(DType dtype, double x);

}  // namespace flash3::ref

// flash3 GPU tests of the FP8 (e4m3) forward against the FP64 CPU reference on the dequantized
// inputs. Skipped (reported as such) on machines without a Hopper GPU.
//
// Rule: max |flash3 - fp64| <= 2 * max |plain - fp64| + atol (atol 1e-3), where "plain" is the
// same computation done plainly from the same FP8 inputs in float32 with P rounded to e4m3 before
// P V (reference.h, attention_fwd_fp8_plain). Inputs are fresh N(0, 1) values (optionally with
// the paper's outliers, N(0, 100) x Bernoulli(0.001)), quantized on the host per (batch, kv head)
// (FlashAttention-3's descales), per block (kFp8BlockQ / fp8_block_kv(head_dim) rows), or not scaled; the
// output is poisoned before each run and every element is checked to have been written.
// With outliers, the score GEMM's own rounding enters: FP8 WGMMA keeps about 14 bits of its
// running sum (DeepSeek-V3 technical report, §3.3.2), not float32's 24, and the plain reference
// sums exactly. Those cases allow each of the head_dim / 32 WGMMA k-steps of a score, and its
// first alignment, to drop 2^-13 of scale * sum_d |q_d k_d| (measured: up to 2^-11 of it at head
// dim 128): that much on the lse tolerance (a score error moves the lse by as much), and twice
// that times max |v| on the output's.
#include <algorithm>
#include <cmath>
#include <tuple>

#include "gpu_harness.h"

namespace flash3::testing {
namespace {

enum class Scales { kNone, kPerHead, kBlock };

struct Fp8Case {
  int head_dim;
  bool causal;
  int batch, seqlen_q, seqlen_k, nheads, nheads_kv;
  Scales scales;
  bool outliers = false;
};

std::string describe(const Fp8Case& c) {
  const char* s = c.scales == Scales::kNone ? "none" : c.scales == Scales::kPerHead ? "per_head" : "block";
  return "fp8 d=" + std::to_string(c.head_dim) + (c.causal ? " causal" : "") + " b=" + std::to_string(c.batch) +
         " sq=" + std::to_string(c.seqlen_q) + " sk=" + std::to_string(c.seqlen_k) + " h=" + std::to_string(c.nheads) +
         " hk=" + std::to_string(c.nheads_kv) + " scales=" + s + (c.outliers ? " outliers" : "");
}

// One input tensor (batch, seqlen, heads, d), quantized: e4m3 bytes, the scales, and the
// dequantized values (e4m3 value x float32 scale, exact in double) for the references.
struct Quantized {
  std::vector<uint8_t> bits;
  std::vector<float> scale;  // (batch, scale_heads, blocks), or (batch, nheads_kv); empty: none
  std::vector<double> values;
};

// x: (b, s, heads, d) dense. group: heads sharing one per-head scale (q: nheads / nheads_kv).
Quantized quantize(const std::vector<double>& x, int b, int s, int heads, int d, Scales mode, int block, int group) {
  Quantized r;
  r.bits.resize(x.size());
  r.values.resize(x.size());
  const int blocks = (s + block - 1) / block;
  const int scale_heads = mode == Scales::kPerHead ? heads / group : heads;
  const int nblk = mode == Scales::kPerHead ? 1 : blocks;
  if (mode != Scales::kNone) r.scale.assign(size_t(b) * scale_heads * nblk, 0.f);
  auto scale_index = [&](int bi, int si, int hi) {
    return mode == Scales::kPerHead ? size_t(bi) * scale_heads + hi / group
                                    : (size_t(bi) * scale_heads + hi) * nblk + si / block;
  };
  auto at = [&](int bi, int si, int hi, int di) { return ((size_t(bi) * s + si) * heads + hi) * d + di; };
  if (mode != Scales::kNone) {
    std::vector<double> amax(r.scale.size(), 0.0);
    for (int bi = 0; bi < b; ++bi)
      for (int si = 0; si < s; ++si)
        for (int hi = 0; hi < heads; ++hi)
          for (int di = 0; di < d; ++di) {
            double& m = amax[scale_index(bi, si, hi)];
            m = std::max(m, std::abs(x[at(bi, si, hi, di)]));
          }
    for (size_t i = 0; i < amax.size(); ++i) r.scale[i] = amax[i] > 0 ? float(amax[i] / 448.0) : 1.f;
  }
  for (int bi = 0; bi < b; ++bi)
    for (int si = 0; si < s; ++si)
      for (int hi = 0; hi < heads; ++hi) {
        const double sc = mode == Scales::kNone ? 1.0 : double(r.scale[scale_index(bi, si, hi)]);
        for (int di = 0; di < d; ++di) {
          const size_t i = at(bi, si, hi, di);
          r.bits[i] = ref::double_to_e4m3_bits(x[i] / sc);
          r.values[i] = ref::e4m3_bits_to_double(r.bits[i]) * sc;
        }
      }
  return r;
}

std::vector<double> random_values(size_t n, bool outliers, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0), wide(0.0, 10.0);
  std::bernoulli_distribution rare(0.001);
  std::vector<double> x(n);
  for (double& v : x) v = normal(rng) + (outliers && rare(rng) ? wide(rng) : 0.0);
  return x;
}

void run_fp8_case(const Fp8Case& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng(seed);
  const int b = c.batch, sq = c.seqlen_q, sk = c.seqlen_k, h = c.nheads, hk = c.nheads_kv, d = c.head_dim;
  const size_t nq = size_t(b) * sq * h * d, nkv = size_t(b) * sk * hk * d;
  const Quantized q = quantize(random_values(nq, c.outliers, rng), b, sq, h, d, c.scales, kFp8BlockQ, h / hk);
  const Quantized k = quantize(random_values(nkv, c.outliers, rng), b, sk, hk, d, c.scales, fp8_block_kv(d), 1);
  const Quantized v = quantize(random_values(nkv, c.outliers, rng), b, sk, hk, d, c.scales, fp8_block_kv(d), 1);

  DeviceBuffer dq(nq), dk(nkv), dv(nkv), dout(nq * 2), dlse(size_t(b) * h * sq * 4);
  DeviceBuffer dqs(q.scale.size() * 4), dks(k.scale.size() * 4), dvs(v.scale.size() * 4);
  ASSERT_TRUE(dq.ptr && dk.ptr && dv.ptr && dout.ptr && dlse.ptr && dqs.ptr && dks.ptr && dvs.ptr);
  dq.upload(q.bits);
  dk.upload(k.bits);
  dv.upload(v.bits);
  FwdArgs args;
  args.q = TensorRef::contiguous(dq.ptr, DType::kFloat8E4M3, {b, sq, h, d});
  args.k = TensorRef::contiguous(dk.ptr, DType::kFloat8E4M3, {b, sk, hk, d});
  args.v = TensorRef::contiguous(dv.ptr, DType::kFloat8E4M3, {b, sk, hk, d});
  args.out = TensorRef::contiguous(dout.ptr, DType::kBFloat16, {b, sq, h, d});
  args.lse = TensorRef::contiguous(dlse.ptr, DType::kFloat32, {b, h, sq});
  args.causal = c.causal;
  if (c.scales != Scales::kNone) {
    dqs.upload(q.scale);
    dks.upload(k.scale);
    dvs.upload(v.scale);
    if (c.scales == Scales::kPerHead) {
      args.q_scale = TensorRef::contiguous(dqs.ptr, DType::kFloat32, {b, hk});
      args.k_scale = TensorRef::contiguous(dks.ptr, DType::kFloat32, {b, hk});
      args.v_scale = TensorRef::contiguous(dvs.ptr, DType::kFloat32, {b, hk});
    } else {
      args.q_scale = TensorRef::contiguous(dqs.ptr, DType::kFloat32, {b, h, (sq + kFp8BlockQ - 1) / kFp8BlockQ});
      args.k_scale = TensorRef::contiguous(dks.ptr, DType::kFloat32, {b, hk, (sk + fp8_block_kv(d) - 1) / fp8_block_kv(d)});
      args.v_scale = TensorRef::contiguous(dvs.ptr, DType::kFloat32, {b, hk, (sk + fp8_block_kv(d) - 1) / fp8_block_kv(d)});
    }
  }

  std::vector<uint16_t> out_bits[2];
  std::vector<float> lse_dev[2];
  for (int run = 0; run < 2; ++run) {
    FLASH3_CUDA_OK(cudaMemset(dout.ptr, 0xFF, nq * 2));
    FLASH3_CUDA_OK(cudaMemset(dlse.ptr, 0xFF, size_t(b) * h * sq * 4));
    ASSERT_NO_THROW(fwd(args));
    FLASH3_CUDA_OK(cudaDeviceSynchronize());
    out_bits[run] = dout.download<uint16_t>(nq);
    lse_dev[run] = dlse.download<float>(size_t(b) * h * sq);
  }
  ASSERT_TRUE(out_bits[0] == out_bits[1]) << "output differs between two identical runs";
  for (size_t i = 0; i < nq; ++i) {
    ASSERT_TRUE(std::isfinite(from_bits(DType::kBFloat16, out_bits[0][i]))) << "out not written at " << i;
  }

  const std::vector<int> rows = reference_rows(sq, rng);
  ref::Problem p{b, sq, sk, h, hk, d, 1.0 / std::sqrt(double(d)), c.causal};
  std::vector<double> out64(nq, 0.0), lse64(size_t(b) * h * sq, 0.0), outlp(nq, 0.0), lselp(size_t(b) * h * sq, 0.0);
  ref::attention_fwd_fp64(p, q.values.data(), k.values.data(), v.values.data(), out64.data(), lse64.data(), &rows);
  ref::attention_fwd_fp8_plain(p, q.values.data(), k.values.data(), v.values.data(), outlp.data(), lselp.data(),
                               &rows);
  double err = 0, err_lp = 0, err_lse = 0, err_lse_lp = 0;
  auto lse_diff = [](double a, double r) {
    if (std::isinf(r) || std::isinf(a)) return (std::isinf(r) && a == r) ? 0.0 : INFINITY;
    return std::abs(a - r);
  };
  for (int bi = 0; bi < b; ++bi)
    for (int hi = 0; hi < h; ++hi)
      for (int si : rows) {
        const size_t li = (size_t(bi) * h + hi) * sq + si;
        err_lse = std::max(err_lse, lse_diff(lse_dev[0][li], lse64[li]));
        err_lse_lp = std::max(err_lse_lp, lse_diff(lselp[li], lse64[li]));
        for (int di = 0; di < d; ++di) {
          const size_t i = ((size_t(bi) * sq + si) * h + hi) * d + di;
          err = std::max(err, std::abs(from_bits(DType::kBFloat16, out_bits[0][i]) - out64[i]));
          err_lp = std::max(err_lp, std::abs(outlp[i] - out64[i]));
        }
      }
  double acc_lse = 0, acc_out = 0;  // outliers: the score GEMM's accumulation (see the top)
  if (c.outliers) {
    double max_abs_sum = 0, max_v = 0;
    for (double x : v.values) max_v = std::max(max_v, std::abs(x));
    for (int bi = 0; bi < b; ++bi)
      for (int hi = 0; hi < h; ++hi)
        for (int si : rows)
          for (int kj = 0; kj < sk; ++kj) {
            const double* qr = &q.values[((size_t(bi) * sq + si) * h + hi) * d];
            const double* kr = &k.values[((size_t(bi) * sk + kj) * hk + hi / (h / hk)) * d];
            double sum = 0;
            for (int di = 0; di < d; ++di) sum += std::abs(qr[di] * kr[di]);
            max_abs_sum = std::max(max_abs_sum, sum);
          }
    acc_lse = (d / 32 + 1) * std::ldexp(max_abs_sum * p.scale, -13);
    acc_out = 2 * acc_lse * max_v;  // weights off by up to e^acc - 1 each
    ::testing::Test::RecordProperty("acc_lse", std::to_string(acc_lse));
  }
  const double atol = 1e-3;
  EXPECT_LE(err, 2 * err_lp + atol + acc_out) << "out: flash3 max err " << err << ", plain fp8 " << err_lp;
  EXPECT_LE(err_lse, 2 * err_lse_lp + atol + acc_lse) << "lse: flash3 max err " << err_lse << ", plain "
                                                      << err_lse_lp;
  ::testing::Test::RecordProperty("max_err", std::to_string(err));
  ::testing::Test::RecordProperty("max_err_plain", std::to_string(err_lp));
}

using Fp8Combo = std::tuple<int, bool, int, Scales>;  // head dim, causal, kv heads (of 8), scales

class FwdFp8Gpu : public ::testing::TestWithParam<Fp8Combo> {};

TEST_P(FwdFp8Gpu, MatchesReference) {
  FLASH3_REQUIRE_HOPPER();
  const auto [d, causal, hk, scales] = GetParam();
  run_fp8_case({d, causal, 2, 257, 383, 8, hk, scales}, 1000 + d + causal * 7 + hk * 13 + int(scales) * 29);
}

std::string fp8_name(const ::testing::TestParamInfo<Fp8Combo>& info) {
  const auto [d, causal, hk, scales] = info.param;
  const char* s = scales == Scales::kNone ? "noscale" : scales == Scales::kPerHead ? "perhead" : "block";
  return "d" + std::to_string(d) + (causal ? "_causal_" : "_full_") + (hk == 8 ? "mha" : hk == 1 ? "mqa" : "gqa") +
         "_" + s;
}

INSTANTIATE_TEST_SUITE_P(Matrix, FwdFp8Gpu,
                         ::testing::Combine(::testing::Values(64, 128, 256), ::testing::Bool(),
                                            ::testing::Values(8, 2, 1),
                                            ::testing::Values(Scales::kNone, Scales::kPerHead, Scales::kBlock)),
                         fp8_name);

// Outliers with block scales, longer sequences (several tiles per block, causal with
// seqlen_q != seqlen_k), short and single-row queries.
TEST(FwdFp8GpuShapes, LongOutliersAndRagged) {
  FLASH3_REQUIRE_HOPPER();
  run_fp8_case({128, false, 2, 1500, 2100, 4, 2, Scales::kBlock, true}, 7);
  run_fp8_case({128, true, 1, 2100, 1500, 4, 4, Scales::kBlock, true}, 8);
  run_fp8_case({64, true, 3, 1, 700, 2, 1, Scales::kPerHead}, 9);
  run_fp8_case({256, true, 1, 700, 65, 2, 2, Scales::kBlock}, 10);
  run_fp8_case({128, false, 1, 130, 1, 2, 1, Scales::kNone}, 11);
}

}  // namespace
}  // namespace flash3::testing

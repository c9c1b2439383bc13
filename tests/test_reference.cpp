// The CPU reference against a textbook formula, and the float16 / bfloat16 helpers.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "flash3/flash3.h"
#include "reference.h"

namespace {

using flash3::DType;
using flash3::ref::Problem;

const double kInf = std::numeric_limits<double>::infinity();

struct Data {
  std::vector<double> q, k, v;
};

Data random_data(const Problem& p, unsigned seed, DType dtype = DType::kFloat32) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist;
  auto fill = [&](size_t n) {
    std::vector<double> x(n);
    for (double& e : x) e = flash3::ref::round_to(dtype, dist(gen));
    return x;
  };
  const size_t nq = size_t(p.batch) * p.seqlen_q * p.nheads * p.head_dim;
  const size_t nk = size_t(p.batch) * p.seqlen_k * p.nheads_kv * p.head_dim;
  return {fill(nq), fill(nk), fill(nk)};
}

// The textbook formula, straight from the definition: exp of the masked scores, no max trick.
void textbook(const Problem& p, const Data& x, std::vector<double>& out, std::vector<double>& lse) {
  const int d = p.head_dim;
  out.assign(size_t(p.batch) * p.seqlen_q * p.nheads * d, 0.0);
  lse.assign(size_t(p.batch) * p.nheads * p.seqlen_q, 0.0);
  for (int b = 0; b < p.batch; ++b)
    for (int h = 0; h < p.nheads; ++h)
      for (int i = 0; i < p.seqlen_q; ++i) {
        const int hk = h / (p.nheads / p.nheads_kv);
        std::vector<double> w(p.seqlen_k, 0.0);
        double sum = 0;
        for (int j = 0; j < p.seqlen_k; ++j) {
          if (p.causal && j > i + p.seqlen_k - p.seqlen_q) continue;
          double dot = 0;
          for (int c = 0; c < d; ++c) {
            dot += x.q[((size_t(b) * p.seqlen_q + i) * p.nheads + h) * d + c] *
                   x.k[((size_t(b) * p.seqlen_k + j) * p.nheads_kv + hk) * d + c];
          }
          sum += (w[j] = std::exp(p.scale * dot));
        }
        for (int j = 0; j < p.seqlen_k; ++j)
          for (int c = 0; c < d; ++c) {
            if (w[j] != 0) {
              out[((size_t(b) * p.seqlen_q + i) * p.nheads + h) * d + c] +=
                  w[j] / sum * x.v[((size_t(b) * p.seqlen_k + j) * p.nheads_kv + hk) * d + c];
            }
          }
        lse[(size_t(b) * p.nheads + h) * p.seqlen_q + i] = sum == 0 ? kInf : std::log(sum);
      }
}

void expect_near_all(const std::vector<double>& got, const std::vector<double>& want, double tol) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isinf(want[i])) {
      EXPECT_EQ(got[i], want[i]) << "at " << i;
    } else {
      EXPECT_NEAR(got[i], want[i], tol) << "at " << i;
    }
  }
}

class Fp64VsTextbook : public ::testing::TestWithParam<Problem> {};

TEST_P(Fp64VsTextbook, OutAndLse) {
  const Problem p = GetParam();
  const Data x = random_data(p, 1);
  std::vector<double> want_out, want_lse;
  textbook(p, x, want_out, want_lse);
  std::vector<double> out(want_out.size(), -1.0), lse(want_lse.size(), -1.0);
  flash3::ref::attention_fwd_fp64(p, x.q.data(), x.k.data(), x.v.data(), out.data(), lse.data());
  expect_near_all(out, want_out, 1e-12);
  expect_near_all(lse, want_lse, 1e-12);
}

// batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, scale, causal
INSTANTIATE_TEST_SUITE_P(Shapes, Fp64VsTextbook,
                         ::testing::Values(Problem{2, 5, 7, 2, 2, 8, 0.35, false},
                                           Problem{2, 5, 7, 2, 2, 8, 0.35, true},   // sq < sk
                                           Problem{1, 9, 4, 2, 1, 4, 0.5, true},    // sq > sk: empty rows
                                           Problem{1, 6, 6, 6, 2, 16, 0.25, true},  // GQA
                                           Problem{3, 20, 33, 4, 1, 8, 0.3, false},
                                           Problem{1, 3, 0, 2, 2, 4, 1.0, false}));  // no keys at all

TEST(Fp64Reference, RowsWithoutVisibleKeysGetZeroAndInfinity) {
  const Problem p{1, 6, 2, 1, 1, 4, 1.0, true};  // row i sees keys j <= i - 4
  const Data x = random_data(p, 2);
  std::vector<double> out(6 * 4, -1.0), lse(6, -1.0);
  flash3::ref::attention_fwd_fp64(p, x.q.data(), x.k.data(), x.v.data(), out.data(), lse.data());
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(lse[i], kInf) << "row " << i;
    for (int c = 0; c < 4; ++c) EXPECT_EQ(out[i * 4 + c], 0.0) << "row " << i;
  }
  EXPECT_TRUE(std::isfinite(lse[4]) && std::isfinite(lse[5]));
  for (int c = 0; c < 4; ++c) EXPECT_DOUBLE_EQ(out[4 * 4 + c], x.v[c]);  // one visible key: its v
}

TEST(Fp64Reference, RowsOptionComputesOnlyThoseRows) {
  const Problem p{2, 40, 24, 4, 2, 8, 0.3, true};
  const Data x = random_data(p, 3);
  std::vector<double> full_out(2 * 40 * 4 * 8), full_lse(2 * 4 * 40);
  flash3::ref::attention_fwd_fp64(p, x.q.data(), x.k.data(), x.v.data(), full_out.data(), full_lse.data());
  const std::vector<int> rows = {39, 0, 17, 5, 16, 33, 2, 8, 9, 10, 11, 12, 13, 14, 15, 30, 31, 20};  // 2 blocks
  const double kUntouched = 12345.0;
  std::vector<double> out(full_out.size(), kUntouched), lse(full_lse.size(), kUntouched);
  flash3::ref::attention_fwd_fp64(p, x.q.data(), x.k.data(), x.v.data(), out.data(), lse.data(), &rows);
  for (int b = 0; b < 2; ++b)
    for (int i = 0; i < 40; ++i) {
      const bool chosen = std::find(rows.begin(), rows.end(), i) != rows.end();
      for (int h = 0; h < 4; ++h) {
        const size_t l = (size_t(b) * 4 + h) * 40 + i;
        EXPECT_EQ(lse[l], chosen ? full_lse[l] : kUntouched) << b << " " << h << " " << i;
        for (int c = 0; c < 8; ++c) {
          const size_t o = ((size_t(b) * 40 + i) * 4 + h) * 8 + c;
          EXPECT_EQ(out[o], chosen ? full_out[o] : kUntouched) << b << " " << h << " " << i;
        }
      }
    }
}

TEST(Fp64Reference, LseMayBeNull) {
  const Problem p{1, 4, 4, 1, 1, 4, 0.5, false};
  const Data x = random_data(p, 4);
  std::vector<double> out(16), want_out, want_lse;
  textbook(p, x, want_out, want_lse);
  flash3::ref::attention_fwd_fp64(p, x.q.data(), x.k.data(), x.v.data(), out.data(), nullptr);
  expect_near_all(out, want_out, 1e-12);
}

// Relative error of got against want, over the largest magnitude of want.
double rel_error(const std::vector<double>& got, const std::vector<double>& want) {
  double err = 0, scale = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err = std::max(err, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return err / scale;
}

TEST(LowpReference, CloseToFp64ButNotIdentical) {
  const Problem p{1, 64, 96, 2, 1, 64, 0.125, true};
  double err[2];
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    const Data x = random_data(p, 5, dtype);
    std::vector<double> out64(64 * 2 * 64), lse64(2 * 64), out(out64.size()), lse(lse64.size());
    flash3::ref::attention_fwd_fp64(p, x.q.data(), x.k.data(), x.v.data(), out64.data(), lse64.data());
    flash3::ref::attention_fwd_lowp(p, dtype, x.q.data(), x.k.data(), x.v.data(), out.data(), lse.data());
    for (double o : out) EXPECT_EQ(o, flash3::ref::round_to(dtype, o)) << "out is rounded to the dtype";
    const double e = err[dtype == DType::kBFloat16] = rel_error(out, out64);
    EXPECT_GT(e, 1e-4) << flash3::dtype_name(dtype);
    EXPECT_LT(e, 3e-2) << flash3::dtype_name(dtype);
    EXPECT_LT(rel_error(lse, lse64), 1e-2) << flash3::dtype_name(dtype);
  }
  EXPECT_LT(err[0], err[1]) << "float16 has 3 more mantissa bits than bfloat16";
}

TEST(LowpReference, RejectsOtherDtypes) {
  const Problem p{1, 1, 1, 1, 1, 1, 1.0, false};
  double x = 1, out, lse;
  EXPECT_THROW(flash3::ref::attention_fwd_lowp(p, DType::kFloat32, &x, &x, &x, &out, &lse),
               std::invalid_argument);
}

// ---- conversions -----------------------------------------------------------------------------

float f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

TEST(Conversions, KnownValues) {
  using namespace flash3::ref;
  EXPECT_EQ(float_to_bf16_bits(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16_bits(-2.0f), 0xC000);
  EXPECT_EQ(float_to_half_bits(1.0f), 0x3C00);
  EXPECT_EQ(float_to_half_bits(-2.0f), 0xC000);
  EXPECT_EQ(float_to_half_bits(65504.0f), 0x7BFF);  // the largest float16
  EXPECT_EQ(float_to_half_bits(65519.0f), 0x7BFF);
  EXPECT_EQ(float_to_half_bits(65520.0f), 0x7C00);  // a tie with 65536: to even, i.e. inf
  EXPECT_EQ(float_to_half_bits(1e10f), 0x7C00);
  EXPECT_EQ(float_to_half_bits(-INFINITY), 0xFC00);
  EXPECT_EQ(float_to_bf16_bits(INFINITY), 0x7F80);
  EXPECT_EQ(float_to_bf16_bits(f32(0x7F7FFFFF)), 0x7F80);  // FLT_MAX overflows bfloat16
  EXPECT_EQ(float_to_half_bits(-0.0f), 0x8000);
  // Ties round to even.
  EXPECT_EQ(float_to_half_bits(1.0f + 0x1p-11f), 0x3C00);
  EXPECT_EQ(float_to_half_bits(1.0f + 3 * 0x1p-11f), 0x3C02);
  EXPECT_EQ(float_to_half_bits(1.0f + 0x1p-11f + 0x1p-20f), 0x3C01);  // above the tie
  EXPECT_EQ(float_to_bf16_bits(1.0f + 0x1p-8f), 0x3F80);
  EXPECT_EQ(float_to_bf16_bits(1.0f + 3 * 0x1p-8f), 0x3F82);
  // float16 subnormals (units of 2^-24) and the smallest normal.
  EXPECT_EQ(float_to_half_bits(0x1p-24f), 0x0001);
  EXPECT_EQ(float_to_half_bits(0x1p-25f), 0x0000);      // tie: to even (0)
  EXPECT_EQ(float_to_half_bits(3 * 0x1p-25f), 0x0002);  // tie: to even (2)
  EXPECT_EQ(float_to_half_bits(-1023 * 0x1p-24f), 0x83FF);
  EXPECT_EQ(float_to_half_bits(0x1p-14f), 0x0400);
  EXPECT_EQ(float_to_half_bits(0x1p-14f - 0x1p-26f), 0x0400);  // rounds up into the normals
  EXPECT_EQ(half_bits_to_float(0x0001), 0x1p-24f);
  EXPECT_EQ(half_bits_to_float(0x03FF), 1023 * 0x1p-24f);
  EXPECT_EQ(half_bits_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(half_bits_to_float(0xFC00), -INFINITY);
  EXPECT_EQ(bf16_bits_to_float(0x3F80), 1.0f);
  // NaN stays NaN.
  EXPECT_TRUE(std::isnan(half_bits_to_float(float_to_half_bits(NAN))));
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(NAN))));
  EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(f32(0x7F800001)))));  // low payload
  EXPECT_TRUE(std::isnan(half_bits_to_float(float_to_half_bits(f32(0xFF800001)))));
}

TEST(Conversions, EveryBitPatternRoundTrips) {
  using namespace flash3::ref;
  for (uint32_t u = 0; u <= 0xFFFF; ++u) {
    const uint16_t h = static_cast<uint16_t>(u);
    const float fh = half_bits_to_float(h), fb = bf16_bits_to_float(h);
    if (std::isnan(fh)) {
      EXPECT_TRUE(std::isnan(half_bits_to_float(float_to_half_bits(fh)))) << std::hex << u;
    } else {
      EXPECT_EQ(float_to_half_bits(fh), h) << std::hex << u;
    }
    if (std::isnan(fb)) {
      EXPECT_TRUE(std::isnan(bf16_bits_to_float(float_to_bf16_bits(fb)))) << std::hex << u;
    } else {
      EXPECT_EQ(float_to_bf16_bits(fb), h) << std::hex << u;
    }
  }
}

// round_to (double arithmetic) and the bit-level float conversions are written independently.
TEST(Conversions, RoundToAgreesWithBitConversions) {
  using namespace flash3::ref;
  std::mt19937 gen(6);
  std::uniform_int_distribution<uint32_t> any;
  for (int n = 0; n < 200000; ++n) {
    const float f = f32(any(gen));
    if (std::isnan(f)) continue;
    EXPECT_EQ(round_to(DType::kFloat16, f), half_bits_to_float(float_to_half_bits(f))) << f;
    EXPECT_EQ(round_to(DType::kBFloat16, f), bf16_bits_to_float(float_to_bf16_bits(f))) << f;
  }
  // Values in float16's range, subnormals included.
  std::uniform_real_distribution<double> mant(-2.0, 2.0);
  std::uniform_int_distribution<int> expo(-27, 17);
  for (int n = 0; n < 200000; ++n) {
    const float f = static_cast<float>(std::ldexp(mant(gen), expo(gen)));
    EXPECT_EQ(round_to(DType::kFloat16, f), half_bits_to_float(float_to_half_bits(f))) << f;
  }
  EXPECT_EQ(round_to(DType::kFloat32, 1.0 + 0x1p-30), 1.0);
  EXPECT_TRUE(std::isnan(round_to(DType::kFloat16, NAN)));
  EXPECT_EQ(round_to(DType::kBFloat16, -kInf), -kInf);
}

}  // namespace

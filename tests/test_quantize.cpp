// flash3: tests of quantize_fp8 and its Hadamard transform. CPU tests (always run): the host FWHT
// and the kernel's register/lane decomposition against dense FP64 products, orthogonality, the
// random signs, and every validation rule (through an injected pointer inspector). GPU tests
// (skipped without a Hopper GPU): scales and e4m3 outputs against an FP64 reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <random>
#include <string>
#include <vector>

#include "error_check.h"
#include "gpu_harness.h"
#include "quant/hadamard.h"
#include "quant/quantize.h"

namespace flash3::testing {
namespace {

using detail::fwht_reference;
using detail::hadamard_element;
using detail::hadamard_group_lanes;
using detail::hadamard_lane_sign_mask;
using detail::hadamard_lane_step;
using detail::hadamard_registers;
using detail::hadamard_rotate_reference;
using detail::hadamard_sign;
using detail::hadamard_sign_bit;
using detail::kHadamardValuesPerLane;

std::vector<double> random_vector(int n, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> x(n);
  for (double& v : x) v = normal(rng);
  return x;
}

int popcount(unsigned v) {
  int c = 0;
  for (; v; v &= v - 1) ++c;
  return c;
}

// y_j = sum_i x_i H_ij with H_ij = (-1)^popcount(i & j), as a dense FP64 product.
std::vector<double> dense_hadamard(const std::vector<double>& x) {
  const int n = int(x.size());
  std::vector<double> y(n, 0.0);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < n; ++i) y[j] += (popcount(unsigned(i & j)) % 2 ? -x[i] : x[i]);
  }
  return y;
}

double sum_abs(const std::vector<double>& x) {
  double s = 0;
  for (double v : x) s += std::fabs(v);
  return s;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

const int kHeadDims[] = {64, 128, 256};

// ---- the transform on the CPU ----------------------------------------------------------------

TEST(QuantizeHadamard, FwhtMatchesDenseProduct) {
  std::mt19937_64 rng(1);
  for (int d : kHeadDims) {
    SCOPED_TRACE("d=" + std::to_string(d));
    const std::vector<double> x = random_vector(d, rng);
    const std::vector<double> want = dense_hadamard(x);
    std::vector<double> got = x;
    fwht_reference(got.data(), d);
    std::vector<float> got32(x.begin(), x.end());
    fwht_reference(got32.data(), d);
    // FP64: exact up to rounding; FP32: rounding x to float, then log2(d) roundings of partial
    // sums bounded by sum |x|.
    const double tol64 = 1e-13 * sum_abs(x);
    const double tol32 = (std::log2(double(d)) + 1) * 0x1p-24 * sum_abs(x);
    for (int j = 0; j < d; ++j) {
      EXPECT_NEAR(got[j], want[j], tol64) << "j=" << j;
      EXPECT_NEAR(double(got32[j]), want[j], tol32 + std::fabs(want[j]) * 0x1p-24) << "j=" << j;
    }
  }
}

// The full rotation y = (x o s) H / sqrt(d) against the dense matrix diag(s) H / sqrt(d).
TEST(QuantizeHadamard, RotationMatchesDenseMatrix) {
  std::mt19937_64 rng(2);
  for (int d : kHeadDims) {
    SCOPED_TRACE("d=" + std::to_string(d));
    const uint64_t seed = 0x1234567u + d;
    const std::vector<double> x = random_vector(d, rng);
    std::vector<double> want(d, 0.0);
    for (int j = 0; j < d; ++j) {
      for (int i = 0; i < d; ++i) {
        const double m = hadamard_sign(seed, uint32_t(i)) * (popcount(unsigned(i & j)) % 2 ? -1.0 : 1.0) / std::sqrt(double(d));
        want[j] += x[i] * m;
      }
    }
    std::vector<double> got(d);
    hadamard_rotate_reference(x.data(), got.data(), d, seed);
    for (int j = 0; j < d; ++j) EXPECT_NEAR(got[j], want[j], 1e-13 * sum_abs(x)) << "j=" << j;
  }
}

// The kernel's decomposition, emulated lane by lane with the same helpers: each lane g of a group
// of G = d / 32 loads the elements hadamard_element(G, g, r) with their signs (from
// hadamard_lane_sign_mask), runs the register butterflies, then one lane step per group-lane bit
// with the partner lane's registers. The result, held in the same map, must be the FWHT of x o s.
TEST(QuantizeHadamard, KernelDecompositionMatchesFwht) {
  std::mt19937_64 rng(3);
  for (int d : kHeadDims) {
    SCOPED_TRACE("d=" + std::to_string(d));
    const uint64_t seed = 77 + d;
    const int G = hadamard_group_lanes(d);
    ASSERT_EQ(G * kHadamardValuesPerLane, d);
    // The map is a bijection onto [0, d).
    std::vector<int> seen(d, 0);
    for (int g = 0; g < G; ++g) {
      for (int r = 0; r < kHadamardValuesPerLane; ++r) ++seen[hadamard_element(G, g, r)];
    }
    for (int i = 0; i < d; ++i) ASSERT_EQ(seen[i], 1) << "element " << i;

    const std::vector<double> x = random_vector(d, rng);
    std::vector<std::vector<double>> lanes(G, std::vector<double>(kHadamardValuesPerLane));
    for (int g = 0; g < G; ++g) {
      const uint32_t mask = hadamard_lane_sign_mask(seed, d, g);
      double v[kHadamardValuesPerLane];
      for (int r = 0; r < kHadamardValuesPerLane; ++r) {
        const int i = hadamard_element(G, g, r);
        ASSERT_EQ((mask >> r) & 1u, hadamard_sign_bit(seed, uint32_t(i))) << "g=" << g << " r=" << r;
        v[r] = ((mask >> r) & 1u) ? -x[i] : x[i];
      }
      hadamard_registers(v);
      std::copy(v, v + kHadamardValuesPerLane, lanes[g].begin());
    }
    for (int m = 1; m < G; m *= 2) {
      std::vector<std::vector<double>> next = lanes;
      for (int g = 0; g < G; ++g) {
        for (int r = 0; r < kHadamardValuesPerLane; ++r) {
          next[g][r] = hadamard_lane_step(lanes[g][r], lanes[g ^ m][r], (g & m) ? -1.0 : 1.0);
        }
      }
      lanes = next;
    }
    std::vector<double> want(d);
    for (int i = 0; i < d; ++i) want[i] = hadamard_sign(seed, uint32_t(i)) * x[i];
    fwht_reference(want.data(), d);
    for (int g = 0; g < G; ++g) {
      for (int r = 0; r < kHadamardValuesPerLane; ++r) {
        const int i = hadamard_element(G, g, r);
        EXPECT_NEAR(lanes[g][r], want[i], 1e-13 * sum_abs(x)) << "element " << i;
      }
    }
  }
}

// Incoherent processing keeps q . k: the rotation is orthogonal (same seed for q and k).
TEST(QuantizeHadamard, SameSeedPreservesDotProducts) {
  std::mt19937_64 rng(4);
  for (int d : kHeadDims) {
    SCOPED_TRACE("d=" + std::to_string(d));
    for (uint64_t seed : {uint64_t(0), uint64_t(42), ~uint64_t(0)}) {
      const std::vector<double> q = random_vector(d, rng), k = random_vector(d, rng);
      std::vector<double> mq(d), mk(d);
      hadamard_rotate_reference(q.data(), mq.data(), d, seed);
      hadamard_rotate_reference(k.data(), mk.data(), d, seed);
      const double scale = std::sqrt(dot(q, q) * dot(k, k));
      EXPECT_NEAR(dot(mq, mk), dot(q, k), 1e-13 * scale);
      EXPECT_NEAR(dot(mq, mq), dot(q, q), 1e-13 * dot(q, q));
      // A different seed for k gives a different rotation: the dot product is not kept.
      std::vector<double> mk_other(d);
      hadamard_rotate_reference(k.data(), mk_other.data(), d, seed + 1);
      EXPECT_GT(std::fabs(dot(mq, mk_other) - dot(q, k)), 1e-6 * scale);
    }
  }
}

TEST(QuantizeHadamard, SignsReproducibleAndSeeded) {
  const uint64_t seeds[] = {0, 1, 2, 12345, 0xdeadbeefcafef00dull};
  std::vector<std::vector<int>> all;
  for (uint64_t seed : seeds) {
    std::vector<int> s(256);
    int negatives = 0;
    for (uint32_t i = 0; i < 256; ++i) {
      s[i] = hadamard_sign(seed, i);
      ASSERT_TRUE(s[i] == 1 || s[i] == -1);
      EXPECT_EQ(s[i], hadamard_sign(seed, i)) << "not reproducible";
      EXPECT_EQ(s[i] == -1, hadamard_sign_bit(seed, i) == 1u);
      negatives += s[i] < 0;
    }
    // Roughly balanced (a fair coin gives 128 +- 8 per standard deviation).
    EXPECT_GT(negatives, 80) << "seed " << seed;
    EXPECT_LT(negatives, 176) << "seed " << seed;
    all.push_back(s);
  }
  for (size_t a = 0; a < all.size(); ++a) {
    for (size_t b = a + 1; b < all.size(); ++b) {
      int differ = 0;
      for (int i = 0; i < 256; ++i) differ += all[a][i] != all[b][i];
      EXPECT_GT(differ, 64) << "seeds " << seeds[a] << " and " << seeds[b];
    }
  }
}

// ---- validation on the CPU -------------------------------------------------------------------

const void* g_host = nullptr;
const void* g_unknown = nullptr;
PointerKind fake_inspect(const void* p) {
  return p == g_host ? PointerKind::kHost : p == g_unknown ? PointerKind::kUnknown : PointerKind::kDevice;
}
void* fake_ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

// Contiguous in (bfloat16), out (e4m3) and scale at distinct aligned fake addresses.
QuantizeArgs make_args(int64_t b, int64_t s, int64_t h, int64_t d, int block_rows = 128) {
  QuantizeArgs a;
  a.in = TensorRef::contiguous(fake_ptr(0x100000), DType::kBFloat16, {b, s, h, d});
  a.out = TensorRef::contiguous(fake_ptr(0x200000), DType::kFloat8E4M3, {b, s, h, d});
  a.scale = TensorRef::contiguous(fake_ptr(0x300000), DType::kFloat32, {b, h, (s + block_rows - 1) / block_rows});
  a.block_rows = block_rows;
  return a;
}

::testing::AssertionResult fails_with(const QuantizeArgs& a, std::initializer_list<std::string> parts) {
  return throws_error([&] { validate_quantize(a, &fake_inspect); }, "flash3::quantize_fp8: ", parts);
}

TEST(QuantizeValidate, AcceptsValidArguments) {
  for (int d : kHeadDims) {
    for (int rows : {1, 7, kFp8BlockQ, fp8_block_kv(d), 1 << 20}) {
      QuantizeArgs a = make_args(2, 300, 3, d, rows);
      a.hadamard = true;
      a.seed = 9;
      const QuantizeProblem p = validate_quantize(a, &fake_inspect);
      EXPECT_EQ(p.batch, 2);
      EXPECT_EQ(p.seqlen, 300);
      EXPECT_EQ(p.nheads, 3);
      EXPECT_EQ(p.head_dim, d);
      EXPECT_EQ(p.num_blocks, (300 + rows - 1) / rows);
      EXPECT_EQ(p.units, int64_t(2) * 3 * p.num_blocks);
      EXPECT_TRUE(p.hadamard);
      EXPECT_EQ(p.seed, 9u);
      EXPECT_TRUE(p.vectorized);
    }
  }
  QuantizeArgs a = make_args(2, 300, 3, 128);
  a.in.dtype = DType::kFloat16;
  EXPECT_EQ(validate_quantize(a, &fake_inspect).dtype, DType::kFloat16);
}

TEST(QuantizeValidate, Ranks) {
  QuantizeArgs a = make_args(2, 100, 3, 64);
  a.in.rank = 3;
  EXPECT_TRUE(fails_with(a, {"in.rank is 3", "(batch, seqlen, nheads, head_dim)"}));
  a = make_args(2, 100, 3, 64);
  a.out.rank = 2;
  EXPECT_TRUE(fails_with(a, {"out.rank is 2"}));
  a = make_args(2, 100, 3, 64);
  a.scale.rank = 4;
  EXPECT_TRUE(fails_with(a, {"scale.rank is 4", "(batch, nheads, num_blocks)"}));
}

TEST(QuantizeValidate, Dtypes) {
  QuantizeArgs a = make_args(2, 100, 3, 64);
  a.in.dtype = DType::kFloat32;
  EXPECT_TRUE(fails_with(a, {"in.dtype is float32", "float16, bfloat16"}));
  a = make_args(2, 100, 3, 64);
  a.in.dtype = static_cast<DType>(99);
  EXPECT_TRUE(fails_with(a, {"in.dtype is unknown (code 99)"}));
  a = make_args(2, 100, 3, 64);
  a.out.dtype = DType::kFloat8E5M2;
  EXPECT_TRUE(fails_with(a, {"out.dtype is float8_e5m2", "float8_e4m3"}));
  a = make_args(2, 100, 3, 64);
  a.scale.dtype = DType::kFloat16;
  EXPECT_TRUE(fails_with(a, {"scale.dtype is float16", "float32"}));
}

TEST(QuantizeValidate, Sizes) {
  QuantizeArgs a = make_args(2, 100, 3, 64);
  a.in.shape[1] = a.out.shape[1] = -1;
  EXPECT_TRUE(fails_with(a, {"in.shape[1] (seqlen) is -1", ">= 0"}));
  a = make_args(2, 100, 3, 64);
  a.in.shape[0] = a.out.shape[0] = a.scale.shape[0] = int64_t(1) << 31;
  EXPECT_TRUE(fails_with(a, {"in.shape[0] (batch) is 2147483648", "int32"}));
}

TEST(QuantizeValidate, BlockRows) {
  for (int rows : {-1, -64}) {
    QuantizeArgs a = make_args(2, 100, 3, 64);
    a.block_rows = rows;
    EXPECT_TRUE(fails_with(a, {"block_rows is " + std::to_string(rows), ">= 1", "fp8_block_kv(64) = 128"}));
  }
  // 0: fp8_block_kv(head_dim) rows, the FP8 forward's k/v blocks (192 at head dim 128)
  for (int d : kHeadDims) {
    QuantizeArgs a = make_args(2, 300, 3, d, fp8_block_kv(d));
    a.block_rows = 0;
    EXPECT_EQ(validate_quantize(a, &fake_inspect).block_rows, fp8_block_kv(d)) << "d " << d;
  }
  QuantizeArgs a = make_args(2, 300, 3, 128, 128);
  a.block_rows = 0;
  EXPECT_TRUE(fails_with(a, {"scale.shape[2] (num_blocks) is 3", "ceil(seqlen / block_rows) is 2", "block_rows 192"}));
}

TEST(QuantizeValidate, OutShape) {
  const char* const names[] = {"batch", "seqlen", "nheads", "head_dim"};
  for (int d = 0; d < 4; ++d) {
    QuantizeArgs a = make_args(2, 100, 3, 64);
    a.out.shape[d] += 1;
    EXPECT_TRUE(fails_with(a, {"out.shape[" + std::to_string(d) + "] (" + names[d] + ")",
                               "same shape as in"}));
  }
}

TEST(QuantizeValidate, ScaleShape) {
  QuantizeArgs a = make_args(2, 100, 3, 64, 64);
  a.scale.shape[2] = 1;  // ceil(100 / 64) = 2
  EXPECT_TRUE(fails_with(a, {"scale.shape[2] (num_blocks) is 1", "ceil(seqlen / block_rows) is 2",
                             "(batch, nheads, ceil(seqlen / block_rows))"}));
  a = make_args(2, 100, 3, 64, 64);
  a.scale.shape[0] = 3;
  EXPECT_TRUE(fails_with(a, {"scale.shape[0] (batch) is 3", "in.shape[0] (batch) is 2"}));
  a = make_args(2, 100, 3, 64, 64);
  a.scale.shape[1] = 1;
  EXPECT_TRUE(fails_with(a, {"scale.shape[1] (nheads) is 1", "in.shape[2] (nheads) is 3"}));
}

TEST(QuantizeValidate, HeadDim) {
  for (int d : {32, 96, 512}) {
    QuantizeArgs a = make_args(2, 100, 3, d);
    EXPECT_TRUE(fails_with(a, {"in.shape[3] (head_dim) is " + std::to_string(d), "64, 128, 256"}));
  }
}

TEST(QuantizeValidate, Strides) {
  QuantizeArgs a = make_args(2, 100, 3, 64);
  a.in.stride[3] = 2;
  EXPECT_TRUE(fails_with(a, {"in.stride[3] is 2", "contiguous"}));
  a = make_args(2, 100, 3, 64);
  a.out.stride[3] = 0;
  EXPECT_TRUE(fails_with(a, {"out.stride[3] is 0", "contiguous"}));
  a = make_args(2, 100, 3, 64);
  a.out.stride[1] = 0;
  EXPECT_TRUE(fails_with(a, {"out.stride[1] (seqlen) is 0", "nonzero"}));
  a = make_args(2, 100, 3, 64, 64);
  a.scale.stride[2] = 0;
  EXPECT_TRUE(fails_with(a, {"scale.stride[2] (num_blocks) is 0"}));
  // in is only read: any stride, 0 included (a broadcast); scale's last dim need not be contiguous.
  a = make_args(2, 100, 3, 64, 64);
  a.in.stride[0] = 0;
  a.in.stride[2] = -64;
  a.scale.stride[0] = 1;
  a.scale.stride[1] = 2;
  a.scale.stride[2] = 6;
  EXPECT_NO_THROW(validate_quantize(a, &fake_inspect));
}

TEST(QuantizeValidate, Pointers) {
  for (const char* name : {"in", "out", "scale"}) {
    QuantizeArgs a = make_args(2, 100, 3, 64);
    TensorRef& t = std::string(name) == "in" ? a.in : std::string(name) == "out" ? a.out : a.scale;
    void* const good = t.data;
    t.data = nullptr;
    EXPECT_TRUE(fails_with(a, {std::string(name) + ".data is null"}));
    t.data = good;
    g_host = good;
    EXPECT_TRUE(fails_with(a, {std::string(name) + ".data points to host memory"}));
    g_host = nullptr;
    g_unknown = good;
    EXPECT_TRUE(fails_with(a, {std::string(name) + ".data", "not a pointer the CUDA runtime knows"}));
    g_unknown = nullptr;
  }
  QuantizeArgs a = make_args(2, 100, 3, 64);
  a.in.data = fake_ptr(0x100001);
  EXPECT_TRUE(fails_with(a, {"in.data is", "not 2-byte aligned"}));
  a = make_args(2, 100, 3, 64);
  a.scale.data = fake_ptr(0x300002);
  EXPECT_TRUE(fails_with(a, {"scale.data is", "not 4-byte aligned"}));
  a = make_args(2, 100, 3, 64);
  a.out.data = a.in.data;
  EXPECT_TRUE(fails_with(a, {"out.data is", "the same as in.data"}));
  a = make_args(2, 100, 3, 64);
  a.scale.data = a.out.data;
  EXPECT_TRUE(fails_with(a, {"scale.data is", "the same as out.data"}));
}

// Misaligned rows select the kernel's scalar path (element accesses), aligned ones the vector one.
TEST(QuantizeValidate, VectorizedOnlyForAlignedRows) {
  QuantizeArgs a = make_args(2, 100, 3, 64);
  EXPECT_TRUE(validate_quantize(a, &fake_inspect).vectorized);
  a.in.stride[2] = 68;  // heads 136 bytes apart: not 16-byte aligned
  a.in.stride[1] = 3 * 68;
  a.in.stride[0] = 100 * 3 * 68;
  EXPECT_FALSE(validate_quantize(a, &fake_inspect).vectorized);
  a = make_args(2, 100, 3, 64);
  a.out.data = fake_ptr(0x200004);  // 4- but not 8-byte aligned
  EXPECT_FALSE(validate_quantize(a, &fake_inspect).vectorized);
  a = make_args(2, 100, 3, 64);
  a.in.data = fake_ptr(0x100008);
  EXPECT_FALSE(validate_quantize(a, &fake_inspect).vectorized);
  a = make_args(1, 1, 1, 64);
  a.in.stride[0] = a.in.stride[1] = a.in.stride[2] = 3;  // dims of size 1: strides unused
  EXPECT_TRUE(validate_quantize(a, &fake_inspect).vectorized);
}

// Empty tensors: shapes are checked, pointers and strides are not, and nothing is launched
// (quantize_fp8 returns before it looks for a GPU, so this runs anywhere).
TEST(QuantizeValidate, EmptyTensorsReturnWithoutLaunch) {
  for (int which = 0; which < 3; ++which) {
    const int64_t b = which == 0 ? 0 : 2, s = which == 1 ? 0 : 100, h = which == 2 ? 0 : 3;
    QuantizeArgs a = make_args(b, s, h, 64);
    a.in.data = a.out.data = a.scale.data = nullptr;
    a.in.stride[3] = 7;
    const QuantizeProblem p = validate_quantize(a, &fake_inspect);
    EXPECT_TRUE(p.empty());
    EXPECT_EQ(p.units, 0);
    EXPECT_NO_THROW(quantize_fp8(a));
  }
  QuantizeArgs a = make_args(0, 100, 3, 64);
  a.scale.shape[2] = 5;  // shapes are still checked
  EXPECT_TRUE(fails_with(a, {"scale.shape[2] (num_blocks) is 5"}));
}

// ---- the kernel on the GPU -------------------------------------------------------------------

struct Case {
  DType dtype;
  int head_dim;
  bool hadamard;
  int batch, seqlen, nheads, block_rows;
  int head_pad = 0, row_pad = 0;  // in's padding (elements); out gets its own (below)
  uint64_t seed = 5;
};

std::string describe(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " d=" + std::to_string(c.head_dim) +
         (c.hadamard ? " hadamard" : " plain") + " b=" + std::to_string(c.batch) +
         " s=" + std::to_string(c.seqlen) + " h=" + std::to_string(c.nheads) +
         " block_rows=" + std::to_string(c.block_rows) + " head_pad=" + std::to_string(c.head_pad) +
         " row_pad=" + std::to_string(c.row_pad);
}

// Tolerances. The kernel transforms in FP32 (log2(d) butterfly stages, each rounding a partial
// sum bounded by sum_i |x_i|), so its unnormalized y_j is within err_j = log2(d) 2^-24 sum|x| of
// the FP64 value; it stores e4m3(y_u * fl(448 / amax_u)). Each scale must be within 1e-5
// (relative) of the FP64 amax / 448. Each output must lie between e4m3(r - w) and e4m3(r + w),
// r = y / scale_ref the FP64 value and w the FP32 error window of r (err_j and amax's error,
// plus 2^-21 relative for the roundings of 448 / amax and the product): it equals e4m3(r) except
// where r is within w of a rounding midpoint, where it may be the neighbour (one e4m3 ulp).
// Dequantized, out * scale must be within 2^-4 |y| + scale 2^-9 of y (e4m3's half ulp: 3
// mantissa bits; subnormals in steps of 2^-9), plus the window w * scale.
void run_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng(c.seed * 7919 + c.head_dim);
  const int b = c.batch, s = c.seqlen, h = c.nheads, d = c.head_dim, R = c.block_rows;
  const int nb = (s + R - 1) / R;
  const PaddedLayout in_layout{b, s, h, d, c.head_pad, c.row_pad};
  const PaddedLayout out_layout{b, s, h, d, 16, 8};  // its own padding, checked untouched

  // Inputs ~ N(0, 1) with outliers (about 1 in 300 elements x 40), and the first block of
  // (batch 0, head 0) all zero (scale 1).
  std::vector<uint16_t> bits;
  std::vector<double> values;
  random_tensor(c.dtype, in_layout.size(), rng, bits, values);
  std::uniform_int_distribution<int> pick(0, 299);
  for (size_t i = 0; i < bits.size(); ++i) {
    if (pick(rng) == 0) {
      bits[i] = to_bits(c.dtype, values[i] * 40.0);
      values[i] = from_bits(c.dtype, bits[i]);
    }
  }
  for (size_t i = 0; i < in_layout.dense_size(); ++i) {
    const int64_t row = int64_t(i) / d / h, head = int64_t(i) / d % h;
    if (row < std::min(R, s) && head == 0) {  // batch 0 (row < s), head 0, block 0
      bits[in_layout.offset(i)] = to_bits(c.dtype, 0.0);
      values[in_layout.offset(i)] = 0.0;
    }
  }
  const std::vector<double> x = in_layout.dense(values);

  DeviceBuffer din(in_layout.size() * 2), dout(out_layout.size()), dscale(size_t(b) * h * nb * 4);
  ASSERT_TRUE(din.ptr && dout.ptr && dscale.ptr) << "cudaMalloc failed";
  din.upload(bits);
  FLASH3_CUDA_OK(cudaMemset(dout.ptr, 0x7F, out_layout.size()));        // e4m3 NaN
  FLASH3_CUDA_OK(cudaMemset(dscale.ptr, 0xFF, size_t(b) * h * nb * 4));  // float NaN

  QuantizeArgs args;
  args.in = in_layout.view(din.ptr, c.dtype);
  args.out = out_layout.view(dout.ptr, DType::kFloat8E4M3);
  // scale stored block-major ([block][batch][head]): a permuted, non-contiguous view.
  args.scale.data = dscale.ptr;
  args.scale.dtype = DType::kFloat32;
  args.scale.rank = 3;
  const int64_t scale_shape[3] = {b, h, nb}, scale_stride[3] = {h, 1, int64_t(b) * h};
  std::memcpy(args.scale.shape, scale_shape, sizeof scale_shape);
  std::memcpy(args.scale.stride, scale_stride, sizeof scale_stride);
  args.block_rows = R;
  args.hadamard = c.hadamard;
  args.seed = c.seed;
  EXPECT_EQ(validate_quantize(args).vectorized, c.head_pad % 8 == 0 && c.row_pad % 8 == 0);
  ASSERT_NO_THROW(quantize_fp8(args));
  FLASH3_CUDA_OK(cudaDeviceSynchronize());
  const std::vector<uint8_t> out_bits = dout.download<uint8_t>(out_layout.size());
  const std::vector<float> scales = dscale.download<float>(size_t(b) * h * nb);

  for (size_t off = 0; off < out_bits.size(); ++off) {
    if (out_layout.is_padding(off)) {
      ASSERT_EQ(out_bits[off], 0x7F) << "padding written at " << off;
    }
  }
  const std::vector<uint8_t> out = out_layout.dense(out_bits);

  const double log2d = std::log2(double(d));
  int bad = 0;
  for (int bi = 0; bi < b; ++bi) {
    for (int hi = 0; hi < h; ++hi) {
      for (int blk = 0; blk < nb; ++blk) {
        const int r0 = blk * R, r1 = std::min(s, r0 + R);
        // FP64 reference rows, and each row's FP32 error bound (unnormalized units).
        std::vector<double> y(size_t(r1 - r0) * d), err(r1 - r0, 0.0);
        double amax = 0, max_err = 0;
        for (int r = r0; r < r1; ++r) {
          const double* xr = &x[((size_t(bi) * s + r) * h + hi) * d];
          double* yr = &y[size_t(r - r0) * d];
          if (c.hadamard) {
            hadamard_rotate_reference(xr, yr, d, c.seed);
            double sa = 0;
            for (int j = 0; j < d; ++j) sa += std::fabs(xr[j]);
            err[r - r0] = log2d * 0x1p-24 * sa / std::sqrt(double(d));  // normalized units
            max_err = std::max(max_err, err[r - r0]);
          } else {
            std::copy(xr, xr + d, yr);
          }
          for (int j = 0; j < d; ++j) amax = std::max(amax, std::fabs(yr[j]));
        }
        const double scale_ref = amax > 0 ? amax / 448.0 : 1.0;
        const double scale_dev = scales[(size_t(blk) * b + bi) * h + hi];
        ASSERT_NEAR(scale_dev, scale_ref, 1e-5 * scale_ref) << "scale of batch " << bi << " head " << hi << " block " << blk;
        if (amax == 0) {
          ASSERT_EQ(scale_dev, 1.0);
        }
        const double rel = (amax > 0 ? max_err / amax : 0) + 0x1p-21;
        for (int r = r0; r < r1; ++r) {
          for (int j = 0; j < d; ++j) {
            const double yv = y[size_t(r - r0) * d + j];
            const uint8_t code = out[((size_t(bi) * s + r) * h + hi) * d + j];
            ASSERT_NE(code & 0x7F, 0x7F) << "NaN (unwritten?) at batch " << bi << " row " << r << " head " << hi << " col " << j;
            const double got = ref::e4m3_bits_to_double(code);
            const double rv = yv / scale_ref;
            const double w = std::fabs(rv) * rel + (amax > 0 ? err[r - r0] / scale_ref : 0);
            const double lo = ref::round_e4m3(rv - w), hi_v = ref::round_e4m3(rv + w);
            const double deq_err = std::fabs(got * scale_dev - yv);
            const double deq_tol = 0x1p-4 * std::fabs(yv) + scale_dev * 0x1p-9 + w * scale_ref + 1e-5 * std::fabs(yv);
            if ((got < lo || got > hi_v || deq_err > deq_tol) && ++bad <= 10) {
              ADD_FAILURE() << "batch " << bi << " row " << r << " head " << hi << " col " << j << ": y " << yv
                            << " scale " << scale_ref << " y/scale " << rv << " -> e4m3 in [" << lo << ", " << hi_v
                            << "], got " << got << " (0x" << std::hex << int(code) << std::dec
                            << "); dequantization error " << deq_err << " (tolerance " << deq_tol << ")";
            }
          }
        }
      }
    }
  }
  EXPECT_EQ(bad, 0) << "elements out of tolerance";
}

class QuantizeGpu : public ::testing::TestWithParam<std::tuple<DType, int, bool>> {};

TEST_P(QuantizeGpu, BlockSizes) {
  FLASH3_REQUIRE_HOPPER();
  const auto [dtype, d, hadamard] = GetParam();
  // block_rows 64 and 128 with a partial last block, one block per (batch, head), and blocks
  // larger than the CTA's registers (the two-pass path: 513+ rows at d 64, 257+ at 128, 129+ at 256).
  run_case({dtype, d, hadamard, 2, 200, 3, kFp8BlockQ});
  run_case({dtype, d, hadamard, 2, 300, 3, fp8_block_kv(d)});
  run_case({dtype, d, hadamard, 2, 333, 2, 1 << 20});
  run_case({dtype, d, hadamard, 1, 1100, 2, 1100});
  run_case({dtype, d, hadamard, 1, 700, 2, 600});
  // Small and odd blocks.
  run_case({dtype, d, hadamard, 1, 50, 2, 1});
  run_case({dtype, d, hadamard, 1, 100, 2, 7});
}

TEST_P(QuantizeGpu, StridedInput) {
  FLASH3_REQUIRE_HOPPER();
  const auto [dtype, d, hadamard] = GetParam();
  // Padded heads and rows, 16-byte aligned (vector path) and not (scalar path).
  run_case({dtype, d, hadamard, 2, 150, 3, kFp8BlockQ, 8, 16});
  run_case({dtype, d, hadamard, 2, 150, 3, fp8_block_kv(d), 3, 5});
  run_case({dtype, d, hadamard, 1, 300, 2, 300, 1, 0, 123});
}

INSTANTIATE_TEST_SUITE_P(
    All, QuantizeGpu,
    ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16), ::testing::Values(64, 128, 256),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<DType, int, bool>>& info) {
      return std::string(std::get<0>(info.param) == DType::kBFloat16 ? "bf16" : "fp16") + "_d" +
             std::to_string(std::get<1>(info.param)) + (std::get<2>(info.param) ? "_hadamard" : "_plain");
    });

// With the CUDA runtime's own inspector, host memory is refused.
TEST(QuantizeGpuValidate, HostPointerRejected) {
  FLASH3_REQUIRE_HOPPER();
  std::vector<uint16_t> host(2 * 64 * 64);
  QuantizeArgs a = make_args(1, 64, 2, 64);
  a.in.data = host.data();
  DeviceBuffer dout(64 * 2 * 64), dscale(2 * 4);
  a.out.data = dout.ptr;
  a.scale.data = dscale.ptr;
  try {
    quantize_fp8(a);
    ADD_FAILURE() << "quantize_fp8 accepted a host pointer";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("in.data points to host memory"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace flash3::testing

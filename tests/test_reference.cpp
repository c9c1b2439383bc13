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
  std::vector<double> q, k, v, dout;  // dout: [b][sq][h][d], the gradient of a loss w.r.t. out
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
  Data x;
  x.q = fill(nq);  // drawn in this order: the forward tests' q, k, v do not depend on dout
  x.k = fill(nk);
  x.v = fill(nk);
  x.dout = fill(nq);
  return x;
}

// Problem's mask written out: causal (bottom-right) and the sliding window.
bool visible(const Problem& p, int i, int j) {
  const int diag = p.seqlen_k - p.seqlen_q, right = p.causal ? 0 : p.window_right;
  return (right < 0 || j <= i + diag + right) && (p.window_left < 0 || j >= i + diag - p.window_left);
}
// The score after the softcap, if any.
double capped(const Problem& p, double s) { return p.softcap > 0 ? p.softcap * std::tanh(s / p.softcap) : s; }

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
          if (!visible(p, i, j)) continue;
          double dot = 0;
          for (int c = 0; c < d; ++c) {
            dot += x.q[((size_t(b) * p.seqlen_q + i) * p.nheads + h) * d + c] *
                   x.k[((size_t(b) * p.seqlen_k + j) * p.nheads_kv + hk) * d + c];
          }
          sum += (w[j] = std::exp(capped(p, p.scale * dot)));
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
                                           Problem{1, 3, 0, 2, 2, 4, 1.0, false},   // no keys at all
                                           // window_left, window_right, softcap
                                           Problem{2, 5, 7, 2, 2, 8, 0.35, false, 2, 1},
                                           Problem{2, 5, 7, 2, 2, 8, 0.35, true, 1},   // causal + left
                                           Problem{1, 9, 4, 2, 1, 4, 0.5, false, 0, 0},  // the diagonal; empty rows
                                           Problem{1, 6, 9, 3, 1, 8, 0.4, false, -1, 0},  // causal as a window
                                           Problem{2, 5, 7, 2, 2, 8, 0.35, true, -1, -1, 1.0},
                                           Problem{3, 20, 33, 4, 1, 8, 0.3, false, 5, 3, 30.0}));

TEST(Fp64Reference, WindowAndSoftcapLimits) {
  auto run = [](const Problem& p, const Data& x) {
    std::vector<double> out(x.q.size(), -1.0), lse(size_t(p.batch) * p.nheads * p.seqlen_q, -1.0);
    flash3::ref::attention_fwd_fp64(p, x.q.data(), x.k.data(), x.v.data(), out.data(), lse.data());
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
  };
  const Problem causal{2, 7, 11, 2, 1, 8, 0.3, true};
  const Data x = random_data(causal, 4);
  const std::vector<double> want = run(causal, x);
  Problem p = causal;
  p.causal = false, p.window_right = 0;  // (-1, 0) is causal
  EXPECT_EQ(run(p, x), want);
  p.causal = true, p.window_right = 3;  // causal makes window_right 0
  EXPECT_EQ(run(p, x), want);
  p.window_right = -1, p.window_left = 100;  // a window wider than the sequence
  EXPECT_EQ(run(p, x), want);
  p.window_left = -1, p.softcap = 1e9;  // a huge cap changes the scores by < 1e-18 relative
  expect_near_all(run(p, x), want, 1e-12);
}

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

// ---- backward ------------------------------------------------------------------------------

struct Grads {
  std::vector<double> dq, dk, dv;
};

// The reference backward, fp64 (dtype float32) or plain lowp (float16, bfloat16), into buffers
// pre-filled with NaN so that an element left unwritten shows.
Grads backward(const Problem& p, const Data& x, DType dtype = DType::kFloat32) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Grads g{std::vector<double>(x.q.size(), nan), std::vector<double>(x.k.size(), nan),
          std::vector<double>(x.v.size(), nan)};
  if (dtype == DType::kFloat32) {
    flash3::ref::attention_bwd_fp64(p, x.q.data(), x.k.data(), x.v.data(), x.dout.data(), g.dq.data(),
                                    g.dk.data(), g.dv.data());
  } else {
    flash3::ref::attention_bwd_lowp(p, dtype, x.q.data(), x.k.data(), x.v.data(), x.dout.data(),
                                    g.dq.data(), g.dk.data(), g.dv.data());
  }
  return g;
}

// The loss sum(dout * out) of the fp64 forward.
double loss(const Problem& p, const Data& x) {
  std::vector<double> out(x.q.size());
  flash3::ref::attention_fwd_fp64(p, x.q.data(), x.k.data(), x.v.data(), out.data(), nullptr);
  double l = 0;
  for (size_t i = 0; i < out.size(); ++i) l += x.dout[i] * out[i];
  return l;
}

class Fp64Backward : public ::testing::TestWithParam<Problem> {};

// Every gradient element against a central difference of the loss (error ~ eps^2 + 1e-16 / eps).
TEST_P(Fp64Backward, MatchesFiniteDifferences) {
  const Problem p = GetParam();
  Data x = random_data(p, 7);
  const Grads g = backward(p, x);
  const double eps = 1e-5;
  auto check = [&](std::vector<double> Data::*input, const std::vector<double>& grad, const char* name) {
    std::vector<double>& t = x.*input;
    for (size_t i = 0; i < t.size(); ++i) {
      const double saved = t[i];
      t[i] = saved + eps;
      const double up = loss(p, x);
      t[i] = saved - eps;
      const double down = loss(p, x);
      t[i] = saved;
      EXPECT_NEAR(grad[i], (up - down) / (2 * eps), 1e-7) << name << " at " << i;
    }
  };
  check(&Data::q, g.dq, "dq");
  check(&Data::k, g.dk, "dk");
  check(&Data::v, g.dv, "dv");
}

// batch, seqlen_q, seqlen_k, nheads, nheads_kv, head_dim, scale, causal
INSTANTIATE_TEST_SUITE_P(Shapes, Fp64Backward,
                         ::testing::Values(Problem{1, 5, 7, 2, 2, 4, 0.5, false},
                                           Problem{1, 5, 7, 2, 2, 4, 0.5, true},    // sq < sk
                                           Problem{1, 7, 3, 1, 1, 4, 0.6, true},    // sq > sk: empty rows
                                           Problem{2, 6, 6, 4, 2, 4, 0.4, true},    // GQA
                                           Problem{1, 4, 19, 3, 1, 8, 0.3, false},  // MQA, > 1 key block
                                           Problem{1, 18, 5, 2, 1, 4, 0.5, true},   // > 1 row block
                                           // window_left, window_right, softcap
                                           Problem{1, 5, 7, 2, 2, 4, 0.5, false, 2, 1},
                                           Problem{1, 5, 7, 2, 2, 4, 0.5, true, -1, -1, 0.7},
                                           Problem{2, 6, 6, 4, 2, 4, 0.4, false, 1, 0, 5.0},
                                           Problem{1, 18, 5, 2, 1, 4, 0.5, false, 3, -1}));

TEST(Fp64Backward, NoKeysGivesZeroDq) {
  const Problem p{2, 3, 0, 2, 1, 4, 0.5, false};
  const Grads g = backward(p, random_data(p, 8));
  for (double x : g.dq) EXPECT_EQ(x, 0.0);
}

TEST(Fp64Backward, NoQueriesGivesZeroDkDv) {
  const Problem p{2, 0, 5, 2, 1, 4, 0.5, false};
  const Grads g = backward(p, random_data(p, 9));
  for (double x : g.dk) EXPECT_EQ(x, 0.0);
  for (double x : g.dv) EXPECT_EQ(x, 0.0);
}

// Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key. They get
// dq = 0 and add nothing to dk, dv: the other rows give what the problem without them gives.
TEST(Fp64Backward, RowsWithoutKeysContributeNothing) {
  const Problem p{1, 23, 17, 2, 1, 8, 0.4, true}, trimmed{1, 17, 17, 2, 1, 8, 0.4, true};
  const Data x = random_data(p, 10);
  const size_t skip = size_t(6) * 2 * 8;  // 6 rows of 2 heads
  const Data y{{x.q.begin() + skip, x.q.end()}, x.k, x.v, {x.dout.begin() + skip, x.dout.end()}};
  const Grads g = backward(p, x), want = backward(trimmed, y);
  for (size_t i = 0; i < skip; ++i) EXPECT_EQ(g.dq[i], 0.0) << i;
  for (size_t i = skip; i < g.dq.size(); ++i) EXPECT_DOUBLE_EQ(g.dq[i], want.dq[i - skip]) << i;
  for (size_t i = 0; i < g.dk.size(); ++i) EXPECT_DOUBLE_EQ(g.dk[i], want.dk[i]) << i;
  for (size_t i = 0; i < g.dv.size(); ++i) EXPECT_DOUBLE_EQ(g.dv[i], want.dv[i]) << i;
}

// GQA is MHA with k and v repeated over each group of query heads: dq is the same, dk and dv are
// the MHA ones summed over the group (in the lowp reference: the rounded per-head values summed
// in float32 in head order, then rounded, as reference.h says).
TEST(Backward, GqaIsMhaWithRepeatedKvSummedOverTheGroup) {
  const Problem gqa{2, 19, 21, 6, 2, 8, 0.35, true}, mha{2, 19, 21, 6, 6, 8, 0.35, true};
  const int group = 3, d = 8;
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    const Data x = random_data(gqa, 11, dtype);
    Data rep{x.q, {}, {}, x.dout};
    for (const std::vector<double>* t : {&x.k, &x.v}) {  // [b][s][hk][d] -> [b][s][h][d]
      std::vector<double>& r = t == &x.k ? rep.k : rep.v;
      for (size_t row = 0; row < t->size() / (2 * d); ++row)
        for (int h = 0; h < 6; ++h) r.insert(r.end(), t->begin() + (row * 2 + h / group) * d,
                                             t->begin() + (row * 2 + h / group + 1) * d);
    }
    const Grads g = backward(gqa, x, dtype), m = backward(mha, rep, dtype);
    EXPECT_EQ(g.dq, m.dq) << flash3::dtype_name(dtype);
    for (size_t row = 0; row < g.dk.size() / (2 * d); ++row)
      for (int hk = 0; hk < 2; ++hk)
        for (int c = 0; c < d; ++c) {
          float sk = 0, sv = 0;
          for (int h = hk * group; h < (hk + 1) * group; ++h) {
            sk += static_cast<float>(m.dk[(row * 6 + h) * d + c]);
            sv += static_cast<float>(m.dv[(row * 6 + h) * d + c]);
          }
          const size_t i = (row * 2 + hk) * d + c;
          if (dtype == DType::kFloat32) {  // fp64: the same sums in double
            double dk = 0, dv = 0;
            for (int h = hk * group; h < (hk + 1) * group; ++h) {
              dk += m.dk[(row * 6 + h) * d + c];
              dv += m.dv[(row * 6 + h) * d + c];
            }
            EXPECT_NEAR(g.dk[i], dk, 1e-13) << i;
            EXPECT_NEAR(g.dv[i], dv, 1e-13) << i;
          } else {
            EXPECT_EQ(g.dk[i], flash3::ref::round_to(dtype, sk)) << flash3::dtype_name(dtype) << " " << i;
            EXPECT_EQ(g.dv[i], flash3::ref::round_to(dtype, sv)) << flash3::dtype_name(dtype) << " " << i;
          }
        }
  }
}

// The plain backward of reference.h written out directly, one scalar at a time: float32
// arithmetic, rnd() where reference.h says, every sum in index order. The reference must
// agree exactly.
Grads textbook_lowp_backward(const Problem& p, const Data& x, DType dtype) {
  auto rnd = [dtype](float f) { return static_cast<float>(flash3::ref::round_to(dtype, f)); };
  const int d = p.head_dim, sq = p.seqlen_q, sk = p.seqlen_k, h = p.nheads, hk = p.nheads_kv;
  auto qi = [&](int b, int i, int hh) { return ((size_t(b) * sq + i) * h + hh) * d; };  // row starts
  auto kj = [&](int b, int j, int hh) { return ((size_t(b) * sk + j) * hk + hh) * d; };
  const float scale = static_cast<float>(p.scale);
  Grads g{std::vector<double>(x.q.size()), std::vector<double>(x.k.size()), std::vector<double>(x.v.size())};
  std::vector<float> dk_sum(x.k.size(), 0.0f), dv_sum(x.v.size(), 0.0f);
  for (int b = 0; b < p.batch; ++b)
    for (int hh = 0; hh < h; ++hh) {
      const int kvh = hh / (h / hk);
      std::vector<std::vector<float>> qs(sq, std::vector<float>(d)), P(sq, std::vector<float>(sk, 0.0f)),
          dS(sq, std::vector<float>(sk, 0.0f));
      const float cap = static_cast<float>(p.softcap);
      for (int i = 0; i < sq; ++i) {
        for (int c = 0; c < d; ++c) qs[i][c] = rnd(float(x.q[qi(b, i, hh) + c]) * scale);
        std::vector<float> S(sk), dP(sk), t(sk);
        float m = -INFINITY, sum = 0, D = 0;
        for (int j = 0; j < sk; ++j) {
          if (!visible(p, i, j)) continue;
          float s = 0, dp = 0;
          for (int c = 0; c < d; ++c) s += qs[i][c] * float(x.k[kj(b, j, kvh) + c]);
          for (int c = 0; c < d; ++c) dp += float(x.dout[qi(b, i, hh) + c]) * float(x.v[kj(b, j, kvh) + c]);
          S[j] = rnd(s);
          if (cap > 0) {
            t[j] = std::tanh(S[j] / cap);
            S[j] = rnd(cap * t[j]);
          }
          dP[j] = rnd(dp);
          m = std::max(m, S[j]);
        }
        for (int j = 0; j < sk; ++j) sum += visible(p, i, j) ? (S[j] = std::exp(S[j] - m)) : 0.0f;
        for (int j = 0; j < sk; ++j) P[i][j] = visible(p, i, j) ? rnd(S[j] / sum) : 0.0f;
        for (int j = 0; j < sk; ++j) D += visible(p, i, j) ? P[i][j] * dP[j] : 0.0f;
        for (int j = 0; j < sk; ++j) {
          if (!visible(p, i, j)) continue;
          dS[i][j] = rnd(P[i][j] * (dP[j] - D));
          if (cap > 0) dS[i][j] = rnd(dS[i][j] * (1.0f - t[j] * t[j]));
        }
        for (int c = 0; c < d; ++c) {
          float dqs = 0;
          for (int j = 0; j < sk; ++j) dqs += visible(p, i, j) ? dS[i][j] * float(x.k[kj(b, j, kvh) + c]) : 0.0f;
          g.dq[qi(b, i, hh) + c] = rnd(rnd(dqs) * scale);
        }
      }
      for (int j = 0; j < sk; ++j)
        for (int c = 0; c < d; ++c) {
          float dk = 0, dv = 0;
          for (int i = 0; i < sq; ++i) {
            if (!visible(p, i, j)) continue;
            dk += dS[i][j] * qs[i][c];
            dv += P[i][j] * float(x.dout[qi(b, i, hh) + c]);
          }
          dk_sum[kj(b, j, kvh) + c] += rnd(dk);
          dv_sum[kj(b, j, kvh) + c] += rnd(dv);
        }
    }
  for (size_t e = 0; e < dk_sum.size(); ++e) {
    g.dk[e] = rnd(dk_sum[e]);
    g.dv[e] = rnd(dv_sum[e]);
  }
  return g;
}

TEST(LowpBackward, RoundsWhereTheHeaderSays) {
  for (const Problem& p : {Problem{2, 5, 7, 4, 2, 8, 0.35, true}, Problem{1, 21, 18, 3, 1, 16, 0.25, false},
                           Problem{1, 9, 4, 2, 2, 8, 0.5, true}, Problem{2, 5, 7, 4, 2, 8, 0.35, false, 2, 1, 3.0},
                           Problem{1, 21, 18, 3, 1, 16, 0.25, true, 4, -1, 20.0}}) {
    for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
      const Data x = random_data(p, 13, dtype);
      const Grads g = backward(p, x, dtype), want = textbook_lowp_backward(p, x, dtype);
      EXPECT_EQ(g.dq, want.dq) << flash3::dtype_name(dtype) << " sq=" << p.seqlen_q;
      EXPECT_EQ(g.dk, want.dk) << flash3::dtype_name(dtype) << " sq=" << p.seqlen_q;
      EXPECT_EQ(g.dv, want.dv) << flash3::dtype_name(dtype) << " sq=" << p.seqlen_q;
    }
  }
}

TEST(LowpBackward, CloseToFp64ButNotIdentical) {
  const Problem p{1, 64, 96, 4, 2, 64, 0.125, true};
  double err[2][3];
  for (DType dtype : {DType::kFloat16, DType::kBFloat16}) {
    const Data x = random_data(p, 12, dtype);
    const Grads g = backward(p, x, dtype), want = backward(p, x);
    const std::vector<double>* got[3] = {&g.dq, &g.dk, &g.dv};
    const std::vector<double>* ref[3] = {&want.dq, &want.dk, &want.dv};
    for (int t = 0; t < 3; ++t) {
      const char* name = t == 0 ? "dq" : t == 1 ? "dk" : "dv";
      for (double e : *got[t]) ASSERT_EQ(e, flash3::ref::round_to(dtype, e)) << name << " is rounded to the dtype";
      const double e = err[dtype == DType::kBFloat16][t] = rel_error(*got[t], *ref[t]);
      EXPECT_GT(e, 1e-4) << flash3::dtype_name(dtype) << " " << name;
      EXPECT_LT(e, 3e-2) << flash3::dtype_name(dtype) << " " << name;
    }
  }
  for (int t = 0; t < 3; ++t) EXPECT_LT(err[0][t], err[1][t]) << "float16 is more precise than bfloat16";
}

TEST(LowpBackward, RejectsOtherDtypes) {
  const Problem p{1, 1, 1, 1, 1, 1, 1.0, false};
  double x = 1, dq, dk, dv;
  EXPECT_THROW(flash3::ref::attention_bwd_lowp(p, DType::kFloat32, &x, &x, &x, &x, &dq, &dk, &dv),
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

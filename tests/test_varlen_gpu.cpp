// flash3 GPU tests of the forward and backward passes on variable-length batches against the
// FP64 CPU reference run per sequence on its slices. Skipped (reported as such) without a Hopper
// GPU.
//
// Rule (as test_fwd_gpu.cpp, test_bwd_gpu.cpp): max |flash3 - fp64| <= 2 * max |plain
// same-precision - fp64| + atol over every row of every sequence. q, k, v are packed (total,
// heads, head_dim) with padded rows; outputs are poisoned with NaN before each run: every row of
// a sequence must be written, the row padding must stay untouched, and two runs must agree
// bitwise. Rows past seqused: out untouched, gradients 0.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "gpu_harness.h"

namespace flash3::testing {
namespace {

struct VarCase {
  DType dtype;
  int head_dim;
  bool causal;
  std::vector<int> len_q, len_k;    // per sequence
  std::vector<int> used_q, used_k;  // seqused (empty: none)
  int nheads = 4, nheads_kv = 2;
  int window_left = -1, window_right = -1;
  double softcap = 0;
  int pad = 8;  // extra elements at the end of every row of q, k, v and out
};

std::string describe(const VarCase& c) {
  std::string s = std::string(dtype_name(c.dtype)) + " d=" + std::to_string(c.head_dim) + (c.causal ? " causal" : "") +
                  " h=" + std::to_string(c.nheads) + " hk=" + std::to_string(c.nheads_kv) + " lens=";
  for (size_t i = 0; i < c.len_q.size(); ++i) {
    s += "(" + std::to_string(c.len_q[i]) + "," + std::to_string(c.len_k[i]) + ")";
  }
  if (!c.used_q.empty() || !c.used_k.empty()) s += " seqused";
  if (c.window_left != -1 || c.window_right != -1) {
    s += " window=(" + std::to_string(c.window_left) + "," + std::to_string(c.window_right) + ")";
  }
  if (c.softcap > 0) s += " softcap=" + std::to_string(c.softcap);
  return s;
}

std::vector<int> prefix(const std::vector<int>& len) {
  std::vector<int> cu(len.size() + 1, 0);
  for (size_t i = 0; i < len.size(); ++i) cu[i + 1] = cu[i] + len[i];
  return cu;
}

void run_varlen_case(const VarCase& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng(seed);
  const int b = int(c.len_q.size()), h = c.nheads, hk = c.nheads_kv, d = c.head_dim;
  const std::vector<int> cu_q = prefix(c.len_q), cu_k = prefix(c.len_k);
  const int total_q = cu_q.back(), total_k = cu_k.back();
  const int64_t q_row = int64_t(h) * d + c.pad, kv_row = int64_t(hk) * d + c.pad;
  const size_t nq = size_t(total_q) * q_row, nkv = size_t(total_k) * kv_row;
  std::vector<uint16_t> q_bits, k_bits, v_bits;
  std::vector<double> qv, kv, vv;
  random_tensor(c.dtype, nq, rng, q_bits, qv);
  random_tensor(c.dtype, nkv, rng, k_bits, kv);
  random_tensor(c.dtype, nkv, rng, v_bits, vv);
  DeviceBuffer dq(nq * 2 + 16), dk(nkv * 2 + 16), dv(nkv * 2 + 16), dout(nq * 2 + 16),
      dlse(size_t(h) * total_q * 4 + 16), dcu_q(cu_q.size() * 4), dcu_k(cu_k.size() * 4), dused_q(b * 4 + 4),
      dused_k(b * 4 + 4);
  ASSERT_TRUE(dq.ptr && dk.ptr && dv.ptr && dout.ptr && dlse.ptr && dcu_q.ptr && dcu_k.ptr) << "cudaMalloc failed";
  dq.upload(q_bits);
  dk.upload(k_bits);
  dv.upload(v_bits);
  dcu_q.upload(cu_q);
  dcu_k.upload(cu_k);
  if (!c.used_q.empty()) dused_q.upload(c.used_q);
  if (!c.used_k.empty()) dused_k.upload(c.used_k);
  auto view = [&](void* p, int total, int heads, int64_t row) {
    TensorRef t;
    t.data = p; t.dtype = c.dtype; t.rank = 3;
    t.shape[0] = total; t.shape[1] = heads; t.shape[2] = d;
    t.stride[0] = row; t.stride[1] = d; t.stride[2] = 1;
    return t;
  };
  FwdArgs args;
  args.q = view(dq.ptr, total_q, h, q_row);
  args.k = view(dk.ptr, total_k, hk, kv_row);
  args.v = view(dv.ptr, total_k, hk, kv_row);
  args.out = view(dout.ptr, total_q, h, q_row);
  args.lse = TensorRef::contiguous(dlse.ptr, DType::kFloat32, {h, total_q});
  args.cu_seqlens_q = TensorRef::contiguous(dcu_q.ptr, DType::kInt32, {b + 1});
  args.cu_seqlens_k = TensorRef::contiguous(dcu_k.ptr, DType::kInt32, {b + 1});
  if (!c.used_q.empty()) args.seqused_q = TensorRef::contiguous(dused_q.ptr, DType::kInt32, {b});
  if (!c.used_k.empty()) args.seqused_k = TensorRef::contiguous(dused_k.ptr, DType::kInt32, {b});
  args.max_seqlen_q = *std::max_element(c.len_q.begin(), c.len_q.end());
  args.max_seqlen_k = *std::max_element(c.len_k.begin(), c.len_k.end());
  args.causal = c.causal;
  args.window_left = c.window_left;
  args.window_right = c.window_right;
  args.softcap = float(c.softcap);
  std::vector<uint16_t> out_bits[2];
  std::vector<float> lse_dev[2];
  for (int run = 0; run < 2; ++run) {
    FLASH3_CUDA_OK(cudaMemset(dout.ptr, 0xFF, nq * 2));
    FLASH3_CUDA_OK(cudaMemset(dlse.ptr, 0xFF, size_t(h) * total_q * 4));
    ASSERT_NO_THROW(fwd(args));
    FLASH3_CUDA_OK(cudaDeviceSynchronize());
    out_bits[run] = dout.download<uint16_t>(nq);
    lse_dev[run] = dlse.download<float>(size_t(h) * total_q);
  }
  ASSERT_TRUE(out_bits[0] == out_bits[1]) << "forward output differs between two identical runs";
  ASSERT_EQ(std::memcmp(lse_dev[0].data(), lse_dev[1].data(), lse_dev[0].size() * 4), 0);

  double err = 0, err_lp = 0, err_lse = 0, err_lse_lp = 0;
  auto lse_diff = [](double a, double ref) {
    if (std::isinf(ref) || std::isinf(a)) return (std::isinf(ref) && a == ref) ? 0.0 : INFINITY;
    return std::abs(a - ref);
  };
  for (int bi = 0; bi < b; ++bi) {
    const int lq = c.len_q[bi], lk = c.len_k[bi];
    const int uq = c.used_q.empty() ? lq : c.used_q[bi], uk = c.used_k.empty() ? lk : c.used_k[bi];
    // Rows past seqused_q: untouched.
    for (int r = uq; r < lq; ++r) {
      for (int64_t j = 0; j < q_row; ++j) {
        ASSERT_EQ(out_bits[0][size_t(cu_q[bi] + r) * q_row + j], 0xFFFF) << "row " << r << " of sequence " << bi
                                                                          << " is past seqused_q but was written";
      }
    }
    if (uq == 0) continue;
    // The sequence's slices, dense, for the reference.
    auto slice = [&](const std::vector<double>& src, int start, int rows, int heads, int64_t row) {
      std::vector<double> o(size_t(rows) * heads * d);
      for (int r = 0; r < rows; ++r) std::copy_n(&src[size_t(start + r) * row], size_t(heads) * d, &o[size_t(r) * heads * d]);
      return o;
    };
    const auto q = slice(qv, cu_q[bi], uq, h, q_row), k = slice(kv, cu_k[bi], uk, hk, kv_row),
               v = slice(vv, cu_k[bi], uk, hk, kv_row);
    ref::Problem p{1, uq, uk, h, hk, d, 1.0 / std::sqrt(double(d)), c.causal};
    p.window_left = c.window_left;
    p.window_right = c.window_right;
    p.softcap = double(float(c.softcap));
    std::vector<double> out64(q.size(), 0.0), lse64(size_t(h) * uq, 0.0), outlp(q.size(), 0.0), lselp(size_t(h) * uq, 0.0);
    if (uk > 0) {
      ref::attention_fwd_fp64(p, q.data(), k.data(), v.data(), out64.data(), lse64.data());
      ref::attention_fwd_lowp(p, c.dtype, q.data(), k.data(), v.data(), outlp.data(), lselp.data());
    } else {
      std::fill(lse64.begin(), lse64.end(), INFINITY);
      std::fill(lselp.begin(), lselp.end(), INFINITY);
    }
    for (int r = 0; r < uq; ++r) {
      const size_t row = size_t(cu_q[bi] + r);
      for (int64_t j = int64_t(h) * d; j < q_row; ++j) ASSERT_EQ(out_bits[0][row * q_row + j], 0xFFFF) << "padding written";
      for (int hi = 0; hi < h; ++hi) {
        const float got_lse = lse_dev[0][size_t(hi) * total_q + row];
        ASSERT_FALSE(std::isnan(got_lse)) << "lse not written: sequence " << bi << " row " << r << " head " << hi;
        err_lse = std::max(err_lse, lse_diff(got_lse, lse64[size_t(hi) * uq + r]));
        err_lse_lp = std::max(err_lse_lp, lse_diff(lselp[size_t(hi) * uq + r], lse64[size_t(hi) * uq + r]));
        for (int di = 0; di < d; ++di) {
          const double got = from_bits(c.dtype, out_bits[0][row * q_row + size_t(hi) * d + di]);
          ASSERT_TRUE(std::isfinite(got)) << "out not written: sequence " << bi << " row " << r << " head " << hi;
          const size_t ri = (size_t(r) * h + hi) * d + di;
          err = std::max(err, std::abs(got - out64[ri]));
          err_lp = std::max(err_lp, std::abs(outlp[ri] - out64[ri]));
        }
      }
    }
  }
  const double atol = 1e-4;
  EXPECT_LE(err, 2 * err_lp + atol) << "out: flash3 max err " << err << ", plain " << err_lp;
  EXPECT_LE(err_lse, 2 * err_lse_lp + atol) << "lse: flash3 max err " << err_lse << ", plain " << err_lse_lp;
  EXPECT_LE(err_lse, 1e-3) << "lse: flash3 max err " << err_lse;
}

// Random lengths: 0, 1, around the tiles (63-65, 127-129, 191-193), one long sequence among
// short ones; q and k lengths differ (bottom-right masks per sequence).
std::vector<int> ragged_lengths(std::mt19937_64& rng, int n, int long_len) {
  const int picks[] = {0, 1, 17, 63, 64, 65, 127, 128, 129, 191, 192, 193, 300};
  std::vector<int> len(n);
  for (int i = 0; i < n; ++i) len[i] = picks[rng() % (sizeof(picks) / sizeof(picks[0]))];
  len[rng() % n] = long_len;
  return len;
}

TEST(FwdGpuVarlen, RaggedBatchesMatchReference) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 9191;
  int i = 0;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        std::mt19937_64 rng(seed);
        VarCase c{dtype, d, causal, ragged_lengths(rng, 7, 1100), {}};
        c.len_k = c.len_q;
        if (i % 2) std::rotate(c.len_k.begin(), c.len_k.begin() + 2, c.len_k.end());  // seqlen_k != seqlen_q
        c.nheads_kv = i % 3 == 0 ? 4 : i % 3 == 1 ? 2 : 1;
        ++i;
        run_varlen_case(c, seed++);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Windows and softcap per sequence, and seqused on both sides.
TEST(FwdGpuVarlen, WindowsSoftcapAndSeqused) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 9292;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      std::mt19937_64 rng(seed);
      VarCase c{d == 128 ? DType::kFloat16 : DType::kBFloat16, d, causal, {200, 0, 1, 700, 129}, {150, 5, 0, 900, 300}};
      c.window_left = 100;
      c.window_right = causal ? 0 : 40;
      c.softcap = 5.0;
      run_varlen_case(c, seed++);
      if (HasFatalFailure()) return;
      VarCase u{DType::kBFloat16, d, causal, {300, 64, 500, 1}, {300, 200, 77, 10}};
      u.used_q = {250, 64, 0, 1};
      u.used_k = {300, 100, 77, 0};
      run_varlen_case(u, seed++);
      if (HasFatalFailure()) return;
    }
  }
}

// Equal lengths (the fixed-length layout's tiles, through the varlen path) and many sequences
// (persistent blocks drawing many tiles from the device-built list).
TEST(FwdGpuVarlen, EqualAndManySequences) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 9393;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      run_varlen_case(VarCase{DType::kBFloat16, d, causal, std::vector<int>(4, 1024), std::vector<int>(4, 1024)}, seed++);
      if (HasFatalFailure()) return;
      std::mt19937_64 rng(seed);
      std::vector<int> len(150);
      for (int& x : len) x = int(rng() % 90);
      run_varlen_case(VarCase{DType::kFloat16, d, causal, len, len}, seed++);
      if (HasFatalFailure()) return;
    }
  }
  // More sequences than the tile list sorts (kVarlenSortMax, runtime/varlen_tiles.h: its order
  // and prefix sums in the scratch instead of shared memory), and the sorted path's largest batch.
  for (int batch : {2048, 2100}) {
    std::mt19937_64 rng(seed);
    std::vector<int> len(batch);
    for (int& x : len) x = int(rng() % 5);
    len[batch / 2] = 300;
    run_varlen_case(VarCase{DType::kBFloat16, 64, true, len, len}, seed++);
    if (HasFatalFailure()) return;
  }
}


// ---- backward --------------------------------------------------------------------------------
// The forward on the GPU gives out and lse; the backward's gradients of the loss sum(dout * out)
// are checked per sequence against ref::attention_bwd_fp64 and attention_bwd_lowp on its slices.
void run_varlen_bwd_case(const VarCase& c, bool deterministic, uint64_t seed) {
  SCOPED_TRACE(describe(c) + (deterministic ? " deterministic" : ""));
  std::mt19937_64 rng(seed);
  const int b = int(c.len_q.size()), h = c.nheads, hk = c.nheads_kv, d = c.head_dim;
  const std::vector<int> cu_q = prefix(c.len_q), cu_k = prefix(c.len_k);
  const int total_q = cu_q.back(), total_k = cu_k.back();
  const int64_t q_row = int64_t(h) * d + c.pad, kv_row = int64_t(hk) * d + c.pad;
  const size_t nq = size_t(total_q) * q_row, nkv = size_t(total_k) * kv_row;
  std::vector<uint16_t> q_bits, k_bits, v_bits, do_bits;
  std::vector<double> qv, kv, vv, dov;
  random_tensor(c.dtype, nq, rng, q_bits, qv);
  random_tensor(c.dtype, nkv, rng, k_bits, kv);
  random_tensor(c.dtype, nkv, rng, v_bits, vv);
  random_tensor(c.dtype, nq, rng, do_bits, dov);
  DeviceBuffer dq_in(nq * 2 + 16), dk_in(nkv * 2 + 16), dv_in(nkv * 2 + 16), ddo(nq * 2 + 16), dout(nq * 2 + 16),
      dlse(size_t(h) * total_q * 4 + 16), ddq(nq * 2 + 16), ddk(nkv * 2 + 16), ddv(nkv * 2 + 16),
      dcu_q(cu_q.size() * 4), dcu_k(cu_k.size() * 4), dused_q(b * 4 + 4), dused_k(b * 4 + 4);
  ASSERT_TRUE(dq_in.ptr && dk_in.ptr && dv_in.ptr && ddo.ptr && dout.ptr && dlse.ptr && ddq.ptr && ddk.ptr && ddv.ptr)
      << "cudaMalloc failed";
  dq_in.upload(q_bits);
  dk_in.upload(k_bits);
  dv_in.upload(v_bits);
  ddo.upload(do_bits);
  dcu_q.upload(cu_q);
  dcu_k.upload(cu_k);
  if (!c.used_q.empty()) dused_q.upload(c.used_q);
  if (!c.used_k.empty()) dused_k.upload(c.used_k);
  auto view = [&](void* p, int total, int heads, int64_t row) {
    TensorRef t;
    t.data = p; t.dtype = c.dtype; t.rank = 3;
    t.shape[0] = total; t.shape[1] = heads; t.shape[2] = d;
    t.stride[0] = row; t.stride[1] = d; t.stride[2] = 1;
    return t;
  };
  auto lengths = [&](auto& a) {
    a.cu_seqlens_q = TensorRef::contiguous(dcu_q.ptr, DType::kInt32, {b + 1});
    a.cu_seqlens_k = TensorRef::contiguous(dcu_k.ptr, DType::kInt32, {b + 1});
    if (!c.used_q.empty()) a.seqused_q = TensorRef::contiguous(dused_q.ptr, DType::kInt32, {b});
    if (!c.used_k.empty()) a.seqused_k = TensorRef::contiguous(dused_k.ptr, DType::kInt32, {b});
    a.max_seqlen_q = *std::max_element(c.len_q.begin(), c.len_q.end());
    a.max_seqlen_k = *std::max_element(c.len_k.begin(), c.len_k.end());
    a.causal = c.causal;
    a.window_left = c.window_left;
    a.window_right = c.window_right;
    a.softcap = float(c.softcap);
  };
  FwdArgs f;
  f.q = view(dq_in.ptr, total_q, h, q_row);
  f.k = view(dk_in.ptr, total_k, hk, kv_row);
  f.v = view(dv_in.ptr, total_k, hk, kv_row);
  f.out = view(dout.ptr, total_q, h, q_row);
  f.lse = TensorRef::contiguous(dlse.ptr, DType::kFloat32, {h, total_q});
  lengths(f);
  FLASH3_CUDA_OK(cudaMemset(dout.ptr, 0, nq * 2));  // rows past seqused_q: 0 (they take no part)
  ASSERT_NO_THROW(fwd(f));
  BwdArgs a;
  a.q = f.q;
  a.k = f.k;
  a.v = f.v;
  a.out = f.out;
  a.dout = view(ddo.ptr, total_q, h, q_row);
  a.lse = f.lse;
  a.dq = view(ddq.ptr, total_q, h, q_row);
  a.dk = view(ddk.ptr, total_k, hk, kv_row);
  a.dv = view(ddv.ptr, total_k, hk, kv_row);
  a.deterministic = deterministic;
  lengths(a);
  std::vector<uint16_t> got[2][3];
  for (int run = 0; run < 2; ++run) {
    FLASH3_CUDA_OK(cudaMemset(ddq.ptr, 0xFF, nq * 2));
    FLASH3_CUDA_OK(cudaMemset(ddk.ptr, 0xFF, nkv * 2));
    FLASH3_CUDA_OK(cudaMemset(ddv.ptr, 0xFF, nkv * 2));
    ASSERT_NO_THROW(bwd(a));
    FLASH3_CUDA_OK(cudaDeviceSynchronize());
    got[run][0] = ddq.download<uint16_t>(nq);
    got[run][1] = ddk.download<uint16_t>(nkv);
    got[run][2] = ddv.download<uint16_t>(nkv);
  }
  if (deterministic) {
    for (int g = 0; g < 3; ++g) ASSERT_TRUE(got[0][g] == got[1][g]) << "deterministic gradient " << g << " differs";
  }
  double err[3] = {0, 0, 0}, err_lp[3] = {0, 0, 0};
  const char* names[3] = {"dq", "dk", "dv"};
  for (int bi = 0; bi < b; ++bi) {
    const int lq = c.len_q[bi], lk = c.len_k[bi];
    const int uq = c.used_q.empty() ? lq : c.used_q[bi], uk = c.used_k.empty() ? lk : c.used_k[bi];
    // Every row written: the used rows finite (checked below), the others 0; padding untouched.
    auto rows_check = [&](const std::vector<uint16_t>& t, int start, int used, int len, int heads, int64_t row,
                          const char* name) {
      for (int r = 0; r < len; ++r) {
        for (int64_t j = 0; j < row; ++j) {
          const uint16_t bits = t[size_t(start + r) * row + j];
          if (j >= int64_t(heads) * d) {
            ASSERT_EQ(bits, 0xFFFF) << name << ": padding written";
          } else if (r >= used) {
            ASSERT_EQ(from_bits(c.dtype, bits), 0.0) << name << " row " << r << " of sequence " << bi
                                                     << " is past seqused and not 0";
          } else {
            ASSERT_TRUE(std::isfinite(from_bits(c.dtype, bits))) << name << " not written: sequence " << bi << " row " << r;
          }
        }
      }
    };
    rows_check(got[0][0], cu_q[bi], uq, lq, h, q_row, "dq");
    rows_check(got[0][1], cu_k[bi], uk, lk, hk, kv_row, "dk");
    rows_check(got[0][2], cu_k[bi], uk, lk, hk, kv_row, "dv");
    if (::testing::Test::HasFatalFailure()) return;
    if (uq == 0 && uk == 0) continue;
    auto slice = [&](const std::vector<double>& src, int start, int rows, int heads, int64_t row) {
      std::vector<double> o(size_t(rows) * heads * d);
      for (int r = 0; r < rows; ++r) std::copy_n(&src[size_t(start + r) * row], size_t(heads) * d, &o[size_t(r) * heads * d]);
      return o;
    };
    const auto q = slice(qv, cu_q[bi], uq, h, q_row), k = slice(kv, cu_k[bi], uk, hk, kv_row),
               v = slice(vv, cu_k[bi], uk, hk, kv_row), g = slice(dov, cu_q[bi], uq, h, q_row);
    ref::Problem p{1, uq, uk, h, hk, d, 1.0 / std::sqrt(double(d)), c.causal};
    p.window_left = c.window_left;
    p.window_right = c.window_right;
    p.softcap = double(float(c.softcap));
    std::vector<double> r64[3] = {std::vector<double>(q.size(), 0.0), std::vector<double>(k.size(), 0.0),
                                  std::vector<double>(k.size(), 0.0)};
    std::vector<double> rlp[3] = {r64[0], r64[1], r64[2]};
    ref::attention_bwd_fp64(p, q.data(), k.data(), v.data(), g.data(), r64[0].data(), r64[1].data(), r64[2].data());
    ref::attention_bwd_lowp(p, c.dtype, q.data(), k.data(), v.data(), g.data(), rlp[0].data(), rlp[1].data(),
                            rlp[2].data());
    const int starts[3] = {cu_q[bi], cu_k[bi], cu_k[bi]}, useds[3] = {uq, uk, uk}, heads[3] = {h, hk, hk};
    const int64_t rows[3] = {q_row, kv_row, kv_row};
    for (int t = 0; t < 3; ++t) {
      for (int r = 0; r < useds[t]; ++r) {
        for (int j = 0; j < heads[t] * d; ++j) {
          const double x = from_bits(c.dtype, got[0][t][size_t(starts[t] + r) * rows[t] + j]);
          const size_t ri = size_t(r) * heads[t] * d + j;
          err[t] = std::max(err[t], std::abs(x - r64[t][ri]));
          err_lp[t] = std::max(err_lp[t], std::abs(rlp[t][ri] - r64[t][ri]));
        }
      }
    }
  }
  const double atol = 1e-4;
  for (int t = 0; t < 3; ++t) {
    EXPECT_LE(err[t], 2 * err_lp[t] + atol) << names[t] << ": flash3 max err " << err[t] << ", plain " << err_lp[t];
  }
}

TEST(BwdGpuVarlen, RaggedBatchesMatchReference) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 9494;
  int i = 0;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        std::mt19937_64 rng(seed);
        VarCase c{dtype, d, causal, ragged_lengths(rng, 6, 700), {}};
        c.len_k = c.len_q;
        if (i % 2) std::rotate(c.len_k.begin(), c.len_k.begin() + 2, c.len_k.end());
        c.nheads_kv = i % 3 == 0 ? 4 : i % 3 == 1 ? 2 : 1;
        ++i;
        run_varlen_bwd_case(c, false, seed++);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Windows, softcap and seqused; the deterministic mode bitwise over two runs.
TEST(BwdGpuVarlen, WindowsSoftcapSequsedDeterministic) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 9595;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      VarCase c{d == 128 ? DType::kFloat16 : DType::kBFloat16, d, causal, {200, 0, 1, 700, 129}, {150, 5, 0, 900, 300}};
      c.window_left = 100;
      c.window_right = causal ? 0 : 40;
      c.softcap = 5.0;
      run_varlen_bwd_case(c, true, seed++);
      if (HasFatalFailure()) return;
      VarCase u{DType::kBFloat16, d, causal, {300, 64, 500, 1}, {300, 200, 77, 10}};
      u.used_q = {250, 64, 0, 1};
      u.used_k = {300, 100, 77, 0};
      run_varlen_bwd_case(u, d == 64, seed++);
      if (HasFatalFailure()) return;
    }
  }
}

// Many short sequences and a long one (persistent blocks drawing many items of the list; the
// deterministic dQ order over long key ranges), MHA (dK, dV stored straight) and GQA.
TEST(BwdGpuVarlen, ManySequencesAndLong) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 9696;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      std::mt19937_64 rng(seed);
      std::vector<int> len(60);
      for (int& x : len) x = int(rng() % 150);
      len[7] = 2500;
      VarCase c{DType::kBFloat16, d, causal, len, len};
      c.nheads = 2;
      c.nheads_kv = causal ? 2 : 1;
      run_varlen_bwd_case(c, causal, seed++);
      if (HasFatalFailure()) return;
    }
  }
}

}  // namespace
}  // namespace flash3::testing

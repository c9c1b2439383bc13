// flash3 GPU tests of the forward pass against the FP64 CPU reference. Skipped (reported as
// such) on machines without a Hopper GPU.
//
// Rule (FlashAttention-3's): max |flash3 - fp64| <= 2 * max |plain same-precision - fp64| + atol,
// where "plain same-precision" is attention computed the way a framework does it in the input
// dtype (tests/reference.h). Inputs are fresh N(0,1) values, outputs are poisoned with NaN
// before each run, and every output element is checked to have been written; padding between
// rows of a strided output is checked to be untouched.
#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>

#include "fwd/fwd_ablation.h"
#include "gpu_harness.h"

namespace flash3::testing {
namespace {

using detail::FwdAblation;

struct Case {
  DType dtype;
  int head_dim;
  bool causal;
  int batch, seqlen_q, seqlen_k, nheads, nheads_kv;
  int pad = 0;  // extra elements at the end of every (seqlen) row of q, k, v and out
  FwdAblation variant = FwdAblation::kDefault;  // schedules and techniques (fwd_ablation.h)
  // > 0: key row j scaled by 1 + key_ramp * (seqlen_k - 1 - j) / seqlen_k, and keys
  // [seqlen_k / 2, seqlen_k / 2 + 16) by 3 more, so that the row max of the scores rises from
  // key block to key block (the kernel visits them last to first) and jumps once.
  double key_ramp = 0;
  int window_left = -1, window_right = -1;  // FwdArgs' sliding window
  double softcap = 0;
};

std::string describe(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " d=" + std::to_string(c.head_dim) +
         (c.causal ? " causal" : "") + " b=" + std::to_string(c.batch) +
         " sq=" + std::to_string(c.seqlen_q) + " sk=" + std::to_string(c.seqlen_k) +
         " h=" + std::to_string(c.nheads) + " hk=" + std::to_string(c.nheads_kv) +
         " pad=" + std::to_string(c.pad) + " variant=" + std::to_string(int(c.variant)) +
         (c.key_ramp > 0 ? " key_ramp=" + std::to_string(c.key_ramp) : "") +
         (c.window_left != -1 || c.window_right != -1
              ? " window=(" + std::to_string(c.window_left) + "," + std::to_string(c.window_right) + ")"
              : "") +
         (c.softcap > 0 ? " softcap=" + std::to_string(c.softcap) : "");
}

void run_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  std::mt19937_64 rng(seed);
  const int b = c.batch, sq = c.seqlen_q, sk = c.seqlen_k, h = c.nheads, hk = c.nheads_kv, d = c.head_dim;
  // Device layouts: (b, s, heads, d) with each (s) row padded by c.pad elements.
  const int64_t q_row = int64_t(h) * d + c.pad, kv_row = int64_t(hk) * d + c.pad;
  const size_t nq = size_t(b) * sq * q_row, nkv = size_t(b) * sk * kv_row;

  std::vector<uint16_t> q_bits, k_bits, v_bits;
  std::vector<double> q_dev_vals, k_dev_vals, v_dev_vals;
  random_tensor(c.dtype, nq, rng, q_bits, q_dev_vals);
  random_tensor(c.dtype, nkv, rng, k_bits, k_dev_vals);
  random_tensor(c.dtype, nkv, rng, v_bits, v_dev_vals);
  if (c.key_ramp > 0) {
    for (size_t i = 0; i < nkv; ++i) {
      const int j = int((i / kv_row) % sk);
      double f = 1.0 + c.key_ramp * double(sk - 1 - j) / sk;
      if (j >= sk / 2 && j < sk / 2 + 16) f *= 3.0;
      k_bits[i] = to_bits(c.dtype, k_dev_vals[i] * f);
      k_dev_vals[i] = from_bits(c.dtype, k_bits[i]);
    }
  }
  // Dense copies for the reference.
  auto dense = [&](const std::vector<double>& src, int s, int heads, int64_t row) {
    std::vector<double> out(size_t(b) * s * heads * d);
    for (int bi = 0; bi < b; ++bi)
      for (int si = 0; si < s; ++si)
        std::copy_n(&src[(size_t(bi) * s + si) * row], size_t(heads) * d,
                    &out[(size_t(bi) * s + si) * heads * d]);
    return out;
  };
  const auto q = dense(q_dev_vals, sq, h, q_row), k = dense(k_dev_vals, sk, hk, kv_row),
             v = dense(v_dev_vals, sk, hk, kv_row);

  DeviceBuffer dq(nq * 2), dk(nkv * 2), dv(nkv * 2), dout(nq * 2), dlse(size_t(b) * h * sq * 4);
  ASSERT_TRUE(dq.ptr && dk.ptr && dv.ptr && dout.ptr && dlse.ptr) << "cudaMalloc failed";
  dq.upload(q_bits);
  dk.upload(k_bits);
  dv.upload(v_bits);

  FwdArgs args;
  auto view = [&](void* p, int s, int heads, int64_t row) {
    TensorRef t;
    t.data = p; t.dtype = c.dtype; t.rank = 4;
    t.shape[0] = b; t.shape[1] = s; t.shape[2] = heads; t.shape[3] = d;
    t.stride[0] = s * row; t.stride[1] = row; t.stride[2] = d; t.stride[3] = 1;
    return t;
  };
  args.q = view(dq.ptr, sq, h, q_row);
  args.k = view(dk.ptr, sk, hk, kv_row);
  args.v = view(dv.ptr, sk, hk, kv_row);
  args.out = view(dout.ptr, sq, h, q_row);
  args.lse = TensorRef::contiguous(dlse.ptr, DType::kFloat32, {b, h, sq});
  args.causal = c.causal;
  args.window_left = c.window_left;
  args.window_right = c.window_right;
  args.softcap = float(c.softcap);

  // Poison, run, fetch: twice, to check the result is bitwise reproducible.
  std::vector<uint16_t> out_bits[2];
  std::vector<float> lse_dev[2];
  for (int run = 0; run < 2; ++run) {
    FLASH3_CUDA_OK(cudaMemset(dout.ptr, 0xFF, nq * 2));  // 0xFFFF: NaN in fp16 and bf16
    FLASH3_CUDA_OK(cudaMemset(dlse.ptr, 0xFF, size_t(b) * h * sq * 4));
    ASSERT_NO_THROW(detail::fwd_ablation(args, c.variant));
    FLASH3_CUDA_OK(cudaDeviceSynchronize());
    out_bits[run] = dout.download<uint16_t>(nq);
    lse_dev[run] = dlse.download<float>(size_t(b) * h * sq);
  }
  ASSERT_TRUE(out_bits[0] == out_bits[1]) << "forward output differs between two identical runs";
  ASSERT_EQ(std::memcmp(lse_dev[0].data(), lse_dev[1].data(), lse_dev[0].size() * 4), 0);

  // Every element written (finite), padding untouched.
  for (size_t r = 0; r < size_t(b) * sq; ++r) {
    for (int64_t j = 0; j < q_row; ++j) {
      const uint16_t bits = out_bits[0][r * q_row + j];
      if (j < int64_t(h) * d) {
        ASSERT_TRUE(std::isfinite(from_bits(c.dtype, bits))) << "out not written at row " << r << " col " << j;
      } else {
        ASSERT_EQ(bits, 0xFFFF) << "padding overwritten at row " << r;
      }
    }
  }
  for (size_t i = 0; i < lse_dev[0].size(); ++i) {
    ASSERT_FALSE(std::isnan(lse_dev[0][i])) << "lse not written at " << i;
  }

  const std::vector<int> rows = reference_rows(sq, rng);
  ref::Problem p{b, sq, sk, h, hk, d, 1.0 / std::sqrt(double(d)), c.causal};
  p.window_left = c.window_left;
  p.window_right = c.window_right;
  p.softcap = double(float(c.softcap));
  std::vector<double> out64(q.size(), 0.0), lse64(size_t(b) * h * sq, 0.0);
  std::vector<double> outlp(q.size(), 0.0), lselp(size_t(b) * h * sq, 0.0);
  ref::attention_fwd_fp64(p, q.data(), k.data(), v.data(), out64.data(), lse64.data(), &rows);
  ref::attention_fwd_lowp(p, c.dtype, q.data(), k.data(), v.data(), outlp.data(), lselp.data(), &rows);

  double err = 0, err_lp = 0, err_lse = 0, err_lse_lp = 0;
  auto lse_diff = [](double a, double ref) {
    if (std::isinf(ref) || std::isinf(a)) return (std::isinf(ref) && a == ref) ? 0.0 : INFINITY;
    return std::abs(a - ref);
  };
  for (int bi = 0; bi < b; ++bi) {
    for (int hi = 0; hi < h; ++hi) {
      for (int si : rows) {
        const size_t lse_idx = (size_t(bi) * h + hi) * sq + si;
        err_lse = std::max(err_lse, lse_diff(lse_dev[0][lse_idx], lse64[lse_idx]));
        err_lse_lp = std::max(err_lse_lp, lse_diff(lselp[lse_idx], lse64[lse_idx]));
        for (int di = 0; di < d; ++di) {
          const size_t ref_idx = ((size_t(bi) * sq + si) * h + hi) * d + di;
          const double got = from_bits(c.dtype, out_bits[0][(size_t(bi) * sq + si) * q_row + size_t(hi) * d + di]);
          err = std::max(err, std::abs(got - out64[ref_idx]));
          err_lp = std::max(err_lp, std::abs(outlp[ref_idx] - out64[ref_idx]));
        }
      }
    }
  }
  const double atol = 1e-4;
  EXPECT_LE(err, 2 * err_lp + atol) << "out: flash3 max err " << err << ", plain " << dtype_name(c.dtype)
                                    << " attention max err " << err_lp;
  EXPECT_LE(err_lse, 2 * err_lse_lp + atol) << "lse: flash3 max err " << err_lse << ", plain " << err_lse_lp;
  EXPECT_LE(err_lse, 1e-3) << "lse: flash3 max err " << err_lse;
  ::testing::Test::RecordProperty("max_err", std::to_string(err));
  ::testing::Test::RecordProperty("max_err_plain", std::to_string(err_lp));
}

// ---- the full matrix: dtype x head dim x causal x (MHA, GQA 4:1, MQA) ----------------------
using Combo = std::tuple<DType, int, bool, int>;  // dtype, head dim, causal, kv heads (of 8)

class FwdGpu : public ::testing::TestWithParam<Combo> {};

TEST_P(FwdGpu, MatchesReference) {
  FLASH3_REQUIRE_HOPPER();
  const auto [dtype, d, causal, hk] = GetParam();
  const int h = 8;
  // (batch, seqlen_q, seqlen_k): ragged sizes around the tiles, and seqlen_q != seqlen_k.
  const std::vector<std::tuple<int, int, int>> shapes = {
      {2, 1, 1},     {2, 17, 17},   {2, 113, 113}, {2, 128, 128}, {2, 129, 129},
      {1, 1000, 1000}, {1, 4096, 4096}, {2, 1, 1000}, {2, 113, 1000}, {1, 1000, 129},
      {2, 129, 17},  {1, 17, 4096},
  };
  uint64_t seed = 1234 + uint64_t(d) * 7 + (causal ? 1 : 0) * 13 + uint64_t(hk) * 17 + int(dtype) * 31;
  for (const auto& [b, sq, sk] : shapes) {
    run_case(Case{dtype, d, causal, b, sq, sk, h, hk}, seed++);
    if (HasFatalFailure()) return;
  }
}

std::string combo_name(const ::testing::TestParamInfo<Combo>& info) {
  const auto [dtype, d, causal, hk] = info.param;
  const char* heads = hk == 8 ? "mha" : hk == 1 ? "mqa" : "gqa";
  return std::string(dtype == DType::kBFloat16 ? "bf16" : "fp16") + "_d" + std::to_string(d) +
         (causal ? "_causal_" : "_full_") + heads;
}

INSTANTIATE_TEST_SUITE_P(All, FwdGpu,
                         ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16),
                                            ::testing::Values(64, 128, 256), ::testing::Bool(),
                                            ::testing::Values(8, 2, 1)),
                         combo_name);

// The online softmax keeps a row's reference max until a key block's scores exceed it by more
// than 2^8 in the exponential (softmax.h): scores rising from block to block (most blocks then
// compute P up to 2^8 against a stale max) and one jump (the max moves, O is rescaled) must give
// the same accuracy as everywhere else. Scores reach ~30 here, so the plain low-precision
// reference is coarse; the lse is also held to 1e-3 absolute.
TEST(FwdGpuSmall, RunningMaxRisesAcrossKeyBlocks) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 4321;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (int d : {64, 128, 256}) {
      for (bool causal : {false, true}) {
        Case c{dtype, d, causal, 1, 256, 2048, 2, 1};
        c.key_ramp = 5.0;
        run_case(c, seed++);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// ---- sliding windows and softcap ------------------------------------------------------------
// Windows at every relation to the tiles (64-192 rows, 64-192 keys): empty on a side (0), smaller
// than a tile, spanning several, larger than the sequence, one side unbounded; with causal (which
// sets right = 0) and without; seqlen_q below, equal to and above seqlen_k (rows that see no
// key: out = 0, lse = +inf); softcap 0, 1, 5, 50 on top. Key blocks outside the window are
// skipped by the scheduler, so wrong block ranges show up as missing keys.
const std::pair<int, int> kWindows[] = {{0, 0},   {1, 0},     {5, 3},   {100, 0},  {-1, 37},
                                        {200, 300}, {0, -1},  {700, -1}, {130, 130}, {64, 64}};
const double kSoftcaps[] = {0, 1, 5, 50};

TEST(FwdGpuWindow, WindowsAndSoftcapMatchReference) {
  FLASH3_REQUIRE_HOPPER();
  const std::tuple<int, int, int> shapes[] = {{2, 300, 517}, {1, 517, 300}, {1, 1000, 1000}};
  uint64_t seed = 8181;
  int i = 0;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      for (const auto& [left, right] : kWindows) {
        const auto [b, sq, sk] = shapes[i % 3];
        Case c{i % 2 ? DType::kFloat16 : DType::kBFloat16, d, causal, b, sq, sk, 4, i % 3 ? 2 : 4};
        c.window_left = left;
        c.window_right = right;
        c.softcap = kSoftcaps[i % 4];
        ++i;
        run_case(c, seed++);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Softcap alone over the head dims and masks (80: above kSoftcapBoundedMax, the BF16 head dim 256
// kernels' row-max step), and long windowed sequences whose tiles each skip many key blocks on
// both sides (persistent blocks computing several tiles each).
TEST(FwdGpuWindow, SoftcapAndLongWindows) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 8282;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      for (double softcap : {1.0, 30.0, 80.0}) {
        Case c{DType::kBFloat16, d, causal, 2, 333, 700, 4, 2};
        c.softcap = softcap;
        run_case(c, seed++);
        if (HasFatalFailure()) return;
      }
    }
    for (auto [left, right, causal] : {std::tuple<int, int, bool>{1024, 0, true}, {512, 700, false},
                                       {-1, 300, false}, {2000, -1, false}}) {
      Case c{DType::kBFloat16, d, causal, 2, 4096, 4096, 8, 2};
      c.window_left = left;
      c.window_right = right;
      run_case(c, seed++);
      if (HasFatalFailure()) return;
    }
  }
}

// ---- small cases: strided (padded) tensors; also the subset run under compute-sanitizer -------
// The window kernels on small strided problems (also under compute-sanitizer).
TEST(FwdGpuSmall, WindowAndSoftcapStrided) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 8383;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      Case c{d == 128 ? DType::kFloat16 : DType::kBFloat16, d, causal, 2, 77, 150, 4, 2, /*pad=*/8};
      c.window_left = 40;
      c.window_right = causal ? 0 : 25;
      c.softcap = 7.0;
      run_case(c, seed++);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(FwdGpuSmall, PaddedStridesAndRaggedShapes) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 99;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16})
    for (int d : {64, 128, 256})
      for (bool causal : {false, true}) {
        run_case(Case{dtype, d, causal, 2, 77, 150, 4, 2, /*pad=*/8}, seed++);
        run_case(Case{dtype, d, causal, 1, 150, 77, 4, 1, /*pad=*/8}, seed++);
        if (HasFatalFailure()) return;
      }
}

// The ablation kernels (benchmark only; built with FLASH3_BUILD_ABLATIONS) and the schedules
// must compute the same function.
TEST(FwdGpuVariants, AblationKernelsMatchReference) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 4242;
  for (FwdAblation v : {FwdAblation::kNoPersistent, FwdAblation::kNoPingpong, FwdAblation::kNoOverlap,
                        FwdAblation::kThreeStage, FwdAblation::kTwoStageBlockN96}) {
    if (detail::is_technique_ablation(v) && !detail::fwd_ablations_built()) continue;
    for (auto [sq, sk] : {std::pair<int, int>{129, 1000}, {1000, 1000}, {4096, 4096}}) {
      run_case(Case{DType::kBFloat16, 128, false, 1, sq, sk, 8, 2, /*pad=*/0, v}, seed++);
      if (HasFatalFailure()) return;
    }
  }
  for (FwdAblation v : {FwdAblation::kNoPersistent, FwdAblation::kPersistent}) {
    run_case(Case{DType::kBFloat16, 128, true, 1, 1000, 1000, 8, 2, /*pad=*/0, v}, seed++);
    if (HasFatalFailure()) return;
  }
}

// Persistent blocks computing many tiles each (about 6-9 per block on 132 SMs): the Q buffer's
// barriers, the tile ring and the L2 prefetch of the next tile's first blocks go through many
// phases, with the static order (non-causal) and the dynamic one (causal).
TEST(FwdGpuPersistent, ManyTilesPerBlock) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 6161;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      run_case(Case{DType::kBFloat16, d, causal, 6, 1536, 1600, 16, 4}, seed++);
      if (HasFatalFailure()) return;
    }
  }
}

// The non-causal tail split (src/common/tail_split.h): the last partial wave of tiles cut along the
// keys over all SMs by the tail kernel and combined. On a 132-SM GPU: (a) 136 tiles = one full
// wave + 4 tiles of 18 key blocks, cut into 72 pieces of one key block; (b) 72 tiles of 63 key
// blocks, no full wave, pieces of 34-35 blocks; (c) 8 tiles of 24 blocks on 132 blocks. The last
// key block is partly past seqlen_k (masked inside a piece), the last query block partly past
// seqlen_q. run_case also runs each twice and checks the output is bitwise the same.
TEST(FwdGpuTailSplit, PiecesCombineToTheReference) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 7171;
  run_case(Case{DType::kBFloat16, 128, false, 1, 2112, 3000, 8, 2}, seed++);
  run_case(Case{DType::kFloat16, 128, false, 1, 2112, 3000, 8, 8}, seed++);
  run_case(Case{DType::kFloat16, 256, false, 1, 1100, 5000, 8, 2}, seed++);
  run_case(Case{DType::kBFloat16, 256, false, 1, 1100, 5000, 8, 1, /*pad=*/8}, seed++);
  run_case(Case{DType::kBFloat16, 128, false, 2, 100, 4100, 4, 4}, seed++);
  run_case(Case{DType::kBFloat16, 256, false, 2, 100, 4100, 4, 4}, seed++);
}

// Causal head dim 64 runs 128-row tiles up to seqlen_q 1024 and 192-row tiles beyond
// (fwd_config.h, kFwdCausal64ShortMax): both sides of the switch, seqlen_k longer and shorter,
// and the 128-row kernel under the static persistent and the one-block-per-tile schedules too.
TEST(FwdGpuVariants, Causal64TileSwitch) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 5151;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (auto [sq, sk] : {std::pair<int, int>{1024, 1024}, {1025, 1025}, {1024, 1500}, {1025, 700}}) {
      run_case(Case{dtype, 64, true, 1, sq, sk, 8, 2}, seed++);
      if (HasFatalFailure()) return;
    }
  }
  for (FwdAblation v : {FwdAblation::kNoPersistent, FwdAblation::kPersistent}) {
    run_case(Case{DType::kBFloat16, 64, true, 2, 900, 1000, 8, 8, /*pad=*/0, v}, seed++);
    if (HasFatalFailure()) return;
  }
}

// Causal head dim 128 runs 176-key tiles where a row sees kFwdCausal128LongMin keys or more on
// average (seqlen_k - seqlen_q / 2, fwd_config.h) and 128-key tiles below: both sides of the
// switch, ragged lengths, seqlen_q shorter than seqlen_k, GQA.
TEST(FwdGpuVariants, Causal128TileSwitch) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 5252;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
    for (auto [sq, sk] : {std::pair<int, int>{128, 4160}, {1000, 4600}, {1000, 4590}, {2500, 5400}}) {
      run_case(Case{dtype, 128, true, 1, sq, sk, 4, 2}, seed++);
      if (HasFatalFailure()) return;
    }
  }
}

// One bf16 forward call on its own contiguous (b, s, heads, d) tensors, q, k, v fresh N(0,1), and
// the output it is expected to give (`want`, filled by the test).
struct BF16Call {
  DeviceBuffer q, k, v, out;
  FwdArgs args;
  std::vector<uint16_t> want;
  BF16Call(int b, int sq, int sk, int h, int d, bool causal, uint64_t seed)
      : q(size_t(b) * sq * h * d * 2), k(size_t(b) * sk * h * d * 2), v(size_t(b) * sk * h * d * 2),
        out(size_t(b) * sq * h * d * 2) {
    std::mt19937_64 rng(seed);
    std::vector<uint16_t> bits;
    std::vector<double> vals;
    for (DeviceBuffer* t : {&q, &k, &v}) {
      random_tensor(DType::kBFloat16, t->bytes / 2, rng, bits, vals);
      t->upload(bits);
    }
    args.q = TensorRef::contiguous(q.ptr, DType::kBFloat16, {b, sq, h, d});
    args.k = TensorRef::contiguous(k.ptr, DType::kBFloat16, {b, sk, h, d});
    args.v = TensorRef::contiguous(v.ptr, DType::kBFloat16, {b, sk, h, d});
    args.out = TensorRef::contiguous(out.ptr, DType::kBFloat16, {b, sq, h, d});
    args.causal = causal;
  }
  std::vector<uint16_t> result() const { return out.download<uint16_t>(out.bytes / 2); }
};

// The causal kernels draw tiles from a counter per stream (fwd_scheduler.h): causal calls on
// two streams at once, repeated, must give exactly what each gives alone, and later calls on
// either stream must still see the counters cleared.
TEST(FwdGpuStreams, CausalCallsOnTwoStreamsAtOnceMatchCallsAlone) {
  FLASH3_REQUIRE_HOPPER();
  BF16Call a(4, 1536, 1536, 16, 128, true, 1), c(2, 2048, 2048, 8, 64, true, 2);
  cudaStream_t streams[2];
  for (auto& st : streams) FLASH3_CUDA_OK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  BF16Call* ones[2] = {&a, &c};
  for (int i = 0; i < 2; ++i) {  // each alone
    ones[i]->args.stream = streams[i];
    FLASH3_CUDA_OK(cudaMemset(ones[i]->out.ptr, 0xFF, ones[i]->out.bytes));
    ASSERT_NO_THROW(fwd(ones[i]->args));
    FLASH3_CUDA_OK(cudaDeviceSynchronize());
    ones[i]->want = ones[i]->result();
    for (uint16_t bits : ones[i]->want) ASSERT_NE(bits, 0xFFFF) << "output not written (alone)";
  }
  for (int round = 0; round < 5; ++round) {  // both at once, the order of issue alternating
    for (BF16Call* o : ones) FLASH3_CUDA_OK(cudaMemsetAsync(o->out.ptr, 0xFF, o->out.bytes, o->args.stream));
    for (int i = 0; i < 2; ++i) ASSERT_NO_THROW(fwd(ones[(i + round) % 2]->args));
    FLASH3_CUDA_OK(cudaDeviceSynchronize());
    for (BF16Call* o : ones) {
      ASSERT_TRUE(o->result() == o->want)
          << "round " << round << ": output differs from the call alone";
    }
  }
  for (auto& st : streams) FLASH3_CUDA_OK(cudaStreamDestroy(st));
}

// CUDA graphs: a forward call captured on a stream that has never run one may not allocate the
// per-stream memory of the tail split and of the dynamic causal scheduler, so it captures whole
// tiles in the static order instead; replayed, it gives what the same kernels give eagerly
// (non-causal: the static persistent kernel, FwdAblation::kPersistent; causal: any order of the
// same tiles gives the same bits). Then, captured again on the stream after an eager call (the
// memory exists now), the split and the dynamic scheduler are in the graph: the eager default
// result, bitwise. (tests/test_torch.py captures forward and backward through PyTorch.)
TEST(FwdGpuGraphs, CaptureOnFreshAndWarmStreams) {
  FLASH3_REQUIRE_HOPPER();
  for (bool causal : {false, true}) {
    SCOPED_TRACE(causal ? "causal" : "non-causal");
    const int b = 1, sq = causal ? 1536 : 2112, sk = causal ? 1536 : 3000, h = 8, hk = 2, d = 128;
    const size_t nq = size_t(b) * sq * h * d, nkv = size_t(b) * sk * hk * d;
    DeviceBuffer q(nq * 2), k(nkv * 2), v(nkv * 2), out(nq * 2);
    std::mt19937_64 rng(causal ? 31 : 37);
    std::vector<uint16_t> bits;
    std::vector<double> vals;
    random_tensor(DType::kBFloat16, nq, rng, bits, vals);
    q.upload(bits);
    for (DeviceBuffer* t : {&k, &v}) {
      random_tensor(DType::kBFloat16, nkv, rng, bits, vals);
      t->upload(bits);
    }
    FwdArgs args;
    args.q = TensorRef::contiguous(q.ptr, DType::kBFloat16, {b, sq, h, d});
    args.k = TensorRef::contiguous(k.ptr, DType::kBFloat16, {b, sk, hk, d});
    args.v = TensorRef::contiguous(v.ptr, DType::kBFloat16, {b, sk, hk, d});
    args.out = TensorRef::contiguous(out.ptr, DType::kBFloat16, {b, sq, h, d});
    args.causal = causal;
    cudaStream_t stream;
    FLASH3_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    args.stream = stream;
    auto eager = [&](FwdAblation variant, std::vector<uint16_t>& result) {
      FwdArgs a = args;
      a.stream = nullptr;  // the default stream: leaves `stream` fresh
      FLASH3_CUDA_OK(cudaMemset(out.ptr, 0xFF, nq * 2));
      ASSERT_NO_THROW(detail::fwd_ablation(a, variant));
      FLASH3_CUDA_OK(cudaDeviceSynchronize());
      result = out.download<uint16_t>(nq);
      for (uint16_t x : result) ASSERT_NE(x, 0xFFFF) << "output not written";
    };
    std::vector<uint16_t> want_default, want_static;
    eager(FwdAblation::kDefault, want_default);
    eager(causal ? FwdAblation::kDefault : FwdAblation::kPersistent, want_static);
    auto capture_and_replay = [&](const std::vector<uint16_t>& want, const char* what) {
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      FLASH3_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      ASSERT_NO_THROW(fwd(args));
      FLASH3_CUDA_OK(cudaStreamEndCapture(stream, &graph));
      FLASH3_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 2; ++replay) {
        FLASH3_CUDA_OK(cudaMemset(out.ptr, 0xFF, nq * 2));
        FLASH3_CUDA_OK(cudaGraphLaunch(exec, stream));
        FLASH3_CUDA_OK(cudaStreamSynchronize(stream));
        EXPECT_TRUE(out.download<uint16_t>(nq) == want) << what << ", replay " << replay;
      }
      FLASH3_CUDA_OK(cudaGraphExecDestroy(exec));
      FLASH3_CUDA_OK(cudaGraphDestroy(graph));
    };
    capture_and_replay(want_static, "captured on a fresh stream");
    FLASH3_CUDA_OK(cudaMemset(out.ptr, 0xFF, nq * 2));
    ASSERT_NO_THROW(fwd(args));  // eager on the stream: its memory is allocated
    FLASH3_CUDA_OK(cudaStreamSynchronize(stream));
    EXPECT_TRUE(out.download<uint16_t>(nq) == want_default) << "eager on the stream";
    capture_and_replay(want_default, "captured on a warm stream");
    FLASH3_CUDA_OK(cudaStreamDestroy(stream));
    if (HasFatalFailure()) return;
  }
}

// A graph keeps the per-stream memory it was captured with: a causal call captured on a warm
// stream (its dynamic scheduler's counters in the stream's buffer), then an eager non-causal
// call whose tail split makes the buffer grow; the graph, replayed after, still gives the eager
// result (the old buffer is kept, not freed: compute-sanitizer's memcheck runs this test).
TEST(FwdGpuGraphs, GraphOutlivesTheStreamMemoryGrowing) {
  FLASH3_REQUIRE_HOPPER();
  // 12 x 8 causal tiles; 17 x 8 = 136 non-causal tiles of 18 key blocks: 4 in the tail, split.
  BF16Call causal(1, 1536, 1536, 8, 128, true, 41), noncausal(1, 2112, 3000, 8, 128, false, 43);
  auto run = [&](BF16Call& c, cudaStream_t st) {
    FLASH3_CUDA_OK(cudaMemsetAsync(c.out.ptr, 0xFF, c.out.bytes, st));
    FwdArgs a = c.args;
    a.stream = st;
    ASSERT_NO_THROW(fwd(a));
    FLASH3_CUDA_OK(cudaStreamSynchronize(st));
  };
  for (BF16Call* c : {&causal, &noncausal}) {
    run(*c, nullptr);  // the default stream
    c->want = c->result();
    for (uint16_t x : c->want) ASSERT_NE(x, 0xFFFF) << "output not written";
  }
  cudaStream_t stream;
  FLASH3_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  run(causal, stream);  // the stream's buffer: the counters only
  EXPECT_TRUE(causal.result() == causal.want) << "eager causal on the stream";
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  FwdArgs a = causal.args;
  a.stream = stream;
  FLASH3_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  ASSERT_NO_THROW(fwd(a));
  FLASH3_CUDA_OK(cudaStreamEndCapture(stream, &graph));
  FLASH3_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
  run(noncausal, stream);  // the tail split's scratch: the buffer grows
  EXPECT_TRUE(noncausal.result() == noncausal.want) << "eager non-causal on the stream";
  for (int replay = 0; replay < 2; ++replay) {
    FLASH3_CUDA_OK(cudaMemsetAsync(causal.out.ptr, 0xFF, causal.out.bytes, stream));
    FLASH3_CUDA_OK(cudaGraphLaunch(exec, stream));
    run(noncausal, stream);
    EXPECT_TRUE(causal.result() == causal.want) << "causal graph, replay " << replay;
    EXPECT_TRUE(noncausal.result() == noncausal.want) << "eager non-causal after replay " << replay;
  }
  FLASH3_CUDA_OK(cudaGraphExecDestroy(exec));
  FLASH3_CUDA_OK(cudaGraphDestroy(graph));
  FLASH3_CUDA_OK(cudaStreamDestroy(stream));
}

TEST(FwdGpuSmall, NoKeysGivesZeroAndInfiniteLse) {
  FLASH3_REQUIRE_HOPPER();
  const int b = 2, sq = 5, h = 2, d = 64;
  DeviceBuffer q(size_t(b) * sq * h * d * 2), out(size_t(b) * sq * h * d * 2), lse(size_t(b) * h * sq * 4);
  DeviceBuffer kv(64);
  FLASH3_CUDA_OK(cudaMemset(q.ptr, 0x3C, q.bytes));
  FLASH3_CUDA_OK(cudaMemset(out.ptr, 0xFF, out.bytes));
  FwdArgs args;
  args.q = TensorRef::contiguous(q.ptr, DType::kFloat16, {b, sq, h, d});
  args.k = TensorRef::contiguous(kv.ptr, DType::kFloat16, {b, 0, h, d});
  args.v = args.k;
  args.out = TensorRef::contiguous(out.ptr, DType::kFloat16, {b, sq, h, d});
  args.lse = TensorRef::contiguous(lse.ptr, DType::kFloat32, {b, h, sq});
  ASSERT_NO_THROW(fwd(args));
  FLASH3_CUDA_OK(cudaDeviceSynchronize());
  for (uint16_t bits : out.download<uint16_t>(size_t(b) * sq * h * d)) ASSERT_EQ(bits, 0);
  for (float x : lse.download<float>(size_t(b) * h * sq)) ASSERT_TRUE(std::isinf(x) && x > 0);
}

}  // namespace
}  // namespace flash3::testing

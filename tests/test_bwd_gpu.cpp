// flash3 GPU tests of the backward pass against the FP64 CPU reference. Skipped (reported as
// such) on machines without a Hopper GPU.
//
// Rule (FlashAttention-3's, as for the forward), for each of dq, dk, dv separately:
//   max |flash3 - fp64| <= 2 * max |plain same-precision - fp64| + 1e-4   over every element,
// where fp64 is ref::attention_bwd_fp64 and "plain same-precision" is ref::attention_bwd_lowp
// (the backward as PyTorch autograd computes it in the input dtype; tests/reference.h), both from
// the same q, k, v, dout. flash3::bwd gets out and lse from flash3::fwd, as in training; the
// references recompute P (and D) from q, k, v in their own precision.
// Inputs are fresh N(0,1) values rounded to the dtype; the padding of strided inputs holds NaN
// (bwd must never read it); the gradients are poisoned with NaN before each run, every element
// is checked to have been written and their padding to be untouched. Tensors with no elements
// are passed with null data.
//
// Suites: BwdGpu (the matrix), BwdGpuLong (seqlen 4096), BwdGpuPersistent (more blocks of work
// than SMs), BwdGpuDeterministic, BwdGpuGraphs (captured into CUDA graphs), and BwdGpuSmall
// (small and fast: strided layouts, empty sizes, workspaces; the compute-sanitizer subset).
#include <algorithm>
#include <cmath>
#include <memory>
#include <tuple>
#include <utility>

#include "flash3/flash3_c.h"
#include "gpu_harness.h"

namespace flash3::testing {
namespace {

struct Case {
  DType dtype;
  int head_dim;
  bool causal;
  int batch, seqlen_q, seqlen_k, nheads, nheads_kv;
  int head_pad = 0, row_pad = 0;  // padding of every (batch, seqlen, heads, head_dim) tensor
  int lse_pad = 0;                // padding after each (batch, head) row of lse
  float scale = 0.0f;             // softmax_scale; 0 means the default 1/sqrt(head_dim)
  bool deterministic = false;
  int window_left = -1, window_right = -1;  // the sliding window
  float softcap = 0.0f;
};

std::string describe(const Case& c) {
  return std::string(dtype_name(c.dtype)) + " d=" + std::to_string(c.head_dim) + (c.causal ? " causal" : "") +
         " b=" + std::to_string(c.batch) + " sq=" + std::to_string(c.seqlen_q) + " sk=" +
         std::to_string(c.seqlen_k) + " h=" + std::to_string(c.nheads) + " hk=" + std::to_string(c.nheads_kv) +
         " pad=" + std::to_string(c.head_pad) + "/" + std::to_string(c.row_pad) + "/" + std::to_string(c.lse_pad) +
         " scale=" + std::to_string(c.scale) + (c.deterministic ? " deterministic" : "") +
         (c.window_left != -1 || c.window_right != -1
              ? " window=(" + std::to_string(c.window_left) + "," + std::to_string(c.window_right) + ")"
              : "") +
         (c.softcap > 0 ? " softcap=" + std::to_string(c.softcap) : "");
}

// Gradients as downloaded: 16-bit patterns in their padded layouts.
struct Grads16 {
  std::vector<uint16_t> dq, dk, dv;
};

// One backward problem on the device: inputs, the forward's out and lse, and bwd runs. Methods
// that can fail fatally return void; callers check HasFatalFailure().
class BwdRun {
 public:
  explicit BwdRun(const Case& c)
      : c_(c),
        ql_{c.batch, c.seqlen_q, c.nheads, c.head_dim, c.head_pad, c.row_pad},
        kl_{c.batch, c.seqlen_k, c.nheads_kv, c.head_dim, c.head_pad, c.row_pad} {}

  const PaddedLayout& q_layout() const { return ql_; }
  const PaddedLayout& k_layout() const { return kl_; }

  // Fresh random q, k, v, dout (padding NaN), uploaded; out and lse written by flash3::fwd.
  void prepare(uint64_t seed) {
    std::mt19937_64 rng(seed);
    upload_random(ql_, q_, q64_, rng);
    upload_random(kl_, k_, k64_, rng);
    upload_random(kl_, v_, v64_, rng);
    upload_random(ql_, dout_, dout64_, rng);
    if (::testing::Test::HasFatalFailure()) return;
    for (auto* buf : {&out_, &dq_}) *buf = std::make_unique<DeviceBuffer>(ql_.size() * 2);
    for (auto* buf : {&dk_, &dv_}) *buf = std::make_unique<DeviceBuffer>(kl_.size() * 2);
    lse_ = std::make_unique<DeviceBuffer>(lse_elems() * 4);
    for (auto* buf : {&out_, &dq_, &dk_, &dv_, &lse_}) ASSERT_NE((*buf)->ptr, nullptr) << "cudaMalloc failed";
    FLASH3_CUDA_OK(cudaMemset(out_->ptr, 0xFF, out_->bytes));  // padding of out stays NaN
    FLASH3_CUDA_OK(cudaMemset(lse_->ptr, 0xFF, lse_->bytes));  // and of lse
    FwdArgs f;
    f.q = view(ql_, *q_);
    f.k = view(kl_, *k_);
    f.v = view(kl_, *v_);
    f.out = view(ql_, *out_);
    f.lse = lse_view();
    f.softmax_scale = c_.scale;
    f.causal = c_.causal;
    f.window_left = c_.window_left;
    f.window_right = c_.window_right;
    f.softcap = c_.softcap;
    ASSERT_NO_THROW(fwd(f));
    FLASH3_CUDA_OK(cudaDeviceSynchronize());
  }

  BwdArgs args() const {
    BwdArgs a;
    a.q = view(ql_, *q_);
    a.k = view(kl_, *k_);
    a.v = view(kl_, *v_);
    a.out = view(ql_, *out_);
    a.dout = view(ql_, *dout_);
    a.lse = lse_view();
    a.dq = view(ql_, *dq_);
    a.dk = view(kl_, *dk_);
    a.dv = view(kl_, *dv_);
    a.softmax_scale = c_.scale;
    a.causal = c_.causal;
    a.deterministic = c_.deterministic;
    a.window_left = c_.window_left;
    a.window_right = c_.window_right;
    a.softcap = c_.softcap;
    return a;
  }

  // dq, dk, dv (padding included) set to 0xFFFF, NaN in float16 and bfloat16.
  void poison() {
    for (auto* buf : {&dq_, &dk_, &dv_}) FLASH3_CUDA_OK(cudaMemset((*buf)->ptr, 0xFF, (*buf)->bytes));
  }
  Grads16 download() const {
    return {dq_->download<uint16_t>(ql_.size()), dk_->download<uint16_t>(kl_.size()),
            dv_->download<uint16_t>(kl_.size())};
  }

  // Poisons the gradients, runs bwd (with this workspace, if any), downloads into g.
  void backward(Grads16& g, void* workspace = nullptr, size_t workspace_bytes = 0) {
    poison();
    if (::testing::Test::HasFatalFailure()) return;
    BwdArgs a = args();
    a.workspace = workspace;
    a.workspace_bytes = workspace_bytes;
    ASSERT_NO_THROW(bwd(a));
    FLASH3_CUDA_OK(cudaDeviceSynchronize());
    g = download();
  }

  // prepare(seed), then backward(g).
  void run(uint64_t seed, Grads16& g) {
    prepare(seed);
    if (!::testing::Test::HasFatalFailure()) backward(g);
  }

  // Every element of dq, dk, dv written (finite), their padding untouched.
  void check_written(const Grads16& g) const {
    for (auto [name, bits, layout] : {std::tuple{"dq", &g.dq, &ql_}, {"dk", &g.dk, &kl_}, {"dv", &g.dv, &kl_}}) {
      for (size_t e = 0; e < bits->size(); ++e) {
        if (layout->is_padding(e)) {
          ASSERT_EQ((*bits)[e], 0xFFFF) << name << ": padding overwritten at offset " << e;
        } else {
          ASSERT_TRUE(std::isfinite(from_bits(c_.dtype, (*bits)[e])))
              << name << ": not written (or not finite) at offset " << e;
        }
      }
    }
  }

  // The rule of this file, for each of dq, dk, dv.
  void check_accuracy(const Grads16& g) {
    if (!have_references_) compute_references();
    const double atol = 1e-4;
    for (auto [name, bits, layout, r64, rlp] :
         {std::tuple{"dq", &g.dq, &ql_, &dq64_, &dqlp_}, {"dk", &g.dk, &kl_, &dk64_, &dklp_},
          {"dv", &g.dv, &kl_, &dv64_, &dvlp_}}) {
      double err = 0, err_lp = 0;
      for (size_t i = 0; i < layout->dense_size(); ++i) {
        const double got = from_bits(c_.dtype, (*bits)[layout->offset(i)]);
        const double e = std::abs(got - (*r64)[i]);
        if (!(e <= err)) err = e;  // NaN sticks
        err_lp = std::max(err_lp, std::abs((*rlp)[i] - (*r64)[i]));
      }
      EXPECT_LE(err, 2 * err_lp + atol) << name << ": flash3 max err " << err << ", plain "
                                        << dtype_name(c_.dtype) << " backward max err " << err_lp;
      ::testing::Test::RecordProperty(std::string(name) + "_max_err", std::to_string(err));
      ::testing::Test::RecordProperty(std::string(name) + "_max_err_plain", std::to_string(err_lp));
    }
  }

 private:
  size_t lse_elems() const { return size_t(c_.batch) * c_.nheads * (c_.seqlen_q + c_.lse_pad); }

  // Null data for a tensor without elements: bwd and fwd must not touch it.
  TensorRef view(const PaddedLayout& l, const DeviceBuffer& buf) const {
    return l.view(l.dense_size() == 0 ? nullptr : buf.ptr, c_.dtype);
  }
  TensorRef lse_view() const {
    const int64_t row = c_.seqlen_q + c_.lse_pad;
    TensorRef t = TensorRef::contiguous(size_t(c_.batch) * c_.nheads * c_.seqlen_q == 0 ? nullptr : lse_->ptr,
                                        DType::kFloat32, {c_.batch, c_.nheads, c_.seqlen_q});
    t.stride[0] = c_.nheads * row;
    t.stride[1] = row;
    return t;
  }

  void upload_random(const PaddedLayout& l, std::unique_ptr<DeviceBuffer>& buf, std::vector<double>& dense,
                     std::mt19937_64& rng) {
    std::vector<uint16_t> bits;
    std::vector<double> values;
    random_tensor(c_.dtype, l.size(), rng, bits, values);
    for (size_t e = 0; e < bits.size(); ++e) {
      if (l.is_padding(e)) bits[e] = kPoison16;
    }
    buf = std::make_unique<DeviceBuffer>(l.size() * 2);
    ASSERT_NE(buf->ptr, nullptr) << "cudaMalloc failed";
    buf->upload(bits);
    dense = l.dense(values);
  }

  void compute_references() {
    // The scale bwd uses: softmax_scale as validate_bwd normalizes it (a float).
    const double scale = validate_bwd(args()).softmax_scale;
    ref::Problem p{c_.batch, c_.seqlen_q, c_.seqlen_k, c_.nheads, c_.nheads_kv, c_.head_dim, scale, c_.causal};
    p.window_left = c_.window_left;
    p.window_right = c_.window_right;
    p.softcap = c_.softcap;
    for (auto* t : {&dq64_, &dqlp_}) t->assign(ql_.dense_size(), 0.0);
    for (auto* t : {&dk64_, &dklp_, &dv64_, &dvlp_}) t->assign(kl_.dense_size(), 0.0);
    ref::attention_bwd_fp64(p, q64_.data(), k64_.data(), v64_.data(), dout64_.data(), dq64_.data(),
                            dk64_.data(), dv64_.data());
    ref::attention_bwd_lowp(p, c_.dtype, q64_.data(), k64_.data(), v64_.data(), dout64_.data(), dqlp_.data(),
                            dklp_.data(), dvlp_.data());
    have_references_ = true;
  }

  Case c_;
  PaddedLayout ql_, kl_;
  std::unique_ptr<DeviceBuffer> q_, k_, v_, out_, dout_, lse_, dq_, dk_, dv_;
  std::vector<double> q64_, k64_, v64_, dout64_;                     // inputs, dense
  std::vector<double> dq64_, dk64_, dv64_, dqlp_, dklp_, dvlp_;     // references, dense
  bool have_references_ = false;
};

// Prepare, run bwd once, check every element written and the accuracy rule.
void run_case(const Case& c, uint64_t seed) {
  SCOPED_TRACE(describe(c));
  BwdRun r(c);
  Grads16 g;
  r.run(seed, g);
  if (::testing::Test::HasFatalFailure()) return;
  r.check_written(g);
  if (::testing::Test::HasFatalFailure()) return;
  r.check_accuracy(g);
}

// ---- the matrix: dtype x head dim x causal x (MHA, GQA 4:2, MQA 4:1) ---------------------------
using Combo = std::tuple<DType, int, bool, int>;  // dtype, head dim, causal, kv heads (of 4)

class BwdGpu : public ::testing::TestWithParam<Combo> {};

TEST_P(BwdGpu, MatchesReference) {
  FLASH3_REQUIRE_HOPPER();
  const auto [dtype, d, causal, hk] = GetParam();
  // (batch, seqlen_q, seqlen_k): ragged sizes around the tiles (64 and 128 rows or keys), and
  // seqlen_q != seqlen_k both ways (with causal and seqlen_q > seqlen_k, rows without keys).
  // seqlen 4096 is in BwdGpuLong (the fp64 reference of every key and row costs seconds there).
  const std::vector<std::tuple<int, int, int>> shapes = {
      {2, 1, 1},      {2, 17, 17},   {2, 113, 113},   {2, 128, 128},  {2, 129, 129}, {1, 1000, 1000},
      {2, 1, 1000},   {2, 113, 1000}, {1, 1000, 113}, {2, 17, 129},   {2, 129, 17},
  };
  uint64_t seed = 5678 + uint64_t(d) * 7 + (causal ? 13 : 0) + uint64_t(hk) * 17 + int(dtype) * 31;
  for (const auto& [b, sq, sk] : shapes) {
    run_case(Case{dtype, d, causal, b, sq, sk, 4, hk}, seed++);
    if (HasFatalFailure()) return;
  }
}

std::string combo_name(const ::testing::TestParamInfo<Combo>& info) {
  return matrix_case_name(std::get<0>(info.param), std::get<1>(info.param), std::get<2>(info.param),
                          /*nheads=*/4, std::get<3>(info.param));
}

INSTANTIATE_TEST_SUITE_P(All, BwdGpu,
                         ::testing::Combine(::testing::Values(DType::kBFloat16, DType::kFloat16),
                                            ::testing::Values(64, 128, 256), ::testing::Bool(),
                                            ::testing::Values(4, 2, 1)),
                         combo_name);

// ---- seqlen 4096: each (dtype, head dim) once, causal and head layouts spread over them -------
TEST(BwdGpuLong, Seqlen4096) {
  FLASH3_REQUIRE_HOPPER();
  const DType bf16 = DType::kBFloat16, fp16 = DType::kFloat16;
  const Case cases[] = {
      {bf16, 64, true, 1, 4096, 4096, 4, 1},  {bf16, 128, false, 1, 4096, 4096, 4, 2},
      {bf16, 256, true, 1, 4096, 4096, 4, 4}, {fp16, 64, false, 1, 4096, 4096, 4, 4},
      {fp16, 128, true, 1, 4096, 4096, 4, 1}, {fp16, 256, false, 1, 4096, 4096, 2, 1},
      {bf16, 128, true, 2, 17, 4096, 4, 2},   {fp16, 128, true, 1, 4096, 17, 4, 2},
      // Head dim 256 with more than 32 key blocks and seqlen_q != seqlen_k: the spread visiting
      // orders (bwd_kernel.h, kSpreadVisits), the non-causal start n * m_count / n_blocks not a
      // multiple of anything.
      {bf16, 256, false, 1, 1000, 2200, 2, 1}, {fp16, 256, true, 1, 2500, 2200, 2, 2},
  };
  uint64_t seed = 777;
  for (const Case& c : cases) {
    run_case(c, seed++);
    if (HasFatalFailure()) return;
  }
}

// ---- the persistent causal kernel (head dim 64): more blocks of work than SMs -------------------
// 264-288 (key block, head, batch) items, so that each block of bwd_kernel_persistent takes two
// or more in turn: K and V reloaded under the previous epilogue, the dQ buffers restarted per
// item, and at seqlen 1050 a last key block with a single visit (dQ writer 1 idle in that item).
TEST(BwdGpuPersistent, SeveralItemsPerBlock) {
  FLASH3_REQUIRE_HOPPER();
  const DType bf16 = DType::kBFloat16, fp16 = DType::kFloat16;
  const Case cases[] = {
      {bf16, 64, true, 2, 1050, 1050, 16, 4},  // GQA; 9 key blocks x 32 pairs
      {fp16, 64, true, 3, 700, 1300, 8, 8},    // seqlen_q < seqlen_k; 11 x 24
      {bf16, 64, true, 1, 2100, 700, 48, 1},   // MQA, rows without keys; 6 x 48
      {bf16, 64, true, 2, 1500, 900, 12, 12},  // MHA (dK, dV by TMA stores), rows without keys; 8 x 24
      {fp16, 64, false, 2, 1050, 1300, 16, 2}, // non-causal; 11 x 32
      {bf16, 64, false, 2, 1000, 1100, 12, 12},  // non-causal MHA; 9 x 24
  };
  uint64_t seed = 4242;
  for (const Case& c : cases) {
    run_case(c, seed++);
    if (HasFatalFailure()) return;
  }
}

// ---- deterministic mode: bitwise-equal gradients over 20 runs, and accurate -----------------------
// seqlen >= 1000 so that many key blocks add into each dq tile (and, with GQA/MQA, many query
// heads into each dk, dv).
void expect_repeatable(const Case& c, uint64_t seed, int runs) {
  SCOPED_TRACE(describe(c));
  BwdRun r(c);
  Grads16 first, again;
  r.run(seed, first);
  if (::testing::Test::HasFatalFailure()) return;
  r.check_written(first);
  r.check_accuracy(first);
  for (int run = 1; run < runs && !::testing::Test::HasFailure(); ++run) {
    r.backward(again);
    if (::testing::Test::HasFatalFailure()) return;
    EXPECT_TRUE(again.dq == first.dq) << "dq of run " << run << " differs from run 0";
    EXPECT_TRUE(again.dk == first.dk) << "dk of run " << run << " differs from run 0";
    EXPECT_TRUE(again.dv == first.dv) << "dv of run " << run << " differs from run 0";
  }
}

Case deterministic(Case c) {
  c.deterministic = true;
  return c;
}

TEST(BwdGpuDeterministic, TwentyRunsAreBitwiseEqual) {
  FLASH3_REQUIRE_HOPPER();
  const DType bf16 = DType::kBFloat16, fp16 = DType::kFloat16;
  expect_repeatable(deterministic({bf16, 128, true, 1, 1500, 1500, 4, 2}), 31, 20);    // causal GQA
  expect_repeatable(deterministic({fp16, 64, false, 2, 1000, 1200, 4, 4}), 32, 20);    // MHA
  expect_repeatable(deterministic({bf16, 256, false, 1, 1024, 2048, 4, 1}), 33, 20);   // MQA
  expect_repeatable(deterministic({fp16, 128, true, 1, 2000, 1000, 4, 4}), 34, 20);    // rows without keys
  expect_repeatable(deterministic({bf16, 256, true, 1, 4100, 4100, 2, 1}), 35, 20);    // causal, 2 dQ copies
  expect_repeatable(deterministic({bf16, 256, true, 1, 8200, 8200, 1, 1}), 38, 20);    // causal, 4 dQ copies
  expect_repeatable(deterministic({bf16, 64, true, 2, 1050, 1050, 16, 4}), 36, 20);    // persistent, 288 items
  expect_repeatable(deterministic({fp16, 64, false, 2, 1050, 1300, 16, 2}), 37, 20);   // 352 items
}

// ---- sliding windows and softcap ---------------------------------------------------------------
// Windows at every relation to the tiles (64-128 rows and keys): empty on a side, smaller than a
// tile, spanning several, larger than the sequence, one side unbounded; causal and not; rows
// without keys (seqlen_q > seqlen_k); softcap 0, 1, 5, 50 on top (dS times 1 - tanh^2). Key blocks
// outside the window are skipped (Mask::m_block_range), and the first key block that adds into a
// dQ tile is the window's, not key block 0 (bwd_dq_writer.h).
TEST(BwdGpuWindow, WindowsAndSoftcapMatchReference) {
  FLASH3_REQUIRE_HOPPER();
  const std::pair<int, int> windows[] = {{0, 0},  {1, 0},     {5, 3},     {100, 0}, {-1, 37},
                                         {200, 300}, {0, -1}, {700, -1}, {130, 130}};
  const float softcaps[] = {0, 1, 5, 50};
  const std::tuple<int, int, int> shapes[] = {{2, 300, 517}, {1, 517, 300}, {1, 700, 700}};
  uint64_t seed = 9191;
  int i = 0;
  for (int d : {64, 128, 256}) {
    for (bool causal : {false, true}) {
      for (const auto& [left, right] : windows) {
        const auto [b, sq, sk] = shapes[i % 3];
        Case c{i % 2 ? DType::kFloat16 : DType::kBFloat16, d, causal, b, sq, sk, 4, i % 3 ? 2 : 4};
        c.window_left = left;
        c.window_right = right;
        c.softcap = softcaps[i % 4];
        ++i;
        run_case(c, seed++);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// Deterministic mode with windows: each dQ tile's chain of adds starts at the first key block of
// its window (per copy, with 2 dQ copies at head dim 256 causal from 32 key blocks), bitwise equal
// over runs; the persistent kernel (head dim 64) too.
TEST(BwdGpuWindow, DeterministicWithWindows) {
  FLASH3_REQUIRE_HOPPER();
  const DType bf16 = DType::kBFloat16, fp16 = DType::kFloat16;
  auto windowed = [](Case c, int left, int right, float softcap = 0) {
    c.deterministic = true;
    c.window_left = left;
    c.window_right = right;
    c.softcap = softcap;
    return c;
  };
  expect_repeatable(windowed({bf16, 128, true, 1, 2000, 2000, 4, 2}, 300, 0), 91, 10);
  expect_repeatable(windowed({fp16, 64, false, 2, 1050, 1300, 16, 2}, 256, 128, 5), 92, 10);
  expect_repeatable(windowed({bf16, 64, true, 2, 1050, 1050, 16, 4}, 100, 0), 93, 10);
  expect_repeatable(windowed({bf16, 256, true, 1, 4100, 4100, 2, 1}, 1000, 0), 94, 10);
  expect_repeatable(windowed({fp16, 256, false, 1, 1500, 1500, 2, 2}, -1, 200, 20), 95, 10);
}

// ---- CUDA graphs: the persistent kernel (causal head dim 64) captured ---------------------------
// On a fresh stream the capture finds no per-stream memory (which it may not allocate), so the
// blocks take the items in a fixed round-robin order; on a warm stream it uses the stream's
// counter, which every replay must leave at zero for the next. Deterministic mode, so that the
// gradients are bitwise equal to the eager call's whatever block takes which item.
TEST(BwdGpuGraphs, PersistentCapturedOnFreshAndWarmStreams) {
  FLASH3_REQUIRE_HOPPER();
  Case c{DType::kBFloat16, 64, true, 1, 1050, 1050, 32, 8};  // 9 key blocks x 32 heads = 288 items
  c.deterministic = true;
  BwdRun r(c);
  Grads16 want;
  r.run(51, want);
  if (HasFatalFailure()) return;
  r.check_written(want);
  r.check_accuracy(want);
  cudaStream_t stream;
  FLASH3_CUDA_OK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  auto expect_want = [&](const char* what) {
    const Grads16 got = r.download();
    EXPECT_TRUE(got.dq == want.dq) << what << ": dq differs from the eager call's";
    EXPECT_TRUE(got.dk == want.dk) << what << ": dk differs from the eager call's";
    EXPECT_TRUE(got.dv == want.dv) << what << ": dv differs from the eager call's";
  };
  auto capture_and_replay = [&](const char* what) {
    BwdArgs a = r.args();
    a.stream = stream;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    FLASH3_CUDA_OK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    EXPECT_NO_THROW(bwd(a));
    FLASH3_CUDA_OK(cudaStreamEndCapture(stream, &graph));
    FLASH3_CUDA_OK(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 2; ++replay) {
      r.poison();
      FLASH3_CUDA_OK(cudaDeviceSynchronize());
      FLASH3_CUDA_OK(cudaGraphLaunch(exec, stream));
      FLASH3_CUDA_OK(cudaStreamSynchronize(stream));
      expect_want(what);
    }
    FLASH3_CUDA_OK(cudaGraphExecDestroy(exec));
    FLASH3_CUDA_OK(cudaGraphDestroy(graph));
  };
  capture_and_replay("captured on a fresh stream");
  {  // an eager call on the stream: it allocates the stream's counters
    BwdArgs a = r.args();
    a.stream = stream;
    r.poison();
    FLASH3_CUDA_OK(cudaDeviceSynchronize());
    ASSERT_NO_THROW(bwd(a));
    FLASH3_CUDA_OK(cudaStreamSynchronize(stream));
    expect_want("eager on the stream");
  }
  capture_and_replay("captured on a warm stream");
  FLASH3_CUDA_OK(cudaStreamDestroy(stream));
}

// ---- small and fast ---------------------------------------------------------------------------

// Every tensor strided: heads and rows padded (NaN in the inputs' padding), lse rows padded, and
// an explicit softmax_scale.
TEST(BwdGpuSmall, PaddedStridesAndRaggedShapes) {
  FLASH3_REQUIRE_HOPPER();
  uint64_t seed = 99;
  for (DType dtype : {DType::kBFloat16, DType::kFloat16})
    for (int d : {64, 128, 256})
      for (bool causal : {false, true}) {
        run_case(Case{dtype, d, causal, 2, 77, 150, 4, 2, /*head_pad=*/8, /*row_pad=*/24, /*lse_pad=*/3, 0.3f},
                 seed++);
        run_case(Case{dtype, d, causal, 1, 150, 77, 4, 1, /*head_pad=*/16, /*row_pad=*/8, /*lse_pad=*/5}, seed++);
        if (HasFatalFailure()) return;
      }
}

// The persistent kernels (head dim 64) with two blocks of work per SM, small enough for the
// compute-sanitizer subset: 3 key blocks x 64 (head, batch) pairs, causal GQA (dK, dV added per
// query head), causal and non-causal MHA (dK, dV by TMA stores, the last key block clipped), the
// default and the deterministic mode, strided.
TEST(BwdGpuSmall, PersistentTwoItemsPerBlock) {
  FLASH3_REQUIRE_HOPPER();
  for (const auto& [causal, nheads_kv] : {std::pair{true, 8}, std::pair{true, 64}, std::pair{false, 64}}) {
    Case c{DType::kBFloat16, 64, causal, 1, 200, 300, 64, nheads_kv, /*head_pad=*/8, /*row_pad=*/8, /*lse_pad=*/1};
    run_case(c, 71 + nheads_kv + causal);
    if (HasFatalFailure()) return;
    c.deterministic = true;
    run_case(c, 72 + nheads_kv + causal);
    if (HasFatalFailure()) return;
  }
}

// Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key (lse = +inf
// from fwd) and get dq = 0 exactly.
TEST(BwdGpuSmall, RowsWithoutKeysGetZeroDq) {
  FLASH3_REQUIRE_HOPPER();
  for (int d : {64, 128, 256}) {
    const Case c{DType::kBFloat16, d, true, 2, 300, 100, 4, 2};
    SCOPED_TRACE(describe(c));
    BwdRun r(c);
    Grads16 g;
    r.run(40 + d, g);
    if (HasFatalFailure()) return;
    const PaddedLayout& l = r.q_layout();
    for (size_t i = 0; i < l.dense_size(); ++i) {
      const int64_t row = int64_t(i) / (l.heads * l.head_dim) % l.seqlen;
      if (row < 200) ASSERT_EQ(from_bits(c.dtype, g.dq[l.offset(i)]), 0.0) << "dq row " << row;
    }
    r.check_written(g);
    r.check_accuracy(g);
  }
}

// Empty sizes: seqlen_k == 0 writes dq = 0; seqlen_q == 0 makes dk = dv = 0 (the gradient of a
// loss that does not depend on k, v); batch == 0 is a no-op. Empty tensors have null data.
TEST(BwdGpuSmall, NoKeysGivesZeroDq) {
  FLASH3_REQUIRE_HOPPER();
  for (const Case& c : {Case{DType::kBFloat16, 128, false, 2, 70, 0, 4, 2}, Case{DType::kFloat16, 64, true, 1, 5, 0, 4, 1}}) {
    SCOPED_TRACE(describe(c));
    BwdRun r(c);
    Grads16 g;
    r.run(50, g);
    if (HasFatalFailure()) return;
    for (size_t i = 0; i < r.q_layout().dense_size(); ++i) ASSERT_EQ(from_bits(c.dtype, g.dq[r.q_layout().offset(i)]), 0.0) << i;
    r.check_written(g);
  }
}

TEST(BwdGpuSmall, NoQueriesGivesZeroDkDv) {
  FLASH3_REQUIRE_HOPPER();
  const Case c{DType::kBFloat16, 64, false, 2, 0, 70, 4, 2};
  BwdRun r(c);
  Grads16 g;
  r.run(51, g);
  if (HasFatalFailure()) return;
  const PaddedLayout& l = r.k_layout();
  for (size_t i = 0; i < l.dense_size(); ++i) {
    ASSERT_EQ(from_bits(c.dtype, g.dk[l.offset(i)]), 0.0) << "dk at " << i;
    ASSERT_EQ(from_bits(c.dtype, g.dv[l.offset(i)]), 0.0) << "dv at " << i;
  }
}

TEST(BwdGpuSmall, EmptyBatchIsANoOp) {
  FLASH3_REQUIRE_HOPPER();
  BwdRun r(Case{DType::kFloat16, 128, true, 0, 50, 60, 4, 1});
  r.prepare(52);
  if (HasFatalFailure()) return;
  EXPECT_NO_THROW(bwd(r.args()));
  EXPECT_EQ(bwd_workspace_size(validate_bwd(r.args())), 0u);
}

// A caller's workspace (dirty: filled with 0xFF, and reused) gives bitwise what bwd's own
// allocation gives, in deterministic mode; and an accurate result in the default mode, with the
// dQ accumulator cleared (causal, head dim 128) and not (non-causal: the first add is a store).
TEST(BwdGpuSmall, CallerWorkspaceMatchesOwnAllocation) {
  FLASH3_REQUIRE_HOPPER();
  for (auto [det, causal] : {std::pair{true, true}, std::pair{false, true}, std::pair{false, false}}) {
    Case c{DType::kBFloat16, 128, causal, 2, 300, 500, 4, 2};
    c.deterministic = det;
    SCOPED_TRACE(describe(c));
    BwdRun r(c);
    r.prepare(60);
    if (HasFatalFailure()) return;
    const size_t bytes = bwd_workspace_size(validate_bwd(r.args()));
    ASSERT_GT(bytes, 0u);
    DeviceBuffer ws(bytes);
    ASSERT_NE(ws.ptr, nullptr);
    FLASH3_CUDA_OK(cudaMemset(ws.ptr, 0xFF, bytes));
    Grads16 own, given, reused;
    r.backward(own);
    r.backward(given, ws.ptr, bytes);
    r.backward(reused, ws.ptr, bytes);
    if (HasFatalFailure()) return;
    r.check_written(given);
    r.check_accuracy(given);
    r.check_accuracy(reused);
    if (det) {
      EXPECT_TRUE(given.dq == own.dq && given.dk == own.dk && given.dv == own.dv);
      EXPECT_TRUE(reused.dq == own.dq && reused.dk == own.dk && reused.dv == own.dv);
    }
  }
}

// Too small a workspace is an argument error, found before anything runs: the gradients keep
// their poison.
TEST(BwdGpuSmall, TooSmallWorkspaceThrows) {
  FLASH3_REQUIRE_HOPPER();
  BwdRun r(Case{DType::kFloat16, 64, false, 1, 200, 300, 4, 4});
  r.prepare(61);
  if (HasFatalFailure()) return;
  BwdArgs a = r.args();
  const size_t bytes = bwd_workspace_size(validate_bwd(a));
  DeviceBuffer ws(bytes);
  ASSERT_NE(ws.ptr, nullptr);
  r.poison();
  a.workspace = ws.ptr;
  a.workspace_bytes = bytes - 1;
  try {
    bwd(a);
    ADD_FAILURE() << "bwd accepted a workspace of " << bytes - 1 << " bytes; it needs " << bytes;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("workspace"), std::string::npos) << e.what();
  }
  FLASH3_CUDA_OK(cudaDeviceSynchronize());
  const Grads16 g = r.download();
  for (const auto* t : {&g.dq, &g.dk, &g.dv}) {
    EXPECT_TRUE(std::all_of(t->begin(), t->end(), [](uint16_t b) { return b == 0xFFFF; })) << "written anyway";
  }
}

// A few runs in deterministic mode on a small problem (for the sanitizer's racecheck too).
TEST(BwdGpuSmall, DeterministicRepeats) {
  FLASH3_REQUIRE_HOPPER();
  expect_repeatable(deterministic({DType::kFloat16, 64, true, 1, 300, 400, 4, 1}), 70, 3);
  expect_repeatable(deterministic({DType::kBFloat16, 256, false, 1, 200, 130, 2, 2}), 71, 3);
  // The window kernels (first key block of a dQ tile's chain past key block 0) and softcap.
  Case c = deterministic({DType::kBFloat16, 128, true, 1, 300, 400, 4, 2});
  c.window_left = 70;
  c.softcap = 10.0f;
  expect_repeatable(c, 72, 3);
  c = deterministic({DType::kFloat16, 64, false, 1, 250, 200, 4, 4});
  c.window_left = 30;
  c.window_right = 90;
  expect_repeatable(c, 73, 3);
}

// The C ABI computes what the C++ API computes (bitwise, in deterministic mode).
TEST(BwdGpuSmall, CApiMatchesCpp) {
  FLASH3_REQUIRE_HOPPER();
  BwdRun r(deterministic({DType::kBFloat16, 64, true, 2, 100, 150, 4, 2}));
  Grads16 cpp;
  r.run(80, cpp);
  if (HasFatalFailure()) return;
  const BwdArgs a = r.args();
  // flash3_tensor has TensorRef's layout (static_assert in src/c_api.cpp)
  auto t = [](const TensorRef& x) { return *reinterpret_cast<const flash3_tensor*>(&x); };
  flash3_bwd_args ca;
  flash3_bwd_args_init(&ca);
  ca.q = t(a.q), ca.k = t(a.k), ca.v = t(a.v), ca.out = t(a.out), ca.dout = t(a.dout), ca.lse = t(a.lse);
  ca.dq = t(a.dq), ca.dk = t(a.dk), ca.dv = t(a.dv);
  ca.softmax_scale = a.softmax_scale;
  ca.causal = a.causal;
  ca.deterministic = a.deterministic;
  char err[256] = "";
  uint64_t bytes = 0;
  ASSERT_EQ(flash3_bwd_workspace_size(&ca, &bytes, err, sizeof err), FLASH3_OK) << err;
  EXPECT_EQ(bytes, bwd_workspace_size(validate_bwd(a)));
  r.poison();
  ASSERT_EQ(flash3_bwd(&ca, err, sizeof err), FLASH3_OK) << err;
  FLASH3_CUDA_OK(cudaDeviceSynchronize());
  const Grads16 c = r.download();
  EXPECT_TRUE(c.dq == cpp.dq && c.dk == cpp.dk && c.dv == cpp.dv);
}

}  // namespace
}  // namespace flash3::testing

// validate_fwd, validate_bwd and validate_kvcache on the CPU: a fake PointerInspector stands in for
// the CUDA runtime, so every rule is checked without a GPU. Each rule has one test that checks
// the message names the argument and the value it got. Also the checks of the values of
// cu_seqlens and seqused (host arrays; their device copy where a GPU is present) and the C ABI's
// error reporting.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "flash3/flash3.h"
#include "error_check.h"
#include "flash3/flash3_c.h"
#include "varlen_check.h"

namespace {

using flash3::BwdArgs;
using flash3::DType;
using flash3::FwdArgs;
using flash3::PointerKind;
using flash3::TensorRef;

// The fake inspector: every pointer is device memory except g_host and g_unknown.
const void* g_host = nullptr;
const void* g_unknown = nullptr;
int g_calls = 0;
PointerKind fake_inspect(const void* p) {
  ++g_calls;
  return p == g_host ? PointerKind::kHost : p == g_unknown ? PointerKind::kUnknown : PointerKind::kDevice;
}

void* fake_ptr(uintptr_t address) { return reinterpret_cast<void*>(address); }

// Contiguous q, k, v, out and lse at distinct 16-byte aligned fake addresses (q, k, v and out
// null when with_data is false).
FwdArgs make_args(int64_t b, int64_t sq, int64_t sk, int64_t h, int64_t hk, int64_t d,
                  bool with_data = true) {
  FwdArgs a;
  auto ptr = [&](uintptr_t address) { return with_data ? fake_ptr(address) : nullptr; };
  a.q = TensorRef::contiguous(ptr(0x100000), DType::kBFloat16, {b, sq, h, d});
  a.k = TensorRef::contiguous(ptr(0x200000), DType::kBFloat16, {b, sk, hk, d});
  a.v = TensorRef::contiguous(ptr(0x300000), DType::kBFloat16, {b, sk, hk, d});
  a.out = TensorRef::contiguous(ptr(0x400000), DType::kBFloat16, {b, sq, h, d});
  a.lse = TensorRef::contiguous(fake_ptr(0x500000), DType::kFloat32, {b, h, sq});
  a.causal = true;
  return a;
}

void validate(const FwdArgs& a) { flash3::validate_fwd(a, &fake_inspect); }
void validate(const BwdArgs& a) { flash3::validate_bwd(a, &fake_inspect); }

// validate_fwd (validate_bwd) throws flash3::Error and its message starts with "flash3::fwd: "
// ("flash3::bwd: ") and contains every one of parts.
template <class Args>
::testing::AssertionResult fails_with(const Args& a, std::initializer_list<std::string> parts) {
  const std::string prefix = std::is_same_v<Args, FwdArgs> ? "flash3::fwd: " : "flash3::bwd: ";
  return flash3::testing::throws_error([&] { validate(a); }, prefix, parts);
}

// Contiguous q, k, v, out, dout, lse, dq, dk, dv at distinct aligned fake addresses (those of
// make_args for q, k, v, out and lse; all null when with_data is false).
BwdArgs make_bwd_args(int64_t b, int64_t sq, int64_t sk, int64_t h, int64_t hk, int64_t d,
                      bool with_data = true) {
  BwdArgs a;
  auto ptr = [&](uintptr_t address) { return with_data ? fake_ptr(address) : nullptr; };
  a.q = TensorRef::contiguous(ptr(0x100000), DType::kBFloat16, {b, sq, h, d});
  a.k = TensorRef::contiguous(ptr(0x200000), DType::kBFloat16, {b, sk, hk, d});
  a.v = TensorRef::contiguous(ptr(0x300000), DType::kBFloat16, {b, sk, hk, d});
  a.out = TensorRef::contiguous(ptr(0x400000), DType::kBFloat16, {b, sq, h, d});
  a.dout = TensorRef::contiguous(ptr(0x600000), DType::kBFloat16, {b, sq, h, d});
  a.lse = TensorRef::contiguous(ptr(0x500000), DType::kFloat32, {b, h, sq});
  a.dq = TensorRef::contiguous(ptr(0x700000), DType::kBFloat16, {b, sq, h, d});
  a.dk = TensorRef::contiguous(ptr(0x800000), DType::kBFloat16, {b, sk, hk, d});
  a.dv = TensorRef::contiguous(ptr(0x900000), DType::kBFloat16, {b, sk, hk, d});
  a.causal = true;
  return a;
}

// The tensors of a BwdArgs by name; `layout` is the dims a message lists for it.
struct Named {
  std::string name;
  TensorRef BwdArgs::*member;
  std::string layout;
};
const char* const kQLayout = "(batch, seqlen_q, nheads, head_dim)";
const char* const kKLayout = "(batch, seqlen_k, nheads_kv, head_dim)";
const std::vector<Named> kBwdTensors = {
    {"q", &BwdArgs::q, kQLayout},     {"k", &BwdArgs::k, kKLayout},
    {"v", &BwdArgs::v, kKLayout},     {"out", &BwdArgs::out, kQLayout},
    {"dout", &BwdArgs::dout, kQLayout}, {"lse", &BwdArgs::lse, "(batch, nheads, seqlen_q)"},
    {"dq", &BwdArgs::dq, kQLayout},   {"dk", &BwdArgs::dk, kKLayout},
    {"dv", &BwdArgs::dv, kKLayout},
};
// The 16-bit ones (all but lse).
std::vector<Named> bwd_16bit_tensors() {
  std::vector<Named> t;
  for (const Named& n : kBwdTensors) {
    if (n.name != "lse") t.push_back(n);
  }
  return t;
}

// ---- the rules fwd and bwd share: each test runs on FwdArgs and on BwdArgs ----------------------

template <class Args>
Args make(int64_t b, int64_t sq, int64_t sk, int64_t h, int64_t hk, int64_t d, bool with_data = true);
template <>
FwdArgs make<FwdArgs>(int64_t b, int64_t sq, int64_t sk, int64_t h, int64_t hk, int64_t d, bool with_data) {
  return make_args(b, sq, sk, h, hk, d, with_data);
}
template <>
BwdArgs make<BwdArgs>(int64_t b, int64_t sq, int64_t sk, int64_t h, int64_t hk, int64_t d, bool with_data) {
  return make_bwd_args(b, sq, sk, h, hk, d, with_data);
}
flash3::FwdProblem problem(const FwdArgs& a) { return flash3::validate_fwd(a, &fake_inspect); }
flash3::BwdProblem problem(const BwdArgs& a) { return flash3::validate_bwd(a, &fake_inspect); }
// The float16 / bfloat16 tensors of the arguments.
std::vector<TensorRef*> sixteen_bit(FwdArgs& a) { return {&a.q, &a.k, &a.v, &a.out}; }
std::vector<TensorRef*> sixteen_bit(BwdArgs& a) { return {&a.q, &a.k, &a.v, &a.out, &a.dout, &a.dq, &a.dk, &a.dv}; }

template <class Args>
class Validate : public ::testing::Test {
 protected:
  void SetUp() override {
    g_host = g_unknown = nullptr;
    g_calls = 0;
  }
  Args a = make<Args>(2, 128, 256, 8, 2, 128);  // a valid GQA baseline
};

struct ArgsName {
  template <class T>
  static std::string GetName(int) { return std::is_same_v<T, FwdArgs> ? "fwd" : "bwd"; }
};
using BothArgs = ::testing::Types<FwdArgs, BwdArgs>;
TYPED_TEST_SUITE(Validate, BothArgs, ArgsName);

TYPED_TEST(Validate, BaselinePassesAndFillsTheProblem) {
  const auto p = problem(this->a);
  EXPECT_EQ(p.dtype, DType::kBFloat16);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen_q, 128);
  EXPECT_EQ(p.seqlen_k, 256);
  EXPECT_EQ(p.nheads, 8);
  EXPECT_EQ(p.nheads_kv, 2);
  EXPECT_EQ(p.head_dim, 128);
  EXPECT_FLOAT_EQ(p.softmax_scale, 1.0f / std::sqrt(128.0f));
  EXPECT_TRUE(p.causal);
  // Every pointer inspected: q, k, v, out, lse (fwd); and dout, dq, dk, dv (bwd, no workspace).
  EXPECT_EQ(g_calls, (std::is_same_v<TypeParam, FwdArgs> ? 5 : 9));
  this->a.causal = false;
  EXPECT_FALSE(problem(this->a).causal);
}

TYPED_TEST(Validate, Float16AndEveryHeadDimPass) {
  for (int64_t d : {64, 128, 256}) {
    TypeParam b = make<TypeParam>(1, 8, 8, 4, 4, d);
    for (TensorRef* t : sixteen_bit(b)) t->dtype = DType::kFloat16;
    b.causal = false;
    const auto p = problem(b);
    EXPECT_EQ(p.dtype, DType::kFloat16);
    EXPECT_EQ(p.head_dim, d);
    EXPECT_FALSE(p.causal);
  }
}

TYPED_TEST(Validate, ScaleIsKeptOrDefaulted) {
  auto& a = this->a;
  a.softmax_scale = 0.5f;
  EXPECT_EQ(problem(a).softmax_scale, 0.5f);
  for (float s : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()}) {  // the default
    a.softmax_scale = s;
    EXPECT_FLOAT_EQ(problem(a).softmax_scale, 1.0f / std::sqrt(128.0f)) << s;
  }
}

TYPED_TEST(Validate, StridesOfSizeOneDimsAreIgnored) {
  auto& a = this->a;
  a = make<TypeParam>(1, 128, 256, 1, 1, 64);
  a.q.stride[0] = 0;
  a.k.stride[2] = 3;
  a.lse.stride[1] = -7;
  EXPECT_NO_THROW(problem(a));
}

TYPED_TEST(Validate, EmptyBatchSkipsPointerChecks) {
  auto& a = this->a;
  a = make<TypeParam>(0, 128, 256, 8, 2, 128, /*with_data=*/false);
  EXPECT_EQ(problem(a).batch, 0);
  EXPECT_EQ(g_calls, 0);
}

TYPED_TEST(Validate, UnsupportedDtype) {
  auto& a = this->a;
  for (TensorRef* t : sixteen_bit(a)) t->dtype = DType::kFloat32;
  EXPECT_TRUE(fails_with(a, {"q.dtype is float32", "supported dtypes are float16, bfloat16"}));
  a.q.dtype = static_cast<DType>(42);
  EXPECT_TRUE(fails_with(a, {"q.dtype is unknown (code 42)"}));
}

TYPED_TEST(Validate, LseDtype) {
  auto& a = this->a;
  a.lse.dtype = DType::kBFloat16;
  EXPECT_TRUE(fails_with(a, {"lse.dtype is bfloat16", "lse must be float32"}));
}

TYPED_TEST(Validate, NegativeSize) {
  auto& a = this->a;
  a.q.shape[1] = -1;
  EXPECT_TRUE(fails_with(a, {"q.shape[1] (seqlen_q) is -1", "sizes must be >= 0"}));
}

TYPED_TEST(Validate, SizeBeyondInt32) {
  auto& a = this->a;
  a.k.shape[1] = a.v.shape[1] = int64_t{1} << 31;
  EXPECT_TRUE(fails_with(a, {"k.shape[1] (seqlen_k) is 2147483648", "int32"}));
}

TYPED_TEST(Validate, BatchMismatch) {
  auto& a = this->a;
  a.k.shape[0] = 3;
  EXPECT_TRUE(fails_with(a, {"k.shape[0] (batch) is 3 but q.shape[0] (batch) is 2"}));
}

TYPED_TEST(Validate, HeadDimMismatch) {
  auto& a = this->a;
  a.k.shape[3] = 64;
  EXPECT_TRUE(fails_with(a, {"k.shape[3] (head_dim) is 64 but q.shape[3] (head_dim) is 128"}));
}

TYPED_TEST(Validate, KAndVShapesDiffer) {
  auto& a = this->a;
  a.v.shape[1] = 255;
  EXPECT_TRUE(fails_with(a, {"v.shape[1] (seqlen_k) is 255 but k.shape[1] (seqlen_k) is 256",
                             "k and v must have the same shape"}));
}

TYPED_TEST(Validate, OutShapeDiffersFromQ) {
  auto& a = this->a;
  a.out.shape[2] = 4;
  EXPECT_TRUE(fails_with(a, {"out.shape[2] (nheads) is 4 but q.shape[2] (nheads) is 8", "same shape as q"}));
}

TYPED_TEST(Validate, LseShape) {
  auto& a = this->a;
  a.lse.shape[2] = 127;
  EXPECT_TRUE(fails_with(a, {"lse.shape[2] (seqlen_q) is 127 but q.shape[1] (seqlen_q) is 128",
                             "lse must be (batch, nheads, seqlen_q)"}));
}

TYPED_TEST(Validate, UnsupportedHeadDim) {
  auto& a = this->a;
  a = make<TypeParam>(2, 128, 256, 8, 2, 96);
  EXPECT_TRUE(fails_with(a, {"q.shape[3] (head_dim) is 96; supported head dims are 64, 128, 256"}));
}

TYPED_TEST(Validate, NoKvHeads) {
  auto& a = this->a;
  a = make<TypeParam>(2, 128, 256, 8, 0, 128);
  EXPECT_TRUE(fails_with(a, {"k.shape[2] (nheads_kv) is 0"}));
}

TYPED_TEST(Validate, HeadsNotAMultipleOfKvHeads) {
  auto& a = this->a;
  a = make<TypeParam>(2, 128, 256, 6, 4, 128);
  EXPECT_TRUE(fails_with(a, {"q.shape[2] (nheads) is 6 and k.shape[2] (nheads_kv) is 4", "multiple"}));
}

TYPED_TEST(Validate, LastDimNotContiguous) {
  auto& a = this->a;
  a.q.stride[3] = 2;
  EXPECT_TRUE(fails_with(a, {"q.stride[3] is 2", "stride 1"}));
  a = make<TypeParam>(2, 128, 256, 8, 2, 128);
  a.lse.stride[2] = 2;
  EXPECT_TRUE(fails_with(a, {"lse.stride[2] is 2", "stride 1"}));
}

TYPED_TEST(Validate, StrideNotAMultipleOf16Bytes) {
  auto& a = this->a;
  a.k.stride[1] = 260;
  EXPECT_TRUE(fails_with(a, {"k.stride[1] (seqlen_k) is 260 elements (520 bytes)",
                             "multiples of 8 elements (16 bytes)"}));
}

TYPED_TEST(Validate, NonPositiveStride) {
  auto& a = this->a;
  a.v.stride[0] = 0;
  EXPECT_TRUE(fails_with(a, {"v.stride[0] (batch) is 0", "positive"}));
  a.v.stride[0] = -256;
  EXPECT_TRUE(fails_with(a, {"v.stride[0] (batch) is -256", "positive"}));
  a = make<TypeParam>(2, 128, 256, 8, 2, 128);
  a.lse.stride[1] = -128;  // lse's strides need not be multiples of 16 bytes, but positive
  EXPECT_TRUE(fails_with(a, {"lse.stride[1] (nheads) is -128", "positive"}));
}

TYPED_TEST(Validate, InfiniteScale) {
  auto& a = this->a;
  a.softmax_scale = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(fails_with(a, {"softmax_scale is inf", "finite"}));
}

// softmax_scale up to 2^11, where both passes' float32 exponents are exact (validate.cpp); a
// finite scale beyond (1e30 gave NaN in about half of the outputs) is rejected by name.
TYPED_TEST(Validate, HugeScale) {
  auto& a = this->a;
  a.softmax_scale = 2048.0f;
  EXPECT_EQ(problem(a).softmax_scale, 2048.0f);
  a.softmax_scale = 1e30f;
  EXPECT_TRUE(fails_with(a, {"softmax_scale is 1e+30; it must be finite and at most 2048 (2^11",
                             "or <= 0 for the default"}));
  a.softmax_scale = 2049.0f;
  EXPECT_TRUE(fails_with(a, {"softmax_scale is 2049", "at most 2048"}));
  a.softmax_scale = 3e38f;
  EXPECT_TRUE(fails_with(a, {"softmax_scale is 3e+38", "at most 2048"}));
}

// The sliding window, normalized as FlashAttention-3 does: causal sets right = 0, a window (-1, 0)
// is causal, and a bound that excludes nothing (left >= seqlen_k - 1, right >= seqlen_q - 1)
// becomes -1.
TYPED_TEST(Validate, WindowIsNormalized) {
  struct Row {
    bool causal;
    int left, right;     // given
    bool want_causal;
    int want_left, want_right;
  };
  const Row rows[] = {  // seqlen_q 128, seqlen_k 256
      {false, -1, -1, false, -1, -1}, {false, 10, 20, false, 10, 20}, {false, -1, 0, true, -1, 0},
      {true, 10, 5, true, 10, 0},     {false, 255, 127, false, -1, -1}, {false, 254, 126, false, 254, 126},
  };
  for (const Row& r : rows) {
    auto& a = this->a;
    a.causal = r.causal;
    a.window_left = r.left;
    a.window_right = r.right;
    const auto p = problem(a);
    EXPECT_EQ(p.causal, r.want_causal) << r.left << "," << r.right;
    EXPECT_EQ(p.window_left, r.want_left) << r.left << "," << r.right;
    EXPECT_EQ(p.window_right, r.want_right) << r.left << "," << r.right;
  }
}

TYPED_TEST(Validate, WindowBelowMinusOne) {
  auto& a = this->a;
  a.window_left = -2;
  EXPECT_TRUE(fails_with(a, {"window_left is -2; it must be >= 0, or -1 for no bound on the left"}));
  a.window_left = 3;
  a.window_right = -7;
  EXPECT_TRUE(fails_with(a, {"window_right is -7; it must be >= 0, or -1 for no bound on the right"}));
}

TYPED_TEST(Validate, Softcap) {
  auto& a = this->a;
  a.softcap = 30.0f;
  EXPECT_EQ(problem(a).softcap, 30.0f);
  a.softcap = 0.0f;
  EXPECT_EQ(problem(a).softcap, 0.0f);
  a.softcap = -1.0f;
  EXPECT_TRUE(fails_with(a, {"softcap is -1; it must be finite and in [0, 2048] (0: no softcap"}));
  a.softcap = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(fails_with(a, {"softcap is nan", "finite"}));
  a.softcap = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(fails_with(a, {"softcap is inf", "finite"}));
  a.softcap = 2049.0f;
  EXPECT_TRUE(fails_with(a, {"softcap is 2049", "[0, 2048]"}));
}

// Lengths past kMaxSeqlen = 2^30 would overflow the kernels' 32-bit row arithmetic.
TYPED_TEST(Validate, SeqlenBeyondKMaxSeqlen) {
  auto& a = this->a;
  a = make<TypeParam>(1, 64, int64_t{1} << 30, 1, 1, 64);
  EXPECT_NO_THROW(problem(a));
  a = make<TypeParam>(1, 64, (int64_t{1} << 30) + 1, 1, 1, 64);
  EXPECT_TRUE(fails_with(a, {"k.shape[1] (seqlen_k) is 1073741825; seqlen_k must be at most 1073741824 (2^30)"}));
  a = make<TypeParam>(1, (int64_t{1} << 30) + 1, 64, 1, 1, 64);
  EXPECT_TRUE(fails_with(a, {"q.shape[1] (seqlen_q) is 1073741825; seqlen_q must be at most 1073741824"}));
}

// The issue's case: 2^31 - 1 keys through an overlapping-row view of K and V (16-byte rows),
// 64 queries, non-causal: a legal view, rejected for its length (it gave wrong results).
TYPED_TEST(Validate, OverlappingViewOfTooManyKeys) {
  auto& a = this->a;
  a = make<TypeParam>(1, 64, 2147483647, 1, 1, 128);
  a.causal = false;
  for (TensorRef* t : sixteen_bit(a)) {
    if (t->shape[1] != 64) {
      t->stride[1] = 8;  // 16 bytes: row j starts 8 elements after row j - 1
      t->stride[0] = t->stride[2] = 8;
    }
  }
  EXPECT_TRUE(fails_with(a, {"k.shape[1] (seqlen_k) is 2147483647", "at most 1073741824 (2^30)"}));
}

// ceil(seqlen / 64) x nheads x batch must stay within 2^30 (32-bit tile counts): query tiles in
// both passes, key tiles in the backward.
TYPED_TEST(Validate, TileCounts) {
  auto& a = this->a;
  const bool fwd = std::is_same_v<TypeParam, FwdArgs>;
  a = make<TypeParam>(int64_t{1} << 20, 4096, 64, 16, 16, 64);  // 64 x 16 x 2^20 = 2^30 query tiles
  EXPECT_NO_THROW(problem(a));
  a = make<TypeParam>(int64_t{1} << 20, 4096, 64, 32, 32, 64);  // 2^31
  EXPECT_TRUE(fails_with(a, {"q.shape[1] (seqlen_q) is 4096 with nheads 32 and batch 1048576",
                             "ceil(seqlen_q / 64) x nheads x batch = 64 x 32 x 1048576 query tiles",
                             "more than the 1073741824 (2^30)"}));
  a = make<TypeParam>(int64_t{1} << 16, 64, 8192, 256, 256, 64);  // 128 x 256 x 2^16 = 2^31 key tiles
  if (fwd) {
    EXPECT_NO_THROW(problem(a));  // the forward counts query tiles only
  } else {
    EXPECT_TRUE(fails_with(a, {"k.shape[1] (seqlen_k) is 8192 with nheads 256 and batch 65536",
                               "ceil(seqlen_k / 64) x nheads x batch = 128 x 256 x 65536 key tiles"}));
  }
  // factors near int32's limit do not overflow the check itself
  a = make<TypeParam>(int64_t{1} << 20, int64_t{1} << 30, 64, int64_t{1} << 20, int64_t{1} << 20, 64);
  EXPECT_TRUE(fails_with(a, {"= 16777216 x 1048576 x 1048576 query tiles"}));
}

// An empty tensor's strides are never used: PyTorch gives an expanded empty gradient (the
// backward of out.sum() at batch 0) strides of 0, the last one included.
TYPED_TEST(Validate, EmptyTensorsIgnoreStrides) {
  auto& a = this->a;
  a = make<TypeParam>(0, 128, 256, 8, 2, 128, /*with_data=*/false);
  for (TensorRef* t : sixteen_bit(a)) {
    for (int64_t& st : t->stride) st = 0;
  }
  for (int64_t& st : a.lse.stride) st = 0;
  EXPECT_EQ(problem(a).batch, 0);
  EXPECT_EQ(g_calls, 0);
}

TYPED_TEST(Validate, NullPointer) {
  auto& a = this->a;
  a.q.data = nullptr;
  EXPECT_TRUE(fails_with(a, {"q.data is null", "a non-empty q needs a device pointer"}));
}

TYPED_TEST(Validate, MisalignedPointer) {
  auto& a = this->a;
  a.out.data = fake_ptr(0x400008);
  EXPECT_TRUE(fails_with(a, {"out.data is 0x400008", "16-byte aligned"}));
  a = make<TypeParam>(2, 128, 256, 8, 2, 128);
  a.lse.data = fake_ptr(0x500002);
  EXPECT_TRUE(fails_with(a, {"lse.data is 0x500002", "4-byte aligned"}));
  a.lse.data = fake_ptr(0x500004);  // 4 bytes is enough for lse
  EXPECT_NO_THROW(problem(a));
}

TYPED_TEST(Validate, HostPointer) {
  auto& a = this->a;
  g_host = a.v.data;
  EXPECT_TRUE(fails_with(a, {"v.data points to host memory; flash3 needs device memory (cudaMalloc "
                             "or a CUDA tensor)"}));
  g_host = a.lse.data;
  EXPECT_TRUE(fails_with(a, {"lse.data points to host memory"}));
}

TYPED_TEST(Validate, UnknownPointer) {
  auto& a = this->a;
  g_unknown = a.k.data;
  EXPECT_TRUE(fails_with(a, {"k.data (0x200000) is not a pointer the CUDA runtime knows"}));
}

TYPED_TEST(Validate, PointerChecksComeLast) {
  auto& a = this->a;
  g_host = a.q.data;
  a.k.stride[2] = 4;
  EXPECT_TRUE(fails_with(a, {"k.stride[2] (nheads_kv) is 4"}));
  EXPECT_EQ(g_calls, 0);
}

// ---- forward only ----------------------------------------------------------------------------

class ValidateFwd : public Validate<FwdArgs> {};

TEST_F(ValidateFwd, LseIsWrittenWhenGiven) {
  EXPECT_TRUE(flash3::validate_fwd(a, &fake_inspect).write_lse);
}

TEST_F(ValidateFwd, LseIsOptional) {
  a.lse = TensorRef{};  // data == nullptr: not written, nothing else about it is checked
  EXPECT_FALSE(flash3::validate_fwd(a, &fake_inspect).write_lse);
  EXPECT_EQ(g_calls, 4);
}

TEST_F(ValidateFwd, PaddedStridesPass) {  // q and out as slices of wider buffers
  for (TensorRef* t : {&a.q, &a.out}) {
    t->stride[2] = 136;
    t->stride[1] = 8 * 136 + 8;
    t->stride[0] = 128 * t->stride[1];
  }
  EXPECT_NO_THROW(flash3::validate_fwd(a, &fake_inspect));
}

TEST_F(ValidateFwd, EmptySeqlenQSkipsPointerChecks) {
  a = make_args(2, 0, 256, 8, 2, 128, /*with_data=*/false);
  EXPECT_EQ(flash3::validate_fwd(a, &fake_inspect).seqlen_q, 0);
  EXPECT_EQ(g_calls, 0);
}

TEST_F(ValidateFwd, EmptyKeysNeedNoKvPointers) {  // every row sees no key: out = 0, lse = +inf
  a.k = TensorRef::contiguous(nullptr, DType::kBFloat16, {2, 0, 2, 128});
  a.v = a.k;
  EXPECT_EQ(flash3::validate_fwd(a, &fake_inspect).seqlen_k, 0);
  EXPECT_EQ(g_calls, 3);  // q, out, lse
}

TEST_F(ValidateFwd, RankOfQkvOut) {
  a.q.rank = 3;
  EXPECT_TRUE(fails_with(a, {"q.rank is 3", "q must have rank 4 (batch, seqlen_q, nheads, head_dim)"}));
}

TEST_F(ValidateFwd, RankOfLse) {
  a.lse.rank = 4;
  EXPECT_TRUE(fails_with(a, {"lse.rank is 4", "lse must have rank 3 (batch, nheads, seqlen_q)"}));
}

TEST_F(ValidateFwd, DtypeMismatch) {
  a.k.dtype = DType::kFloat16;
  EXPECT_TRUE(fails_with(a, {"flash3::fwd: k.dtype is float16 but q.dtype is bfloat16; q, k, v and out must "
                             "have the same dtype"}));
}

// ---- backward only ---------------------------------------------------------------------------

class ValidateBwd : public Validate<BwdArgs> {
 protected:
  BwdArgs fresh() const { return make_bwd_args(2, 128, 256, 8, 2, 128); }
};

TEST_F(ValidateFwd, WindowAndSoftcapAreFor16BitInputs) {
  for (TensorRef* t : {&a.q, &a.k, &a.v}) t->dtype = DType::kFloat8E4M3;
  EXPECT_NO_THROW(problem(a));
  a.causal = false;
  a.window_right = 0;  // (-1, 0) is causal: fine
  EXPECT_TRUE(problem(a).causal);
  a.window_left = 20;
  EXPECT_TRUE(fails_with(a, {"window_left is 20 and window_right is 0 but q.dtype is float8_e4m3; sliding windows are "
                             "built for float16 and bfloat16"}));
  a.window_left = -1;
  a.softcap = 5.0f;
  EXPECT_TRUE(fails_with(a, {"softcap is 5 but q.dtype is float8_e4m3; softcap is built for float16 and bfloat16"}));
}

TEST_F(ValidateBwd, DeterministicIsPassedOn) {
  a.deterministic = true;
  EXPECT_TRUE(flash3::validate_bwd(a, &fake_inspect).deterministic);
  a.deterministic = false;
  EXPECT_FALSE(flash3::validate_bwd(a, &fake_inspect).deterministic);
}

// Gradients written into a packed (batch, seqlen, 3, nheads, head_dim) buffer, as a qkv-packed
// caller does: dq, dk, dv interleave (distinct first elements), and so do q, k, v.
TEST_F(ValidateBwd, InterleavedPackedTensorsPass) {
  a = make_bwd_args(2, 128, 128, 4, 4, 64);
  for (auto [base, fields] : {std::pair<uintptr_t, std::vector<TensorRef*>>{0x100000, {&a.q, &a.k, &a.v}},
                              {0x800000, {&a.dq, &a.dk, &a.dv}}}) {
    for (int i = 0; i < 3; ++i) {
      TensorRef& t = *fields[i];
      t.data = fake_ptr(base + uintptr_t(i) * 4 * 64 * 2);
      t.stride[2] = 64;
      t.stride[1] = 3 * 4 * 64;
      t.stride[0] = 128 * t.stride[1];
    }
  }
  a.lse.stride[1] = 131;  // lse strides need only be positive
  a.lse.stride[0] = 4 * 131;
  EXPECT_NO_THROW(flash3::validate_bwd(a, &fake_inspect));
}

TEST_F(ValidateBwd, EmptyKeysNeedNoKvPointers) {  // dq = 0 is all there is to compute
  a = make_bwd_args(2, 128, 0, 8, 2, 128);
  a.k.data = a.v.data = a.dk.data = a.dv.data = nullptr;
  EXPECT_EQ(flash3::validate_bwd(a, &fake_inspect).seqlen_k, 0);
  EXPECT_EQ(g_calls, 5);  // q, out, dout, lse, dq
}

TEST_F(ValidateBwd, EmptyQueriesNeedOnlyKvPointers) {  // dk = dv = 0 is all there is to compute
  a = make_bwd_args(2, 0, 256, 8, 2, 128);
  a.q.data = a.out.data = a.dout.data = a.lse.data = a.dq.data = nullptr;
  EXPECT_EQ(flash3::validate_bwd(a, &fake_inspect).seqlen_q, 0);
  EXPECT_EQ(g_calls, 4);  // k, v, dk, dv
}

TEST_F(ValidateBwd, RankOfEachTensor) {
  for (const Named& n : kBwdTensors) {
    a = fresh();
    TensorRef& t = a.*n.member;
    t.rank = t.rank == 3 ? 4 : 3;
    EXPECT_TRUE(fails_with(a, {n.name + ".rank is " + std::to_string(t.rank),
                               n.name + " must have rank " + std::to_string(7 - t.rank) + " " + n.layout}));
  }
}

TEST_F(ValidateBwd, LseIsRequired) {
  a.lse = TensorRef{};
  EXPECT_TRUE(fails_with(a, {"lse.rank is 0", "lse must have rank 3 (batch, nheads, seqlen_q)"}));
  a = fresh();
  a.lse.data = nullptr;
  EXPECT_TRUE(fails_with(a, {"lse.data is null", "a non-empty lse needs a device pointer"}));
}

TEST_F(ValidateBwd, DtypeMismatch) {
  for (const Named& n : bwd_16bit_tensors()) {
    if (n.name == "q") continue;
    a = fresh();
    (a.*n.member).dtype = DType::kFloat16;
    EXPECT_TRUE(fails_with(a, {n.name + ".dtype is float16 but q.dtype is bfloat16",
                               "q, k, v, out, dout, dq, dk and dv must have the same dtype"}));
  }
}

// out, dout, dq have q's shape; v, dk, dv have k's. Each differs in one dim in turn.
TEST_F(ValidateBwd, ShapesFollowQOrK) {
  for (const Named& n : bwd_16bit_tensors()) {
    if (n.name == "q" || n.name == "k") continue;
    const bool like_q = n.layout == kQLayout;
    const std::string ref = like_q ? "q" : "k", dim = like_q ? "(nheads) is " : "(nheads_kv) is ";
    for (int d : {1, 2}) {
      a = fresh();
      TensorRef& t = a.*n.member;
      const int64_t want = t.shape[d];
      t.shape[d] = want + 1;
      const std::string dname = d == 1 ? (like_q ? "(seqlen_q) is " : "(seqlen_k) is ") : dim;
      EXPECT_TRUE(fails_with(a, {n.name + ".shape[" + std::to_string(d) + "] " + dname + std::to_string(want + 1) +
                                     " but " + ref + ".shape[" + std::to_string(d) + "] " + dname +
                                     std::to_string(want),
                                 n.name == "v" ? "k and v must have the same shape"
                                               : n.name + " must have the same shape as " + ref}));
    }
  }
}

TEST_F(ValidateBwd, EveryLastDimContiguous) {
  for (const Named& n : kBwdTensors) {
    a = fresh();
    TensorRef& t = a.*n.member;
    t.stride[t.rank - 1] = 2;
    EXPECT_TRUE(fails_with(a, {n.name + ".stride[" + std::to_string(t.rank - 1) + "] is 2", "stride 1"}));
  }
}

TEST_F(ValidateBwd, EveryStrideAMultipleOf16Bytes) {
  for (const Named& n : bwd_16bit_tensors()) {
    a = fresh();
    TensorRef& t = a.*n.member;
    t.stride[1] += 4;
    const std::string st = std::to_string(t.stride[1]), dim = n.layout == kQLayout ? "seqlen_q" : "seqlen_k";
    EXPECT_TRUE(fails_with(a, {n.name + ".stride[1] (" + dim + ") is " + st + " elements (" +
                                   std::to_string(2 * t.stride[1]) + " bytes)",
                               "multiples of 8 elements (16 bytes)"}));
  }
}

// An output that starts where another argument starts is rejected, whichever pair it is.
TEST_F(ValidateBwd, OutputsMustNotAlias) {
  for (const char* out : {"dq", "dk", "dv"}) {
    for (const Named& n : kBwdTensors) {
      if (n.name == out) continue;
      a = fresh();
      const Named& o = *std::find_if(kBwdTensors.begin(), kBwdTensors.end(), [&](const Named& x) { return x.name == out; });
      (a.*o.member).data = (a.*n.member).data;
      // Outputs are checked in the order dq, dk, dv: an output pair is named by the earlier one.
      const std::vector<std::string> outs = {"dq", "dk", "dv"};
      const auto n_at = std::find(outs.begin(), outs.end(), n.name);  // outs.end() for an input
      const bool n_first = n_at < std::find(outs.begin(), outs.end(), out);
      const std::string first = n_first ? n.name : out, second = n_first ? out : n.name;
      char addr[32];
      std::snprintf(addr, sizeof addr, "%p", (a.*n.member).data);
      EXPECT_TRUE(fails_with(a, {first + ".data is " + addr + ", the same as " + second + ".data",
                                 "must not alias"}));
    }
  }
}

TEST_F(ValidateBwd, WorkspaceIsOptionalAndChecked) {
  a.workspace = fake_ptr(0xA00000);
  a.workspace_bytes = 1;  // the size is bwd()'s to check, against bwd_workspace_size()
  EXPECT_NO_THROW(flash3::validate_bwd(a, &fake_inspect));
  EXPECT_EQ(g_calls, 10);
  a.workspace = fake_ptr(0xA00080);
  EXPECT_TRUE(fails_with(a, {"workspace is 0xa00080, not 256-byte aligned"}));
  a.workspace = fake_ptr(0xA00000);
  g_host = a.workspace;
  EXPECT_TRUE(fails_with(a, {"workspace points to host memory"}));
  g_host = nullptr;
  g_unknown = a.workspace;
  EXPECT_TRUE(fails_with(a, {"workspace (0xa00000) is not a pointer the CUDA runtime knows"}));
}

// ---- variable-length batches: shapes (validate_fwd, validate_bwd) ------------------------------

// The tensors of each side: q, out (dout, dq) and k, v (dk, dv).
std::vector<TensorRef*> q_side(FwdArgs& a) { return {&a.q, &a.out}; }
std::vector<TensorRef*> q_side(BwdArgs& a) { return {&a.q, &a.out, &a.dout, &a.dq}; }
std::vector<TensorRef*> k_side(FwdArgs& a) { return {&a.k, &a.v}; }
std::vector<TensorRef*> k_side(BwdArgs& a) { return {&a.k, &a.v, &a.dk, &a.dv}; }

// Fake addresses of cu_seqlens_q/k and seqused_q/k.
constexpr uintptr_t kCuQ = 0xB00000, kCuK = 0xB10000, kUsedQ = 0xB20000, kUsedK = 0xB30000;

TensorRef int32_vector(uintptr_t address, int64_t n) {
  return TensorRef::contiguous(fake_ptr(address), DType::kInt32, {n});
}

// A valid variable-length batch of 3 sequences, 8 heads, 2 kv heads, head dim 128: a packed side
// has 300 query rows (max_seqlen_q 128) or 500 keys (max_seqlen_k 256); a side not packed is
// (3, 128, ...) or (3, 256, ...). seqused where asked.
template <class Args>
Args make_varlen(bool pack_q, bool pack_k, bool used_q = false, bool used_k = false) {
  Args a = make<Args>(3, 128, 256, 8, 2, 128);
  if (pack_q) {
    for (TensorRef* t : q_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {300, 8, 128});
    a.lse = TensorRef::contiguous(a.lse.data, DType::kFloat32, {8, 300});
    a.cu_seqlens_q = int32_vector(kCuQ, 4);
    a.max_seqlen_q = 128;
  }
  if (pack_k) {
    for (TensorRef* t : k_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {500, 2, 128});
    a.cu_seqlens_k = int32_vector(kCuK, 4);
    a.max_seqlen_k = 256;
  }
  if (used_q) a.seqused_q = int32_vector(kUsedQ, 3);
  if (used_k) a.seqused_k = int32_vector(kUsedK, 3);
  return a;
}

template <class Args>
class ValidateVarlen : public Validate<Args> {
 protected:
  Args a = make_varlen<Args>(true, true);
  static constexpr bool kFwd = std::is_same_v<Args, FwdArgs>;
  static constexpr int kTensors = kFwd ? 5 : 9;  // the pointers of a fixed-length problem
};
TYPED_TEST_SUITE(ValidateVarlen, BothArgs, ArgsName);

TYPED_TEST(ValidateVarlen, PackedSidesFillTheProblem) {
  const auto p = problem(this->a);
  EXPECT_TRUE(p.varlen);
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.seqlen_q, 128);
  EXPECT_EQ(p.seqlen_k, 256);
  EXPECT_EQ(p.total_q, 300);
  EXPECT_EQ(p.total_k, 500);
  EXPECT_EQ(p.nheads, 8);
  EXPECT_EQ(p.nheads_kv, 2);
  EXPECT_EQ(p.head_dim, 128);
  EXPECT_FLOAT_EQ(p.softmax_scale, 1.0f / std::sqrt(128.0f));
  EXPECT_EQ(g_calls, this->kTensors + 2);  // and cu_seqlens_q, cu_seqlens_k
}

TYPED_TEST(ValidateVarlen, OneSidePacked) {
  auto p = problem(make_varlen<TypeParam>(true, false));
  EXPECT_TRUE(p.varlen);
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.seqlen_q, 128);
  EXPECT_EQ(p.total_q, 300);
  EXPECT_EQ(p.seqlen_k, 256);  // k's dim 1
  EXPECT_EQ(p.total_k, 3 * 256);
  p = problem(make_varlen<TypeParam>(false, true));
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.seqlen_q, 128);
  EXPECT_EQ(p.total_q, 3 * 128);
  EXPECT_EQ(p.seqlen_k, 256);
  EXPECT_EQ(p.total_k, 500);
}

TYPED_TEST(ValidateVarlen, SequsedAlone) {
  auto& a = this->a;
  a = make_varlen<TypeParam>(false, false, true, true);
  a.max_seqlen_q = -5;  // ignored without cu_seqlens_q
  a.max_seqlen_k = std::numeric_limits<int>::max();
  const auto p = problem(a);
  EXPECT_TRUE(p.varlen);
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.seqlen_q, 128);
  EXPECT_EQ(p.seqlen_k, 256);
  EXPECT_EQ(p.total_q, 3 * 128);
  EXPECT_EQ(p.total_k, 3 * 256);
  EXPECT_EQ(g_calls, this->kTensors + 2);  // and seqused_q, seqused_k
  a = make_varlen<TypeParam>(true, true, true, true);
  EXPECT_EQ(problem(a).batch, 3);
}

TYPED_TEST(ValidateVarlen, FixedLengthsHaveTotals) {
  const auto p = problem(make<TypeParam>(2, 128, 256, 8, 2, 128));
  EXPECT_FALSE(p.varlen);
  EXPECT_EQ(p.total_q, 2 * 128);
  EXPECT_EQ(p.total_k, 2 * 256);
}

// batch 0, both sides packed (cu_seqlens of one entry, empty tensors), seqused_q of no entry; all
// data null.
template <class Args>
Args empty_varlen() {
  Args a = make<Args>(0, 0, 0, 8, 2, 128, /*with_data=*/false);
  for (TensorRef* t : q_side(a)) *t = TensorRef::contiguous(nullptr, t->dtype, {0, 8, 128});
  for (TensorRef* t : k_side(a)) *t = TensorRef::contiguous(nullptr, t->dtype, {0, 2, 128});
  a.lse = TensorRef::contiguous(nullptr, DType::kFloat32, {8, 0});
  a.cu_seqlens_q = a.cu_seqlens_k = TensorRef::contiguous(nullptr, DType::kInt32, {1});
  a.seqused_q = TensorRef::contiguous(nullptr, DType::kInt32, {0});
  return a;
}

// batch 0: nothing to compute, no pointer read.
TYPED_TEST(ValidateVarlen, EmptyBatch) {
  const auto p = problem(empty_varlen<TypeParam>());
  EXPECT_TRUE(p.varlen);
  EXPECT_EQ(p.batch, 0);
  EXPECT_EQ(p.total_q, 0);
  EXPECT_EQ(p.total_k, 0);
  EXPECT_EQ(g_calls, 0);
}

// Sequences of length 0 only (batch > 0, max_seqlen 0): valid.
TYPED_TEST(ValidateVarlen, ZeroLengthSequences) {
  auto& a = this->a;
  for (TensorRef* t : q_side(a)) t->shape[0] = 0;
  a.lse.shape[1] = 0;
  a.max_seqlen_q = 0;
  const auto p = problem(a);
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.seqlen_q, 0);
  EXPECT_EQ(p.total_q, 0);
}

TYPED_TEST(ValidateVarlen, RankOfPackedTensors) {
  auto& a = this->a;
  const std::string names[] = {"q", "out", "dout", "dq"};  // the order of q_side
  for (size_t i = 0; i < q_side(a).size(); ++i) {
    a = make_varlen<TypeParam>(true, true);
    const std::string& name = names[i];
    q_side(a)[i]->rank = 4;
    EXPECT_TRUE(fails_with(a, {name + ".rank is 4; with cu_seqlens_q, " + name +
                                   " must have rank 3 (total_q, nheads, head_dim) (rank 4 (batch, seqlen_q, nheads, "
                                   "head_dim) without cu_seqlens_q)"}));
  }
  a = make_varlen<TypeParam>(true, true);
  a.v.rank = 4;
  EXPECT_TRUE(fails_with(a, {"v.rank is 4; with cu_seqlens_k, v must have rank 3 (total_k, nheads_kv, head_dim) "
                             "(rank 4 (batch, seqlen_k, nheads_kv, head_dim) without cu_seqlens_k)"}));
  a = make_varlen<TypeParam>(true, true);
  a.lse.rank = 3;
  EXPECT_TRUE(fails_with(a, {"lse.rank is 3; with cu_seqlens_q, lse must have rank 2 (nheads, total_q) (rank 3 "
                             "(batch, nheads, seqlen_q) without cu_seqlens_q)"}));
  // packed tensors without cu_seqlens: the message says which argument packs them
  a = make_varlen<TypeParam>(true, false);
  a.cu_seqlens_q = TensorRef{};
  EXPECT_TRUE(fails_with(a, {"q.rank is 3; q must have rank 4 (batch, seqlen_q, nheads, head_dim) (rank 3 "
                             "(total_q, nheads, head_dim) with cu_seqlens_q)"}));
  a = make_varlen<TypeParam>(false, true);
  a.cu_seqlens_k = TensorRef{};
  EXPECT_TRUE(fails_with(a, {"k.rank is 3; k must have rank 4 (batch, seqlen_k, nheads_kv, head_dim) (rank 3 "
                             "(total_k, nheads_kv, head_dim) with cu_seqlens_k)"}));
}

TYPED_TEST(ValidateVarlen, CuSeqlensRankDtypeStrideAndSize) {
  auto& a = this->a;
  a.cu_seqlens_q = TensorRef::contiguous(fake_ptr(kCuQ), DType::kInt32, {4, 1});
  EXPECT_TRUE(fails_with(a, {"cu_seqlens_q.rank is 2; cu_seqlens_q must have rank 1 (batch + 1)"}));
  a = make_varlen<TypeParam>(true, true);
  a.cu_seqlens_k.dtype = DType::kFloat32;
  EXPECT_TRUE(fails_with(a, {"cu_seqlens_k.dtype is float32; cu_seqlens_k must be int32"}));
  a = make_varlen<TypeParam>(true, true);
  a.cu_seqlens_q.stride[0] = 2;
  EXPECT_TRUE(fails_with(a, {"cu_seqlens_q.stride[0] is 2; cu_seqlens_q must be contiguous (stride 1)"}));
  a = make_varlen<TypeParam>(true, true);
  a.cu_seqlens_k.shape[0] = -1;
  EXPECT_TRUE(fails_with(a, {"cu_seqlens_k.shape[0] (batch + 1) is -1; sizes must be >= 0"}));
  a = make_varlen<TypeParam>(true, true);
  a.cu_seqlens_q.shape[0] = a.cu_seqlens_k.shape[0] = 0;
  EXPECT_TRUE(fails_with(a, {"cu_seqlens_q.shape[0] is 0; cu_seqlens_q must have batch + 1 entries (at least 1)"}));
}

TYPED_TEST(ValidateVarlen, BatchIsTheSameOnBothSides) {
  auto& a = this->a;
  a.cu_seqlens_k.shape[0] = 5;
  EXPECT_TRUE(fails_with(a, {"cu_seqlens_k.shape[0] is 5 but cu_seqlens_q.shape[0] is 4; cu_seqlens_q and "
                             "cu_seqlens_k must both have batch + 1 entries"}));
  a = make_varlen<TypeParam>(true, false);
  for (TensorRef* t : k_side(a)) t->shape[0] = 2;
  EXPECT_TRUE(fails_with(a, {"k.shape[0] (batch) is 2 but cu_seqlens_q.shape[0] is 4; k must have batch = "
                             "cu_seqlens_q.shape[0] - 1 = 3 sequences"}));
  a = make_varlen<TypeParam>(false, true);
  for (TensorRef* t : q_side(a)) t->shape[0] = 4;
  a.lse.shape[0] = 4;
  EXPECT_TRUE(fails_with(a, {"q.shape[0] (batch) is 4 but cu_seqlens_k.shape[0] is 4; q must have batch = "
                             "cu_seqlens_k.shape[0] - 1 = 3 sequences"}));
}

TYPED_TEST(ValidateVarlen, Seqused) {
  auto& a = this->a;
  a = make_varlen<TypeParam>(true, true, true, false);
  a.seqused_q.shape[0] = 2;
  EXPECT_TRUE(fails_with(a, {"seqused_q.shape[0] is 2 but batch is 3 (cu_seqlens_q.shape[0] - 1); seqused_q must "
                             "have batch entries"}));
  a = make_varlen<TypeParam>(false, true, false, true);
  a.seqused_k.shape[0] = 4;
  EXPECT_TRUE(fails_with(a, {"seqused_k.shape[0] is 4 but batch is 3 (cu_seqlens_k.shape[0] - 1)"}));
  a = make_varlen<TypeParam>(false, false, false, true);
  a.seqused_k.shape[0] = 4;
  EXPECT_TRUE(fails_with(a, {"seqused_k.shape[0] is 4 but batch is 3 (q.shape[0]); seqused_k must have batch "
                             "entries"}));
  a = make_varlen<TypeParam>(false, false, true, false);
  a.seqused_q.dtype = DType::kFloat16;
  EXPECT_TRUE(fails_with(a, {"seqused_q.dtype is float16; seqused_q must be int32"}));
  a = make_varlen<TypeParam>(false, false, true, false);
  a.seqused_q = TensorRef::contiguous(fake_ptr(kUsedQ), DType::kInt32, {3, 1});
  EXPECT_TRUE(fails_with(a, {"seqused_q.rank is 2; seqused_q must have rank 1 (batch)"}));
  a = make_varlen<TypeParam>(false, false, true, false);
  a.seqused_q.stride[0] = 0;
  EXPECT_TRUE(fails_with(a, {"seqused_q.stride[0] is 0; seqused_q must be contiguous (stride 1)"}));
  a = make<TypeParam>(1, 128, 256, 8, 2, 128);  // one entry: its stride is never used
  a.seqused_q = int32_vector(kUsedQ, 1);
  a.seqused_q.stride[0] = 5;
  EXPECT_TRUE(problem(a).varlen);
}

TYPED_TEST(ValidateVarlen, MaxSeqlen) {
  auto& a = this->a;
  a.max_seqlen_q = -1;
  EXPECT_TRUE(fails_with(a, {"max_seqlen_q is -1; it must be >= 0"}));
  a = make_varlen<TypeParam>(true, true);
  a.max_seqlen_k = 501;
  EXPECT_TRUE(fails_with(a, {"max_seqlen_k is 501 but k.shape[0] (total_k) is 500; no sequence is longer than the "
                             "packed length"}));
  a.max_seqlen_k = 500;
  EXPECT_EQ(problem(a).seqlen_k, 500);
  // beyond kMaxSeqlen: 2^30 + 2 packed keys
  a = make_varlen<TypeParam>(true, true);
  for (TensorRef* t : k_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {(int64_t{1} << 30) + 2, 2, 128});
  a.max_seqlen_k = (1 << 30) + 1;
  EXPECT_TRUE(fails_with(a, {"max_seqlen_k is 1073741825; it must be at most 1073741824 (2^30)"}));
  a.max_seqlen_k = 1 << 30;
  EXPECT_EQ(problem(a).seqlen_k, 1 << 30);
}

// Rows past int32: a packed dim 0 by the size rule, a side not packed (batch x seqlen) by name.
TYPED_TEST(ValidateVarlen, RowsFitInInt32) {
  auto& a = this->a;
  for (TensorRef* t : q_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {int64_t{1} << 31, 8, 128});
  a.lse = TensorRef::contiguous(a.lse.data, DType::kFloat32, {8, int64_t{1} << 31});
  EXPECT_TRUE(fails_with(a, {"q.shape[0] (total_q) is 2147483648; sizes must fit in int32"}));
  a = make<TypeParam>(int64_t{1} << 16, int64_t{1} << 16, 64, 1, 1, 64);
  a.seqused_k = int32_vector(kUsedK, int64_t{1} << 16);
  EXPECT_TRUE(fails_with(a, {"q has q.shape[0] (batch) x q.shape[1] (seqlen_q) = 65536 x 65536 = 4294967296 rows; "
                             "with cu_seqlens or seqused the rows of each side must fit in int32"}));
  a.seqused_k = TensorRef{};  // fixed lengths: no such bound
  EXPECT_NO_THROW(problem(a));
}

// (total / 64 + batch) x nheads tiles of a packed side at most 2^30: query tiles in both passes,
// key tiles in the backward.
TYPED_TEST(ValidateVarlen, TileCounts) {
  auto& a = this->a;
  auto shape = [&](int64_t total_q, int64_t total_k) {
    a = make_varlen<TypeParam>(true, true);
    for (TensorRef* t : q_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {total_q, 64, 64});
    for (TensorRef* t : k_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {total_k, 1, 64});
    a.lse = TensorRef::contiguous(a.lse.data, DType::kFloat32, {64, total_q});
    a.max_seqlen_q = a.max_seqlen_k = 64;
  };
  shape((int64_t{1} << 30) - 3 * 64, 64);  // (2^24 - 3 + 3) x 64 = 2^30 query tiles
  EXPECT_NO_THROW(problem(a));
  shape(int64_t{1} << 30, 64);  // (2^24 + 3) x 64
  EXPECT_TRUE(fails_with(a, {"q.shape[0] (total_q) is 1073741824 with nheads 64 and batch 3: (total_q / 64 + batch) "
                             "x nheads = (16777216 + 3) x 64 query tiles, more than the 1073741824 (2^30)"}));
  shape(64, int64_t{1} << 30);
  if (this->kFwd) {
    EXPECT_NO_THROW(problem(a));  // the forward counts query tiles only
  } else {
    EXPECT_TRUE(fails_with(a, {"k.shape[0] (total_k) is 1073741824 with nheads 64 and batch 3: (total_k / 64 + batch) "
                               "x nheads = (16777216 + 3) x 64 key tiles"}));
  }
}

TYPED_TEST(ValidateVarlen, PackedShapes) {
  auto& a = this->a;
  a.v.shape[0] = 499;
  EXPECT_TRUE(fails_with(a, {"v.shape[0] (total_k) is 499 but k.shape[0] (total_k) is 500; k and v must have the "
                             "same shape"}));
  a = make_varlen<TypeParam>(true, true);
  a.out.shape[1] = 4;
  EXPECT_TRUE(fails_with(a, {"out.shape[1] (nheads) is 4 but q.shape[1] (nheads) is 8; out must have the same "
                             "shape as q"}));
  a = make_varlen<TypeParam>(true, true);
  for (TensorRef* t : k_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {500, 2, 64});
  EXPECT_TRUE(fails_with(a, {"k.shape[2] (head_dim) is 64 but q.shape[2] (head_dim) is 128"}));
  a = make_varlen<TypeParam>(true, false);  // head_dim across layouts
  for (TensorRef* t : k_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {3, 256, 2, 64});
  EXPECT_TRUE(fails_with(a, {"k.shape[3] (head_dim) is 64 but q.shape[2] (head_dim) is 128"}));
  a = make_varlen<TypeParam>(true, true);
  for (TensorRef* t : q_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {300, 6, 128});
  for (TensorRef* t : k_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {500, 4, 128});
  a.lse = TensorRef::contiguous(a.lse.data, DType::kFloat32, {6, 300});
  EXPECT_TRUE(fails_with(a, {"q.shape[1] (nheads) is 6 and k.shape[1] (nheads_kv) is 4", "multiple"}));
  a = make_varlen<TypeParam>(true, true);
  for (TensorRef* t : q_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {300, 8, 96});
  for (TensorRef* t : k_side(a)) *t = TensorRef::contiguous(t->data, t->dtype, {500, 2, 96});
  EXPECT_TRUE(fails_with(a, {"q.shape[2] (head_dim) is 96; supported head dims are 64, 128, 256"}));
}

TYPED_TEST(ValidateVarlen, PackedLse) {
  auto& a = this->a;
  a.lse.shape[1] = 299;
  EXPECT_TRUE(fails_with(a, {"lse.shape[1] (total_q) is 299 but q.shape[0] (total_q) is 300; with cu_seqlens_q, "
                             "lse must be (nheads, total_q)"}));
  a = make_varlen<TypeParam>(true, true);
  a.lse.shape[0] = 2;
  EXPECT_TRUE(fails_with(a, {"lse.shape[0] (nheads) is 2 but q.shape[1] (nheads) is 8"}));
  a = make_varlen<TypeParam>(true, true);
  a.lse.stride[1] = 2;
  EXPECT_TRUE(fails_with(a, {"lse.stride[1] is 2", "stride 1"}));
  a = make_varlen<TypeParam>(true, true);
  a.lse.stride[0] = 301;  // lse's other strides need only be positive
  EXPECT_NO_THROW(problem(a));
}

TYPED_TEST(ValidateVarlen, PackedStrides) {
  auto& a = this->a;
  a.q.stride[2] = 2;
  EXPECT_TRUE(fails_with(a, {"q.stride[2] is 2", "stride 1"}));
  a = make_varlen<TypeParam>(true, true);
  a.k.stride[0] = 260;
  EXPECT_TRUE(fails_with(a, {"k.stride[0] (total_k) is 260 elements (520 bytes)", "multiples of 8 elements"}));
  a = make_varlen<TypeParam>(true, true);
  for (TensorRef* t : k_side(a)) t->stride[0] = 3 * 2 * 128;  // rows of a packed kv buffer
  EXPECT_NO_THROW(problem(a));
}

TYPED_TEST(ValidateVarlen, Pointers) {
  auto& a = this->a;
  a.cu_seqlens_q.data = nullptr;
  EXPECT_TRUE(fails_with(a, {"cu_seqlens_q.data is null; cu_seqlens_q needs a device pointer"}));
  a = make_varlen<TypeParam>(true, true, true, true);
  a.cu_seqlens_k.data = fake_ptr(kCuK + 2);
  EXPECT_TRUE(fails_with(a, {"cu_seqlens_k.data is 0xb10002, not 4-byte aligned"}));
  a = make_varlen<TypeParam>(true, true, true, true);
  a.seqused_q.data = fake_ptr(kUsedQ + 4);  // 4 bytes is enough
  EXPECT_NO_THROW(problem(a));
  g_host = a.seqused_k.data;
  EXPECT_TRUE(fails_with(a, {"seqused_k.data points to host memory"}));
  g_host = nullptr;
  g_unknown = a.cu_seqlens_q.data;
  EXPECT_TRUE(fails_with(a, {"cu_seqlens_q.data (0xb00000) is not a pointer the CUDA runtime knows"}));
}

// A bound that excludes nothing in the longest sequences excludes nothing in any: windows are
// normalized with max_seqlen_q / max_seqlen_k.
TYPED_TEST(ValidateVarlen, WindowIsNormalizedWithTheLongestLengths) {
  auto& a = this->a;  // max_seqlen_q 128, max_seqlen_k 256 (totals 300, 500)
  a.causal = false;
  a.window_left = 255;
  a.window_right = 127;
  auto p = problem(a);
  EXPECT_EQ(p.window_left, -1);
  EXPECT_EQ(p.window_right, -1);
  a.window_left = 254;
  a.window_right = 126;
  p = problem(a);
  EXPECT_EQ(p.window_left, 254);
  EXPECT_EQ(p.window_right, 126);
}

TEST_F(ValidateFwd, VarlenIsFor16BitInputs) {
  a = make_varlen<FwdArgs>(true, true);
  for (TensorRef* t : {&a.q, &a.k, &a.v}) t->dtype = DType::kFloat8E4M3;
  EXPECT_TRUE(fails_with(a, {"cu_seqlens_q is given but q.dtype is float8_e4m3; variable-length batches "
                             "(cu_seqlens, seqused) are built for float16 and bfloat16"}));
  a = make_args(3, 128, 256, 8, 2, 128);
  for (TensorRef* t : {&a.q, &a.k, &a.v}) t->dtype = DType::kFloat8E4M3;
  a.seqused_k = int32_vector(kUsedK, 3);
  EXPECT_TRUE(fails_with(a, {"seqused_k is given but q.dtype is float8_e4m3"}));
}

TEST_F(ValidateFwd, VarlenLseIsOptional) {
  a = make_varlen<FwdArgs>(true, false);
  a.lse = TensorRef{};
  EXPECT_FALSE(problem(a).write_lse);
  EXPECT_EQ(g_calls, 5);  // q, k, v, out, cu_seqlens_q
}

TEST_F(ValidateFwd, VarlenWithNoQueriesSkipsPointerChecks) {
  a = make_varlen<FwdArgs>(true, true);
  for (TensorRef* t : q_side(a)) *t = TensorRef::contiguous(nullptr, t->dtype, {0, 8, 128});
  a.lse = TensorRef::contiguous(nullptr, DType::kFloat32, {8, 0});
  a.max_seqlen_q = 0;
  a.cu_seqlens_q.data = nullptr;
  EXPECT_EQ(problem(a).seqlen_q, 0);
  EXPECT_EQ(g_calls, 0);
}

TEST_F(ValidateBwd, VarlenGradientsFollowTheirSide) {
  a = make_varlen<BwdArgs>(true, true);
  a.dq.shape[0] = 301;
  EXPECT_TRUE(fails_with(a, {"dq.shape[0] (total_q) is 301 but q.shape[0] (total_q) is 300; dq must have the same "
                             "shape as q"}));
  a = make_varlen<BwdArgs>(true, true);
  a.dk.rank = 4;
  EXPECT_TRUE(fails_with(a, {"dk.rank is 4; with cu_seqlens_k, dk must have rank 3 (total_k, nheads_kv, head_dim)"}));
  a = make_varlen<BwdArgs>(true, true);
  a.dout.stride[1] = 4;
  EXPECT_TRUE(fails_with(a, {"dout.stride[1] (nheads) is 4 elements (8 bytes)"}));
}

// ---- variable-length batches: the values (check_seqlen_values, on host arrays) -----------------

using flash3::detail::check_seqlen_values;
using flash3::detail::SeqlenSide;

// check_seqlen_values throws flash3::Error whose message starts with op and contains parts.
::testing::AssertionResult values_fail(const char* op, int batch, const SeqlenSide& q, const SeqlenSide& k,
                                       std::initializer_list<std::string> parts) {
  return flash3::testing::throws_error([&] { check_seqlen_values(op, batch, q, k); }, op, parts);
}

// 3 sequences: queries 100, 0, 200 rows of 300 (max 200); keys 0, 250, 250 of 500 (max 250).
struct GoodValues {
  std::vector<int> cu_q = {0, 100, 100, 300}, cu_k = {0, 0, 250, 500};
  std::vector<int> used_q = {0, 0, 150}, used_k = {0, 250, 1};
  SeqlenSide q() const { return SeqlenSide{cu_q.data(), used_q.data(), 300, 200}; }
  SeqlenSide k() const { return SeqlenSide{cu_k.data(), used_k.data(), 500, 250}; }
};

TEST(SeqlenValues, AcceptsValidValues) {
  GoodValues v;
  EXPECT_NO_THROW(check_seqlen_values("flash3::fwd: ", 3, v.q(), v.k()));
  // max_seqlen above every length; seqused at the lengths
  v.used_q = {100, 0, 200};
  EXPECT_NO_THROW(check_seqlen_values("flash3::fwd: ", 3, SeqlenSide{v.cu_q.data(), v.used_q.data(), 300, 1000},
                                      v.k()));
  // no seqused; one side not packed (seqused up to its dim 1)
  EXPECT_NO_THROW(check_seqlen_values("flash3::fwd: ", 3, SeqlenSide{v.cu_q.data(), nullptr, 300, 200},
                                      SeqlenSide{nullptr, v.used_k.data(), 768, 256}));
  // every sequence empty, seqused 0
  const std::vector<int> zeros = {0, 0, 0, 0};
  EXPECT_NO_THROW(check_seqlen_values("flash3::bwd: ", 3, SeqlenSide{zeros.data(), zeros.data(), 0, 0},
                                      SeqlenSide{zeros.data(), zeros.data(), 0, 0}));
  // batch 0: cu_seqlens {0}
  EXPECT_NO_THROW(check_seqlen_values("flash3::fwd: ", 0, SeqlenSide{zeros.data(), nullptr, 0, 0},
                                      SeqlenSide{zeros.data(), nullptr, 0, 0}));
  // nothing given
  EXPECT_NO_THROW(check_seqlen_values("flash3::fwd: ", 3, SeqlenSide{}, SeqlenSide{}));
}

TEST(SeqlenValues, CuSeqlensStartsAtZero) {
  GoodValues v;
  v.cu_q[0] = 5;
  EXPECT_TRUE(values_fail("flash3::fwd: ", 3, v.q(), v.k(), {"cu_seqlens_q[0] is 5; cu_seqlens_q must start at 0"}));
  v = GoodValues{};
  v.cu_k[0] = -1;
  EXPECT_TRUE(values_fail("flash3::bwd: ", 3, v.q(), v.k(), {"cu_seqlens_k[0] is -1; cu_seqlens_k must start at 0"}));
}

TEST(SeqlenValues, CuSeqlensNonDecreasing) {
  GoodValues v;
  v.cu_q = {0, 120, 100, 300};
  EXPECT_TRUE(values_fail("flash3::fwd: ", 3, v.q(), v.k(),
                          {"flash3::fwd: cu_seqlens_q[2] is 100, below cu_seqlens_q[1] = 120; cu_seqlens must be "
                           "non-decreasing"}));
  v = GoodValues{};
  v.cu_k = {0, 0, 600, 500};
  EXPECT_TRUE(values_fail("flash3::bwd: ", 3, v.q(), v.k(), {"cu_seqlens_k[3] is 500, below cu_seqlens_k[2] = 600"}));
}

TEST(SeqlenValues, CuSeqlensEndsAtThePackedLength) {
  GoodValues v;
  v.cu_k[3] = 499;
  EXPECT_TRUE(values_fail("flash3::fwd: ", 3, v.q(), v.k(),
                          {"cu_seqlens_k[3] is 499 but k.shape[0] (total_k) is 500; the last entry of cu_seqlens_k "
                           "must be the packed length"}));
  v = GoodValues{};
  EXPECT_TRUE(values_fail("flash3::fwd: ", 3, SeqlenSide{v.cu_q.data(), nullptr, 301, 200}, v.k(),
                          {"cu_seqlens_q[3] is 300 but q.shape[0] (total_q) is 301"}));
}

TEST(SeqlenValues, SequenceLongerThanMaxSeqlen) {
  GoodValues v;
  EXPECT_TRUE(values_fail("flash3::fwd: ", 3, SeqlenSide{v.cu_q.data(), nullptr, 300, 199}, v.k(),
                          {"cu_seqlens_q[3] - cu_seqlens_q[2] = 300 - 100 = 200 (the length of sequence 2) but "
                           "max_seqlen_q is 199; max_seqlen_q must be at least every sequence's length"}));
  EXPECT_TRUE(values_fail("flash3::bwd: ", 3, v.q(), SeqlenSide{v.cu_k.data(), nullptr, 500, 0},
                          {"cu_seqlens_k[2] - cu_seqlens_k[1] = 250 - 0 = 250 (the length of sequence 1) but "
                           "max_seqlen_k is 0"}));
}

TEST(SeqlenValues, SequsedNegative) {
  GoodValues v;
  v.used_k[1] = -1;
  EXPECT_TRUE(values_fail("flash3::fwd: ", 3, v.q(), v.k(), {"seqused_k[1] is -1; seqused must be >= 0"}));
}

TEST(SeqlenValues, SequsedBeyondTheSequence) {
  GoodValues v;
  v.used_q[0] = 101;
  EXPECT_TRUE(values_fail("flash3::fwd: ", 3, v.q(), v.k(),
                          {"seqused_q[0] is 101 but sequence 0 has length cu_seqlens_q[1] - cu_seqlens_q[0] = 100; "
                           "seqused must be at most the sequence's length"}));
  v = GoodValues{};
  v.used_q[1] = 1;  // a sequence of length 0
  EXPECT_TRUE(values_fail("flash3::fwd: ", 3, v.q(), v.k(), {"seqused_q[1] is 1 but sequence 1 has length"}));
  v = GoodValues{};  // without cu_seqlens: at most the dim 1
  EXPECT_TRUE(values_fail("flash3::bwd: ", 3, v.q(), SeqlenSide{nullptr, v.used_k.data(), 3 * 249, 249},
                          {"seqused_k[1] is 250 but k.shape[1] (seqlen_k) is 249; seqused must be at most the "
                           "sequence's length"}));
}

TEST(SeqlenValues, LengthsNearInt32DoNotOverflow) {
  const int big = std::numeric_limits<int>::max();
  const std::vector<int> cu = {0, big}, used = {big};
  EXPECT_NO_THROW(check_seqlen_values("flash3::fwd: ", 1, SeqlenSide{cu.data(), used.data(), big, big},
                                      SeqlenSide{cu.data(), used.data(), big, big}));
  EXPECT_TRUE(values_fail("flash3::fwd: ", 1, SeqlenSide{cu.data(), used.data(), big, big - 1}, SeqlenSide{},
                          {"= 2147483647 (the length of sequence 0) but max_seqlen_q is 2147483646"}));
}

// check_seqlens_on_device does nothing (no CUDA call) when there is nothing to check: fixed
// lengths, check_seqlens off, batch 0, no queries (forward).
TEST(SeqlenValues, DeviceCheckSkipsWhenNothingToCheck) {
  FwdArgs f = make_varlen<FwdArgs>(true, true);  // fake device pointers: a copy would fail
  flash3::FwdProblem fp = problem(f);
  f.check_seqlens = false;
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(f, fp));
  f.check_seqlens = true;
  flash3::FwdProblem empty = fp;
  empty.batch = 0;
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(f, empty));
  empty = fp;
  empty.seqlen_q = 0;
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(f, empty));
  empty = fp;
  empty.varlen = false;
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(f, empty));
  BwdArgs b = make_varlen<BwdArgs>(true, true);
  flash3::BwdProblem bp = problem(b);
  b.check_seqlens = false;
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(b, bp));
  b.check_seqlens = true;
  bp.batch = 0;
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(b, bp));
}

// The copy of check_seqlens_on_device on a GPU (skipped without one): real device arrays on a
// stream; skipped when check_seqlens is off or the stream is being captured.
TEST(SeqlenValues, DeviceCheckCopiesTheValues) {
  std::string why_not;
  if (!flash3::hopper_available(&why_not)) GTEST_SKIP() << why_not;
  struct Device {
    int* ptr = nullptr;
    explicit Device(const std::vector<int>& v) {
      if (cudaMalloc(reinterpret_cast<void**>(&ptr), v.size() * sizeof(int)) == cudaSuccess) {
        cudaMemcpy(ptr, v.data(), v.size() * sizeof(int), cudaMemcpyHostToDevice);
      }
    }
    ~Device() { cudaFree(ptr); }
    void set(const std::vector<int>& v) { cudaMemcpy(ptr, v.data(), v.size() * sizeof(int), cudaMemcpyHostToDevice); }
  };
  const GoodValues v;  // 3 sequences: 300 query rows (max 200), 500 keys (max 250)
  Device cu_q(v.cu_q), cu_k(v.cu_k), used_q(v.used_q), used_k(v.used_k);
  ASSERT_TRUE(cu_q.ptr && cu_k.ptr && used_q.ptr && used_k.ptr);
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  FwdArgs f = make_varlen<FwdArgs>(true, true, true, true);
  f.max_seqlen_q = 200;
  f.max_seqlen_k = 250;
  f.cu_seqlens_q.data = cu_q.ptr;
  f.cu_seqlens_k.data = cu_k.ptr;
  f.seqused_q.data = used_q.ptr;
  f.seqused_k.data = used_k.ptr;
  f.stream = stream;
  const flash3::FwdProblem fp = problem(f);
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(f, fp));
  cu_q.set({0, 120, 100, 300});
  EXPECT_TRUE(flash3::testing::throws_error([&] { flash3::detail::check_seqlens_on_device(f, fp); }, "flash3::fwd: ",
                                            {"cu_seqlens_q[2] is 100, below cu_seqlens_q[1] = 120"}));
  f.check_seqlens = false;
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(f, fp));
  f.check_seqlens = true;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(f, fp));  // captured: not checked
  cudaGraph_t graph = nullptr;
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  if (graph != nullptr) cudaGraphDestroy(graph);
  cu_q.set(v.cu_q);

  BwdArgs b = make_varlen<BwdArgs>(true, true, true, true);
  b.max_seqlen_q = 200;
  b.max_seqlen_k = 250;
  b.cu_seqlens_q.data = cu_q.ptr;
  b.cu_seqlens_k.data = cu_k.ptr;
  b.seqused_q.data = used_q.ptr;
  b.seqused_k.data = used_k.ptr;
  b.stream = stream;
  const flash3::BwdProblem bp = problem(b);
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(b, bp));
  used_k.set({0, 251, 1});
  EXPECT_TRUE(flash3::testing::throws_error([&] { flash3::detail::check_seqlens_on_device(b, bp); }, "flash3::bwd: ",
                                            {"seqused_k[1] is 251 but sequence 1 has length"}));
  b.seqused_k = TensorRef{};  // not given: not copied
  const flash3::BwdProblem bp2 = problem(b);
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(b, bp2));
  b.stream = nullptr;  // the legacy default stream
  EXPECT_NO_THROW(flash3::detail::check_seqlens_on_device(b, bp2));
  EXPECT_EQ(cudaStreamDestroy(stream), cudaSuccess);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// ---- the C ABI -------------------------------------------------------------------------------
// Failures found before any pointer is inspected, so these run without a GPU too.

// flash3_tensor has TensorRef's layout (static_assert in src/c_api.cpp).
flash3_tensor c_tensor(const TensorRef& t) {
  flash3_tensor c;
  std::memcpy(&c, &t, sizeof c);
  return c;
}
flash3_fwd_args c_fwd_args(const FwdArgs& a) {
  flash3_fwd_args c;
  flash3_fwd_args_init(&c);
  c.q = c_tensor(a.q);
  c.k = c_tensor(a.k);
  c.v = c_tensor(a.v);
  c.out = c_tensor(a.out);
  c.lse = c_tensor(a.lse);
  c.softmax_scale = a.softmax_scale;
  c.causal = a.causal;
  c.window = a.window_left != -1 || a.window_right != -1;
  c.window_left = a.window_left;
  c.window_right = a.window_right;
  c.softcap = a.softcap;
  c.cu_seqlens_q = c_tensor(a.cu_seqlens_q);
  c.cu_seqlens_k = c_tensor(a.cu_seqlens_k);
  c.seqused_q = c_tensor(a.seqused_q);
  c.seqused_k = c_tensor(a.seqused_k);
  c.max_seqlen_q = a.max_seqlen_q;
  c.max_seqlen_k = a.max_seqlen_k;
  c.no_seqlens_check = !a.check_seqlens;
  return c;
}
flash3_bwd_args c_bwd_args(const BwdArgs& a) {
  flash3_bwd_args c;
  flash3_bwd_args_init(&c);
  c.q = c_tensor(a.q);
  c.k = c_tensor(a.k);
  c.v = c_tensor(a.v);
  c.out = c_tensor(a.out);
  c.dout = c_tensor(a.dout);
  c.lse = c_tensor(a.lse);
  c.dq = c_tensor(a.dq);
  c.dk = c_tensor(a.dk);
  c.dv = c_tensor(a.dv);
  c.softmax_scale = a.softmax_scale;
  c.causal = a.causal;
  c.deterministic = a.deterministic;
  c.workspace = a.workspace;
  c.workspace_bytes = a.workspace_bytes;
  c.window = a.window_left != -1 || a.window_right != -1;
  c.window_left = a.window_left;
  c.window_right = a.window_right;
  c.softcap = a.softcap;
  c.cu_seqlens_q = c_tensor(a.cu_seqlens_q);
  c.cu_seqlens_k = c_tensor(a.cu_seqlens_k);
  c.seqused_q = c_tensor(a.seqused_q);
  c.seqused_k = c_tensor(a.seqused_k);
  c.max_seqlen_q = a.max_seqlen_q;
  c.max_seqlen_k = a.max_seqlen_k;
  c.no_seqlens_check = !a.check_seqlens;
  return c;
}
int c_bwd(const BwdArgs& a, char* err, int err_len) {
  const flash3_bwd_args c = c_bwd_args(a);
  return flash3_bwd(&c, err, err_len);
}
int c_bwd_workspace_size(const BwdArgs& a, uint64_t* bytes, char* err, int err_len) {
  const flash3_bwd_args c = c_bwd_args(a);
  return flash3_bwd_workspace_size(&c, bytes, err, err_len);
}

TEST(CApi, InitSetsTheSizeAndZeroDefaults) {
  flash3_fwd_args f;
  std::memset(&f, 0xAB, sizeof f);
  flash3_fwd_args_init(&f);
  EXPECT_EQ(f.struct_size, sizeof(flash3_fwd_args));
  EXPECT_EQ(f.struct_size, FLASH3_FWD_ARGS_SIZE_V4);
  EXPECT_EQ(f.window, 0);  // no window
  EXPECT_EQ(f.cu_seqlens_q.data, nullptr);  // no variable lengths, values checked
  EXPECT_EQ(f.cu_seqlens_q.rank, 0);
  EXPECT_EQ(f.seqused_k.rank, 0);
  EXPECT_EQ(f.max_seqlen_q, 0);
  EXPECT_EQ(f.no_seqlens_check, 0);
  EXPECT_EQ(f.reserved_v4, 0u);
  EXPECT_EQ(f.softcap, 0.0f);
  EXPECT_EQ(f.q.data, nullptr);
  EXPECT_EQ(f.softmax_scale, 0.0f);
  EXPECT_EQ(f.stream, nullptr);
  flash3_bwd_args b;
  std::memset(&b, 0xCD, sizeof b);
  flash3_bwd_args_init(&b);
  EXPECT_EQ(b.struct_size, sizeof(flash3_bwd_args));
  EXPECT_EQ(b.struct_size, FLASH3_BWD_ARGS_SIZE_V3);
  EXPECT_EQ(b.window, 0);
  EXPECT_EQ(b.cu_seqlens_k.data, nullptr);
  EXPECT_EQ(b.seqused_q.rank, 0);
  EXPECT_EQ(b.max_seqlen_k, 0);
  EXPECT_EQ(b.no_seqlens_check, 0);
  EXPECT_EQ(b.reserved_v3, 0u);
  EXPECT_EQ(b.workspace_bytes, 0u);
}

TEST(CApi, FwdReportsInvalidArguments) {
  FwdArgs a = make_args(2, 128, 256, 8, 2, 128);
  a.v.shape[3] = 64;
  flash3_fwd_args c = c_fwd_args(a);
  char err[256];
  EXPECT_EQ(flash3_fwd(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "flash3::fwd: v.shape[3] (head_dim) is 64 but k.shape[3] (head_dim) is 128; k and v must "
                    "have the same shape");
  flash3_fwd_args_init(&c);  // every tensor NULL (rank 0)
  EXPECT_EQ(flash3_fwd(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::fwd: q.rank is 0", 0), 0u) << err;
  c = c_fwd_args(make_args(0, 128, 256, 8, 2, 128, /*with_data=*/false));
  c.reserved = 1;
  EXPECT_EQ(flash3_fwd(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "flash3::fwd: args->reserved is 1; it must be 0");
}

TEST(CApi, FwdOfAnEmptyBatchIsANoOp) {  // validation passes with no pointer to inspect
  const flash3_fwd_args c = c_fwd_args(make_args(0, 128, 256, 8, 2, 128, /*with_data=*/false));
  char err[64] = "unchanged";
  EXPECT_EQ(flash3_fwd(&c, err, sizeof err), FLASH3_OK) << err;
  EXPECT_STREQ(err, "");
}

TEST(CApi, NullArgsAreRejected) {
  char err[256];
  uint64_t bytes = 7;
  EXPECT_EQ(flash3_fwd(nullptr, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "flash3::fwd: args is null; pass a flash3_fwd_args; set it up with flash3_fwd_args_init");
  EXPECT_EQ(flash3_bwd(nullptr, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "flash3::bwd: args is null; pass a flash3_bwd_args; set it up with flash3_bwd_args_init");
  EXPECT_EQ(flash3_bwd_workspace_size(nullptr, &bytes, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::bwd: args is null", 0), 0u) << err;
  EXPECT_EQ(bytes, 7u);
}

TEST(CApi, StructSizeBelowTheFirstVersionIsRejected) {
  flash3_fwd_args f = c_fwd_args(make_args(0, 128, 256, 8, 2, 128, /*with_data=*/false));
  flash3_bwd_args b = c_bwd_args(make_bwd_args(0, 128, 256, 8, 2, 128, /*with_data=*/false));
  char err[256];
  for (uint32_t size : {0u, 4u, 16u, FLASH3_FWD_ARGS_SIZE_V1 - 1}) {
    f.struct_size = size;
    EXPECT_EQ(flash3_fwd(&f, err, sizeof err), FLASH3_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(err), "flash3::fwd: args->struct_size is " + std::to_string(size) +
                                    "; it must be at least " + std::to_string(FLASH3_FWD_ARGS_SIZE_V1) +
                                    " (sizeof(flash3_fwd_args) of the first version); set it up with "
                                    "flash3_fwd_args_init");
  }
  b.struct_size = FLASH3_BWD_ARGS_SIZE_V1 - 8;
  EXPECT_EQ(flash3_bwd(&b, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::bwd: args->struct_size is " + std::to_string(b.struct_size) +
                                       "; it must be at least " + std::to_string(FLASH3_BWD_ARGS_SIZE_V1),
                                   0),
            0u)
      << err;
  uint64_t bytes = 7;
  EXPECT_EQ(flash3_bwd_workspace_size(&b, &bytes, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err).find("struct_size"), std::string::npos) << err;
  EXPECT_EQ(bytes, 7u);
}

// A caller of the first version: the library reads its struct_size bytes and nothing past them
// (here bytes of 0xFF that a later field would occupy).
TEST(CApi, FirstVersionStructIsReadToItsSizeOnly) {
  const flash3_fwd_args f = c_fwd_args(make_args(0, 128, 256, 8, 2, 128, /*with_data=*/false));
  std::vector<unsigned char> buf(FLASH3_FWD_ARGS_SIZE_V1 + 64, 0xFF);
  std::memcpy(buf.data(), &f, FLASH3_FWD_ARGS_SIZE_V1);
  const uint32_t v1 = FLASH3_FWD_ARGS_SIZE_V1;
  std::memcpy(buf.data(), &v1, sizeof v1);  // a first-version caller's struct_size
  char err[256];
  EXPECT_EQ(flash3_fwd(reinterpret_cast<const flash3_fwd_args*>(buf.data()), err, sizeof err), FLASH3_OK) << err;
  const flash3_bwd_args b = c_bwd_args(make_bwd_args(0, 128, 256, 8, 2, 128, /*with_data=*/false));
  std::vector<unsigned char> bbuf(FLASH3_BWD_ARGS_SIZE_V1 + 64, 0xFF);
  std::memcpy(bbuf.data(), &b, FLASH3_BWD_ARGS_SIZE_V1);
  const uint32_t bv1 = FLASH3_BWD_ARGS_SIZE_V1;
  std::memcpy(bbuf.data(), &bv1, sizeof bv1);  // a first-version caller's struct_size
  const auto* pb = reinterpret_cast<const flash3_bwd_args*>(bbuf.data());
  EXPECT_EQ(flash3_bwd(pb, err, sizeof err), FLASH3_OK) << err;
  uint64_t bytes = 7;
  EXPECT_EQ(flash3_bwd_workspace_size(pb, &bytes, err, sizeof err), FLASH3_OK) << err;
  EXPECT_EQ(bytes, 0u);
  // the fields are read: a first-version struct with a bad tensor is still checked
  std::memcpy(buf.data(), &f, FLASH3_FWD_ARGS_SIZE_V1);
  std::memcpy(buf.data(), &v1, sizeof v1);
  reinterpret_cast<flash3_fwd_args*>(buf.data())->k.shape[3] = 64;
  EXPECT_EQ(flash3_fwd(reinterpret_cast<const flash3_fwd_args*>(buf.data()), err, sizeof err),
            FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::fwd: k.shape[3] (head_dim) is 64", 0), 0u) << err;
}

// The window and softcap fields (fwd v3, bwd v2): read where `window` is set, checked by name; a
// v2 forward struct (without them) has no window.
TEST(CApi, WindowAndSoftcapFields) {
  flash3_fwd_args f = c_fwd_args(make_args(0, 128, 256, 8, 2, 128, /*with_data=*/false));
  char err[256];
  f.window_left = -5;  // ignored: window is 0
  EXPECT_EQ(flash3_fwd(&f, err, sizeof err), FLASH3_OK) << err;
  f.window = 1;
  EXPECT_EQ(flash3_fwd(&f, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::fwd: window_left is -5", 0), 0u) << err;
  f.window_left = 3;
  f.window_right = -1;
  f.softcap = -2.0f;
  EXPECT_EQ(flash3_fwd(&f, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::fwd: softcap is -2", 0), 0u) << err;
  f.struct_size = FLASH3_FWD_ARGS_SIZE_V2;  // an older caller: the fields are not there
  EXPECT_EQ(flash3_fwd(&f, err, sizeof err), FLASH3_OK) << err;
  flash3_bwd_args b = c_bwd_args(make_bwd_args(0, 128, 256, 8, 2, 128, /*with_data=*/false));
  b.window = 1;
  b.window_left = 0;
  b.window_right = -3;
  EXPECT_EQ(flash3_bwd(&b, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::bwd: window_right is -3", 0), 0u) << err;
  b.struct_size = FLASH3_BWD_ARGS_SIZE_V1;
  EXPECT_EQ(flash3_bwd(&b, err, sizeof err), FLASH3_OK) << err;
}

// Each version's size is the end of its last field, the structs have no padding, and the later
// fields start where the earlier version ends (LP64 sizes: what the Python binding packs).
TEST(CApi, VersionSizes) {
  EXPECT_EQ(FLASH3_FWD_ARGS_SIZE_V2, 664u);
  EXPECT_EQ(FLASH3_FWD_ARGS_SIZE_V3, 680u);
  EXPECT_EQ(offsetof(flash3_fwd_args, cu_seqlens_q), FLASH3_FWD_ARGS_SIZE_V3);
  EXPECT_EQ(offsetof(flash3_fwd_args, max_seqlen_q), FLASH3_FWD_ARGS_SIZE_V3 + 4 * sizeof(flash3_tensor));
  EXPECT_EQ(FLASH3_FWD_ARGS_SIZE_V4, FLASH3_FWD_ARGS_SIZE_V3 + 4 * sizeof(flash3_tensor) + 16);
  EXPECT_EQ(FLASH3_FWD_ARGS_SIZE_V4, 1016u);
  EXPECT_EQ(sizeof(flash3_fwd_args), FLASH3_FWD_ARGS_SIZE_V4);
  EXPECT_EQ(FLASH3_BWD_ARGS_SIZE_V2, 776u);
  EXPECT_EQ(offsetof(flash3_bwd_args, cu_seqlens_q), FLASH3_BWD_ARGS_SIZE_V2);
  EXPECT_EQ(offsetof(flash3_bwd_args, max_seqlen_q), FLASH3_BWD_ARGS_SIZE_V2 + 4 * sizeof(flash3_tensor));
  EXPECT_EQ(FLASH3_BWD_ARGS_SIZE_V3, FLASH3_BWD_ARGS_SIZE_V2 + 4 * sizeof(flash3_tensor) + 16);
  EXPECT_EQ(FLASH3_BWD_ARGS_SIZE_V3, 1112u);
  EXPECT_EQ(sizeof(flash3_bwd_args), FLASH3_BWD_ARGS_SIZE_V3);
}

// The variable-length fields (fwd v4, bwd v3) are read and checked by name; an older struct
// (struct_size of the previous version) has none, whatever bytes follow it.
TEST(CApi, VarlenFields) {
  char err[512];
  flash3_fwd_args f = c_fwd_args(empty_varlen<FwdArgs>());
  EXPECT_EQ(flash3_fwd(&f, err, sizeof err), FLASH3_OK) << err;  // batch 0: nothing to read or copy
  f.no_seqlens_check = 1;
  EXPECT_EQ(flash3_fwd(&f, err, sizeof err), FLASH3_OK) << err;
  auto fwd_fails = [&](const flash3_fwd_args& c, const std::string& start) {
    EXPECT_EQ(flash3_fwd(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(err).rfind(start, 0), 0u) << err;
  };
  f.max_seqlen_q = -1;
  fwd_fails(f, "flash3::fwd: max_seqlen_q is -1");
  f = c_fwd_args(empty_varlen<FwdArgs>());
  f.max_seqlen_k = 5;
  fwd_fails(f, "flash3::fwd: max_seqlen_k is 5 but k.shape[0] (total_k) is 0");
  f = c_fwd_args(empty_varlen<FwdArgs>());
  f.cu_seqlens_k.dtype = FLASH3_FLOAT32;
  fwd_fails(f, "flash3::fwd: cu_seqlens_k.dtype is float32");
  f = c_fwd_args(empty_varlen<FwdArgs>());
  f.seqused_q.rank = 2;
  fwd_fails(f, "flash3::fwd: seqused_q.rank is 2");
  f = c_fwd_args(empty_varlen<FwdArgs>());
  f.seqused_k = c_tensor(TensorRef::contiguous(nullptr, DType::kInt32, {1}));
  fwd_fails(f, "flash3::fwd: seqused_k.shape[0] is 1 but batch is 0");
  f = c_fwd_args(empty_varlen<FwdArgs>());
  f.reserved_v4 = 1;
  fwd_fails(f, "flash3::fwd: args->reserved_v4 is 1; it must be 0");
  // a v3 caller: the packed q is rank 3 without cu_seqlens_q (not read)
  f = c_fwd_args(empty_varlen<FwdArgs>());
  f.struct_size = FLASH3_FWD_ARGS_SIZE_V3;
  fwd_fails(f, "flash3::fwd: q.rank is 3; q must have rank 4 (batch, seqlen_q, nheads, head_dim) (rank 3 (total_q, "
               "nheads, head_dim) with cu_seqlens_q)");
  f = c_fwd_args(make_args(0, 128, 256, 8, 2, 128, /*with_data=*/false));
  f.max_seqlen_q = -1;
  f.reserved_v4 = 7;
  f.seqused_q.rank = 3;
  f.struct_size = FLASH3_FWD_ARGS_SIZE_V3;
  EXPECT_EQ(flash3_fwd(&f, err, sizeof err), FLASH3_OK) << err;

  flash3_bwd_args b = c_bwd_args(empty_varlen<BwdArgs>());
  EXPECT_EQ(flash3_bwd(&b, err, sizeof err), FLASH3_OK) << err;
  uint64_t bytes = 7;
  EXPECT_EQ(flash3_bwd_workspace_size(&b, &bytes, err, sizeof err), FLASH3_OK) << err;
  EXPECT_EQ(bytes, 0u);
  auto bwd_fails = [&](const flash3_bwd_args& c, const std::string& start) {
    EXPECT_EQ(flash3_bwd(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(err).rfind(start, 0), 0u) << err;
    EXPECT_EQ(flash3_bwd_workspace_size(&c, &bytes, err, sizeof err), FLASH3_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(err).rfind(start, 0), 0u) << err;
  };
  b.max_seqlen_k = -3;
  bwd_fails(b, "flash3::bwd: max_seqlen_k is -3");
  b = c_bwd_args(empty_varlen<BwdArgs>());
  b.cu_seqlens_q.rank = 2;
  bwd_fails(b, "flash3::bwd: cu_seqlens_q.rank is 2");
  b = c_bwd_args(empty_varlen<BwdArgs>());
  b.seqused_k = c_tensor(TensorRef::contiguous(nullptr, DType::kFloat16, {0}));
  bwd_fails(b, "flash3::bwd: seqused_k.dtype is float16");
  b = c_bwd_args(empty_varlen<BwdArgs>());
  b.reserved_v3 = 2;
  bwd_fails(b, "flash3::bwd: args->reserved_v3 is 2; it must be 0");
  b = c_bwd_args(empty_varlen<BwdArgs>());
  b.struct_size = FLASH3_BWD_ARGS_SIZE_V2;  // a v2 caller: the packed q is rank 3 without cu_seqlens_q
  bwd_fails(b, "flash3::bwd: q.rank is 3; q must have rank 4");
}

// A caller of a later version: accepted while its fields past the ones this library knows are
// at their defaults (zero bytes); a set one is an option this library lacks, and is rejected.
TEST(CApi, LargerStructNeedsZeroUnknownFields) {
  const flash3_fwd_args f = c_fwd_args(make_args(0, 128, 256, 8, 2, 128, /*with_data=*/false));
  const uint32_t size = sizeof(flash3_fwd_args) + 24;
  std::vector<unsigned char> buf(size, 0);
  std::memcpy(buf.data(), &f, sizeof f);
  std::memcpy(buf.data(), &size, sizeof size);
  const auto* p = reinterpret_cast<const flash3_fwd_args*>(buf.data());
  char err[256];
  EXPECT_EQ(flash3_fwd(p, err, sizeof err), FLASH3_OK) << err;
  buf[sizeof(flash3_fwd_args) + 5] = 1;
  EXPECT_EQ(flash3_fwd(p, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err), "flash3::fwd: args->struct_size is " + std::to_string(size) + " and byte " +
                                  std::to_string(sizeof(flash3_fwd_args) + 5) +
                                  " is not zero; this library knows the first " +
                                  std::to_string(sizeof(flash3_fwd_args)) +
                                  " bytes of flash3_fwd_args: the caller sets an option it does not have (use a "
                                  "newer libflash3)");
  const flash3_bwd_args b = c_bwd_args(make_bwd_args(0, 128, 256, 8, 2, 128, /*with_data=*/false));
  const uint32_t bsize = sizeof(flash3_bwd_args) + 8;
  std::vector<unsigned char> bbuf(bsize, 0);
  std::memcpy(bbuf.data(), &b, sizeof b);
  std::memcpy(bbuf.data(), &bsize, sizeof bsize);
  const auto* pb = reinterpret_cast<const flash3_bwd_args*>(bbuf.data());
  EXPECT_EQ(flash3_bwd(pb, err, sizeof err), FLASH3_OK) << err;
  bbuf[bsize - 1] = 0x80;
  EXPECT_EQ(flash3_bwd(pb, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err).find("byte " + std::to_string(bsize - 1) + " is not zero"), std::string::npos) << err;
}

TEST(CApi, BwdReportsInvalidArguments) {
  BwdArgs a = make_bwd_args(2, 128, 256, 8, 2, 128);
  a.dv.shape[3] = 64;
  char err[256];
  EXPECT_EQ(c_bwd(a, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "flash3::bwd: dv.shape[3] (head_dim) is 64 but k.shape[3] (head_dim) is 128; dv must "
                    "have the same shape as k");
  uint64_t bytes = 7;
  EXPECT_EQ(c_bwd_workspace_size(a, &bytes, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(bytes, 7u);
  EXPECT_EQ(std::string(err).rfind("flash3::bwd: dv.shape[3]", 0), 0u) << err;
  char small[12];  // truncated, NUL-terminated
  EXPECT_EQ(c_bwd(a, small, sizeof small), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(small, "flash3::bwd");
  EXPECT_EQ(c_bwd(a, nullptr, 0), FLASH3_INVALID_ARGUMENT);
  flash3_bwd_args empty;
  flash3_bwd_args_init(&empty);  // every tensor NULL (rank 0)
  EXPECT_EQ(flash3_bwd(&empty, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::bwd: q.rank is 0", 0), 0u) << err;
}

TEST(CApi, BwdOfAnEmptyBatchIsANoOp) {  // validation passes with no pointer to inspect
  const BwdArgs a = make_bwd_args(0, 128, 256, 8, 2, 128, /*with_data=*/false);
  char err[64] = "unchanged";
  uint64_t bytes = 7;
  EXPECT_EQ(c_bwd_workspace_size(a, &bytes, err, sizeof err), FLASH3_OK) << err;
  EXPECT_EQ(bytes, 0u);
  EXPECT_STREQ(err, "");
  EXPECT_EQ(c_bwd(a, err, sizeof err), FLASH3_OK) << err;
  EXPECT_EQ(c_bwd_workspace_size(a, nullptr, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "flash3::bwd: bytes is null; it must point to a uint64_t");
}

// flash3_quantize_fp8: contiguous in (b, s, h, d) bfloat16, out float8_e4m3, scale (b, h,
// ceil(s / block_rows), block_rows 0: fp8_block_kv(d)) float32, all with null data (every failure below is found before the
// pointers are looked at, and an empty in never looks at them).
flash3_quantize_fp8_args c_quantize_args(int64_t b, int64_t s, int64_t h, int64_t d, int block_rows = 0) {
  flash3_quantize_fp8_args c;
  flash3_quantize_fp8_args_init(&c);
  const int64_t rows = block_rows ? block_rows : flash3::fp8_block_kv(d);  // scale's shape; c.block_rows stays 0
  c.in = c_tensor(TensorRef::contiguous(nullptr, DType::kBFloat16, {b, s, h, d}));
  c.out = c_tensor(TensorRef::contiguous(nullptr, DType::kFloat8E4M3, {b, s, h, d}));
  c.scale = c_tensor(TensorRef::contiguous(nullptr, DType::kFloat32, {b, h, (s + rows - 1) / rows}));
  return c;
}

TEST(CApi, QuantizeInitSetsTheSizeAndZeroDefaults) {
  flash3_quantize_fp8_args q;
  std::memset(&q, 0xAB, sizeof q);
  flash3_quantize_fp8_args_init(&q);
  EXPECT_EQ(q.struct_size, sizeof(flash3_quantize_fp8_args));
  EXPECT_EQ(q.struct_size, FLASH3_QUANTIZE_FP8_ARGS_SIZE_V1);
  EXPECT_EQ(q.reserved, 0u);
  EXPECT_EQ(q.in.data, nullptr);
  EXPECT_EQ(q.in.rank, 0);
  EXPECT_EQ(q.scale.data, nullptr);
  EXPECT_EQ(q.block_rows, 0);  // the default: fp8_block_kv(head_dim)
  EXPECT_EQ(q.hadamard, 0);
  EXPECT_EQ(q.seed, 0u);
  EXPECT_EQ(q.stream, nullptr);
}

TEST(CApi, QuantizeReportsInvalidArguments) {
  flash3_quantize_fp8_args c = c_quantize_args(2, 300, 4, 96);
  char err[256];
  EXPECT_EQ(flash3_quantize_fp8(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "flash3::quantize_fp8: in.shape[3] (head_dim) is 96; supported head dims are 64, 128, 256");
  c = c_quantize_args(2, 300, 4, 128);
  c.out.dtype = FLASH3_FLOAT8_E5M2;
  EXPECT_EQ(flash3_quantize_fp8(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "flash3::quantize_fp8: out.dtype is float8_e5m2; out must be float8_e4m3");
  c = c_quantize_args(2, 300, 4, 128);
  c.block_rows = -3;
  EXPECT_EQ(flash3_quantize_fp8(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::quantize_fp8: block_rows is -3; it must be >= 1", 0), 0u) << err;
  // block_rows 0 is the default fp8_block_kv(128) = 192: a scale shaped for 64-row blocks no longer fits
  c = c_quantize_args(2, 300, 4, 128, /*block_rows=*/64);
  EXPECT_EQ(flash3_quantize_fp8(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::quantize_fp8: scale.shape[2] (num_blocks) is 5 but "
                                   "ceil(seqlen / block_rows) is 2 (seqlen 300, block_rows 192)",
                                   0),
            0u)
      << err;
  c = c_quantize_args(0, 300, 4, 128);
  c.reserved = 2;
  EXPECT_EQ(flash3_quantize_fp8(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "flash3::quantize_fp8: args->reserved is 2; it must be 0");
  flash3_quantize_fp8_args_init(&c);  // every tensor NULL (rank 0)
  EXPECT_EQ(flash3_quantize_fp8(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::quantize_fp8: in.rank is 0", 0), 0u) << err;
  EXPECT_EQ(flash3_quantize_fp8(nullptr, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "flash3::quantize_fp8: args is null; pass a flash3_quantize_fp8_args; set it up with "
                    "flash3_quantize_fp8_args_init");
  c = c_quantize_args(0, 300, 4, 128);
  c.struct_size = 8;
  EXPECT_EQ(flash3_quantize_fp8(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err), "flash3::quantize_fp8: args->struct_size is 8; it must be at least " +
                                  std::to_string(FLASH3_QUANTIZE_FP8_ARGS_SIZE_V1) +
                                  " (sizeof(flash3_quantize_fp8_args) of the first version); set it up with "
                                  "flash3_quantize_fp8_args_init");
}

TEST(CApi, QuantizeOfAnEmptyBatchIsANoOp) {  // validation passes with no pointer to inspect
  for (int which = 0; which < 3; ++which) {
    const flash3_quantize_fp8_args c =
        c_quantize_args(which == 0 ? 0 : 2, which == 1 ? 0 : 300, which == 2 ? 0 : 4, 128);
    char err[64] = "unchanged";
    EXPECT_EQ(flash3_quantize_fp8(&c, err, sizeof err), FLASH3_OK) << err;
    EXPECT_STREQ(err, "");
  }
  // a later version's struct: zero bytes past the known fields are accepted, a set one is not
  const flash3_quantize_fp8_args c = c_quantize_args(0, 300, 4, 128);
  const uint32_t size = sizeof c + 16;
  std::vector<unsigned char> buf(size, 0);
  std::memcpy(buf.data(), &c, sizeof c);
  std::memcpy(buf.data(), &size, sizeof size);
  const auto* p = reinterpret_cast<const flash3_quantize_fp8_args*>(buf.data());
  char err[512];
  EXPECT_EQ(flash3_quantize_fp8(p, err, sizeof err), FLASH3_OK) << err;
  buf[size - 1] = 1;
  EXPECT_EQ(flash3_quantize_fp8(p, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_NE(std::string(err).find("byte " + std::to_string(size - 1) + " is not zero"), std::string::npos) << err;
}

// ---- FP8 forward: dtypes and scales ---------------------------------------------------------

// make_args with float8_e4m3 q, k, v (bfloat16 out) and the three scales: per (batch, kv head)
// when block is false, else block scales (q per 64 rows, k and v per 128 keys).
FwdArgs make_fp8_args(bool block) {
  FwdArgs a = make_args(2, 200, 300, 8, 2, 128);
  for (TensorRef* t : {&a.q, &a.k, &a.v}) {
    *t = TensorRef::contiguous(t->data, DType::kFloat8E4M3, {t->shape[0], t->shape[1], t->shape[2], t->shape[3]});
  }
  if (block) {
    a.q_scale = TensorRef::contiguous(fake_ptr(0x600000), DType::kFloat32, {2, 8, 4});  // ceil(200 / 64)
    a.k_scale = TensorRef::contiguous(fake_ptr(0x610000), DType::kFloat32, {2, 2, 2});  // ceil(300 / 192)
    a.v_scale = TensorRef::contiguous(fake_ptr(0x620000), DType::kFloat32, {2, 2, 2});
  } else {
    a.q_scale = TensorRef::contiguous(fake_ptr(0x600000), DType::kFloat32, {2, 2});
    a.k_scale = TensorRef::contiguous(fake_ptr(0x610000), DType::kFloat32, {2, 2});
    a.v_scale = TensorRef::contiguous(fake_ptr(0x620000), DType::kFloat32, {2, 2});
  }
  return a;
}

TEST(FwdFp8Validation, AcceptsDescalesBlockScalesAndNone) {
  for (bool block : {false, true}) {
    const FwdArgs a = make_fp8_args(block);
    const flash3::FwdProblem p = flash3::validate_fwd(a, &fake_inspect);
    EXPECT_EQ(p.dtype, DType::kFloat8E4M3);
    FwdArgs none = a;
    none.q_scale = none.k_scale = none.v_scale = TensorRef{};
    EXPECT_NO_THROW(validate(none));
    FwdArgs strided = a;  // any strides, 0 included (one scale broadcast over blocks)
    strided.k_scale.stride[2] = 0;
    EXPECT_NO_THROW(validate(strided));
  }
}

TEST(FwdFp8Validation, RejectsMixedDtypesAndOut) {
  FwdArgs a = make_fp8_args(false);
  a.k.dtype = DType::kBFloat16;
  EXPECT_TRUE(fails_with(a, {"k.dtype is bfloat16 but q.dtype is float8_e4m3", "same dtype"}));
  a = make_fp8_args(false);
  a.out.dtype = DType::kFloat8E4M3;
  EXPECT_TRUE(fails_with(a, {"out.dtype is float8_e4m3", "out must be bfloat16"}));
  a = make_fp8_args(false);
  a.q.dtype = a.k.dtype = a.v.dtype = DType::kFloat8E5M2;
  EXPECT_TRUE(fails_with(a, {"q.dtype is float8_e5m2", "float8_e4m3 (with bfloat16 out)"}));
  a = make_args(2, 200, 300, 8, 2, 128);  // 16-bit q with a scale
  a.v_scale = TensorRef::contiguous(fake_ptr(0x620000), DType::kFloat32, {2, 2});
  EXPECT_TRUE(fails_with(a, {"v_scale is given but q.dtype is bfloat16", "float8_e4m3 inputs only"}));
}

TEST(FwdFp8Validation, RejectsScalesOfTheWrongShapeDtypeOrMemory) {
  FwdArgs a = make_fp8_args(true);
  a.q_scale.shape[2] = 3;  // ceil(200 / 64) is 4
  EXPECT_TRUE(fails_with(a, {"q_scale.shape[2] is 3", "(batch, nheads, ceil(seqlen_q / 64)) = (2, 8, 4)"}));
  a = make_fp8_args(true);
  a.k_scale.shape[2] = 3;  // 128-key blocks; at head dim 128 they are fp8_block_kv(128) = 192 keys
  EXPECT_TRUE(fails_with(a, {"k_scale.shape[2] is 3", "(batch, nheads_kv, ceil(seqlen_k / 192)) = (2, 2, 2)"}));
  a = make_fp8_args(true);
  a.k_scale.shape[1] = 8;
  EXPECT_TRUE(fails_with(a, {"k_scale.shape[1] is 8", "(batch, nheads_kv) = (2, 2)"}));
  a = make_fp8_args(false);
  a.v_scale.dtype = DType::kBFloat16;
  EXPECT_TRUE(fails_with(a, {"v_scale.dtype is bfloat16", "scales must be float32"}));
  a = make_fp8_args(false);
  a.q_scale = TensorRef::contiguous(fake_ptr(0x600000), DType::kFloat32, {2, 2, 1, 1});
  EXPECT_TRUE(fails_with(a, {"q_scale.rank is 4"}));
  a = make_fp8_args(false);
  a.k_scale.stride[0] = -1;
  EXPECT_TRUE(fails_with(a, {"k_scale.stride[0] is -1", ">= 0"}));
  a = make_fp8_args(false);
  g_host = a.v_scale.data;
  EXPECT_TRUE(fails_with(a, {"v_scale.data points to host memory"}));
  g_host = nullptr;
  a = make_fp8_args(false);
  a.q_scale.data = nullptr;
  EXPECT_TRUE(fails_with(a, {"q_scale.data is null"}));
}

// ---- decoding over a KV cache: validate_kvcache ------------------------------------------------

using flash3::KvcacheArgs;
using flash3::KvcacheProblem;

// Fake addresses of the index tensors (4-byte aligned, distinct from the others').
constexpr uintptr_t kSeqlensAt = 0xA00000, kBatchIdxAt = 0xB00000, kLeftpadAt = 0xC00000, kPageTableAt = 0xD00000;

// A valid contiguous decoding problem: q, out (b, sq, h, d), k_cache, v_cache (b, sc, hk, d),
// lse, cache_seqlens (b), contiguous, at distinct fake addresses (q, the caches, out and
// cache_seqlens null when with_data is false), causal.
KvcacheArgs make_kvcache(int64_t b, int64_t sq, int64_t sc, int64_t h, int64_t hk, int64_t d, bool with_data = true) {
  KvcacheArgs a;
  auto ptr = [&](uintptr_t address) { return with_data ? fake_ptr(address) : nullptr; };
  a.q = TensorRef::contiguous(ptr(0x100000), DType::kBFloat16, {b, sq, h, d});
  a.k_cache = TensorRef::contiguous(ptr(0x200000), DType::kBFloat16, {b, sc, hk, d});
  a.v_cache = TensorRef::contiguous(ptr(0x300000), DType::kBFloat16, {b, sc, hk, d});
  a.out = TensorRef::contiguous(ptr(0x400000), DType::kBFloat16, {b, sq, h, d});
  a.lse = TensorRef::contiguous(fake_ptr(0x500000), DType::kFloat32, {b, h, sq});
  a.cache_seqlens = TensorRef::contiguous(ptr(kSeqlensAt), DType::kInt32, {b});
  a.causal = true;
  return a;
}

// make_kvcache with a paged cache: k_cache, v_cache (num_pages, page_size, hk, d) and page_table
// (b, max_pages).
KvcacheArgs make_paged(int64_t b, int64_t sq, int64_t num_pages, int64_t page_size, int64_t max_pages, int64_t h,
                       int64_t hk, int64_t d, bool with_data = true) {
  KvcacheArgs a = make_kvcache(b, sq, 1, h, hk, d, with_data);
  a.k_cache = TensorRef::contiguous(a.k_cache.data, DType::kBFloat16, {num_pages, page_size, hk, d});
  a.v_cache = TensorRef::contiguous(a.v_cache.data, DType::kBFloat16, {num_pages, page_size, hk, d});
  a.page_table = TensorRef::contiguous(with_data ? fake_ptr(kPageTableAt) : nullptr, DType::kInt32, {b, max_pages});
  return a;
}

TensorRef int32_entries(uintptr_t address, int64_t n) {
  return TensorRef::contiguous(fake_ptr(address), DType::kInt32, {n});
}

KvcacheProblem problem(const KvcacheArgs& a) { return flash3::validate_kvcache(a, &fake_inspect); }

// validate_kvcache throws flash3::Error whose message starts with "flash3::fwd_kvcache: " and
// contains every one of parts.
::testing::AssertionResult kvcache_fails(const KvcacheArgs& a, std::initializer_list<std::string> parts) {
  return flash3::testing::throws_error([&] { problem(a); }, "flash3::fwd_kvcache: ", parts);
}

class ValidateKvcache : public ::testing::Test {
 protected:
  void SetUp() override {
    g_host = g_unknown = nullptr;
    g_calls = 0;
  }
  KvcacheArgs a = make_kvcache(2, 1, 512, 16, 2, 128);            // decoding, GQA 8
  KvcacheArgs pg = make_paged(3, 4, 40, 16, 10, 8, 2, 64);        // 10 pages of 16 keys per sequence
};

TEST_F(ValidateKvcache, ContiguousProblemIsFilled) {
  a.cache_leftpad = int32_entries(kLeftpadAt, 2);
  a.softmax_scale = 0.25f;
  a.num_splits = 3;
  const KvcacheProblem p = problem(a);
  EXPECT_EQ(p.dtype, DType::kBFloat16);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen_q, 1);
  EXPECT_EQ(p.nheads, 16);
  EXPECT_EQ(p.nheads_kv, 2);
  EXPECT_EQ(p.head_dim, 128);
  EXPECT_EQ(p.batch_cache, 2);
  EXPECT_EQ(p.seqlen_cache, 512);
  EXPECT_FALSE(p.paged);
  EXPECT_EQ(p.page_size, 0);
  EXPECT_EQ(p.max_pages, 0);
  EXPECT_TRUE(p.has_seqlens);
  EXPECT_FALSE(p.has_batch_idx);
  EXPECT_TRUE(p.has_leftpad);
  EXPECT_EQ(p.softmax_scale, 0.25f);
  EXPECT_TRUE(p.causal);
  EXPECT_TRUE(p.write_lse);
  EXPECT_EQ(p.window_left, -1);
  EXPECT_EQ(p.window_right, -1);  // causal's right = 0 excludes nothing with one query row
  EXPECT_EQ(p.softcap, 0.0f);
  EXPECT_EQ(p.num_splits, 3);
  EXPECT_EQ(g_calls, 7);  // q, k_cache, v_cache, out, lse, cache_seqlens, cache_leftpad
}

TEST_F(ValidateKvcache, PagedProblemIsFilled) {
  pg.cache_leftpad = int32_entries(kLeftpadAt, 3);
  pg.causal = false;
  for (TensorRef* t : {&pg.q, &pg.k_cache, &pg.v_cache, &pg.out}) t->dtype = DType::kFloat16;
  const KvcacheProblem p = problem(pg);
  EXPECT_EQ(p.dtype, DType::kFloat16);
  EXPECT_EQ(p.batch, 3);
  EXPECT_EQ(p.seqlen_q, 4);
  EXPECT_EQ(p.nheads, 8);
  EXPECT_EQ(p.nheads_kv, 2);
  EXPECT_EQ(p.head_dim, 64);
  EXPECT_EQ(p.batch_cache, 40);   // num_pages
  EXPECT_EQ(p.seqlen_cache, 160);  // max_pages x page_size
  EXPECT_TRUE(p.paged);
  EXPECT_EQ(p.page_size, 16);
  EXPECT_EQ(p.max_pages, 10);
  EXPECT_TRUE(p.has_seqlens);
  EXPECT_FALSE(p.has_batch_idx);
  EXPECT_TRUE(p.has_leftpad);
  EXPECT_FLOAT_EQ(p.softmax_scale, 0.125f);  // 1/sqrt(64)
  EXPECT_FALSE(p.causal);
  EXPECT_EQ(p.window_left, -1);
  EXPECT_EQ(p.window_right, -1);
  EXPECT_EQ(p.num_splits, 0);
  EXPECT_EQ(g_calls, 8);  // q, k_cache, v_cache, out, lse, cache_seqlens, cache_leftpad, page_table
  // any page size, one page per sequence, a single page
  for (int64_t size : {1, 3, 256}) {
    pg = make_paged(3, 4, 1, size, 1, 8, 2, 64);
    const KvcacheProblem q = problem(pg);
    EXPECT_EQ(q.page_size, size);
    EXPECT_EQ(q.seqlen_cache, size);
    EXPECT_EQ(q.batch_cache, 1);
  }
}

TEST_F(ValidateKvcache, OptionalTensors) {
  a.cache_seqlens = TensorRef{};  // the whole cache
  a.lse = TensorRef{};            // not written
  const KvcacheProblem p = problem(a);
  EXPECT_FALSE(p.has_seqlens);
  EXPECT_FALSE(p.write_lse);
  EXPECT_EQ(g_calls, 4);
}

// Without cache_batch_idx the cache has one entry per batch entry; with it, any number >= 1.
TEST_F(ValidateKvcache, CacheBatchIdxAllowsAnyCacheSize) {
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.k_cache.shape[0] = a.v_cache.shape[0] = 5;
  EXPECT_TRUE(kvcache_fails(a, {"k_cache.shape[0] (batch_cache) is 5 but q.shape[0] (batch) is 2; without "
                                "cache_batch_idx, k_cache must have one entry per batch entry (batch_cache = batch)"}));
  a.cache_batch_idx = int32_entries(kBatchIdxAt, 2);
  KvcacheProblem p = problem(a);
  EXPECT_TRUE(p.has_batch_idx);
  EXPECT_EQ(p.batch_cache, 5);
  a.k_cache.shape[0] = a.v_cache.shape[0] = 1;
  EXPECT_EQ(problem(a).batch_cache, 1);
  a.k_cache.shape[0] = a.v_cache.shape[0] = 0;
  EXPECT_TRUE(kvcache_fails(a, {"k_cache.shape[0] (batch_cache) is 0; cache_batch_idx selects entries of k_cache"}));
}

TEST_F(ValidateKvcache, CacheBatchIdxWithPageTable) {
  pg.cache_batch_idx = int32_entries(kBatchIdxAt, 3);
  EXPECT_TRUE(kvcache_fails(pg, {"cache_batch_idx is given with page_table; a paged cache is addressed through "
                                 "page_table alone"}));
}

TEST_F(ValidateKvcache, Ranks) {
  a.q.rank = 3;
  EXPECT_TRUE(kvcache_fails(a, {"q.rank is 3; q must have rank 4 (batch, seqlen_q, nheads, head_dim)"}));
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.k_cache.rank = 3;
  EXPECT_TRUE(kvcache_fails(a, {"k_cache.rank is 3; k_cache must have rank 4 (batch_cache, seqlen_cache, "
                                "nheads_kv, head_dim)"}));
  pg.v_cache.rank = 2;
  EXPECT_TRUE(kvcache_fails(pg, {"v_cache.rank is 2; v_cache must have rank 4 (num_pages, page_size, nheads_kv, "
                                 "head_dim)"}));
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.lse.rank = 2;
  EXPECT_TRUE(kvcache_fails(a, {"lse.rank is 2; lse must have rank 3 (batch, nheads, seqlen_q)"}));
}

TEST_F(ValidateKvcache, Dtypes) {
  for (TensorRef* t : {&a.q, &a.k_cache, &a.v_cache, &a.out}) t->dtype = DType::kFloat8E4M3;
  EXPECT_TRUE(kvcache_fails(a, {"q.dtype is float8_e4m3; supported dtypes are float16, bfloat16"}));
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.v_cache.dtype = DType::kFloat16;
  EXPECT_TRUE(kvcache_fails(a, {"v_cache.dtype is float16 but q.dtype is bfloat16; q, k_cache, v_cache and out "
                                "must have the same dtype"}));
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.out.dtype = DType::kFloat32;
  EXPECT_TRUE(kvcache_fails(a, {"out.dtype is float32 but q.dtype is bfloat16"}));
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.lse.dtype = DType::kBFloat16;
  EXPECT_TRUE(kvcache_fails(a, {"lse.dtype is bfloat16; lse must be float32"}));
}

// cache_seqlens, cache_batch_idx, cache_leftpad: int32 (batch), contiguous; each rule by name.
TEST_F(ValidateKvcache, LengthAndIndexTensors) {
  struct Entry {
    const char* name;
    TensorRef KvcacheArgs::*member;
    uintptr_t at;
  };
  const Entry entries[] = {{"cache_seqlens", &KvcacheArgs::cache_seqlens, kSeqlensAt},
                           {"cache_batch_idx", &KvcacheArgs::cache_batch_idx, kBatchIdxAt},
                           {"cache_leftpad", &KvcacheArgs::cache_leftpad, kLeftpadAt}};
  for (const Entry& e : entries) {
    const std::string n = e.name;
    auto fresh = [&] {
      KvcacheArgs b = make_kvcache(2, 1, 512, 16, 2, 128);
      b.*e.member = int32_entries(e.at, 2);
      return b;
    };
    KvcacheArgs b = fresh();
    EXPECT_NO_THROW(problem(b)) << n;
    b.*e.member = TensorRef::contiguous(fake_ptr(e.at), DType::kInt32, {2, 1});
    EXPECT_TRUE(kvcache_fails(b, {n + ".rank is 2; " + n + " must have rank 1 (batch)"}));
    b = fresh();
    (b.*e.member).dtype = DType::kFloat32;
    EXPECT_TRUE(kvcache_fails(b, {n + ".dtype is float32; " + n + " must be int32"}));
    b = fresh();
    (b.*e.member).shape[0] = 3;
    EXPECT_TRUE(
        kvcache_fails(b, {n + ".shape[0] is 3 but q.shape[0] (batch) is 2; " + n + " must have batch entries"}));
    b = fresh();
    (b.*e.member).shape[0] = -1;
    EXPECT_TRUE(kvcache_fails(b, {n + ".shape[0] (batch) is -1; sizes must be >= 0"}));
    b = fresh();
    (b.*e.member).stride[0] = 2;
    EXPECT_TRUE(kvcache_fails(b, {n + ".stride[0] is 2; " + n + " must be contiguous (stride 1)"}));
    b = fresh();
    (b.*e.member).data = fake_ptr(e.at + 2);
    EXPECT_TRUE(kvcache_fails(b, {n + ".data is 0x", ", not 4-byte aligned; flash3 needs 4-byte aligned int32 "
                                                     "pointers"}));
    b = fresh();
    (b.*e.member).data = nullptr;
    EXPECT_TRUE(kvcache_fails(b, {n + ".data is null; " + n + " needs a device pointer"}));
    b = fresh();
    g_host = (b.*e.member).data;
    EXPECT_TRUE(kvcache_fails(b, {n + ".data points to host memory"}));
    g_host = nullptr;
  }
  // batch 1: the stride of the one entry is never used
  a = make_kvcache(1, 1, 512, 16, 2, 128);
  a.cache_seqlens.stride[0] = 0;
  EXPECT_NO_THROW(problem(a));
}

TEST_F(ValidateKvcache, PageTable) {
  KvcacheArgs b = pg;
  b.page_table = TensorRef::contiguous(fake_ptr(kPageTableAt), DType::kInt32, {3});
  EXPECT_TRUE(kvcache_fails(b, {"page_table.rank is 1; page_table must have rank 2 (batch, max_pages_per_seq)"}));
  b = pg;
  b.page_table.dtype = DType::kFloat16;
  EXPECT_TRUE(kvcache_fails(b, {"page_table.dtype is float16; page_table must be int32"}));
  b = pg;
  b.page_table.shape[0] = 2;
  EXPECT_TRUE(kvcache_fails(b, {"page_table.shape[0] (batch) is 2 but q.shape[0] (batch) is 3; page_table must have "
                                "one row per batch entry"}));
  b = pg;
  b.page_table.shape[1] = 0;
  EXPECT_TRUE(kvcache_fails(b, {"page_table.shape[1] (max_pages_per_seq) is 0; page_table needs at least one page "
                                "per sequence"}));
  b = pg;
  b.page_table.stride[1] = 2;
  EXPECT_TRUE(
      kvcache_fails(b, {"page_table.stride[1] is 2; the last dim of page_table must be contiguous (stride 1)"}));
  b = pg;
  b.page_table.stride[0] = 0;
  EXPECT_TRUE(kvcache_fails(b, {"page_table.stride[0] (batch) is 0; strides must be positive for dims of size > 1"}));
  b = pg;
  b.page_table.stride[0] = 13;  // rows of a wider table: any positive row stride
  EXPECT_NO_THROW(problem(b));
  b = pg;
  b.k_cache.shape[0] = b.v_cache.shape[0] = 0;
  EXPECT_TRUE(kvcache_fails(b, {"k_cache.shape[0] (num_pages) is 0; a paged cache needs at least one page"}));
  b = pg;
  b.k_cache.shape[1] = b.v_cache.shape[1] = 0;
  EXPECT_TRUE(kvcache_fails(b, {"k_cache.shape[1] (page_size) is 0; a page must hold at least one key"}));
  b = pg;
  b.page_table.data = fake_ptr(kPageTableAt + 1);
  EXPECT_TRUE(kvcache_fails(b, {"page_table.data is 0xd00001, not 4-byte aligned"}));
  b = pg;
  g_unknown = b.page_table.data;
  EXPECT_TRUE(kvcache_fails(b, {"page_table.data (0xd00000) is not a pointer the CUDA runtime knows"}));
}

TEST_F(ValidateKvcache, Shapes) {
  a.out.shape[2] = 4;
  EXPECT_TRUE(kvcache_fails(a, {"out.shape[2] (nheads) is 4 but q.shape[2] (nheads) is 16; out must have the same "
                                "shape as q"}));
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.v_cache.shape[1] = 511;
  EXPECT_TRUE(kvcache_fails(a, {"v_cache.shape[1] (seqlen_cache) is 511 but k_cache.shape[1] (seqlen_cache) is 512; "
                                "k_cache and v_cache must have the same shape"}));
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.k_cache.shape[3] = a.v_cache.shape[3] = 64;
  EXPECT_TRUE(kvcache_fails(a, {"k_cache.shape[3] (head_dim) is 64 but q.shape[3] (head_dim) is 128; q and k_cache "
                                "must have the same head_dim"}));
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.lse.shape[2] = 2;
  EXPECT_TRUE(kvcache_fails(a, {"lse.shape[2] (seqlen_q) is 2 but q.shape[1] (seqlen_q) is 1; lse must be (batch, "
                                "nheads, seqlen_q)"}));
  pg.v_cache.shape[1] = 8;
  EXPECT_TRUE(kvcache_fails(pg, {"v_cache.shape[1] (page_size) is 8 but k_cache.shape[1] (page_size) is 16"}));
}

TEST_F(ValidateKvcache, HeadsAndHeadDims) {
  for (int64_t d : {64, 128, 256}) EXPECT_EQ(problem(make_kvcache(2, 1, 64, 16, 2, d)).head_dim, d);
  for (int64_t h : {2, 8, 16, 32}) EXPECT_EQ(problem(make_paged(2, 1, 4, 16, 2, h, 2, 128)).nheads, h);
  EXPECT_TRUE(kvcache_fails(make_kvcache(2, 1, 64, 16, 2, 96), {"q.shape[3] (head_dim) is 96; supported head dims are "
                                                               "64, 128, 256"}));
  EXPECT_TRUE(kvcache_fails(make_kvcache(2, 1, 64, 6, 4, 128), {"q.shape[2] (nheads) is 6 and k_cache.shape[2] "
                                                               "(nheads_kv) is 4", "multiple of nheads_kv"}));
  EXPECT_TRUE(kvcache_fails(make_paged(2, 1, 4, 16, 2, 8, 0, 128), {"k_cache.shape[2] (nheads_kv) is 0"}));
}

TEST_F(ValidateKvcache, Strides) {
  a.q.stride[3] = 2;
  EXPECT_TRUE(kvcache_fails(a, {"q.stride[3] is 2; the last dim must be contiguous (stride 1)"}));
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.k_cache.stride[1] = 260;
  EXPECT_TRUE(kvcache_fails(a, {"k_cache.stride[1] (seqlen_cache) is 260 elements (520 bytes)",
                                "multiples of 8 elements (16 bytes)"}));
  pg.v_cache.stride[1] = 132;  // page rows: (2 x 64) + 4
  EXPECT_TRUE(kvcache_fails(pg, {"v_cache.stride[1] (page_size) is 132 elements (264 bytes)"}));
  pg = make_paged(3, 4, 40, 16, 10, 8, 2, 64);
  pg.k_cache.stride[0] = -pg.k_cache.stride[0];
  EXPECT_TRUE(kvcache_fails(pg, {"k_cache.stride[0] (num_pages) is -2048", "positive"}));
  // padded rows (a cache inside a wider buffer), lse with any positive strides
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  for (TensorRef* t : {&a.k_cache, &a.v_cache}) {
    t->stride[1] = 2 * 128 + 8;
    t->stride[0] = 600 * t->stride[1];
  }
  a.lse.stride[1] = 3;
  a.lse.stride[0] = 51;
  EXPECT_NO_THROW(problem(a));
  // page size 1: the page dim's stride is never used
  pg = make_paged(3, 4, 40, 1, 10, 8, 2, 64);
  pg.k_cache.stride[1] = pg.v_cache.stride[1] = 3;
  EXPECT_NO_THROW(problem(pg));
}

// Sizes fit int32; seqlen_q and the longest key range (seqlen_cache, max_pages_per_seq x page_size
// formed in int64) at most 2^30.
TEST_F(ValidateKvcache, Lengths) {
  a.k_cache.shape[1] = a.v_cache.shape[1] = int64_t{1} << 31;
  EXPECT_TRUE(kvcache_fails(a, {"k_cache.shape[1] (seqlen_cache) is 2147483648; sizes must fit in int32"}));
  a = make_kvcache(1, 1, int64_t{1} << 30, 1, 1, 64);
  EXPECT_EQ(problem(a).seqlen_cache, 1 << 30);
  a = make_kvcache(1, 1, (int64_t{1} << 30) + 1, 1, 1, 64);
  EXPECT_TRUE(kvcache_fails(a, {"k_cache.shape[1] (seqlen_cache) is 1073741825; seqlen_cache must be at most "
                                "1073741824 (2^30)"}));
  a = make_kvcache(1, (int64_t{1} << 30) + 1, 64, 1, 1, 64);
  EXPECT_TRUE(kvcache_fails(a, {"q.shape[1] (seqlen_q) is 1073741825; seqlen_q must be at most 1073741824 (2^30)"}));
  pg = make_paged(1, 1, 4, 1024, int64_t{1} << 20, 1, 1, 64);
  EXPECT_EQ(problem(pg).seqlen_cache, 1 << 30);
  pg = make_paged(1, 1, 4, 1024, (int64_t{1} << 20) + 1, 1, 1, 64);
  EXPECT_TRUE(kvcache_fails(pg, {"page_table.shape[1] (max_pages_per_seq) x k_cache.shape[1] (page_size) = 1048577 x "
                                 "1024 = 1073742848 keys per sequence; max_pages_per_seq x page_size must be at most "
                                 "1073741824 (2^30)"}));
  const int64_t big = std::numeric_limits<int32_t>::max();  // the product does not overflow the check
  pg = make_paged(1, 1, 1, big, big, 1, 1, 64);
  EXPECT_TRUE(kvcache_fails(pg, {"= 2147483647 x 2147483647 = 4611686014132420609 keys per sequence"}));
}

TEST_F(ValidateKvcache, ScaleAndNumSplits) {
  EXPECT_FLOAT_EQ(problem(a).softmax_scale, 1.0f / std::sqrt(128.0f));
  a.softmax_scale = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(kvcache_fails(a, {"softmax_scale is inf; it must be finite and at most 2048"}));
  a.softmax_scale = 2049.0f;
  EXPECT_TRUE(kvcache_fails(a, {"softmax_scale is 2049"}));
  a.softmax_scale = 0.0f;
  for (int n : {0, 1, 3, 64}) {
    a.num_splits = n;
    EXPECT_EQ(problem(a).num_splits, n);
  }
  a.num_splits = -1;
  EXPECT_TRUE(kvcache_fails(a, {"num_splits is -1; it must be in [0, 64] (0: the heuristic, kvcache_num_splits)"}));
  a.num_splits = flash3::kMaxKvcacheSplits + 1;
  EXPECT_TRUE(kvcache_fails(a, {"num_splits is 65; it must be in [0, 64]"}));
}

// The window, normalized as validate_fwd's with seqlen_k the longest key range (here 10 pages of
// 16 keys: 160) and seqlen_q 4; softcap's rule.
TEST_F(ValidateKvcache, WindowAndSoftcap) {
  struct Row {
    bool causal;
    int left, right;
    bool want_causal;
    int want_left, want_right;
  };
  const Row rows[] = {
      {false, -1, -1, false, -1, -1}, {false, 10, 2, false, 10, 2}, {false, -1, 0, true, -1, 0},
      {true, 10, 5, true, 10, 0},     {false, 159, 3, false, -1, -1}, {false, 158, 2, false, 158, 2},
  };
  for (const Row& r : rows) {
    KvcacheArgs b = pg;
    b.causal = r.causal;
    b.window_left = r.left;
    b.window_right = r.right;
    const KvcacheProblem p = problem(b);
    EXPECT_EQ(p.causal, r.want_causal) << r.left << "," << r.right;
    EXPECT_EQ(p.window_left, r.want_left) << r.left << "," << r.right;
    EXPECT_EQ(p.window_right, r.want_right) << r.left << "," << r.right;
  }
  pg.window_left = -2;
  EXPECT_TRUE(kvcache_fails(pg, {"window_left is -2; it must be >= 0, or -1 for no bound on the left"}));
  pg.window_left = -1;
  pg.softcap = 30.0f;
  EXPECT_EQ(problem(pg).softcap, 30.0f);
  pg.softcap = -1.0f;
  EXPECT_TRUE(kvcache_fails(pg, {"softcap is -1; it must be finite and in [0, 2048]"}));
}

TEST_F(ValidateKvcache, Pointers) {
  a.q.data = nullptr;
  EXPECT_TRUE(kvcache_fails(a, {"q.data is null; a non-empty q needs a device pointer"}));
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.out.data = fake_ptr(0x400008);
  EXPECT_TRUE(kvcache_fails(a, {"out.data is 0x400008, not 16-byte aligned"}));
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  g_host = a.v_cache.data;
  EXPECT_TRUE(kvcache_fails(a, {"v_cache.data points to host memory; flash3 needs device memory"}));
  g_host = nullptr;
  a.lse.data = fake_ptr(0x500004);  // 4 bytes is enough for lse
  EXPECT_NO_THROW(problem(a));
}

TEST_F(ValidateKvcache, PointerChecksComeLast) {
  g_host = pg.q.data;
  pg.k_cache.stride[2] = 4;
  EXPECT_TRUE(kvcache_fails(pg, {"k_cache.stride[2] (nheads_kv) is 4"}));
  pg = make_paged(3, 4, 40, 16, 10, 8, 2, 64);
  pg.num_splits = 99;
  EXPECT_TRUE(kvcache_fails(pg, {"num_splits is 99"}));
  EXPECT_EQ(g_calls, 0);
}

// Nothing to compute (batch 0, or no query): no pointer is looked at; an empty cache needs no
// cache pointers (every row sees no key: out 0, lse +inf).
TEST_F(ValidateKvcache, EmptyProblemsSkipPointerChecks) {
  a = make_kvcache(0, 1, 512, 16, 2, 128, /*with_data=*/false);
  EXPECT_EQ(problem(a).batch, 0);
  pg = make_paged(0, 1, 40, 16, 10, 8, 2, 64, /*with_data=*/false);
  pg.cache_leftpad = TensorRef::contiguous(nullptr, DType::kInt32, {0});
  EXPECT_EQ(problem(pg).batch, 0);
  a = make_kvcache(2, 0, 512, 16, 2, 128, /*with_data=*/false);
  EXPECT_EQ(problem(a).seqlen_q, 0);
  EXPECT_EQ(g_calls, 0);
  a = make_kvcache(2, 1, 0, 16, 2, 128);
  a.k_cache.data = a.v_cache.data = nullptr;
  EXPECT_EQ(problem(a).seqlen_cache, 0);
  EXPECT_EQ(g_calls, 4);  // q, out, lse, cache_seqlens
}

// ---- the append (k_new, v_new) and its rotary tables (rotary_cos, rotary_sin) -------------------

// Fake addresses of the append's tensors (16-byte aligned, distinct from the others').
constexpr uintptr_t kKNewAt = 0xE00000, kVNewAt = 0xF00000, kCosAt = 0x1100000, kSinAt = 0x1200000;

// a with an append of s_new rows: k_new (batch, s_new, nheads_kv, head_dim) and v_new (batch,
// s_new, nheads_kv, v_cache's head dim) of q's dtype, contiguous (null data when with_data is
// false).
KvcacheArgs with_append(KvcacheArgs a, int64_t s_new, bool with_data = true) {
  const int64_t b = a.q.shape[0], hk = a.k_cache.shape[2], d = a.k_cache.shape[3], dv = a.v_cache.shape[3];
  a.k_new = TensorRef::contiguous(with_data ? fake_ptr(kKNewAt) : nullptr, a.q.dtype, {b, s_new, hk, d});
  a.v_new = TensorRef::contiguous(with_data ? fake_ptr(kVNewAt) : nullptr, a.q.dtype, {b, s_new, hk, dv});
  return a;
}

// a with rotary tables rotary_cos, rotary_sin float32 (seqlen_ro, rotary_dim / 2), contiguous.
KvcacheArgs with_rotary(KvcacheArgs a, int64_t seqlen_ro, int64_t rotary_dim) {
  a.rotary_cos = TensorRef::contiguous(fake_ptr(kCosAt), DType::kFloat32, {seqlen_ro, rotary_dim / 2});
  a.rotary_sin = TensorRef::contiguous(fake_ptr(kSinAt), DType::kFloat32, {seqlen_ro, rotary_dim / 2});
  return a;
}

TEST_F(ValidateKvcache, AppendWithRotaryIsFilled) {
  KvcacheArgs b = with_rotary(with_append(a, 3), 600, 64);
  b.rotary_interleaved = true;
  KvcacheProblem p = problem(b);
  EXPECT_EQ(p.seqlen_new, 3);
  EXPECT_EQ(p.rotary_dim, 64);
  EXPECT_TRUE(p.rotary_interleaved);
  EXPECT_EQ(p.seqlen_ro, 600);
  EXPECT_EQ(p.seqlen_cache, 512);  // the cache's shape, not the lengths after the append
  // q, k_cache, v_cache, out, lse, cache_seqlens, k_new, v_new, rotary_cos, rotary_sin
  EXPECT_EQ(g_calls, 10);
  b.rotary_interleaved = false;
  EXPECT_FALSE(problem(b).rotary_interleaved);
  // without rotary: rotary_dim 0, not interleaved whatever the flag says
  b = with_append(a, 3);
  b.rotary_interleaved = true;
  p = problem(b);
  EXPECT_EQ(p.seqlen_new, 3);
  EXPECT_EQ(p.rotary_dim, 0);
  EXPECT_FALSE(p.rotary_interleaved);
  EXPECT_EQ(p.seqlen_ro, 0);
  // without an append: seqlen_new 0 (the baseline)
  p = problem(a);
  EXPECT_EQ(p.seqlen_new, 0);
  EXPECT_EQ(p.rotary_dim, 0);
  EXPECT_EQ(p.seqlen_ro, 0);
  // paged, float16, every head dim and the rotary_dim bounds (16, head_dim); one table row
  for (int64_t d : {64, 128, 256}) {
    for (int64_t rot : {int64_t{16}, d}) {
      KvcacheArgs c = with_rotary(with_append(make_paged(3, 4, 40, 16, 10, 8, 2, d), 5), 1, rot);
      for (TensorRef* t : {&c.q, &c.k_cache, &c.v_cache, &c.out, &c.k_new, &c.v_new}) t->dtype = DType::kFloat16;
      p = problem(c);
      EXPECT_EQ(p.seqlen_new, 5);
      EXPECT_EQ(p.rotary_dim, rot);
      EXPECT_EQ(p.seqlen_ro, 1);
    }
  }
}

// seqlen_new 0 (an empty append) is an append of nothing: no pointer needed for k_new, v_new.
TEST_F(ValidateKvcache, EmptyAppendNeedsNoPointers) {
  const KvcacheArgs b = with_rotary(with_append(a, 0, /*with_data=*/false), 8, 32);
  const KvcacheProblem p = problem(b);
  EXPECT_EQ(p.seqlen_new, 0);
  EXPECT_EQ(p.rotary_dim, 32);
  EXPECT_EQ(g_calls, 8);  // the rotary tables are still read (q is rotated)
}

TEST_F(ValidateKvcache, AppendArgumentsComeTogether) {
  KvcacheArgs b = with_append(a, 3);
  b.v_new = TensorRef{};
  EXPECT_TRUE(kvcache_fails(b, {"v_new is not given but k_new is; k_new and v_new are given together (the appended "
                                "keys and their values)"}));
  b = with_append(a, 3);
  b.k_new = TensorRef{};
  EXPECT_TRUE(kvcache_fails(b, {"k_new is not given but v_new is; k_new and v_new are given together"}));
  b = with_rotary(with_append(a, 3), 600, 64);
  b.rotary_sin = TensorRef{};
  EXPECT_TRUE(kvcache_fails(b, {"rotary_sin is not given but rotary_cos is; rotary_cos and rotary_sin are given "
                                "together"}));
  b = with_rotary(with_append(a, 3), 600, 64);
  b.rotary_cos = TensorRef{};
  EXPECT_TRUE(kvcache_fails(b, {"rotary_cos is not given but rotary_sin is"}));
  b = with_rotary(a, 600, 64);
  EXPECT_TRUE(kvcache_fails(b, {"rotary_cos is given without k_new; the rotary embedding applies with an append "
                                "(k_new, v_new) only"}));
  b = with_append(a, 3);
  b.cache_seqlens = TensorRef{};
  EXPECT_TRUE(kvcache_fails(b, {"k_new is given without cache_seqlens; an append needs cache_seqlens (each "
                                "sequence's length before it: where its new keys go)"}));
  b.k_new = b.v_new = TensorRef{};  // no append: the whole cache, as before
  EXPECT_NO_THROW(problem(b));
}

TEST_F(ValidateKvcache, AppendShapesAndDtypes) {
  KvcacheArgs b = with_append(a, 3);
  b.k_new.rank = 3;
  EXPECT_TRUE(kvcache_fails(b, {"k_new.rank is 3; k_new must have rank 4 (batch, seqlen_new, nheads_kv, head_dim)"}));
  b = with_append(a, 3);
  b.v_new.dtype = DType::kFloat16;
  EXPECT_TRUE(kvcache_fails(b, {"v_new.dtype is float16 but q.dtype is bfloat16; k_new and v_new must have q's dtype "
                                "(the cache's)"}));
  b = with_append(a, 3);
  b.k_new.dtype = DType::kFloat32;
  EXPECT_TRUE(kvcache_fails(b, {"k_new.dtype is float32 but q.dtype is bfloat16"}));
  b = with_append(a, 3);
  b.k_new.shape[1] = b.v_new.shape[1] = -1;
  EXPECT_TRUE(kvcache_fails(b, {"k_new.shape[1] (seqlen_new) is -1; sizes must be >= 0"}));
  b = with_append(a, 3);
  b.k_new.shape[0] = b.v_new.shape[0] = 3;
  EXPECT_TRUE(kvcache_fails(b, {"k_new.shape[0] (batch) is 3 but q.shape[0] (batch) is 2; k_new must have q's "
                                "batch"}));
  b = with_append(a, 3);
  b.k_new.shape[2] = b.v_new.shape[2] = 4;
  EXPECT_TRUE(kvcache_fails(b, {"k_new.shape[2] (nheads_kv) is 4 but k_cache.shape[2] (nheads_kv) is 2; k_new must "
                                "have the cache's nheads_kv"}));
  b = with_append(a, 3);
  b.k_new.shape[3] = b.v_new.shape[3] = 64;
  EXPECT_TRUE(kvcache_fails(b, {"k_new.shape[3] (head_dim) is 64 but k_cache.shape[3] (head_dim) is 128; k_new must "
                                "have the cache's head_dim"}));
  b = with_append(a, 3);
  b.v_new.shape[1] = 2;
  EXPECT_TRUE(kvcache_fails(b, {"v_new.shape[1] (seqlen_new) is 2 but k_new.shape[1] (seqlen_new) is 3; k_new and "
                                "v_new must have the same shape"}));
  // with cache_batch_idx the batch is still q's (not the cache's number of entries)
  b = with_append(a, 3);
  b.k_cache.shape[0] = b.v_cache.shape[0] = 5;
  b.cache_batch_idx = int32_entries(kBatchIdxAt, 2);
  EXPECT_EQ(problem(b).seqlen_new, 3);
}

// seqlen_new is at most what one sequence holds (the caller's precondition, cache_seqlens +
// seqlen_new within it, is on the device and not checked).
TEST_F(ValidateKvcache, AppendOverrunsTheCache) {
  EXPECT_EQ(problem(with_append(a, 512)).seqlen_new, 512);
  EXPECT_TRUE(kvcache_fails(with_append(a, 513), {"k_new.shape[1] (seqlen_new) is 513 but a sequence holds "
                                                  "k_cache.shape[1] (seqlen_cache) = 512 keys; k_new overruns the "
                                                  "cache (seqlen_new must be at most seqlen_cache)"}));
  EXPECT_EQ(problem(with_append(pg, 160)).seqlen_new, 160);
  EXPECT_TRUE(kvcache_fails(with_append(pg, 161), {"k_new.shape[1] (seqlen_new) is 161 but a sequence holds "
                                                   "page_table.shape[1] (max_pages_per_seq) x k_cache.shape[1] "
                                                   "(page_size) = 10 x 16 = 160 keys; k_new overruns the cache "
                                                   "(seqlen_new must be at most max_pages_per_seq x page_size)"}));
  // an empty cache holds no new key either
  KvcacheArgs b = make_kvcache(2, 1, 0, 16, 2, 128);
  b.k_cache.data = b.v_cache.data = nullptr;
  EXPECT_EQ(problem(with_append(b, 0)).seqlen_new, 0);
  EXPECT_TRUE(kvcache_fails(with_append(b, 1), {"k_new.shape[1] (seqlen_new) is 1 but a sequence holds "
                                                "k_cache.shape[1] (seqlen_cache) = 0 keys; k_new overruns the cache"}));
}

TEST_F(ValidateKvcache, AppendStrides) {
  KvcacheArgs b = with_append(a, 3);
  b.k_new.stride[3] = 2;
  EXPECT_TRUE(kvcache_fails(b, {"k_new.stride[3] is 2; the last dim must be contiguous (stride 1)"}));
  b = with_append(a, 3);
  b.v_new.stride[1] = 260;
  EXPECT_TRUE(kvcache_fails(b, {"v_new.stride[1] (seqlen_new) is 260 elements (520 bytes); strides other than the "
                                "last must be multiples of 8 elements (16 bytes)"}));
  b = with_append(a, 3);
  b.k_new.stride[0] = -b.k_new.stride[0];
  EXPECT_TRUE(kvcache_fails(b, {"k_new.stride[0] (batch) is -768", "positive"}));
  // slices of wider buffers (k and v of one projection), and dims of size 1 whose strides are
  // never used
  b = with_append(a, 3);
  for (TensorRef* t : {&b.k_new, &b.v_new}) {
    t->stride[2] = 3 * 128;
    t->stride[1] = 2 * t->stride[2];
    t->stride[0] = 3 * t->stride[1];
  }
  EXPECT_NO_THROW(problem(b));
  b = with_append(make_kvcache(1, 1, 64, 8, 1, 64), 1);
  b.k_new.stride[0] = b.k_new.stride[1] = b.k_new.stride[2] = 3;
  EXPECT_NO_THROW(problem(b));
}

TEST_F(ValidateKvcache, RotaryTables) {
  const KvcacheArgs base = with_rotary(with_append(a, 3), 600, 64);
  KvcacheArgs b = base;
  b.rotary_cos.dtype = DType::kFloat16;  // q is bfloat16
  b.rotary_sin.dtype = DType::kFloat16;
  EXPECT_TRUE(kvcache_fails(b, {"rotary_cos.dtype is float16; rotary_cos and rotary_sin must be float32 or q's "
                                "dtype (bfloat16)"}));
  b = base;
  b.rotary_sin.dtype = DType::kBFloat16;
  EXPECT_TRUE(kvcache_fails(b, {"rotary_sin.dtype is bfloat16 and rotary_cos.dtype is float32; the two tables "
                                "must have one dtype"}));
  b.rotary_cos.dtype = DType::kBFloat16;  // tables of q's dtype
  EXPECT_NO_THROW(problem(b));
  b = base;
  b.rotary_sin.rank = 1;
  EXPECT_TRUE(kvcache_fails(b, {"rotary_sin.rank is 1; rotary_sin must have rank 2 (seqlen_ro, rotary_dim / 2)"}));
  b = base;
  b.rotary_sin.shape[0] = 599;
  EXPECT_TRUE(kvcache_fails(b, {"rotary_sin.shape[0] (seqlen_ro) is 599 but rotary_cos.shape[0] (seqlen_ro) is 600; "
                                "rotary_cos and rotary_sin must have the same shape"}));
  b = base;
  b.rotary_cos.shape[1] = -2;
  EXPECT_TRUE(kvcache_fails(b, {"rotary_cos.shape[1] (rotary_dim / 2) is -2; sizes must be >= 0"}));
  EXPECT_TRUE(kvcache_fails(with_rotary(with_append(a, 3), 0, 64), {"rotary_cos.shape[0] (seqlen_ro) is 0; the "
                                                                    "rotary tables need at least one position (row)"}));
  for (int64_t rot : {0, 8, 24, 136, 144}) {
    const std::string half = std::to_string(rot / 2);
    EXPECT_TRUE(kvcache_fails(with_rotary(with_append(a, 3), 600, rot),
                              {"rotary_cos.shape[1] (rotary_dim / 2) is " + half + ", so rotary_dim is " +
                               std::to_string(rot) + "; rotary_dim = 2 x rotary_cos.shape[1] must be a multiple of 16 "
                               "in [16, head_dim = 128]"}));
  }
  b = base;
  b.rotary_cos.stride[1] = 2;
  EXPECT_TRUE(kvcache_fails(b, {"rotary_cos.stride[1] is 2; the last dim of rotary_cos must be contiguous (stride 1)"}));
  b = base;
  b.rotary_sin.stride[0] = 16;
  EXPECT_TRUE(kvcache_fails(b, {"rotary_sin.stride[0] (seqlen_ro) is 16 but rotary_sin.shape[1] (rotary_dim / 2) is "
                                "32; the rows of rotary_sin must not overlap (stride[0] at least rotary_dim / 2)"}));
  b = base;
  b.rotary_cos.stride[0] = -32;
  EXPECT_TRUE(kvcache_fails(b, {"rotary_cos.stride[0] (seqlen_ro) is -32"}));
  // rows of a wider table; one row, whose stride is never used
  b = base;
  b.rotary_cos.stride[0] = b.rotary_sin.stride[0] = 100;
  EXPECT_NO_THROW(problem(b));
  b = with_rotary(with_append(a, 3), 1, 64);
  b.rotary_cos.stride[0] = b.rotary_sin.stride[0] = 0;
  EXPECT_NO_THROW(problem(b));
}

TEST_F(ValidateKvcache, AppendPointers) {
  const KvcacheArgs base = with_rotary(with_append(a, 3), 600, 64);
  KvcacheArgs b = base;
  b.k_new.data = nullptr;
  EXPECT_TRUE(kvcache_fails(b, {"k_new.data is null; a non-empty k_new needs a device pointer"}));
  b = base;
  b.v_new.data = fake_ptr(kVNewAt + 8);
  EXPECT_TRUE(kvcache_fails(b, {"v_new.data is 0xf00008, not 16-byte aligned; flash3 needs 16-byte aligned data "
                                "pointers"}));
  b = base;
  g_host = b.k_new.data;
  EXPECT_TRUE(kvcache_fails(b, {"k_new.data points to host memory; flash3 needs device memory"}));
  g_host = nullptr;
  b.rotary_cos.data = nullptr;
  EXPECT_TRUE(kvcache_fails(b, {"rotary_cos.data is null; rotary_cos needs a device pointer"}));
  b = base;
  b.rotary_sin.data = fake_ptr(kSinAt + 2);
  EXPECT_TRUE(kvcache_fails(b, {"rotary_sin.data is 0x1200002, not 4-byte aligned; flash3 needs 4-byte aligned "
                                "rotary table pointers"}));
  b.rotary_sin.data = fake_ptr(kSinAt + 4);  // 4 bytes is enough for the tables
  EXPECT_NO_THROW(problem(b));
  g_unknown = b.rotary_cos.data;
  EXPECT_TRUE(kvcache_fails(b, {"rotary_cos.data (0x1100000) is not a pointer the CUDA runtime knows"}));
  g_unknown = nullptr;
}

// The rules of the append come before any pointer is inspected, and with nothing to compute
// (batch 0, no query) no pointer is.
TEST_F(ValidateKvcache, AppendPointerChecksComeLast) {
  KvcacheArgs b = with_rotary(with_append(a, 3), 600, 64);
  g_host = b.q.data;
  b.rotary_sin.stride[1] = 3;
  EXPECT_TRUE(kvcache_fails(b, {"rotary_sin.stride[1] is 3"}));
  EXPECT_EQ(g_calls, 0);
  g_host = nullptr;
  for (const KvcacheArgs& empty : {make_kvcache(0, 1, 512, 16, 2, 128, false), make_kvcache(2, 0, 512, 16, 2, 128,
                                                                                             false)}) {
    b = with_rotary(with_append(empty, 3, /*with_data=*/false), 600, 64);
    b.rotary_cos.data = b.rotary_sin.data = nullptr;
    EXPECT_EQ(problem(b).seqlen_new, 3);
  }
  EXPECT_EQ(g_calls, 0);
}

// ---- MLA (qv): q the queries' rotary part (64), qv their latent (512), v_cache the keys' latent -

constexpr uintptr_t kQvAt = 0x1300000;  // 16-byte aligned, distinct from the others'

// a made an MLA problem (its batch, seqlen_q, heads, cache entries and lengths kept): q and
// k_cache (..., 64), v_cache and out (..., 512), and qv (batch, seqlen_q, nheads, 512) of q's
// dtype, all contiguous (qv's data null where q's is).
KvcacheArgs with_mla(KvcacheArgs a) {
  const int64_t b = a.q.shape[0], sq = a.q.shape[1], h = a.q.shape[2];
  const int64_t n = a.k_cache.shape[0], sc = a.k_cache.shape[1], hk = a.k_cache.shape[2];
  const DType t = a.q.dtype;
  a.q = TensorRef::contiguous(a.q.data, t, {b, sq, h, flash3::kMlaRotaryDim});
  a.k_cache = TensorRef::contiguous(a.k_cache.data, t, {n, sc, hk, flash3::kMlaRotaryDim});
  a.v_cache = TensorRef::contiguous(a.v_cache.data, t, {n, sc, hk, flash3::kMlaLatentDim});
  a.out = TensorRef::contiguous(a.out.data, t, {b, sq, h, flash3::kMlaLatentDim});
  a.qv = TensorRef::contiguous(a.q.data != nullptr ? fake_ptr(kQvAt) : nullptr, t, {b, sq, h, flash3::kMlaLatentDim});
  return a;
}

TEST_F(ValidateKvcache, MlaProblemIsFilled) {
  // DeepSeek's decoding shape: 128 query heads over one latent KV head
  KvcacheArgs m = with_mla(make_kvcache(2, 1, 512, 128, 1, 64));
  KvcacheProblem p = problem(m);
  EXPECT_TRUE(p.mla);
  EXPECT_EQ(p.head_dim, 64);
  EXPECT_EQ(p.head_dim_v, 512);
  EXPECT_EQ(p.nheads, 128);
  EXPECT_EQ(p.nheads_kv, 1);
  EXPECT_EQ(p.seqlen_cache, 512);
  EXPECT_FLOAT_EQ(p.softmax_scale, 1.0f / 24.0f);  // 1/sqrt(64 + 512), the scores' head dim
  EXPECT_EQ(g_calls, 7);  // q, k_cache, v_cache, out, lse, cache_seqlens, qv
  m.softmax_scale = 0.5f;
  EXPECT_EQ(problem(m).softmax_scale, 0.5f);
  // without qv: head_dim_v is head_dim, the default scale 1/sqrt(head_dim)
  p = problem(a);
  EXPECT_FALSE(p.mla);
  EXPECT_EQ(p.head_dim, 128);
  EXPECT_EQ(p.head_dim_v, 128);
  EXPECT_FLOAT_EQ(p.softmax_scale, 0.08838834764f);
  // paged (pages of 1, 64, 256 keys), GQA 4, several query rows, float16
  for (int64_t page_size : {1, 64, 256}) {
    m = with_mla(make_paged(3, 2, 40, page_size, 10, 8, 2, 64));
    for (TensorRef* t : {&m.q, &m.k_cache, &m.v_cache, &m.out, &m.qv}) t->dtype = DType::kFloat16;
    p = problem(m);
    EXPECT_TRUE(p.mla && p.paged);
    EXPECT_EQ(p.dtype, DType::kFloat16);
    EXPECT_EQ(p.page_size, page_size);
    EXPECT_EQ(p.seqlen_cache, 10 * page_size);
    EXPECT_EQ(p.head_dim, 64);
    EXPECT_EQ(p.head_dim_v, 512);
    EXPECT_EQ(p.seqlen_q, 2);
  }
  // slices of wider buffers (q and qv of one projection of 576 per head), a cache entry selected
  // through cache_batch_idx
  m = with_mla(make_kvcache(2, 5, 300, 16, 2, 64));
  m.q.stride[2] = m.qv.stride[2] = 576;
  m.q.stride[1] = m.qv.stride[1] = 16 * 576;
  m.q.stride[0] = m.qv.stride[0] = 5 * 16 * 576;
  m.k_cache.shape[0] = m.v_cache.shape[0] = 7;
  m.cache_batch_idx = int32_entries(kBatchIdxAt, 2);
  p = problem(m);
  EXPECT_EQ(p.batch_cache, 7);
  EXPECT_EQ(p.seqlen_q, 5);
}

TEST_F(ValidateKvcache, MlaDtypeRankAndHeadDims) {
  const KvcacheArgs base = with_mla(make_kvcache(2, 1, 512, 16, 2, 64));
  KvcacheArgs m = base;
  m.qv.dtype = DType::kFloat16;
  EXPECT_TRUE(kvcache_fails(m, {"qv.dtype is float16 but q.dtype is bfloat16; qv must have q's dtype"}));
  m = base;
  m.qv.rank = 3;
  EXPECT_TRUE(kvcache_fails(m, {"qv.rank is 3; qv must have rank 4 (batch, seqlen_q, nheads, head_dim_v)"}));
  m = base;
  m.qv.shape[3] = -1;
  EXPECT_TRUE(kvcache_fails(m, {"qv.shape[3] (head_dim_v) is -1; sizes must be >= 0"}));
  // q (and the keys' rotary part) not 64: MLA's message, not the supported head dims'
  for (int64_t d : {128, 96}) {
    m = base;
    m.q = TensorRef::contiguous(m.q.data, DType::kBFloat16, {2, 1, 16, d});
    m.k_cache = TensorRef::contiguous(m.k_cache.data, DType::kBFloat16, {2, 512, 2, d});
    EXPECT_TRUE(kvcache_fails(m, {"qv is given (MLA): q.shape[3] (head_dim) is " + std::to_string(d) +
                                  "; MLA needs q's rotary part of 64 and qv's latent of 512"}));
  }
  // the latent not 512 (qv, v_cache and out alike)
  m = base;
  m.qv.shape[3] = m.v_cache.shape[3] = m.out.shape[3] = 256;
  EXPECT_TRUE(kvcache_fails(m, {"qv is given (MLA): qv.shape[3] (head_dim_v) is 256; MLA needs q's rotary part of "
                                "64 and qv's latent of 512"}));
  // without qv, head dims other than 64, 128, 256 are refused as ever, and k_cache and v_cache
  // (and out and q) must have the same shape
  EXPECT_TRUE(kvcache_fails(make_kvcache(2, 1, 64, 16, 2, 512), {"q.shape[3] (head_dim) is 512; supported head dims "
                                                                 "are 64, 128, 256"}));
  m = base;
  m.qv = TensorRef{};
  EXPECT_TRUE(kvcache_fails(m, {"out.shape[3] (head_dim) is 512 but q.shape[3] (head_dim) is 64; out must have the "
                                "same shape as q"}));
  m.out.shape[3] = 64;
  EXPECT_TRUE(kvcache_fails(m, {"v_cache.shape[3] (head_dim) is 512 but k_cache.shape[3] (head_dim) is 64; k_cache "
                                "and v_cache must have the same shape"}));
}

TEST_F(ValidateKvcache, MlaShapes) {
  const KvcacheArgs base = with_mla(make_kvcache(2, 1, 512, 16, 2, 64));
  const char* qv_rule = "; qv must be (batch, seqlen_q, nheads, 512) with q's batch, seqlen_q and nheads";
  KvcacheArgs m = base;
  m.qv.shape[0] = 3;
  EXPECT_TRUE(kvcache_fails(m, {std::string("qv.shape[0] (batch) is 3 but q.shape[0] (batch) is 2") + qv_rule}));
  m = base;
  m.qv.shape[1] = 2;
  EXPECT_TRUE(kvcache_fails(m, {std::string("qv.shape[1] (seqlen_q) is 2 but q.shape[1] (seqlen_q) is 1") + qv_rule}));
  m = base;
  m.qv.shape[2] = 8;
  EXPECT_TRUE(kvcache_fails(m, {std::string("qv.shape[2] (nheads) is 8 but q.shape[2] (nheads) is 16") + qv_rule}));
  const char* out_rule = "; with qv (MLA), out must be (batch, seqlen_q, nheads, 512): q's first three dims and qv's "
                         "head_dim_v";
  m = base;
  m.out.shape[3] = 64;  // out like q
  EXPECT_TRUE(kvcache_fails(m, {std::string("out.shape[3] (head_dim_v) is 64 but qv.shape[3] (head_dim_v) is 512") +
                                out_rule}));
  m = base;
  m.out.shape[2] = 8;
  EXPECT_TRUE(kvcache_fails(m, {std::string("out.shape[2] (nheads) is 8 but q.shape[2] (nheads) is 16") + out_rule}));
  m = base;
  m.v_cache.shape[3] = 64;  // a cache of k's shape
  EXPECT_TRUE(kvcache_fails(m, {"v_cache.shape[3] (head_dim_v) is 64 but qv.shape[3] (head_dim_v) is 512; with qv "
                                "(MLA), v_cache holds each key's latent: its head_dim_v must be qv's"}));
  const char* v_rule = "; with qv (MLA), v_cache must have k_cache's first three dims (only the head dims differ: 64 "
                       "and 512)";
  m = base;
  m.v_cache.shape[1] = 511;
  EXPECT_TRUE(kvcache_fails(m, {std::string("v_cache.shape[1] (seqlen_cache) is 511 but k_cache.shape[1] "
                                            "(seqlen_cache) is 512") + v_rule}));
  m = base;
  m.v_cache.shape[2] = 1;
  EXPECT_TRUE(kvcache_fails(m, {std::string("v_cache.shape[2] (nheads_kv) is 1 but k_cache.shape[2] (nheads_kv) is "
                                            "2") + v_rule}));
  m = with_mla(make_paged(3, 4, 40, 16, 10, 8, 2, 64));
  m.v_cache.shape[1] = 8;
  EXPECT_TRUE(kvcache_fails(m, {std::string("v_cache.shape[1] (page_size) is 8 but k_cache.shape[1] (page_size) is "
                                            "16") + v_rule}));
  m = base;
  m.k_cache.shape[3] = 512;  // a cache of v's shape
  EXPECT_TRUE(kvcache_fails(m, {"k_cache.shape[3] (head_dim) is 512 but q.shape[3] (head_dim) is 64; q and k_cache "
                                "must have the same head_dim (with qv, the rotary part's 64)"}));
  // GQA as ever: nheads a multiple of nheads_kv
  EXPECT_TRUE(kvcache_fails(with_mla(make_kvcache(2, 1, 64, 6, 4, 64)),
                            {"q.shape[2] (nheads) is 6 and k_cache.shape[2] (nheads_kv) is 4; nheads must be a "
                             "positive multiple of nheads_kv"}));
  m = base;
  m.lse.shape[1] = 2;
  EXPECT_TRUE(kvcache_fails(m, {"lse.shape[1] (nheads) is 2 but q.shape[2] (nheads) is 16"}));
}

// qv's strides and pointer as q's: the last dim contiguous, the others multiples of 16 bytes,
// 16-byte aligned device memory; none looked at with nothing to compute.
TEST_F(ValidateKvcache, MlaStridesAndPointers) {
  const KvcacheArgs base = with_mla(make_kvcache(2, 1, 512, 16, 2, 64));
  KvcacheArgs m = base;
  m.qv.stride[3] = 2;
  EXPECT_TRUE(kvcache_fails(m, {"qv.stride[3] is 2; the last dim must be contiguous (stride 1)"}));
  m = base;
  m.qv.stride[2] = 516;
  EXPECT_TRUE(kvcache_fails(m, {"qv.stride[2] (nheads) is 516 elements (1032 bytes); strides other than the last "
                                "must be multiples of 8 elements (16 bytes)"}));
  m = base;
  m.v_cache.stride[2] = 516;
  EXPECT_TRUE(kvcache_fails(m, {"v_cache.stride[2] (nheads_kv) is 516 elements (1032 bytes)"}));
  m = base;
  m.qv.data = nullptr;
  EXPECT_TRUE(kvcache_fails(m, {"qv.data is null; a non-empty qv needs a device pointer"}));
  m = base;
  m.qv.data = fake_ptr(kQvAt + 8);
  EXPECT_TRUE(kvcache_fails(m, {"qv.data is 0x1300008, not 16-byte aligned; flash3 needs 16-byte aligned data "
                                "pointers"}));
  m = base;
  g_host = m.qv.data;
  EXPECT_TRUE(kvcache_fails(m, {"qv.data points to host memory; flash3 needs device memory"}));
  g_host = nullptr;
  g_calls = 0;
  for (const KvcacheArgs& empty : {make_kvcache(0, 1, 512, 16, 2, 64, false), make_kvcache(2, 0, 512, 16, 2, 64,
                                                                                           false)}) {
    m = with_mla(empty);
    EXPECT_EQ(m.qv.data, nullptr);
    EXPECT_TRUE(problem(m).mla);
  }
  EXPECT_EQ(g_calls, 0);
}

// The append with MLA: k_new (..., 64) and v_new (..., 512), rotary_dim at most 64.
TEST_F(ValidateKvcache, MlaAppend) {
  const KvcacheArgs m = with_mla(make_kvcache(2, 1, 512, 16, 2, 64));
  KvcacheArgs b = with_rotary(with_append(m, 3), 600, 64);
  EXPECT_EQ(b.v_new.shape[3], 512);
  KvcacheProblem p = problem(b);
  EXPECT_TRUE(p.mla);
  EXPECT_EQ(p.seqlen_new, 3);
  EXPECT_EQ(p.rotary_dim, 64);
  EXPECT_EQ(g_calls, 11);  // q, k_cache, v_cache, out, lse, cache_seqlens, qv, k_new, v_new, rotary_cos, rotary_sin
  EXPECT_EQ(problem(with_rotary(with_append(m, 3), 600, 16)).rotary_dim, 16);
  EXPECT_EQ(problem(with_append(with_mla(make_paged(3, 4, 40, 16, 10, 8, 2, 64)), 5)).seqlen_new, 5);
  EXPECT_TRUE(kvcache_fails(with_rotary(with_append(m, 3), 600, 128),
                            {"rotary_cos.shape[1] (rotary_dim / 2) is 64, so rotary_dim is 128; rotary_dim = 2 x "
                             "rotary_cos.shape[1] must be a multiple of 16 in [16, head_dim = 64]"}));
  b = with_append(m, 3);
  b.k_new.shape[3] = 512;  // k_new like v_new
  EXPECT_TRUE(kvcache_fails(b, {"k_new.shape[3] (head_dim) is 512 but k_cache.shape[3] (head_dim) is 64; k_new must "
                                "have the cache's head_dim"}));
  b = with_append(m, 3);
  b.v_new.shape[3] = 64;  // v_new like k_new
  EXPECT_TRUE(kvcache_fails(b, {"v_new.shape[3] (head_dim_v) is 64 but v_cache.shape[3] (head_dim_v) is 512; with qv "
                                "(MLA), v_new must have v_cache's head_dim_v (the latent's)"}));
  b = with_append(m, 3);
  b.v_new.shape[1] = 2;
  EXPECT_TRUE(kvcache_fails(b, {"v_new.shape[1] (seqlen_new) is 2 but k_new.shape[1] (seqlen_new) is 3; k_new and "
                                "v_new must have the same first three dims"}));
  b = with_append(m, 3);
  b.v_new.stride[1] = 2 * 512 + 4;
  EXPECT_TRUE(kvcache_fails(b, {"v_new.stride[1] (seqlen_new) is 1028 elements (2056 bytes); strides other than the "
                                "last must be multiples of 8 elements (16 bytes)"}));
}

// ---- the C ABI of the KV cache (flash3_fwd_kvcache) -------------------------------------------
// Failures found before any pointer is inspected, and batch 0 (no launch), so these run without
// a GPU too.

flash3_kvcache_args c_kvcache_args(const KvcacheArgs& a) {
  flash3_kvcache_args c;
  flash3_kvcache_args_init(&c);
  c.q = c_tensor(a.q);
  c.k_cache = c_tensor(a.k_cache);
  c.v_cache = c_tensor(a.v_cache);
  c.out = c_tensor(a.out);
  c.lse = c_tensor(a.lse);
  c.cache_seqlens = c_tensor(a.cache_seqlens);
  c.cache_batch_idx = c_tensor(a.cache_batch_idx);
  c.cache_leftpad = c_tensor(a.cache_leftpad);
  c.page_table = c_tensor(a.page_table);
  c.softmax_scale = a.softmax_scale;
  c.causal = a.causal;
  c.num_splits = a.num_splits;
  c.window = a.window_left != -1 || a.window_right != -1;
  c.window_left = a.window_left;
  c.window_right = a.window_right;
  c.softcap = a.softcap;
  c.k_new = c_tensor(a.k_new);
  c.v_new = c_tensor(a.v_new);
  c.rotary_cos = c_tensor(a.rotary_cos);
  c.rotary_sin = c_tensor(a.rotary_sin);
  c.rotary_interleaved = a.rotary_interleaved;
  c.qv = c_tensor(a.qv);
  return c;
}

TEST(CApiKvcache, InitSetsTheSizeAndZeroDefaults) {
  flash3_kvcache_args c;
  std::memset(&c, 0xAB, sizeof c);
  flash3_kvcache_args_init(&c);
  EXPECT_EQ(c.struct_size, sizeof(flash3_kvcache_args));
  EXPECT_EQ(c.struct_size, FLASH3_KVCACHE_ARGS_SIZE_V2);
  EXPECT_EQ(c.causal, 0);
  EXPECT_EQ(c.softmax_scale, 0.0f);
  EXPECT_EQ(c.num_splits, 0);  // the heuristic
  EXPECT_EQ(c.q.data, nullptr);
  for (const flash3_tensor* t : {&c.lse, &c.cache_seqlens, &c.cache_batch_idx, &c.cache_leftpad, &c.page_table}) {
    EXPECT_EQ(t->data, nullptr);  // not given
    EXPECT_EQ(t->rank, 0);
  }
  EXPECT_EQ(c.window, 0);
  EXPECT_EQ(c.softcap, 0.0f);
  EXPECT_EQ(c.stream, nullptr);
  for (const flash3_tensor* t : {&c.k_new, &c.v_new, &c.rotary_cos, &c.rotary_sin, &c.qv}) {
    EXPECT_EQ(t->data, nullptr);  // no append, no rotary, no MLA
    EXPECT_EQ(t->rank, 0);
  }
  EXPECT_EQ(c.rotary_interleaved, 0);
  EXPECT_EQ(c.reserved_v2, 0u);
}

// The size is the end of the last field, without padding (LP64: what the Python binding packs).
TEST(CApiKvcache, VersionSize) {
  EXPECT_EQ(offsetof(flash3_kvcache_args, q), 16u);
  EXPECT_EQ(offsetof(flash3_kvcache_args, cache_seqlens), 16 + 5 * sizeof(flash3_tensor));
  EXPECT_EQ(offsetof(flash3_kvcache_args, page_table), 16 + 8 * sizeof(flash3_tensor));
  EXPECT_EQ(offsetof(flash3_kvcache_args, window), 16 + 9 * sizeof(flash3_tensor));
  EXPECT_EQ(offsetof(flash3_kvcache_args, stream), 752u);
  EXPECT_EQ(FLASH3_KVCACHE_ARGS_SIZE_V1, 760u);
  // v2: the append's tensors and qv (MLA) where v1 ends, then the flag and a reserved word (no
  // tail padding)
  EXPECT_EQ(offsetof(flash3_kvcache_args, k_new), FLASH3_KVCACHE_ARGS_SIZE_V1);
  EXPECT_EQ(offsetof(flash3_kvcache_args, v_new), 760 + sizeof(flash3_tensor));
  EXPECT_EQ(offsetof(flash3_kvcache_args, rotary_cos), 760 + 2 * sizeof(flash3_tensor));
  EXPECT_EQ(offsetof(flash3_kvcache_args, rotary_sin), 760 + 3 * sizeof(flash3_tensor));
  EXPECT_EQ(offsetof(flash3_kvcache_args, qv), 1080u);
  EXPECT_EQ(offsetof(flash3_kvcache_args, rotary_interleaved), 1160u);
  EXPECT_EQ(offsetof(flash3_kvcache_args, reserved_v2), 1164u);
  EXPECT_EQ(FLASH3_KVCACHE_ARGS_SIZE_V2, 1168u);
  EXPECT_EQ(sizeof(flash3_kvcache_args), FLASH3_KVCACHE_ARGS_SIZE_V2);
}

TEST(CApiKvcache, ReportsInvalidArguments) {
  char err[512];
  auto fails = [&](const flash3_kvcache_args& c, const std::string& start) {
    EXPECT_EQ(flash3_fwd_kvcache(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(err).rfind(start, 0), 0u) << err;
  };
  flash3_kvcache_args c;
  flash3_kvcache_args_init(&c);  // every tensor NULL (rank 0)
  fails(c, "flash3::fwd_kvcache: q.rank is 0");
  KvcacheArgs a = make_paged(2, 1, 40, 16, 10, 8, 2, 64);
  a.cache_batch_idx = int32_entries(kBatchIdxAt, 2);
  fails(c_kvcache_args(a), "flash3::fwd_kvcache: cache_batch_idx is given with page_table");
  a = make_paged(2, 1, 40, 16, 10, 8, 2, 64);
  a.page_table.dtype = DType::kFloat32;
  fails(c_kvcache_args(a), "flash3::fwd_kvcache: page_table.dtype is float32; page_table must be int32");
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.cache_leftpad = TensorRef::contiguous(fake_ptr(kLeftpadAt), DType::kInt32, {3});
  fails(c_kvcache_args(a), "flash3::fwd_kvcache: cache_leftpad.shape[0] is 3 but q.shape[0] (batch) is 2");
  a = make_kvcache(2, 1, 512, 16, 2, 128);
  a.num_splits = 65;
  fails(c_kvcache_args(a), "flash3::fwd_kvcache: num_splits is 65");
  flash3_kvcache_args w = c_kvcache_args(make_kvcache(0, 1, 512, 16, 2, 128, /*with_data=*/false));
  w.window_left = -5;  // ignored: window is 0
  EXPECT_EQ(flash3_fwd_kvcache(&w, err, sizeof err), FLASH3_OK) << err;
  w.window = 1;
  fails(w, "flash3::fwd_kvcache: window_left is -5");
  w.window_left = 0;
  w.softcap = -2.0f;
  fails(w, "flash3::fwd_kvcache: softcap is -2");
}

// The v2 fields (the append) are read and checked by name; reserved_v2 must be 0; a v1 struct
// (struct_size of the first version) has no append, whatever bytes follow it.
TEST(CApiKvcache, AppendFields) {
  char err[512];
  auto fails = [&](const flash3_kvcache_args& c, const std::string& start) {
    EXPECT_EQ(flash3_fwd_kvcache(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(err).rfind(start, 0), 0u) << err;
  };
  const KvcacheArgs empty = make_kvcache(0, 1, 512, 16, 2, 128, /*with_data=*/false);
  KvcacheArgs a = with_rotary(with_append(empty, 3, /*with_data=*/false), 600, 64);
  a.rotary_interleaved = true;
  flash3_kvcache_args c = c_kvcache_args(a);
  EXPECT_EQ(c.rotary_interleaved, 1);
  EXPECT_EQ(flash3_fwd_kvcache(&c, err, sizeof err), FLASH3_OK) << err;  // batch 0: no launch
  c.v_new = flash3_tensor{};
  fails(c, "flash3::fwd_kvcache: v_new is not given but k_new is");
  c = c_kvcache_args(a);
  c.k_new.shape[1] = c.v_new.shape[1] = 513;
  fails(c, "flash3::fwd_kvcache: k_new.shape[1] (seqlen_new) is 513 but a sequence holds k_cache.shape[1] "
           "(seqlen_cache) = 512 keys; k_new overruns the cache");
  c = c_kvcache_args(a);
  c.rotary_sin.dtype = FLASH3_INT32;
  fails(c, "flash3::fwd_kvcache: rotary_sin.dtype is int32; rotary_cos and rotary_sin must be float32 or q's dtype "
           "(bfloat16)");
  c = c_kvcache_args(a);
  c.reserved_v2 = 1;
  fails(c, "flash3::fwd_kvcache: args->reserved_v2 is 1; it must be 0");
  // a first-version caller: the bytes past its struct (here a k_new without v_new, and 0xFF) are
  // not read
  c = c_kvcache_args(with_append(empty, 3, /*with_data=*/false));
  c.v_new = flash3_tensor{};
  fails(c, "flash3::fwd_kvcache: v_new is not given but k_new is");
  std::vector<unsigned char> buf(sizeof c, 0xFF);
  std::memcpy(buf.data(), &c, FLASH3_KVCACHE_ARGS_SIZE_V1 + sizeof(flash3_tensor));
  const uint32_t v1 = FLASH3_KVCACHE_ARGS_SIZE_V1;
  std::memcpy(buf.data(), &v1, sizeof v1);
  EXPECT_EQ(flash3_fwd_kvcache(reinterpret_cast<const flash3_kvcache_args*>(buf.data()), err, sizeof err), FLASH3_OK)
      << err;
}

// qv (v2) is read and checked by name; a v1 struct has no qv, whatever bytes follow it, so an
// MLA-shaped problem is then checked as one without qv.
TEST(CApiKvcache, QvField) {
  char err[512];
  auto fails = [&](const flash3_kvcache_args& c, const std::string& start) {
    EXPECT_EQ(flash3_fwd_kvcache(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(err).rfind(start, 0), 0u) << err;
  };
  const KvcacheArgs m = with_mla(make_kvcache(0, 1, 512, 16, 2, 64, /*with_data=*/false));
  flash3_kvcache_args c = c_kvcache_args(m);
  EXPECT_EQ(c.qv.rank, 4);
  EXPECT_EQ(c.qv.shape[3], 512);
  EXPECT_EQ(flash3_fwd_kvcache(&c, err, sizeof err), FLASH3_OK) << err;  // batch 0: no launch
  c.qv.dtype = FLASH3_FLOAT16;
  fails(c, "flash3::fwd_kvcache: qv.dtype is float16 but q.dtype is bfloat16; qv must have q's dtype");
  c = c_kvcache_args(m);
  c.qv.shape[3] = 256;
  fails(c, "flash3::fwd_kvcache: qv is given (MLA): qv.shape[3] (head_dim_v) is 256; MLA needs q's rotary part of "
           "64 and qv's latent of 512");
  c = c_kvcache_args(with_append(m, 3, /*with_data=*/false));
  EXPECT_EQ(flash3_fwd_kvcache(&c, err, sizeof err), FLASH3_OK) << err;  // the append with MLA
  c = c_kvcache_args(m);
  c.qv = flash3_tensor{};
  fails(c, "flash3::fwd_kvcache: out.shape[3] (head_dim) is 512 but q.shape[3] (head_dim) is 64");
  c = c_kvcache_args(m);
  c.struct_size = FLASH3_KVCACHE_ARGS_SIZE_V1;
  fails(c, "flash3::fwd_kvcache: out.shape[3] (head_dim) is 512 but q.shape[3] (head_dim) is 64");
}

TEST(CApiKvcache, EmptyBatchIsANoOp) {  // validation passes with no pointer to inspect
  for (const KvcacheArgs& a : {make_kvcache(0, 1, 512, 16, 2, 128, false),
                               make_paged(0, 4, 40, 16, 10, 8, 2, 64, false),
                               make_kvcache(2, 0, 512, 16, 2, 128, false)}) {
    const flash3_kvcache_args c = c_kvcache_args(a);
    char err[64] = "unchanged";
    EXPECT_EQ(flash3_fwd_kvcache(&c, err, sizeof err), FLASH3_OK) << err;
    EXPECT_STREQ(err, "");
  }
}

// The struct-size rules (flash3_c.h): NULL and sizes below the first version are rejected; a
// later version's struct is accepted while the bytes past the known fields are zero.
TEST(CApiKvcache, StructSizeRules) {
  char err[512];
  EXPECT_EQ(flash3_fwd_kvcache(nullptr, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_STREQ(err, "flash3::fwd_kvcache: args is null; pass a flash3_kvcache_args; set it up with "
                    "flash3_kvcache_args_init");
  flash3_kvcache_args c = c_kvcache_args(make_kvcache(0, 1, 512, 16, 2, 128, /*with_data=*/false));
  for (uint32_t size : {0u, 4u, 16u, FLASH3_KVCACHE_ARGS_SIZE_V1 - 1}) {
    c.struct_size = size;
    EXPECT_EQ(flash3_fwd_kvcache(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
    EXPECT_EQ(std::string(err), "flash3::fwd_kvcache: args->struct_size is " + std::to_string(size) +
                                    "; it must be at least " + std::to_string(FLASH3_KVCACHE_ARGS_SIZE_V1) +
                                    " (sizeof(flash3_kvcache_args) of the first version); set it up with "
                                    "flash3_kvcache_args_init");
  }
  c.struct_size = FLASH3_KVCACHE_ARGS_SIZE_V1;
  const uint32_t size = sizeof c + 24;
  std::vector<unsigned char> buf(size, 0);
  std::memcpy(buf.data(), &c, sizeof c);
  std::memcpy(buf.data(), &size, sizeof size);
  const auto* p = reinterpret_cast<const flash3_kvcache_args*>(buf.data());
  EXPECT_EQ(flash3_fwd_kvcache(p, err, sizeof err), FLASH3_OK) << err;
  buf[sizeof c + 3] = 1;
  EXPECT_EQ(flash3_fwd_kvcache(p, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err), "flash3::fwd_kvcache: args->struct_size is " + std::to_string(size) + " and byte " +
                                  std::to_string(sizeof c + 3) + " is not zero; this library knows the first " +
                                  std::to_string(sizeof c) +
                                  " bytes of flash3_kvcache_args: the caller sets an option it does not have (use a "
                                  "newer libflash3)");
  // the fields are read: a bad tensor in the struct is still checked
  c.k_cache.shape[3] = 64;
  EXPECT_EQ(flash3_fwd_kvcache(&c, err, sizeof err), FLASH3_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(err).rfind("flash3::fwd_kvcache: v_cache.shape[3] (head_dim) is 128 but k_cache.shape[3]", 0),
            0u)
      << err;
}

}  // namespace

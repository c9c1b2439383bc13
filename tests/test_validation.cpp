// validate_fwd on the CPU: a fake PointerInspector stands in for the CUDA runtime, so every rule
// is checked without a GPU. Each rule has one test that checks the message names the argument
// and the value it got.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>

#include "flash3/flash3.h"

namespace {

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

// validate_fwd throws flash3::Error and its message starts with "flash3::fwd: " and contains
// every one of parts.
::testing::AssertionResult fails_with(const FwdArgs& a, std::initializer_list<std::string> parts) {
  try {
    flash3::validate_fwd(a, &fake_inspect);
  } catch (const flash3::Error& e) {
    const std::string msg = e.what();
    if (msg.rfind("flash3::fwd: ", 0) != 0) return ::testing::AssertionFailure() << "bad prefix: " << msg;
    for (const std::string& part : parts) {
      if (msg.find(part) == std::string::npos) {
        return ::testing::AssertionFailure() << "message \"" << msg << "\" lacks \"" << part << "\"";
      }
    }
    return ::testing::AssertionSuccess() << msg;
  }
  return ::testing::AssertionFailure() << "validate_fwd did not throw";
}

class Validate : public ::testing::Test {
 protected:
  void SetUp() override {
    g_host = g_unknown = nullptr;
    g_calls = 0;
  }
  FwdArgs a = make_args(2, 128, 256, 8, 2, 128);  // a valid GQA baseline
};

// ---- valid arguments -------------------------------------------------------------------------

TEST_F(Validate, BaselinePassesAndFillsTheProblem) {
  const flash3::FwdProblem p = flash3::validate_fwd(a, &fake_inspect);
  EXPECT_EQ(p.dtype, DType::kBFloat16);
  EXPECT_EQ(p.batch, 2);
  EXPECT_EQ(p.seqlen_q, 128);
  EXPECT_EQ(p.seqlen_k, 256);
  EXPECT_EQ(p.nheads, 8);
  EXPECT_EQ(p.nheads_kv, 2);
  EXPECT_EQ(p.head_dim, 128);
  EXPECT_FLOAT_EQ(p.softmax_scale, 1.0f / std::sqrt(128.0f));
  EXPECT_TRUE(p.causal);
  EXPECT_TRUE(p.write_lse);
  EXPECT_EQ(g_calls, 5);  // q, k, v, out, lse
}

TEST_F(Validate, Float16AndEveryHeadDimPass) {
  for (int64_t d : {64, 128, 256}) {
    FwdArgs b = make_args(1, 8, 8, 4, 4, d);
    for (TensorRef* t : {&b.q, &b.k, &b.v, &b.out}) t->dtype = DType::kFloat16;
    b.causal = false;
    const flash3::FwdProblem p = flash3::validate_fwd(b, &fake_inspect);
    EXPECT_EQ(p.dtype, DType::kFloat16);
    EXPECT_EQ(p.head_dim, d);
    EXPECT_FALSE(p.causal);
  }
}

TEST_F(Validate, LseIsOptional) {
  a.lse = TensorRef{};  // data == nullptr: not written, nothing else about it is checked
  EXPECT_FALSE(flash3::validate_fwd(a, &fake_inspect).write_lse);
  EXPECT_EQ(g_calls, 4);
}

TEST_F(Validate, ExplicitScaleIsKept) {
  a.softmax_scale = 0.5f;
  EXPECT_EQ(flash3::validate_fwd(a, &fake_inspect).softmax_scale, 0.5f);
}

TEST_F(Validate, NonPositiveOrNanScaleMeansDefault) {
  for (float s : {0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()}) {
    a.softmax_scale = s;
    EXPECT_FLOAT_EQ(flash3::validate_fwd(a, &fake_inspect).softmax_scale, 1.0f / std::sqrt(128.0f)) << s;
  }
}

TEST_F(Validate, PaddedStridesPass) {  // q and out as slices of wider buffers
  for (TensorRef* t : {&a.q, &a.out}) {
    t->stride[2] = 136;
    t->stride[1] = 8 * 136 + 8;
    t->stride[0] = 128 * t->stride[1];
  }
  EXPECT_NO_THROW(flash3::validate_fwd(a, &fake_inspect));
}

TEST_F(Validate, StridesOfSizeOneDimsAreIgnored) {
  a = make_args(1, 128, 256, 1, 1, 64);
  a.q.stride[0] = 0;
  a.k.stride[2] = 3;
  a.lse.stride[1] = -7;
  EXPECT_NO_THROW(flash3::validate_fwd(a, &fake_inspect));
}

TEST_F(Validate, EmptyBatchSkipsPointerChecks) {
  a = make_args(0, 128, 256, 8, 2, 128, /*with_data=*/false);
  EXPECT_EQ(flash3::validate_fwd(a, &fake_inspect).batch, 0);
  EXPECT_EQ(g_calls, 0);
}

TEST_F(Validate, EmptySeqlenQSkipsPointerChecks) {
  a = make_args(2, 0, 256, 8, 2, 128, /*with_data=*/false);
  EXPECT_EQ(flash3::validate_fwd(a, &fake_inspect).seqlen_q, 0);
  EXPECT_EQ(g_calls, 0);
}

TEST_F(Validate, EmptyKeysNeedNoKvPointers) {  // every row sees no key: out = 0, lse = +inf
  a.k = TensorRef::contiguous(nullptr, DType::kBFloat16, {2, 0, 2, 128});
  a.v = a.k;
  EXPECT_EQ(flash3::validate_fwd(a, &fake_inspect).seqlen_k, 0);
  EXPECT_EQ(g_calls, 3);  // q, out, lse
}

// ---- one test per rule -----------------------------------------------------------------------

TEST_F(Validate, RankOfQkvOut) {
  a.q.rank = 3;
  EXPECT_TRUE(fails_with(a, {"q.rank is 3", "q must have rank 4 (batch, seqlen_q, nheads, head_dim)"}));
}

TEST_F(Validate, RankOfLse) {
  a.lse.rank = 4;
  EXPECT_TRUE(fails_with(a, {"lse.rank is 4", "lse must have rank 3 (batch, nheads, seqlen_q)"}));
}

TEST_F(Validate, UnsupportedDtype) {
  for (TensorRef* t : {&a.q, &a.k, &a.v, &a.out}) t->dtype = DType::kFloat32;
  EXPECT_TRUE(fails_with(a, {"q.dtype is float32", "supported dtypes are float16, bfloat16"}));
  a.q.dtype = static_cast<DType>(42);
  EXPECT_TRUE(fails_with(a, {"q.dtype is unknown (code 42)"}));
}

TEST_F(Validate, DtypeMismatch) {
  a.k.dtype = DType::kFloat16;
  EXPECT_TRUE(fails_with(a, {"flash3::fwd: k.dtype is float16 but q.dtype is bfloat16; q, k, v and out must "
                             "have the same dtype"}));
}

TEST_F(Validate, LseDtype) {
  a.lse.dtype = DType::kBFloat16;
  EXPECT_TRUE(fails_with(a, {"lse.dtype is bfloat16", "lse must be float32"}));
}

TEST_F(Validate, NegativeSize) {
  a.q.shape[1] = -1;
  EXPECT_TRUE(fails_with(a, {"q.shape[1] (seqlen_q) is -1", "sizes must be >= 0"}));
}

TEST_F(Validate, SizeBeyondInt32) {
  a.k.shape[1] = a.v.shape[1] = int64_t{1} << 31;
  EXPECT_TRUE(fails_with(a, {"k.shape[1] (seqlen_k) is 2147483648", "int32"}));
}

TEST_F(Validate, BatchMismatch) {
  a.k.shape[0] = 3;
  EXPECT_TRUE(fails_with(a, {"k.shape[0] (batch) is 3 but q.shape[0] (batch) is 2"}));
}

TEST_F(Validate, HeadDimMismatch) {
  a.k.shape[3] = 64;
  EXPECT_TRUE(fails_with(a, {"k.shape[3] (head_dim) is 64 but q.shape[3] (head_dim) is 128"}));
}

TEST_F(Validate, KAndVShapesDiffer) {
  a.v.shape[1] = 255;
  EXPECT_TRUE(fails_with(a, {"v.shape[1] (seqlen_k) is 255 but k.shape[1] (seqlen_k) is 256", "same shape"}));
}

TEST_F(Validate, OutShapeDiffersFromQ) {
  a.out.shape[2] = 4;
  EXPECT_TRUE(fails_with(a, {"out.shape[2] (nheads) is 4 but q.shape[2] (nheads) is 8", "same shape as q"}));
}

TEST_F(Validate, LseShape) {
  a.lse.shape[2] = 127;
  EXPECT_TRUE(fails_with(a, {"lse.shape[2] (seqlen_q) is 127 but q.shape[1] (seqlen_q) is 128"}));
}

TEST_F(Validate, UnsupportedHeadDim) {
  a = make_args(2, 128, 256, 8, 2, 96);
  EXPECT_TRUE(fails_with(a, {"flash3::fwd: q.shape[3] (head_dim) is 96; supported head dims are 64, 128, 256"}));
}

TEST_F(Validate, NoKvHeads) {
  a = make_args(2, 128, 256, 8, 0, 128);
  EXPECT_TRUE(fails_with(a, {"k.shape[2] (nheads_kv) is 0"}));
}

TEST_F(Validate, HeadsNotAMultipleOfKvHeads) {
  a = make_args(2, 128, 256, 6, 4, 128);
  EXPECT_TRUE(fails_with(a, {"q.shape[2] (nheads) is 6 and k.shape[2] (nheads_kv) is 4", "multiple"}));
}

TEST_F(Validate, LastDimNotContiguous) {
  a.q.stride[3] = 2;
  EXPECT_TRUE(fails_with(a, {"q.stride[3] is 2", "stride 1"}));
}

TEST_F(Validate, LseLastDimNotContiguous) {
  a.lse.stride[2] = 2;
  EXPECT_TRUE(fails_with(a, {"lse.stride[2] is 2", "stride 1"}));
}

TEST_F(Validate, StrideNotAMultipleOf16Bytes) {
  a.k.stride[1] = 260;
  EXPECT_TRUE(fails_with(a, {"k.stride[1] (seqlen_k) is 260 elements (520 bytes)",
                             "multiples of 8 elements (16 bytes)"}));
}

TEST_F(Validate, NonPositiveStride) {
  a.v.stride[0] = 0;
  EXPECT_TRUE(fails_with(a, {"v.stride[0] (batch) is 0", "positive"}));
  a.v.stride[0] = -256;
  EXPECT_TRUE(fails_with(a, {"v.stride[0] (batch) is -256", "positive"}));
}

TEST_F(Validate, InfiniteScale) {
  a.softmax_scale = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(fails_with(a, {"softmax_scale is inf", "finite"}));
}

TEST_F(Validate, NullPointer) {
  a.q.data = nullptr;
  EXPECT_TRUE(fails_with(a, {"q.data is null"}));
}

TEST_F(Validate, MisalignedPointer) {
  a.out.data = fake_ptr(0x400008);
  EXPECT_TRUE(fails_with(a, {"out.data is 0x400008", "16-byte aligned"}));
  a = make_args(2, 128, 256, 8, 2, 128);
  a.lse.data = fake_ptr(0x500002);
  EXPECT_TRUE(fails_with(a, {"lse.data is 0x500002", "4-byte aligned"}));
}

TEST_F(Validate, HostPointer) {
  g_host = a.v.data;
  EXPECT_TRUE(fails_with(a, {"flash3::fwd: v.data points to host memory; flash3 needs device memory (cudaMalloc "
                             "or a CUDA tensor)"}));
  g_host = a.lse.data;
  EXPECT_TRUE(fails_with(a, {"lse.data points to host memory"}));
}

TEST_F(Validate, UnknownPointer) {
  g_unknown = a.k.data;
  EXPECT_TRUE(fails_with(a, {"k.data (0x200000) is not a pointer the CUDA runtime knows"}));
}

TEST_F(Validate, PointerChecksComeLast) {
  g_host = a.q.data;
  a.k.stride[2] = 4;
  EXPECT_TRUE(fails_with(a, {"k.stride[2] (nheads_kv) is 4"}));
  EXPECT_EQ(g_calls, 0);
}

}  // namespace

// flash3: validate_quantize, every precondition of quantize_fp8 checked on the host before any
// launch (plain C++, testable without a GPU through an injected PointerInspector).
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>

#include "flash3/flash3.h"
#include "quant/quantize.h"

namespace flash3 {
namespace {

// Message pieces as text: plain std::string building, no iostreams (see src/validate.cpp: an
// std::ostream crashed inside a PyTorch process that loaded the library through ctypes).
std::string text(const char* s) { return s; }
std::string text(const std::string& s) { return s; }
std::string text(int v) { return std::to_string(v); }
std::string text(long long v) { return std::to_string(v); }
std::string text(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}
std::string text(DType dtype) {
  if (dtype_size(dtype) == 0) return "unknown (code " + std::to_string(static_cast<int>(dtype)) + ")";
  return dtype_name(dtype);
}

template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::string msg = "flash3::quantize_fp8: ";
  ((msg += text(parts)), ...);
  throw Error(msg);
}

// A tensor argument: its name, the names of its dims and the rank it must have.
struct Arg {
  const char* name;
  const TensorRef& t;
  const char* const* dims;
  int rank;
};
const char* const kRowDims[] = {"batch", "seqlen", "nheads", "head_dim"};
const char* const kScaleDims[] = {"batch", "nheads", "num_blocks"};

std::string dim(const Arg& a, int d) {
  return std::string(a.name) + ".shape[" + std::to_string(d) + "] (" + a.dims[d] + ")";
}
std::string layout(const Arg& a) {
  std::string s;
  for (int d = 0; d < a.rank; ++d) s += std::string(d ? ", " : "(") + a.dims[d];
  return s + ")";
}

bool is_empty(const Arg& a) {
  for (int d = 0; d < a.rank; ++d) {
    if (a.t.shape[d] == 0) return true;
  }
  return false;
}

void check_rank(const Arg& a) {
  if (a.t.rank != a.rank) {
    fail(a.name, ".rank is ", a.t.rank, "; ", a.name, " must have rank ", a.rank, " ", layout(a));
  }
}

void check_sizes(const Arg& a) {
  for (int d = 0; d < a.rank; ++d) {
    const int64_t s = a.t.shape[d];
    if (s < 0) fail(dim(a, d), " is ", (long long)s, "; sizes must be >= 0");
    if (s > std::numeric_limits<int32_t>::max()) {
      fail(dim(a, d), " is ", (long long)s, "; sizes must fit in int32 (at most 2147483647)");
    }
  }
}

// in and out: the last dim contiguous (the other strides are free). Written tensors (out and
// scale): no stride 0 on a dim of size > 1, where distinct elements would share memory and be
// written concurrently.
void check_strides(const Arg& a, bool contiguous_last, bool written) {
  if (is_empty(a)) return;  // an empty tensor's strides are never used
  const int last = a.rank - 1;
  if (contiguous_last && a.t.stride[last] != 1) {
    fail(a.name, ".stride[", last, "] is ", (long long)a.t.stride[last],
         "; the last dim must be contiguous (stride 1)");
  }
  if (!written) return;
  for (int d = 0; d < a.rank; ++d) {
    if (contiguous_last && d == last) continue;
    if (a.t.shape[d] > 1 && a.t.stride[d] == 0) {
      fail(a.name, ".stride[", d, "] (", a.dims[d], ") is 0; ", a.name,
           " is written, so dims of size > 1 need a nonzero stride");
    }
  }
}

// Non-null device memory aligned to the element size.
void check_pointer(const Arg& a, PointerInspector inspect) {
  const void* p = a.t.data;
  if (p == nullptr) fail(a.name, ".data is null; a non-empty ", a.name, " needs a device pointer");
  const int align = dtype_size(a.t.dtype);
  if (reinterpret_cast<uintptr_t>(p) % align != 0) {
    fail(a.name, ".data is ", p, ", not ", align, "-byte aligned; ", a.name, " holds ",
         text(a.t.dtype), " elements");
  }
  const char* needs = "; flash3 needs device memory (cudaMalloc or a CUDA tensor)";
  switch ((inspect ? inspect : &cuda_pointer_kind)(p)) {
    case PointerKind::kDevice: return;
    case PointerKind::kHost: fail(a.name, ".data points to host memory", needs);
    case PointerKind::kUnknown: fail(a.name, ".data (", p, ") is not a pointer the CUDA runtime knows", needs);
  }
}

// Every row start of `t` (rank 4, last dim contiguous) is `bytes`-aligned: the data pointer,
// and the strides of the dims of size > 1 in bytes.
bool rows_aligned(const TensorRef& t, int bytes) {
  const int esize = dtype_size(t.dtype);
  if (reinterpret_cast<uintptr_t>(t.data) % bytes != 0) return false;
  for (int d = 0; d < 3; ++d) {
    if (t.shape[d] > 1 && (t.stride[d] * esize) % bytes != 0) return false;
  }
  return true;
}

}  // namespace

QuantizeProblem validate_quantize(const QuantizeArgs& args, PointerInspector inspect) {
  const Arg in{"in", args.in, kRowDims, 4}, out{"out", args.out, kRowDims, 4},
      scale{"scale", args.scale, kScaleDims, 3};

  for (const Arg* a : {&in, &out, &scale}) check_rank(*a);
  if (args.in.dtype != DType::kFloat16 && args.in.dtype != DType::kBFloat16) {
    fail("in.dtype is ", text(args.in.dtype), "; supported dtypes are float16, bfloat16");
  }
  if (args.out.dtype != DType::kFloat8E4M3) {
    fail("out.dtype is ", text(args.out.dtype), "; out must be float8_e4m3");
  }
  if (args.scale.dtype != DType::kFloat32) {
    fail("scale.dtype is ", text(args.scale.dtype), "; scale must be float32");
  }
  for (const Arg* a : {&in, &out, &scale}) check_sizes(*a);
  if (args.block_rows < 0) {
    fail("block_rows is ", args.block_rows, "; it must be >= 1, or 0 for fp8_block_kv(head_dim) (kFp8BlockQ = ",
         kFp8BlockQ, " for q, fp8_block_kv(", (long long)args.in.shape[3], ") = ", fp8_block_kv(args.in.shape[3]),
         " for k and v)");
  }
  for (int d = 0; d < 4; ++d) {
    if (args.out.shape[d] != args.in.shape[d]) {
      fail(dim(out, d), " is ", (long long)args.out.shape[d], " but ", dim(in, d), " is ",
           (long long)args.in.shape[d], "; out must have the same shape as in");
    }
  }
  const int64_t batch = args.in.shape[0], seqlen = args.in.shape[1], nheads = args.in.shape[2],
                head_dim = args.in.shape[3];
  const int block_rows = args.block_rows == 0 ? fp8_block_kv(head_dim) : args.block_rows;
  const int64_t num_blocks = (seqlen + block_rows - 1) / block_rows;
  const int64_t want[3] = {batch, nheads, num_blocks};
  const char* const from[3] = {"in.shape[0] (batch)", "in.shape[2] (nheads)",
                               "ceil(seqlen / block_rows)"};
  for (int d = 0; d < 3; ++d) {
    if (args.scale.shape[d] != want[d]) {
      fail(dim(scale, d), " is ", (long long)args.scale.shape[d], " but ", from[d], " is ",
           (long long)want[d], " (seqlen ", (long long)seqlen, ", block_rows ", block_rows,
           "); scale must be (batch, nheads, ceil(seqlen / block_rows))");
    }
  }
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) {
    fail(dim(in, 3), " is ", (long long)head_dim, "; supported head dims are 64, 128, 256");
  }
  check_strides(in, true, false);
  check_strides(out, true, true);
  check_strides(scale, false, true);

  QuantizeProblem p;
  p.dtype = args.in.dtype;
  p.batch = static_cast<int>(batch);
  p.seqlen = static_cast<int>(seqlen);
  p.nheads = static_cast<int>(nheads);
  p.head_dim = static_cast<int>(head_dim);
  p.block_rows = block_rows;
  p.num_blocks = static_cast<int>(num_blocks);
  p.units = batch * nheads * num_blocks;  // each factor < 2^31: fits in int64
  p.hadamard = args.hadamard;
  p.seed = args.seed;
  if (p.empty()) return p;

  // Pointers last, and only when there is something to compute.
  for (const Arg* a : {&in, &out, &scale}) check_pointer(*a, inspect);
  for (const Arg* a : {&out, &scale}) {
    if (a->t.data == args.in.data) {
      fail(a->name, ".data is ", a->t.data, ", the same as in.data; ", a->name,
           " must not overlap in");
    }
  }
  if (args.scale.data == args.out.data) {
    fail("scale.data is ", args.scale.data, ", the same as out.data; scale must not overlap out");
  }
  p.vectorized = rows_aligned(args.in, 16) && rows_aligned(args.out, 8);
  return p;
}

}  // namespace flash3

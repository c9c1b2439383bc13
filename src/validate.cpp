// validate_fwd: every precondition of flash3::fwd, checked on the host before any launch.
// Each failure throws flash3::Error naming the argument, the value it got and what is allowed.
#include "flash3/flash3.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <cstdio>
#include <string>
#include <vector>

namespace flash3 {
namespace {

// Message pieces as text. NOTES: plain std::string building, no iostreams: formatting through
// std::ostream crashed (inside the locale machinery) when the library was loaded by ctypes
// into a PyTorch process on the GPU machine.
struct Arg;
struct Dim;
struct Layout;
struct Name;
std::string text(const char* s) { return s; }
std::string text(int v) { return std::to_string(v); }
std::string text(long v) { return std::to_string(v); }
std::string text(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", v);
  return buf;
}
std::string text(float v) { return text(double(v)); }
std::string text(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}
std::string text(const Dim& x);
std::string text(const Layout& x);
std::string text(const Name& x);

// The one place error messages are formatted: "flash3::fwd: " + the pieces.
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  std::string msg = "flash3::fwd: ";
  ((msg += text(parts)), ...);
  throw Error(msg);
}

// An argument, the names of its dims, and the rank it must have.
struct Arg {
  const char* name;
  const TensorRef& t;
  const char* const* dims;
  int rank;
};
const char* const kQDims[] = {"batch", "seqlen_q", "nheads", "head_dim"};
const char* const kKDims[] = {"batch", "seqlen_k", "nheads_kv", "head_dim"};
const char* const kLseDims[] = {"batch", "nheads", "seqlen_q"};

// "q.shape[3] (head_dim)".
struct Dim {
  const Arg& a;
  int d;
};
std::string text(const Dim& x) {
  return std::string(x.a.name) + ".shape[" + std::to_string(x.d) + "] (" + x.a.dims[x.d] + ")";
}
// "(batch, seqlen_q, nheads, head_dim)".
struct Layout {
  const Arg& a;
};
std::string text(const Layout& x) {
  std::string s;
  for (int d = 0; d < x.a.rank; ++d) s += std::string(d ? ", " : "(") + x.a.dims[d];
  return s + ")";
}
// A dtype name, or the code of a value that is not a DType.
struct Name {
  DType dtype;
};
std::string text(const Name& x) {
  if (dtype_size(x.dtype) == 0) return "unknown (code " + std::to_string(static_cast<int>(x.dtype)) + ")";
  return dtype_name(x.dtype);
}

void check_same(const Arg& a, int da, const Arg& b, int db, const char* rule) {
  if (a.t.shape[da] != b.t.shape[db]) {
    fail(Dim{a, da}, " is ", a.t.shape[da], " but ", Dim{b, db}, " is ", b.t.shape[db], "; ", rule);
  }
}

bool is_empty(const Arg& a) {
  for (int d = 0; d < a.rank; ++d) {
    if (a.t.shape[d] == 0) return true;
  }
  return false;
}

void check_pointer(const Arg& a, int align, PointerInspector inspect) {
  const void* p = a.t.data;
  if (p == nullptr) fail(a.name, ".data is null; a non-empty ", a.name, " needs a device pointer");
  if (reinterpret_cast<uintptr_t>(p) % align != 0) {
    fail(a.name, ".data is ", p, ", not ", align, "-byte aligned; flash3 needs ", align,
         "-byte aligned data pointers");
  }
  const char* needs = "; flash3 needs device memory (cudaMalloc or a CUDA tensor)";
  switch (inspect(p)) {
    case PointerKind::kDevice: return;
    case PointerKind::kHost: fail(a.name, ".data points to host memory", needs);
    case PointerKind::kUnknown:
      fail(a.name, ".data (", p, ") is not a pointer the CUDA runtime knows", needs);
  }
}

}  // namespace

FwdProblem validate_fwd(const FwdArgs& args, PointerInspector inspect) {
  const Arg q{"q", args.q, kQDims, 4}, k{"k", args.k, kKDims, 4}, v{"v", args.v, kKDims, 4},
      out{"out", args.out, kQDims, 4}, lse{"lse", args.lse, kLseDims, 3};
  const bool write_lse = args.lse.data != nullptr;
  std::vector<const Arg*> all = {&q, &k, &v, &out};
  if (write_lse) all.push_back(&lse);

  for (const Arg* a : all) {
    if (a->t.rank != a->rank) {
      fail(a->name, ".rank is ", a->t.rank, "; ", a->name, " must have rank ", a->rank, " ", Layout{*a});
    }
  }

  const DType dtype = args.q.dtype;
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    fail("q.dtype is ", Name{dtype}, "; supported dtypes are float16, bfloat16");
  }
  for (const Arg* a : {&k, &v, &out}) {
    if (a->t.dtype != dtype) {
      fail(a->name, ".dtype is ", Name{a->t.dtype}, " but q.dtype is ", Name{dtype},
           "; q, k, v and out must have the same dtype");
    }
  }
  if (write_lse && args.lse.dtype != DType::kFloat32) {
    fail("lse.dtype is ", Name{args.lse.dtype}, "; lse must be float32");
  }

  for (const Arg* a : all) {
    for (int d = 0; d < a->rank; ++d) {
      const int64_t s = a->t.shape[d];
      if (s < 0) fail(Dim{*a, d}, " is ", s, "; sizes must be >= 0");
      if (s > std::numeric_limits<int32_t>::max()) {
        fail(Dim{*a, d}, " is ", s, "; sizes must fit in int32 (at most 2147483647)");
      }
    }
  }

  check_same(k, 0, q, 0, "q and k must have the same batch");
  check_same(k, 3, q, 3, "q and k must have the same head_dim");
  for (int d = 0; d < 4; ++d) check_same(v, d, k, d, "k and v must have the same shape");
  for (int d = 0; d < 4; ++d) check_same(out, d, q, d, "out must have the same shape as q");
  if (write_lse) {
    const char* rule = "lse must be (batch, nheads, seqlen_q)";
    check_same(lse, 0, q, 0, rule);
    check_same(lse, 1, q, 2, rule);
    check_same(lse, 2, q, 1, rule);
  }

  const int64_t head_dim = args.q.shape[3], nheads = args.q.shape[2], nheads_kv = args.k.shape[2];
  if (!is_supported_head_dim(static_cast<int>(head_dim))) {
    fail(Dim{q, 3}, " is ", head_dim, "; supported head dims are 64, 128, 256");
  }
  if (nheads_kv < 1) fail(Dim{k, 2}, " is ", nheads_kv, "; k and v need at least one head");
  if (nheads < 1 || nheads % nheads_kv != 0) {
    fail(Dim{q, 2}, " is ", nheads, " and ", Dim{k, 2}, " is ", nheads_kv,
         "; nheads must be a positive multiple of nheads_kv");
  }

  // Only the last dim is contiguous; the others are used as strides of 16-byte (TMA) copies.
  const int esize = dtype_size(dtype), align_elems = 16 / esize;
  for (const Arg* a : all) {
    const int last = a->rank - 1;
    if (a->t.stride[last] != 1) {
      fail(a->name, ".stride[", last, "] is ", a->t.stride[last],
           "; the last dim must be contiguous (stride 1)");
    }
    for (int d = 0; d < last && !is_empty(*a); ++d) {  // an empty tensor's strides are never used
      if (a->t.shape[d] == 1) continue;                    // nor the stride of a dim of size 1
      const int64_t st = a->t.stride[d];
      if (st <= 0) {
        fail(a->name, ".stride[", d, "] (", a->dims[d], ") is ", st,
             "; strides must be positive for dims of size > 1");
      }
      if (a != &lse && st % align_elems != 0) {
        fail(a->name, ".stride[", d, "] (", a->dims[d], ") is ", st, " elements (", st * esize,
             " bytes); strides other than the last must be multiples of ", align_elems,
             " elements (16 bytes)");
      }
    }
  }

  float scale = args.softmax_scale;
  if (std::isinf(scale)) {
    fail("softmax_scale is ", scale, "; it must be finite (or <= 0 for the default 1/sqrt(head_dim))");
  }
  if (!(scale > 0.0f)) scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));

  // Pointers last, and only when there is something to compute.
  if (args.q.shape[0] > 0 && args.q.shape[1] > 0) {
    for (const Arg* a : all) {
      if (!is_empty(*a)) check_pointer(*a, a == &lse ? 4 : 16, inspect ? inspect : &cuda_pointer_kind);
    }
  }

  FwdProblem p;
  p.dtype = dtype;
  p.batch = static_cast<int>(args.q.shape[0]);
  p.seqlen_q = static_cast<int>(args.q.shape[1]);
  p.seqlen_k = static_cast<int>(args.k.shape[1]);
  p.nheads = static_cast<int>(nheads);
  p.nheads_kv = static_cast<int>(nheads_kv);
  p.head_dim = static_cast<int>(head_dim);
  p.softmax_scale = scale;
  p.causal = args.causal;
  p.write_lse = write_lse;
  return p;
}

}  // namespace flash3

// validate_fwd and validate_bwd: every precondition of flash3::fwd and flash3::bwd, checked on
// the host before any launch. Each failure throws flash3::Error whose message starts with the
// operation ("flash3::fwd: " or "flash3::bwd: ") and names the argument, the value it got and
// what is allowed.
#include "flash3/flash3.h"

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "common/seqlen.h"

namespace flash3 {
namespace {

// NOTES: the kernels index tiles, and the launchers size grids, in 32-bit int: the number of
// query tiles (forward; backward preprocess and dQ postprocess) and of key tiles (backward
// main kernel) x nheads x batch. Tiles are at least kMinTile rows (one WGMMA's 64 rows; every
// tile of either pass is 64, 128 or 192 rows or keys), so ceil(seqlen / kMinTile) x nheads x
// batch bounds them. The bound kMaxTiles = 2^30 leaves int room above the last tile index for
// the schedulers' "tile + grid" steps and counters that run past the end by up to one per block.
// With seqlen <= kMaxSeqlen (seqlen.h) the row arithmetic (row + block ends, seqlen_k -
// seqlen_q) fits too, and so does every other product (batch x seqlen x nheads <= 2^36 rows, in
// int64 where formed, grids of 256-row blocks <= 2^28).
constexpr int64_t kMinTile = 64;
constexpr int64_t kMaxTiles = int64_t(1) << 30;

// NOTES: both passes form exponents as exp2(fma(S, scale * log2(e), -offset)) with offset a row's
// max (forward) or its lse (backward) times scale * log2(e), rounded to float32; the FFMA takes
// S * scale_log2 exactly, so the rounding of offset (2^-24 |offset|) goes into the exponent of
// every P: exact only while |offset| stays below about 2^20 (residual <= 2^-5). |offset| is about
// softmax_scale x max |S|; for unit-scale data (|q|, |k| elements <= 1, what a softmax_scale near
// 1/sqrt(head_dim) is meant for) |S| <= head_dim <= 2^8, so softmax_scale <= 2^20 / (2^8 log2(e))
// = 2839 keeps every P exact: the bound is 2^11. (At softmax_scale = 1e30 the residual reaches
// 1e23 and P overflowed to inf, then NaN.)
constexpr float kMaxSoftmaxScale = 2048.0f;

// Message pieces as text. NOTES: plain std::string building, no iostreams: formatting through
// std::ostream crashed (inside the locale machinery) when the library was loaded by ctypes
// into a PyTorch process on the GPU machine.
struct Arg;
struct Dim;
struct Layout;
struct Name;
std::string text(const char* s) { return s; }
std::string text(const std::string& s) { return s; }
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
const char* const kQScaleDims[] = {"batch", "nheads", "q_blocks"};
const char* const kKScaleDims[] = {"batch", "nheads_kv", "kv_blocks"};

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

bool is_empty(const Arg& a) {
  for (int d = 0; d < a.rank; ++d) {
    if (a.t.shape[d] == 0) return true;
  }
  return false;
}

using Args = std::vector<const Arg*>;

// The checks validate_fwd and validate_bwd share. `op` ("flash3::fwd: ") starts every message.
class Checker {
 public:
  explicit Checker(const char* op) : op_(op) {}

  // The one place error messages are formatted: op + the pieces.
  template <class... Parts>
  [[noreturn]] void fail(const Parts&... parts) const {
    std::string msg = op_;
    ((msg += text(parts)), ...);
    throw Error(msg);
  }

  void ranks(const Args& all) const {
    for (const Arg* a : all) {
      if (a->t.rank != a->rank) {
        fail(a->name, ".rank is ", a->t.rank, "; ", a->name, " must have rank ", a->rank, " ", Layout{*a});
      }
    }
  }

  // q is float16 or bfloat16, each of `same` has q's dtype (else `rule`), lse (if any) float32.
  // `more`: the other dtypes q may have (the message's end).
  DType dtypes(const Arg& q, const Args& same, const Arg* lse, const char* rule, const char* more = "") const {
    const DType dtype = q.t.dtype;
    if (dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
      fail("q.dtype is ", Name{dtype}, "; supported dtypes are float16, bfloat16", more);
    }
    for (const Arg* a : same) {
      if (a->t.dtype != dtype) {
        fail(a->name, ".dtype is ", Name{a->t.dtype}, " but q.dtype is ", Name{dtype}, "; ", rule);
      }
    }
    if (lse != nullptr && lse->t.dtype != DType::kFloat32) {
      fail("lse.dtype is ", Name{lse->t.dtype}, "; lse must be float32");
    }
    return dtype;
  }

  // FP8 q: k and v float8_e4m3 too, out bfloat16, lse (if any) float32.
  void fp8_dtypes(const Arg& k, const Arg& v, const Arg& out, const Arg* lse) const {
    for (const Arg* a : {&k, &v}) {
      if (a->t.dtype != DType::kFloat8E4M3) {
        fail(a->name, ".dtype is ", Name{a->t.dtype}, " but q.dtype is float8_e4m3; q, k and v must have the same dtype");
      }
    }
    if (out.t.dtype != DType::kBFloat16) {
      fail("out.dtype is ", Name{out.t.dtype}, "; with float8_e4m3 q, k, v, out must be bfloat16");
    }
    if (lse != nullptr && lse->t.dtype != DType::kFloat32) {
      fail("lse.dtype is ", Name{lse->t.dtype}, "; lse must be float32");
    }
  }

  // An FP8 dequantization scale (FwdArgs::q_scale, k_scale, v_scale): float32, (batch, heads)
  // with heads = nheads_kv (one per (batch, kv head)) or (batch, heads_blocks, blocks) with
  // `blocks` blocks of `block` rows; any strides >= 0; 4-byte aligned device memory.
  void fp8_scale(const Arg& s, int64_t batch, int64_t nheads_kv, int64_t heads_blocks, int64_t seqlen, int block,
                 PointerInspector inspect) const {
    const TensorRef& t = s.t;
    const int64_t blocks = (seqlen + block - 1) / block;
    const std::string shapes = std::string("; ") + s.name + " must be (batch, nheads_kv) = (" + std::to_string(batch) +
                               ", " + std::to_string(nheads_kv) + ") or (batch, " + s.dims[1] + ", ceil(" +
                               (s.dims == kQScaleDims ? "seqlen_q / " : "seqlen_k / ") + std::to_string(block) +
                               ")) = (" + std::to_string(batch) + ", " + std::to_string(heads_blocks) + ", " +
                               std::to_string(blocks) + ")";
    if (t.dtype != DType::kFloat32) fail(s.name, ".dtype is ", Name{t.dtype}, "; scales must be float32");
    if (t.rank != 2 && t.rank != 3) fail(s.name, ".rank is ", t.rank, shapes);
    const int64_t want[3] = {batch, t.rank == 2 ? nheads_kv : heads_blocks, blocks};
    for (int d = 0; d < t.rank; ++d) {
      if (t.shape[d] != want[d]) fail(s.name, ".shape[", d, "] is ", t.shape[d], shapes);
      if (t.stride[d] < 0) fail(s.name, ".stride[", d, "] is ", t.stride[d], "; scale strides must be >= 0");
    }
    if (batch > 0 && want[1] > 0 && (t.rank == 2 || blocks > 0)) {
      if (t.data == nullptr) fail(s.name, ".data is null; a non-empty ", s.name, " needs a device pointer");
      pointer(std::string(s.name) + ".data", t.data, 4, inspect, "scale pointers");
    }
  }

  void sizes(const Args& all) const {
    for (const Arg* a : all) {
      for (int d = 0; d < a->rank; ++d) {
        const int64_t s = a->t.shape[d];
        if (s < 0) fail(Dim{*a, d}, " is ", s, "; sizes must be >= 0");
        if (s > std::numeric_limits<int32_t>::max()) {
          fail(Dim{*a, d}, " is ", s, "; sizes must fit in int32 (at most 2147483647)");
        }
      }
    }
  }

  void same(const Arg& a, int da, const Arg& b, int db, const char* rule) const {
    if (a.t.shape[da] != b.t.shape[db]) {
      fail(Dim{a, da}, " is ", a.t.shape[da], " but ", Dim{b, db}, " is ", b.t.shape[db], "; ", rule);
    }
  }
  void same_shape(const Arg& a, const Arg& b, const char* rule) const {
    for (int d = 0; d < 4; ++d) same(a, d, b, d, rule);
  }

  void qk_shapes(const Arg& q, const Arg& k) const {
    same(k, 0, q, 0, "q and k must have the same batch");
    same(k, 3, q, 3, "q and k must have the same head_dim");
  }
  void lse_shape(const Arg& lse, const Arg& q) const {
    const char* rule = "lse must be (batch, nheads, seqlen_q)";
    same(lse, 0, q, 0, rule);
    same(lse, 1, q, 2, rule);
    same(lse, 2, q, 1, rule);
  }

  void heads(const Arg& q, const Arg& k) const {
    const int64_t head_dim = q.t.shape[3], nheads = q.t.shape[2], nheads_kv = k.t.shape[2];
    if (!is_supported_head_dim(static_cast<int>(head_dim))) {
      fail(Dim{q, 3}, " is ", head_dim, "; supported head dims are 64, 128, 256");
    }
    if (nheads_kv < 1) fail(Dim{k, 2}, " is ", nheads_kv, "; k and v need at least one head");
    if (nheads < 1 || nheads % nheads_kv != 0) {
      fail(Dim{q, 2}, " is ", nheads, " and ", Dim{k, 2}, " is ", nheads_kv,
           "; nheads must be a positive multiple of nheads_kv");
    }
  }

  // Only the last dim is contiguous; the others are used as strides of 16-byte (TMA) copies,
  // except lse's (float32, read and written element by element), which need only be positive.
  void strides(const Args& all, const Arg* lse, DType dtype) const {
    const int esize = dtype_size(dtype), align_elems = 16 / esize;
    for (const Arg* a : all) {
      if (is_empty(*a)) continue;  // an empty tensor's strides are never used (torch gives 0s)
      const int last = a->rank - 1;
      if (a->t.stride[last] != 1) {
        fail(a->name, ".stride[", last, "] is ", a->t.stride[last],
             "; the last dim must be contiguous (stride 1)");
      }
      for (int d = 0; d < last; ++d) {
        if (a->t.shape[d] == 1) continue;  // nor is the stride of a dim of size 1
        const int64_t st = a->t.stride[d];
        if (st <= 0) {
          fail(a->name, ".stride[", d, "] (", a->dims[d], ") is ", st,
               "; strides must be positive for dims of size > 1");
        }
        if (a != lse && st % align_elems != 0) {
          fail(a->name, ".stride[", d, "] (", a->dims[d], ") is ", st, " elements (", st * esize,
               " bytes); strides other than the last must be multiples of ", align_elems,
               " elements (16 bytes)");
        }
      }
    }
  }

  // The scale, or the default for s <= 0 (or NaN); finite and at most `max`, `why` says why.
  float scale(float s, int64_t head_dim, double max, const char* why) const {
    if (std::isinf(s) || s > max) {
      fail("softmax_scale is ", s, "; it must be finite and at most ", max, " (", why,
           "), or <= 0 for the default 1/sqrt(head_dim)");
    }
    return s > 0.0f ? s : static_cast<float>(1.0 / std::sqrt(static_cast<double>(head_dim)));
  }

  // The sliding window and softcap, normalized into p: a bound that excludes nothing becomes -1
  // (left >= seqlen_k - 1, right >= seqlen_q - 1), causal sets right = 0, and a window (-1, 0) is
  // causal.
  template <class Problem>
  void mask(int left, int right, float softcap, Problem& p) const {
    if (left < -1) fail("window_left is ", left, "; it must be >= 0, or -1 for no bound on the left");
    if (right < -1) fail("window_right is ", right, "; it must be >= 0, or -1 for no bound on the right");
    if (!(softcap >= 0.0f) || std::isinf(softcap) || softcap > kMaxSoftmaxScale) {
      fail("softcap is ", softcap, "; it must be finite and in [0, ", double(kMaxSoftmaxScale),
           "] (0: no softcap; the bound as softmax_scale's)");
    }
    if (p.causal) right = 0;
    if (left >= p.seqlen_k - 1) left = -1;
    if (right >= p.seqlen_q - 1) right = -1;
    if (left < 0 && right == 0) p.causal = true;
    p.window_left = left;
    p.window_right = right;
    p.softcap = softcap;
  }

  // seqlen_q and seqlen_k at most kMaxSeqlen (32-bit row arithmetic in the kernels).
  void seqlens(const Arg& q, const Arg& k) const {
    for (const Dim& x : {Dim{q, 1}, Dim{k, 1}}) {
      const int64_t s = x.a.t.shape[1];
      if (s > kMaxSeqlen) {
        fail(x, " is ", s, "; ", x.a.dims[1], " must be at most ", int64_t{kMaxSeqlen},
             " (2^30): the kernels index rows in 32 bits");
      }
    }
  }

  // ceil(seqlen / kMinTile) x nheads x batch at most kMaxTiles, seqlen the dim 1 of `a`
  // (q: query tiles, k: key tiles); nheads is q's.
  void tiles(const Arg& a, const Arg& q) const {
    const int64_t seqlen = a.t.shape[1], nheads = q.t.shape[2], batch = q.t.shape[0];
    const int64_t blocks = (seqlen + kMinTile - 1) / kMinTile;
    // each factor < 2^31: blocks x nheads < 2^57, then compare before the last multiply
    const int64_t per_batch = blocks * nheads;
    if (batch > 0 && per_batch > kMaxTiles / batch) {
      fail(Dim{a, 1}, " is ", seqlen, " with nheads ", nheads, " and batch ", batch, ": ceil(", a.dims[1],
           " / 64) x nheads x batch = ", blocks, " x ", nheads, " x ", batch, " ", &a == &q ? "query" : "key",
           " tiles, more than the ", kMaxTiles, " (2^30) the kernels count in 32 bits");
    }
  }

  // `align`-byte aligned device memory; `what` names the pointer ("q.data"), `kind` says what
  // it is in the alignment rule ("data pointers").
  void pointer(const std::string& what, const void* p, int align, PointerInspector inspect,
               const char* kind) const {
    if (reinterpret_cast<uintptr_t>(p) % align != 0) {
      fail(what, " is ", p, ", not ", align, "-byte aligned; flash3 needs ", align, "-byte aligned ", kind);
    }
    const char* needs = "; flash3 needs device memory (cudaMalloc or a CUDA tensor)";
    switch ((inspect ? inspect : &cuda_pointer_kind)(p)) {
      case PointerKind::kDevice: return;
      case PointerKind::kHost: fail(what, " points to host memory", needs);
      case PointerKind::kUnknown: fail(what, " (", p, ") is not a pointer the CUDA runtime knows", needs);
    }
  }
  // The data of every non-empty one of `args`: non-null, lse's 4-byte aligned, the others'
  // 16-byte, device memory.
  void pointers(const Args& args, const Arg* lse, PointerInspector inspect) const {
    for (const Arg* a : args) {
      if (is_empty(*a)) continue;
      if (a->t.data == nullptr) fail(a->name, ".data is null; a non-empty ", a->name, " needs a device pointer");
      pointer(std::string(a->name) + ".data", a->t.data, a == lse ? 4 : 16, inspect, "data pointers");
    }
  }

 private:
  const char* op_;
};

// The fields FwdProblem and BwdProblem share, from q's and k's shapes.
template <class Problem>
Problem problem(DType dtype, const TensorRef& q, const TensorRef& k, float scale, bool causal) {
  Problem p;
  p.dtype = dtype;
  p.batch = static_cast<int>(q.shape[0]);
  p.seqlen_q = static_cast<int>(q.shape[1]);
  p.seqlen_k = static_cast<int>(k.shape[1]);
  p.nheads = static_cast<int>(q.shape[2]);
  p.nheads_kv = static_cast<int>(k.shape[2]);
  p.head_dim = static_cast<int>(q.shape[3]);
  p.softmax_scale = scale;
  p.causal = causal;
  return p;
}

}  // namespace

FwdProblem validate_fwd(const FwdArgs& args, PointerInspector inspect) {
  const Checker c("flash3::fwd: ");
  const Arg q{"q", args.q, kQDims, 4}, k{"k", args.k, kKDims, 4}, v{"v", args.v, kKDims, 4},
      out{"out", args.out, kQDims, 4}, lse{"lse", args.lse, kLseDims, 3};
  const bool write_lse = args.lse.data != nullptr;
  const Arg* lse_if = write_lse ? &lse : nullptr;
  Args all = {&q, &k, &v, &out};
  if (write_lse) all.push_back(&lse);

  c.ranks(all);
  const bool fp8 = args.q.dtype == DType::kFloat8E4M3;
  const DType dtype = fp8 ? DType::kFloat8E4M3
                          : c.dtypes(q, {&k, &v, &out}, lse_if, "q, k, v and out must have the same dtype",
                                   ", float8_e4m3 (with bfloat16 out)");
  if (fp8) c.fp8_dtypes(k, v, out, lse_if);
  const Arg q_scale{"q_scale", args.q_scale, kQScaleDims, 3}, k_scale{"k_scale", args.k_scale, kKScaleDims, 3},
      v_scale{"v_scale", args.v_scale, kKScaleDims, 3};
  if (!fp8) {
    for (const Arg* s : {&q_scale, &k_scale, &v_scale}) {
      if (s->t.data != nullptr) {
        c.fail(s->name, " is given but q.dtype is ", Name{dtype}, "; scales apply to float8_e4m3 inputs only");
      }
    }
  }
  c.sizes(all);
  c.qk_shapes(q, k);
  c.same_shape(v, k, "k and v must have the same shape");
  c.same_shape(out, q, "out must have the same shape as q");
  if (write_lse) c.lse_shape(lse, q);
  c.heads(q, k);
  if (fp8) {
    c.strides({&q, &k, &v}, nullptr, dtype);
    c.strides(write_lse ? Args{&out, &lse} : Args{&out}, lse_if, DType::kBFloat16);
  } else {
    c.strides(all, lse_if, dtype);
  }
  c.seqlens(q, k);
  c.tiles(q, q);
  const float scale = c.scale(args.softmax_scale, args.q.shape[3], kMaxSoftmaxScale,
                              "2^11: beyond, float32 exponents of the softmax are not exact");

  // Pointers last, and only when there is something to compute.
  if (args.q.shape[0] > 0 && args.q.shape[1] > 0) {
    c.pointers(all, lse_if, inspect);
    if (fp8) {
      const int64_t batch = args.q.shape[0], nheads = args.q.shape[2], nheads_kv = args.k.shape[2];
      if (args.q_scale.data || args.q_scale.rank) {
        c.fp8_scale(q_scale, batch, nheads_kv, nheads, args.q.shape[1], kFp8BlockQ, inspect);
      }
      if (args.k_scale.data || args.k_scale.rank) {
        c.fp8_scale(k_scale, batch, nheads_kv, nheads_kv, args.k.shape[1], fp8_block_kv(args.q.shape[3]), inspect);
      }
      if (args.v_scale.data || args.v_scale.rank) {
        c.fp8_scale(v_scale, batch, nheads_kv, nheads_kv, args.k.shape[1], fp8_block_kv(args.q.shape[3]), inspect);
      }
    }
  }

  FwdProblem p = problem<FwdProblem>(dtype, args.q, args.k, scale, args.causal);
  p.write_lse = write_lse;
  c.mask(args.window_left, args.window_right, args.softcap, p);
  if (fp8 && p.softcap > 0.0f) {
    c.fail("softcap is ", p.softcap, " but q.dtype is float8_e4m3; softcap is built for float16 and bfloat16");
  }
  if (fp8 && has_window(p)) {
    c.fail("window_left is ", args.window_left, " and window_right is ", args.window_right,
           " but q.dtype is float8_e4m3; sliding windows are built for float16 and bfloat16");
  }
  return p;
}

BwdProblem validate_bwd(const BwdArgs& args, PointerInspector inspect) {
  const Checker c("flash3::bwd: ");
  const Arg q{"q", args.q, kQDims, 4}, k{"k", args.k, kKDims, 4}, v{"v", args.v, kKDims, 4},
      out{"out", args.out, kQDims, 4}, dout{"dout", args.dout, kQDims, 4},
      lse{"lse", args.lse, kLseDims, 3}, dq{"dq", args.dq, kQDims, 4}, dk{"dk", args.dk, kKDims, 4},
      dv{"dv", args.dv, kKDims, 4};
  const Args all = {&q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv};

  c.ranks(all);
  const DType dtype = c.dtypes(q, {&k, &v, &out, &dout, &dq, &dk, &dv}, &lse,
                               "q, k, v, out, dout, dq, dk and dv must have the same dtype");
  c.sizes(all);
  c.qk_shapes(q, k);
  c.same_shape(v, k, "k and v must have the same shape");
  c.same_shape(out, q, "out must have the same shape as q");
  c.same_shape(dout, q, "dout must have the same shape as q");
  c.same_shape(dq, q, "dq must have the same shape as q");
  c.same_shape(dk, k, "dk must have the same shape as k");
  c.same_shape(dv, k, "dv must have the same shape as k");
  c.lse_shape(lse, q);
  c.heads(q, k);
  c.strides(all, &lse, dtype);
  c.seqlens(q, k);
  c.tiles(q, q);
  c.tiles(k, q);
  const float scale = c.scale(args.softmax_scale, args.q.shape[3], kMaxSoftmaxScale,
                              "2^11: beyond, the backward cannot recompute P exactly from the float32 lse");

  // The gradients are written while the inputs are read (and dq's partial sums are added in
  // place), so an output may share its data pointer with no other argument. Overlap other than
  // at the first element (e.g. interleaved heads of one buffer, as a packed dqkv) is allowed:
  // disjoint element sets are what matters, and that is the caller's to keep.
  for (const Arg* o : {&dq, &dk, &dv}) {
    for (const Arg* a : all) {
      if (a == o || is_empty(*a) || is_empty(*o) || a->t.data != o->t.data || a->t.data == nullptr) continue;
      c.fail(o->name, ".data is ", o->t.data, ", the same as ", a->name,
             ".data; dq, dk and dv must not alias each other or q, k, v, out, dout, lse");
    }
  }

  // Pointers last. Every non-empty tensor is checked, k, v, dk and dv also when seqlen_q == 0
  // (then dk = dv = 0 are the gradients), q, out, dout, lse and dq also when seqlen_k == 0.
  c.pointers(all, &lse, inspect);
  if (args.workspace != nullptr) {
    c.pointer("workspace", args.workspace, 256, inspect, "workspace (cudaMalloc gives 256)");
  }

  BwdProblem p = problem<BwdProblem>(dtype, args.q, args.k, scale, args.causal);
  p.deterministic = args.deterministic;
  c.mask(args.window_left, args.window_right, args.softcap, p);
  return p;
}

}  // namespace flash3

// validate_fwd, validate_bwd and validate_kvcache: every precondition of flash3::fwd, flash3::bwd
// and flash3::fwd_kvcache, checked on the host before any launch. Each failure throws
// flash3::Error whose message starts with the operation ("flash3::fwd: ", "flash3::bwd: " or
// "flash3::fwd_kvcache: ") and names the argument, the value it got and what is allowed.
#include "flash3/flash3.h"

#include <cuda_runtime_api.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "common/seqlen.h"
#include "dispatch.h"
#include "varlen_check.h"

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

// An argument, the names of its dims, and the rank it must have. A tensor whose layout
// cu_seqlens_q or cu_seqlens_k selects (q, k, v, out, lse, and the gradients) also has `cu`, that
// argument's name, and the other layout (alt_dims, alt_rank); `packed`: the layout is the packed
// one (cu_seqlens given).
struct Arg {
  const char* name;
  const TensorRef& t;
  const char* const* dims;
  int rank;
  const char* cu = nullptr;
  const char* const* alt_dims = nullptr;
  int alt_rank = 0;
  bool packed = false;
};
const char* const kQDims[] = {"batch", "seqlen_q", "nheads", "head_dim"};
const char* const kKDims[] = {"batch", "seqlen_k", "nheads_kv", "head_dim"};
const char* const kLseDims[] = {"batch", "nheads", "seqlen_q"};
const char* const kQPackedDims[] = {"total_q", "nheads", "head_dim"};
const char* const kKPackedDims[] = {"total_k", "nheads_kv", "head_dim"};
const char* const kLsePackedDims[] = {"nheads", "total_q"};
const char* const kQScaleDims[] = {"batch", "nheads", "q_blocks"};
const char* const kKScaleDims[] = {"batch", "nheads_kv", "kv_blocks"};
const char* const kCuDims[] = {"batch + 1"};
const char* const kUsedDims[] = {"batch"};

// q, out, dout, dq (q_side) or k, v, dk, dv: (total, heads, head_dim) when packed (cu_seqlens of
// their side given), else (batch, seqlen, heads, head_dim).
Arg side_arg(const char* name, const TensorRef& t, bool q_side, bool packed) {
  const char* cu = q_side ? "cu_seqlens_q" : "cu_seqlens_k";
  const char* const* unpacked = q_side ? kQDims : kKDims;
  const char* const* dims = q_side ? kQPackedDims : kKPackedDims;
  if (packed) return Arg{name, t, dims, 3, cu, unpacked, 4, true};
  return Arg{name, t, unpacked, 4, cu, dims, 3, false};
}
// lse: (nheads, total_q) with cu_seqlens_q, else (batch, nheads, seqlen_q).
Arg lse_arg(const TensorRef& t, bool packed) {
  if (packed) return Arg{"lse", t, kLsePackedDims, 2, "cu_seqlens_q", kLseDims, 3, true};
  return Arg{"lse", t, kLseDims, 3, "cu_seqlens_q", kLsePackedDims, 2, false};
}

// Whether an optional tensor argument is given: data or a rank (a zero TensorRef is not).
bool given(const TensorRef& t) { return t.data != nullptr || t.rank != 0; }

// The variable-length arguments of FwdArgs or BwdArgs.
struct Varlen {
  const TensorRef &cu_q, &cu_k, &used_q, &used_k;
  int max_q, max_k;
  bool packed_q, packed_k;  // cu_seqlens_q / cu_seqlens_k given
  bool any;                 // any of the four given
};
template <class A>
Varlen varlen_of(const A& a) {
  const bool pq = given(a.cu_seqlens_q), pk = given(a.cu_seqlens_k);
  return Varlen{a.cu_seqlens_q, a.cu_seqlens_k, a.seqused_q, a.seqused_k, a.max_seqlen_q, a.max_seqlen_k, pq, pk,
                pq || pk || given(a.seqused_q) || given(a.seqused_k)};
}

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
  const char* const* dims;
  int rank;
};
std::string text(const Layout& x) {
  std::string s;
  for (int d = 0; d < x.rank; ++d) s += std::string(d ? ", " : "(") + x.dims[d];
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

// The checks validate_fwd, validate_bwd and validate_kvcache share. `op` ("flash3::fwd: ") starts
// every message.
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

  // Each of `all` has its rank; the message of a tensor with two layouts names both.
  void ranks(const Args& all) const {
    for (const Arg* a : all) {
      if (a->t.rank == a->rank) continue;
      const Layout layout{a->dims, a->rank}, alt{a->alt_dims, a->alt_rank};
      if (a->cu == nullptr) {
        fail(a->name, ".rank is ", a->t.rank, "; ", a->name, " must have rank ", a->rank, " ", layout);
      } else if (a->packed) {
        fail(a->name, ".rank is ", a->t.rank, "; with ", a->cu, ", ", a->name, " must have rank ", a->rank, " ",
             layout, " (rank ", a->alt_rank, " ", alt, " without ", a->cu, ")");
      } else {
        fail(a->name, ".rank is ", a->t.rank, "; ", a->name, " must have rank ", a->rank, " ", layout, " (rank ",
             a->alt_rank, " ", alt, " with ", a->cu, ")");
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
  // a and b have the same rank (one layout).
  void same_shape(const Arg& a, const Arg& b, const char* rule) const {
    for (int d = 0; d < a.rank; ++d) same(a, d, b, d, rule);
  }

  // The batch (where neither side is packed; else varlen_batch) and the head_dim.
  void qk_shapes(const Arg& q, const Arg& k) const {
    if (!q.packed && !k.packed) same(k, 0, q, 0, "q and k must have the same batch");
    same(k, k.rank - 1, q, q.rank - 1, "q and k must have the same head_dim");
  }
  void lse_shape(const Arg& lse, const Arg& q) const {
    if (lse.packed) {
      const char* rule = "with cu_seqlens_q, lse must be (nheads, total_q)";
      same(lse, 0, q, 1, rule);
      same(lse, 1, q, 0, rule);
      return;
    }
    const char* rule = "lse must be (batch, nheads, seqlen_q)";
    same(lse, 0, q, 0, rule);
    same(lse, 1, q, 2, rule);
    same(lse, 2, q, 1, rule);
  }

  // The heads and head_dim: the last two dims in either layout.
  void heads(const Arg& q, const Arg& k) const {
    const int qh = q.rank - 2, kh = k.rank - 2, qd = q.rank - 1;
    const int64_t head_dim = q.t.shape[qd], nheads = q.t.shape[qh], nheads_kv = k.t.shape[kh];
    if (!detail::kernel_built(q.t.dtype, static_cast<int>(head_dim))) {
      fail(Dim{q, qd}, " is ", head_dim, "; supported head dims are ", detail::built_head_dims(q.t.dtype));
    }
    if (nheads_kv < 1) fail(Dim{k, kh}, " is ", nheads_kv, "; k and v need at least one head");
    if (nheads < 1 || nheads % nheads_kv != 0) {
      fail(Dim{q, qh}, " is ", nheads, " and ", Dim{k, kh}, " is ", nheads_kv,
           "; nheads must be a positive multiple of nheads_kv");
    }
  }

  // Index tensors (cu_seqlens, seqused, the KV cache's cache_seqlens, page_table, ...; those
  // given): each has its rank and is int32.
  void int32_tensors(const Args& given) const {
    for (const Arg* a : given) {
      if (a->t.rank != a->rank) {
        fail(a->name, ".rank is ", a->t.rank, "; ", a->name, " must have rank ", a->rank, " ",
             Layout{a->dims, a->rank});
      }
      if (a->t.dtype != DType::kInt32) fail(a->name, ".dtype is ", Name{a->t.dtype}, "; ", a->name, " must be int32");
    }
  }
  // Their strides (after sizes()): the last dim contiguous, the others positive (read element by
  // element: no 16-byte rule); dims of size 1 are not stepped along, so their strides do not count.
  void int32_strides(const Args& given) const {
    for (const Arg* a : given) {
      const int last = a->rank - 1;
      if (a->t.shape[last] > 1 && a->t.stride[last] != 1) {
        if (a->rank == 1) {
          fail(a->name, ".stride[0] is ", a->t.stride[0], "; ", a->name, " must be contiguous (stride 1)");
        }
        fail(a->name, ".stride[", last, "] is ", a->t.stride[last], "; the last dim of ", a->name,
             " must be contiguous (stride 1)");
      }
      for (int d = 0; d < last; ++d) {
        if (a->t.shape[d] > 1 && a->t.stride[d] <= 0) {
          fail(a->name, ".stride[", d, "] (", a->dims[d], ") is ", a->t.stride[d],
               "; strides must be positive for dims of size > 1");
        }
      }
    }
  }

  // cu_seqlens_q / cu_seqlens_k (given where non-null) and seqused_q / seqused_k: rank 1, int32,
  // contiguous; cu_seqlens batch + 1 >= 1 entries, the same on both sides, seqused batch entries.
  // A side without cu_seqlens has batch as the dim 0 of q (k). Returns batch.
  int64_t varlen_batch(const Arg* cu_q, const Arg* cu_k, const Arg* used_q, const Arg* used_k, const Arg& q,
                       const Arg& k) const {
    Args given;
    for (const Arg* a : {cu_q, cu_k, used_q, used_k}) {
      if (a != nullptr) given.push_back(a);
    }
    int32_tensors(given);
    sizes(given);
    int32_strides(given);
    for (const Arg* cu : {cu_q, cu_k}) {
      if (cu != nullptr && cu->t.shape[0] < 1) {
        fail(cu->name, ".shape[0] is 0; ", cu->name, " must have batch + 1 entries (at least 1)");
      }
    }
    int64_t batch = q.t.shape[0];
    std::string from = "q.shape[0]";
    if (cu_q != nullptr && cu_k != nullptr) {
      if (cu_k->t.shape[0] != cu_q->t.shape[0]) {
        fail("cu_seqlens_k.shape[0] is ", cu_k->t.shape[0], " but cu_seqlens_q.shape[0] is ", cu_q->t.shape[0],
             "; cu_seqlens_q and cu_seqlens_k must both have batch + 1 entries");
      }
    }
    if (cu_q != nullptr || cu_k != nullptr) {
      const Arg& cu = cu_q != nullptr ? *cu_q : *cu_k;
      const Arg* other = cu_q == nullptr ? &q : cu_k == nullptr ? &k : nullptr;  // a side not packed
      batch = cu.t.shape[0] - 1;
      from = std::string(cu.name) + ".shape[0] - 1";
      if (other != nullptr && other->t.shape[0] != batch) {
        fail(Dim{*other, 0}, " is ", other->t.shape[0], " but ", cu.name, ".shape[0] is ", cu.t.shape[0], "; ",
             other->name, " must have batch = ", cu.name, ".shape[0] - 1 = ", batch, " sequences");
      }
    }
    for (const Arg* used : {used_q, used_k}) {
      if (used != nullptr && used->t.shape[0] != batch) {
        fail(used->name, ".shape[0] is ", used->t.shape[0], " but batch is ", batch, " (", from, "); ", used->name,
             " must have batch entries");
      }
    }
    return batch;
  }

  // max_seqlen_q / max_seqlen_k of a packed side (`a`: q or k): in [0, kMaxSeqlen] and at most the
  // packed length.
  void max_seqlen(const char* name, int max, const Arg& a) const {
    if (max < 0) fail(name, " is ", max, "; it must be >= 0 (at least every sequence's length)");
    if (max > kMaxSeqlen) {
      fail(name, " is ", max, "; it must be at most ", int64_t{kMaxSeqlen},
           " (2^30): the kernels index rows in 32 bits");
    }
    if (max > a.t.shape[0]) {
      fail(name, " is ", max, " but ", Dim{a, 0}, " is ", a.t.shape[0],
           "; no sequence is longer than the packed length");
    }
  }

  // The rows of a side that is not packed in a variable-length problem, batch x seqlen, fit in
  // int32 as a packed one's do (the kernels keep both sides' row counts in int).
  void unpacked_rows(const Arg& a) const {
    const int64_t rows = a.t.shape[0] * a.t.shape[1];  // each < 2^31
    if (rows > std::numeric_limits<int32_t>::max()) {
      fail(a.name, " has ", Dim{a, 0}, " x ", Dim{a, 1}, " = ", a.t.shape[0], " x ", a.t.shape[1], " = ", rows,
           " rows; with cu_seqlens or seqused the rows of each side must fit in int32 (at most 2147483647)");
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

  // seqlen_q and seqlen_k at most kMaxSeqlen (32-bit row arithmetic in the kernels), where not
  // packed (packed: max_seqlen).
  void seqlens(const Arg& q, const Arg& k) const {
    for (const Dim& x : {Dim{q, 1}, Dim{k, 1}}) {
      if (x.a.packed) continue;
      const int64_t s = x.a.t.shape[1];
      if (s > kMaxSeqlen) {
        fail(x, " is ", s, "; ", x.a.dims[1], " must be at most ", int64_t{kMaxSeqlen},
             " (2^30): the kernels index rows in 32 bits");
      }
    }
  }

  // The tiles of `a` (q: query tiles, k: key tiles) at most kMaxTiles, nheads q's: ceil(seqlen /
  // kMinTile) x nheads x batch, seqlen the dim 1 of `a`; packed, (total / kMinTile + batch) x
  // nheads, which bounds the sum over sequences of ceil(length / kMinTile) x nheads.
  void tiles(const Arg& a, int64_t nheads, int64_t batch, const char* what) const {
    if (a.packed) {
      const int64_t total = a.t.shape[0], blocks = total / kMinTile;
      // blocks + batch < 2^32, nheads >= 1 (heads())
      if (nheads > 0 && blocks + batch > kMaxTiles / nheads) {
        fail(Dim{a, 0}, " is ", total, " with nheads ", nheads, " and batch ", batch, ": (", a.dims[0],
             " / 64 + batch) x nheads = (", blocks, " + ", batch, ") x ", nheads, " ", what, " tiles, more than the ",
             kMaxTiles, " (2^30) the kernels count in 32 bits");
      }
      return;
    }
    const int64_t seqlen = a.t.shape[1];
    const int64_t blocks = (seqlen + kMinTile - 1) / kMinTile;
    // each factor < 2^31: blocks x nheads < 2^57, then compare before the last multiply
    const int64_t per_batch = blocks * nheads;
    if (batch > 0 && per_batch > kMaxTiles / batch) {
      fail(Dim{a, 1}, " is ", seqlen, " with nheads ", nheads, " and batch ", batch, ": ceil(", a.dims[1],
           " / 64) x nheads x batch = ", blocks, " x ", nheads, " x ", batch, " ", what,
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
  // cu_seqlens and seqused (those given; called when batch > 0): non-null, 4-byte aligned device
  // memory.
  void int32_pointers(const Args& args, PointerInspector inspect) const {
    for (const Arg* a : args) {
      if (a->t.data == nullptr) fail(a->name, ".data is null; ", a->name, " needs a device pointer");
      pointer(std::string(a->name) + ".data", a->t.data, 4, inspect, "int32 pointers");
    }
  }

 private:
  const char* op_;
};

// The Args of cu_seqlens_q/k and seqused_q/k.
struct VarlenArgs {
  const Arg cu_q, cu_k, used_q, used_k;
  explicit VarlenArgs(const Varlen& v)
      : cu_q{"cu_seqlens_q", v.cu_q, kCuDims, 1},
        cu_k{"cu_seqlens_k", v.cu_k, kCuDims, 1},
        used_q{"seqused_q", v.used_q, kUsedDims, 1},
        used_k{"seqused_k", v.used_k, kUsedDims, 1} {}
  // a, or null where not given.
  static const Arg* if_given(const Arg& a) { return given(a.t) ? &a : nullptr; }
  // Those given, in the order cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k.
  Args all() const {
    Args r;
    for (const Arg* a : {&cu_q, &cu_k, &used_q, &used_k}) {
      if (given(a->t)) r.push_back(a);
    }
    return r;
  }
};

// The variable-length rules both passes share, after the ranks, dtypes, sizes and qk_shapes:
// cu_seqlens and seqused (varlen_batch), max_seqlen of a packed side, the rows of a side not
// packed. Returns batch (q's dim 0 without variable lengths).
int64_t varlen_shapes(const Checker& c, const Varlen& vl, const VarlenArgs& va, const Arg& q, const Arg& k) {
  if (!vl.any) return q.t.shape[0];
  const int64_t batch = c.varlen_batch(va.if_given(va.cu_q), va.if_given(va.cu_k), va.if_given(va.used_q),
                                       va.if_given(va.used_k), q, k);
  if (q.packed) c.max_seqlen("max_seqlen_q", vl.max_q, q);
  else c.unpacked_rows(q);
  if (k.packed) c.max_seqlen("max_seqlen_k", vl.max_k, k);
  else c.unpacked_rows(k);
  return batch;
}

// The fields FwdProblem and BwdProblem share, from the (checked) shapes: the lengths are
// max_seqlen on a packed side, else dim 1; total the packed rows, else batch x seqlen.
template <class Problem>
Problem problem(DType dtype, const Arg& q, const Arg& k, const Varlen& vl, int64_t batch, float scale, bool causal) {
  Problem p;
  p.dtype = dtype;
  p.batch = static_cast<int>(batch);
  p.seqlen_q = q.packed ? vl.max_q : static_cast<int>(q.t.shape[1]);
  p.seqlen_k = k.packed ? vl.max_k : static_cast<int>(k.t.shape[1]);
  p.nheads = static_cast<int>(q.t.shape[q.rank - 2]);
  p.nheads_kv = static_cast<int>(k.t.shape[k.rank - 2]);
  p.head_dim = static_cast<int>(q.t.shape[q.rank - 1]);
  p.softmax_scale = scale;
  p.causal = causal;
  p.varlen = vl.any;
  p.total_q = q.packed ? q.t.shape[0] : batch * p.seqlen_q;
  p.total_k = k.packed ? k.t.shape[0] : batch * p.seqlen_k;
  p.packed_q = q.packed;
  p.packed_k = k.packed;
  return p;
}

}  // namespace

FwdProblem validate_fwd(const FwdArgs& args, PointerInspector inspect) {
  const Checker c("flash3::fwd: ");
  const Varlen vl = varlen_of(args);
  const VarlenArgs va(vl);
  const Arg q = side_arg("q", args.q, true, vl.packed_q), k = side_arg("k", args.k, false, vl.packed_k),
            v = side_arg("v", args.v, false, vl.packed_k), out = side_arg("out", args.out, true, vl.packed_q),
            lse = lse_arg(args.lse, vl.packed_q);
  const bool write_lse = args.lse.data != nullptr;
  const Arg* lse_if = write_lse ? &lse : nullptr;
  Args all = {&q, &k, &v, &out};
  if (write_lse) all.push_back(&lse);

  const bool fp8 = args.q.dtype == DType::kFloat8E4M3;
  if (fp8 && vl.any) {  // before ranks(), which would name a packed rank instead
    c.fail(va.all().front()->name, " is given but q.dtype is float8_e4m3; variable-length batches (cu_seqlens, "
           "seqused) are built for float16 and bfloat16");
  }
  c.ranks(all);
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
  const int64_t batch = varlen_shapes(c, vl, va, q, k);
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
  c.tiles(q, q.t.shape[q.rank - 2], batch, "query");
  const float scale = c.scale(args.softmax_scale, q.t.shape[q.rank - 1], kMaxSoftmaxScale,
                              "2^11: beyond, float32 exponents of the softmax are not exact");
  FwdProblem p = problem<FwdProblem>(dtype, q, k, vl, batch, scale, args.causal);
  p.write_lse = write_lse;

  // Pointers last, and only when there is something to compute.
  if (p.batch > 0 && p.seqlen_q > 0) {
    c.pointers(all, lse_if, inspect);
    c.int32_pointers(va.all(), inspect);
    if (fp8) {
      const int64_t nheads = args.q.shape[2], nheads_kv = args.k.shape[2];
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
  const Varlen vl = varlen_of(args);
  const VarlenArgs va(vl);
  const bool pq = vl.packed_q, pk = vl.packed_k;
  const Arg q = side_arg("q", args.q, true, pq), k = side_arg("k", args.k, false, pk),
            v = side_arg("v", args.v, false, pk), out = side_arg("out", args.out, true, pq),
            dout = side_arg("dout", args.dout, true, pq), lse = lse_arg(args.lse, pq),
            dq = side_arg("dq", args.dq, true, pq), dk = side_arg("dk", args.dk, false, pk),
            dv = side_arg("dv", args.dv, false, pk);
  const Args all = {&q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv};

  c.ranks(all);
  const DType dtype = c.dtypes(q, {&k, &v, &out, &dout, &dq, &dk, &dv}, &lse,
                               "q, k, v, out, dout, dq, dk and dv must have the same dtype");
  c.sizes(all);
  c.qk_shapes(q, k);
  const int64_t batch = varlen_shapes(c, vl, va, q, k);
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
  const int64_t nheads = q.t.shape[q.rank - 2];
  c.tiles(q, nheads, batch, "query");
  c.tiles(k, nheads, batch, "key");
  const float scale = c.scale(args.softmax_scale, q.t.shape[q.rank - 1], kMaxSoftmaxScale,
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
  // (then dk = dv = 0 are the gradients), q, out, dout, lse and dq also when seqlen_k == 0;
  // cu_seqlens and seqused when batch > 0.
  c.pointers(all, &lse, inspect);
  if (batch > 0) c.int32_pointers(va.all(), inspect);
  if (args.workspace != nullptr) {
    c.pointer("workspace", args.workspace, 256, inspect, "workspace (cudaMalloc gives 256)");
  }

  BwdProblem p = problem<BwdProblem>(dtype, q, k, vl, batch, scale, args.causal);
  p.deterministic = args.deterministic;
  c.mask(args.window_left, args.window_right, args.softcap, p);
  return p;
}

namespace {

const char* const kCacheDims[] = {"batch_cache", "seqlen_cache", "nheads_kv", "head_dim"};
const char* const kPagedCacheDims[] = {"num_pages", "page_size", "nheads_kv", "head_dim"};
const char* const kPageTableDims[] = {"batch", "max_pages_per_seq"};
const char* const kNewDims[] = {"batch", "seqlen_new", "nheads_kv", "head_dim"};
const char* const kRotaryDims[] = {"seqlen_ro", "rotary_dim / 2"};
// MLA (qv given): the tensors whose last dim is the latent's (head_dim_v, kMlaLatentDim), not q's.
const char* const kQvDims[] = {"batch", "seqlen_q", "nheads", "head_dim_v"};
const char* const kCacheDimsV[] = {"batch_cache", "seqlen_cache", "nheads_kv", "head_dim_v"};
const char* const kPagedCacheDimsV[] = {"num_pages", "page_size", "nheads_kv", "head_dim_v"};
const char* const kNewDimsV[] = {"batch", "seqlen_new", "nheads_kv", "head_dim_v"};

// What Checker::mask reads and normalizes, for a KV-cache problem: seqlen_k is the longest key
// range (a bound that excludes nothing there excludes nothing in any sequence).
struct KvcacheMask {
  bool causal;
  int seqlen_q, seqlen_k;
  int window_left = -1, window_right = -1;
  float softcap = 0.0f;
};

// Of two optional arguments that come together (k_new and v_new, rotary_cos and rotary_sin), the
// one given without the other: names the missing one.
void together(const Checker& c, const Arg& a, const Arg& b, const char* rule) {
  if (given(a.t) == given(b.t)) return;
  const Arg& missing = given(a.t) ? b : a;
  const Arg& present = given(a.t) ? a : b;
  c.fail(missing.name, " is not given but ", present.name, " is; ", rule);
}

// The shapes of an MLA problem (qv given), in place of the rule that q, k_cache, v_cache and out
// share one shape: q (batch, seqlen_q, nheads, kMlaRotaryDim) and qv (batch, seqlen_q, nheads,
// kMlaLatentDim); k_cache (..., nheads_kv, kMlaRotaryDim) and v_cache of k_cache's first three
// dims with the latent's head dim; out (batch, seqlen_q, nheads, kMlaLatentDim). After the sizes.
void mla_shapes(const Checker& c, const Arg& q, const Arg& qv, const Arg& k, const Arg& v, const Arg& out) {
  const char* const why = "; MLA needs q's rotary part of 64 and qv's latent of 512";
  if (q.t.shape[3] != kMlaRotaryDim) c.fail("qv is given (MLA): ", Dim{q, 3}, " is ", q.t.shape[3], why);
  if (qv.t.shape[3] != kMlaLatentDim) c.fail("qv is given (MLA): ", Dim{qv, 3}, " is ", qv.t.shape[3], why);
  const char* const qv_rule = "qv must be (batch, seqlen_q, nheads, 512) with q's batch, seqlen_q and nheads";
  const char* const out_rule = "with qv (MLA), out must be (batch, seqlen_q, nheads, 512): q's first three dims and "
                               "qv's head_dim_v";
  const char* const v_rule = "with qv (MLA), v_cache must have k_cache's first three dims (only the head dims "
                             "differ: 64 and 512)";
  for (int d = 0; d < 3; ++d) c.same(qv, d, q, d, qv_rule);
  for (int d = 0; d < 3; ++d) c.same(out, d, q, d, out_rule);
  c.same(out, 3, qv, 3, out_rule);
  for (int d = 0; d < 3; ++d) c.same(v, d, k, d, v_rule);
  c.same(v, 3, qv, 3, "with qv (MLA), v_cache holds each key's latent: its head_dim_v must be qv's");
  c.same(k, 3, q, 3, "q and k_cache must have the same head_dim (with qv, the rotary part's 64)");
}

// The append: k_new and v_new (batch, seqlen_new, nheads_kv, head_dim) of q's dtype, with q's
// batch and the cache's heads and head_dim, at most a sequence's capacity (seqlen_cache: the
// longest key range), strides as the caches'. With qv (mla), v_new's head dim is v_cache's (the
// latent's), k_new's k_cache's. After the cache's own checks.
void new_keys(const Checker& c, const Arg& kn, const Arg& vn, const Arg& q, const Arg& k, const Arg& v, bool mla,
              DType dtype, int64_t seqlen_cache, bool paged, const Arg& page_table) {
  c.ranks({&kn, &vn});
  for (const Arg* a : {&kn, &vn}) {
    if (a->t.dtype != dtype) {
      c.fail(a->name, ".dtype is ", Name{a->t.dtype}, " but q.dtype is ", Name{dtype},
             "; k_new and v_new must have q's dtype (the cache's)");
    }
  }
  c.sizes({&kn, &vn});
  c.same(kn, 0, q, 0, "k_new must have q's batch");
  c.same(kn, 2, k, 2, "k_new must have the cache's nheads_kv");
  c.same(kn, 3, k, 3, "k_new must have the cache's head_dim");
  if (mla) {
    for (int d = 0; d < 3; ++d) c.same(vn, d, kn, d, "k_new and v_new must have the same first three dims");
    c.same(vn, 3, v, 3, "with qv (MLA), v_new must have v_cache's head_dim_v (the latent's)");
  } else {
    c.same_shape(vn, kn, "k_new and v_new must have the same shape");
  }
  const int64_t seqlen_new = kn.t.shape[1];
  if (seqlen_new > seqlen_cache) {
    if (paged) {
      c.fail(Dim{kn, 1}, " is ", seqlen_new, " but a sequence holds ", Dim{page_table, 1}, " x ", Dim{k, 1}, " = ",
             page_table.t.shape[1], " x ", k.t.shape[1], " = ", seqlen_cache,
             " keys; k_new overruns the cache (seqlen_new must be at most max_pages_per_seq x page_size)");
    }
    c.fail(Dim{kn, 1}, " is ", seqlen_new, " but a sequence holds ", Dim{k, 1}, " = ", seqlen_cache,
           " keys; k_new overruns the cache (seqlen_new must be at most seqlen_cache)");
  }
  c.strides({&kn, &vn}, nullptr, dtype);
}

// The rotary tables: rotary_cos and rotary_sin (seqlen_ro, rotary_dim / 2) of one shape and one
// dtype, float32 or q's; seqlen_ro >= 1, rotary_dim a multiple of 16 in [16, head_dim], the last
// dim contiguous and the rows apart (stride[0] >= rotary_dim / 2, where there is more than one
// row).
void rotary_tables(const Checker& c, const Arg& cos, const Arg& sin, int64_t head_dim, DType dtype) {
  c.ranks({&cos, &sin});
  for (const Arg* a : {&cos, &sin}) {
    if (a->t.dtype != DType::kFloat32 && a->t.dtype != dtype) {
      c.fail(a->name, ".dtype is ", Name{a->t.dtype}, "; rotary_cos and rotary_sin must be float32 or q's dtype (",
             Name{dtype}, ")");
    }
  }
  if (cos.t.dtype != sin.t.dtype) {
    c.fail("rotary_sin.dtype is ", Name{sin.t.dtype}, " and rotary_cos.dtype is ", Name{cos.t.dtype},
           "; the two tables must have one dtype");
  }
  c.sizes({&cos, &sin});
  c.same_shape(sin, cos, "rotary_cos and rotary_sin must have the same shape");
  if (cos.t.shape[0] < 1) c.fail(Dim{cos, 0}, " is 0; the rotary tables need at least one position (row)");
  const int64_t half = cos.t.shape[1], rotary_dim = 2 * half;
  if (rotary_dim < 16 || rotary_dim % 16 != 0 || rotary_dim > head_dim) {
    c.fail(Dim{cos, 1}, " is ", half, ", so rotary_dim is ", rotary_dim,
           "; rotary_dim = 2 x rotary_cos.shape[1] must be a multiple of 16 in [16, head_dim = ", head_dim, "]");
  }
  for (const Arg* a : {&cos, &sin}) {
    if (a->t.stride[1] != 1) {
      c.fail(a->name, ".stride[1] is ", a->t.stride[1], "; the last dim of ", a->name,
             " must be contiguous (stride 1)");
    }
    if (a->t.shape[0] > 1 && a->t.stride[0] < half) {
      c.fail(a->name, ".stride[0] (seqlen_ro) is ", a->t.stride[0], " but ", Dim{*a, 1}, " is ", half,
             "; the rows of ", a->name, " must not overlap (stride[0] at least rotary_dim / 2)");
    }
  }
}

}  // namespace

KvcacheProblem validate_kvcache(const KvcacheArgs& args, PointerInspector inspect) {
  const Checker c("flash3::fwd_kvcache: ");
  const bool paged = given(args.page_table), write_lse = args.lse.data != nullptr, mla = given(args.qv);
  const char* const* cache_dims = paged ? kPagedCacheDims : kCacheDims;
  const char* const* v_dims = !mla ? cache_dims : paged ? kPagedCacheDimsV : kCacheDimsV;
  const Arg q{"q", args.q, kQDims, 4}, k{"k_cache", args.k_cache, cache_dims, 4}, v{"v_cache", args.v_cache, v_dims, 4},
      out{"out", args.out, mla ? kQvDims : kQDims, 4}, lse{"lse", args.lse, kLseDims, 3}, qv{"qv", args.qv, kQvDims, 4};
  const Arg seqlens{"cache_seqlens", args.cache_seqlens, kUsedDims, 1},
      batch_idx{"cache_batch_idx", args.cache_batch_idx, kUsedDims, 1},
      leftpad{"cache_leftpad", args.cache_leftpad, kUsedDims, 1},
      page_table{"page_table", args.page_table, kPageTableDims, 2};
  const Arg* lse_if = write_lse ? &lse : nullptr;
  Args all = {&q, &k, &v, &out};
  if (write_lse) all.push_back(&lse);
  if (mla) all.push_back(&qv);
  Args index;  // the index tensors given, in the order of KvcacheArgs
  for (const Arg* a : {&seqlens, &batch_idx, &leftpad, &page_table}) {
    if (given(a->t)) index.push_back(a);
  }

  if (paged && given(args.cache_batch_idx)) {
    c.fail("cache_batch_idx is given with page_table; a paged cache is addressed through page_table alone "
           "(cache_batch_idx selects entries of a contiguous cache)");
  }
  c.ranks(all);
  const DType dtype = c.dtypes(q, {&k, &v, &out}, lse_if, "q, k_cache, v_cache and out must have the same dtype");
  if (mla && qv.t.dtype != dtype) {
    c.fail("qv.dtype is ", Name{qv.t.dtype}, " but q.dtype is ", Name{dtype}, "; qv must have q's dtype");
  }
  c.int32_tensors(index);
  c.sizes(all);
  c.sizes(index);
  if (mla) {
    mla_shapes(c, q, qv, k, v, out);
  } else {
    c.same_shape(out, q, "out must have the same shape as q");
    c.same_shape(v, k, "k_cache and v_cache must have the same shape");
    c.same(k, 3, q, 3, "q and k_cache must have the same head_dim");
  }
  if (write_lse) c.lse_shape(lse, q);
  const int64_t batch = q.t.shape[0];
  for (const Arg* a : {&seqlens, &batch_idx, &leftpad}) {
    if (given(a->t) && a->t.shape[0] != batch) {
      c.fail(a->name, ".shape[0] is ", a->t.shape[0], " but q.shape[0] (batch) is ", batch, "; ", a->name,
             " must have batch entries");
    }
  }
  if (paged) {
    c.same(page_table, 0, q, 0, "page_table must have one row per batch entry");
    if (page_table.t.shape[1] < 1) {
      c.fail(Dim{page_table, 1}, " is 0; page_table needs at least one page per sequence");
    }
    if (k.t.shape[0] < 1) c.fail(Dim{k, 0}, " is 0; a paged cache needs at least one page");
    if (k.t.shape[1] < 1) c.fail(Dim{k, 1}, " is 0; a page must hold at least one key");
  } else if (given(args.cache_batch_idx)) {
    if (k.t.shape[0] < 1) {
      c.fail(Dim{k, 0}, " is 0; cache_batch_idx selects entries of k_cache, which needs at least one");
    }
  } else {
    c.same(k, 0, q, 0, "without cache_batch_idx, k_cache must have one entry per batch entry (batch_cache = batch)");
  }
  c.heads(q, k);
  c.strides(all, lse_if, dtype);
  c.int32_strides(index);

  // The lengths: seqlen_q and the longest key range (seqlen_cache, or max_pages_per_seq x
  // page_size, a product of two int32 sizes formed in int64) at most kMaxSeqlen.
  if (q.t.shape[1] > kMaxSeqlen) {
    c.fail(Dim{q, 1}, " is ", q.t.shape[1], "; seqlen_q must be at most ", int64_t{kMaxSeqlen},
           " (2^30): the kernels index rows in 32 bits");
  }
  const int64_t seqlen_cache = paged ? page_table.t.shape[1] * k.t.shape[1] : k.t.shape[1];
  if (seqlen_cache > kMaxSeqlen) {
    if (paged) {
      c.fail(Dim{page_table, 1}, " x ", Dim{k, 1}, " = ", page_table.t.shape[1], " x ", k.t.shape[1], " = ",
             seqlen_cache, " keys per sequence; max_pages_per_seq x page_size must be at most ", int64_t{kMaxSeqlen},
             " (2^30): the kernels index keys in 32 bits");
    }
    c.fail(Dim{k, 1}, " is ", seqlen_cache, "; seqlen_cache must be at most ", int64_t{kMaxSeqlen},
           " (2^30): the kernels index keys in 32 bits");
  }
  c.tiles(q, q.t.shape[2], batch, "query");
  // the default 1/sqrt(head_dim) of the scores' head dim: q's, or with qv q's and qv's (576)
  const float scale = c.scale(args.softmax_scale, mla ? q.t.shape[3] + qv.t.shape[3] : q.t.shape[3], kMaxSoftmaxScale,
                              "2^11: beyond, float32 exponents of the softmax are not exact");
  if (args.num_splits < 0 || args.num_splits > kMaxKvcacheSplits) {
    c.fail("num_splits is ", args.num_splits, "; it must be in [0, ", kMaxKvcacheSplits,
           "] (0: the heuristic, kvcache_num_splits)");
  }

  // The append (k_new, v_new) and its rotary embedding (rotary_cos, rotary_sin).
  const Arg kn{"k_new", args.k_new, kNewDims, 4}, vn{"v_new", args.v_new, mla ? kNewDimsV : kNewDims, 4},
      cos{"rotary_cos", args.rotary_cos, kRotaryDims, 2}, sin{"rotary_sin", args.rotary_sin, kRotaryDims, 2};
  together(c, kn, vn, "k_new and v_new are given together (the appended keys and their values)");
  together(c, cos, sin, "rotary_cos and rotary_sin are given together");
  const bool append = given(args.k_new), rotary = given(args.rotary_cos);
  if (rotary && !append) {
    c.fail("rotary_cos is given without k_new; the rotary embedding applies with an append (k_new, v_new) only");
  }
  if (append) {
    if (!given(args.cache_seqlens)) {
      c.fail("k_new is given without cache_seqlens; an append needs cache_seqlens (each sequence's length before "
             "it: where its new keys go)");
    }
    new_keys(c, kn, vn, q, k, v, mla, dtype, seqlen_cache, paged, page_table);
  }
  if (rotary) rotary_tables(c, cos, sin, q.t.shape[3], dtype);

  KvcacheProblem p;
  p.dtype = dtype;
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(q.t.shape[1]);
  p.nheads = static_cast<int>(q.t.shape[2]);
  p.nheads_kv = static_cast<int>(k.t.shape[2]);
  p.head_dim = static_cast<int>(q.t.shape[3]);
  p.head_dim_v = static_cast<int>(v.t.shape[3]);  // head_dim without qv (same shapes)
  p.mla = mla;
  p.batch_cache = static_cast<int>(k.t.shape[0]);
  p.seqlen_cache = static_cast<int>(seqlen_cache);
  p.paged = paged;
  p.page_size = paged ? static_cast<int>(k.t.shape[1]) : 0;
  p.max_pages = paged ? static_cast<int>(page_table.t.shape[1]) : 0;
  p.has_seqlens = given(args.cache_seqlens);
  p.has_batch_idx = given(args.cache_batch_idx);
  p.has_leftpad = given(args.cache_leftpad);
  p.softmax_scale = scale;
  p.write_lse = write_lse;
  p.num_splits = args.num_splits;
  KvcacheMask m{args.causal, p.seqlen_q, p.seqlen_cache};
  c.mask(args.window_left, args.window_right, args.softcap, m);
  p.causal = m.causal;
  p.window_left = m.window_left;
  p.window_right = m.window_right;
  p.softcap = m.softcap;
  p.seqlen_new = append ? static_cast<int>(kn.t.shape[1]) : 0;
  p.rotary_dim = rotary ? static_cast<int>(2 * cos.t.shape[1]) : 0;
  p.rotary_interleaved = rotary && args.rotary_interleaved;
  p.seqlen_ro = rotary ? static_cast<int>(cos.t.shape[0]) : 0;

  // Pointers last, and only when there is something to compute (k_new and v_new where not empty,
  // 16-byte aligned as the others; the rotary tables read element by element, 4-byte).
  if (p.batch > 0 && p.seqlen_q > 0) {
    c.pointers(all, lse_if, inspect);
    c.int32_pointers(index, inspect);
    if (append) c.pointers({&kn, &vn}, nullptr, inspect);
    if (rotary) {
      for (const Arg* a : {&cos, &sin}) {
        if (a->t.data == nullptr) c.fail(a->name, ".data is null; ", a->name, " needs a device pointer");
        c.pointer(std::string(a->name) + ".data", a->t.data, 4, inspect, "rotary table pointers");
      }
    }
  }
  return p;
}

namespace detail {

void check_seqlen_values(const char* op, int batch, const SeqlenSide& q, const SeqlenSide& k) {
  const Checker c(op);
  struct Side {
    const SeqlenSide& s;
    const char *cu, *used, *max, *total, *dim1;
  };
  const Side sides[] = {
      {q, "cu_seqlens_q", "seqused_q", "max_seqlen_q", "q.shape[0] (total_q)", "q.shape[1] (seqlen_q)"},
      {k, "cu_seqlens_k", "seqused_k", "max_seqlen_k", "k.shape[0] (total_k)", "k.shape[1] (seqlen_k)"},
  };
  for (const Side& x : sides) {
    const int* cu = x.s.cu_seqlens;
    if (cu == nullptr) continue;
    if (cu[0] != 0) c.fail(x.cu, "[0] is ", cu[0], "; ", x.cu, " must start at 0");
    for (int b = 0; b < batch; ++b) {
      if (cu[b + 1] < cu[b]) {
        c.fail(x.cu, "[", b + 1, "] is ", cu[b + 1], ", below ", x.cu, "[", b, "] = ", cu[b],
               "; cu_seqlens must be non-decreasing");
      }
    }
    if (cu[batch] != x.s.total) {
      c.fail(x.cu, "[", batch, "] is ", cu[batch], " but ", x.total, " is ", x.s.total, "; the last entry of ", x.cu,
             " must be the packed length");
    }
    for (int b = 0; b < batch; ++b) {
      const int64_t len = int64_t{cu[b + 1]} - cu[b];
      if (len > x.s.max_seqlen) {
        c.fail(x.cu, "[", b + 1, "] - ", x.cu, "[", b, "] = ", cu[b + 1], " - ", cu[b], " = ", len,
               " (the length of sequence ", b, ") but ", x.max, " is ", x.s.max_seqlen, "; ", x.max,
               " must be at least every sequence's length");
      }
    }
  }
  for (const Side& x : sides) {
    const int* used = x.s.seqused;
    if (used == nullptr) continue;
    const int* cu = x.s.cu_seqlens;
    for (int b = 0; b < batch; ++b) {
      if (used[b] < 0) c.fail(x.used, "[", b, "] is ", used[b], "; seqused must be >= 0");
      if (cu != nullptr && used[b] > int64_t{cu[b + 1]} - cu[b]) {
        c.fail(x.used, "[", b, "] is ", used[b], " but sequence ", b, " has length ", x.cu, "[", b + 1, "] - ", x.cu,
               "[", b, "] = ", int64_t{cu[b + 1]} - cu[b], "; seqused must be at most the sequence's length");
      }
      if (cu == nullptr && used[b] > x.s.max_seqlen) {
        c.fail(x.used, "[", b, "] is ", used[b], " but ", x.dim1, " is ", x.s.max_seqlen,
               "; seqused must be at most the sequence's length");
      }
    }
  }
}

namespace {

// Throws flash3::CudaError naming the step of copy_and_check unless err is cudaSuccess.
void check_step(cudaError_t err, const char* op, const char* what) {
  if (err != cudaSuccess) {
    throw CudaError(std::string(op) + what + " (the check of cu_seqlens and seqused values; check_seqlens = false "
                    "skips it) failed: " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
  }
}

// Copies the given cu_seqlens and seqused to the host on args.stream, waits for them, and checks
// them (check_seqlen_values); `compute`: whether the call has anything to compute.
template <class Args, class Problem>
void copy_and_check(const char* op, const Args& args, const Problem& p, bool compute) {
  if (!p.varlen || !args.check_seqlens || !compute || p.batch <= 0) return;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t err = cudaStreamIsCapturing(args.stream, &capture);
  if (err == cudaErrorStreamCaptureImplicit || err == cudaErrorStreamCaptureUnsupported) {
    cudaGetLastError();  // the legacy stream while another stream is captured: as captured
    return;
  }
  check_step(err, op, "cudaStreamIsCapturing");
  if (capture != cudaStreamCaptureStatusNone) return;
  const size_t batch = static_cast<size_t>(p.batch);
  const TensorRef* src[4] = {&args.cu_seqlens_q, &args.cu_seqlens_k, &args.seqused_q, &args.seqused_k};
  const size_t counts[4] = {batch + 1, batch + 1, batch, batch};
  const char* names[4] = {"cudaMemcpyAsync(cu_seqlens_q)", "cudaMemcpyAsync(cu_seqlens_k)",
                          "cudaMemcpyAsync(seqused_q)", "cudaMemcpyAsync(seqused_k)"};
  std::vector<int> host(4 * batch + 2);
  const int* at[4] = {nullptr, nullptr, nullptr, nullptr};
  size_t offset = 0;
  for (int i = 0; i < 4; ++i) {
    if (!given(*src[i])) continue;
    at[i] = host.data() + offset;
    check_step(cudaMemcpyAsync(host.data() + offset, src[i]->data, counts[i] * sizeof(int), cudaMemcpyDeviceToHost,
                               args.stream),
               op, names[i]);
    offset += counts[i];
  }
  check_step(cudaStreamSynchronize(args.stream), op, "cudaStreamSynchronize");
  check_seqlen_values(op, p.batch, SeqlenSide{at[0], at[2], p.total_q, p.seqlen_q},
                      SeqlenSide{at[1], at[3], p.total_k, p.seqlen_k});
}

}  // namespace

void check_seqlens_on_device(const FwdArgs& args, const FwdProblem& p) {
  copy_and_check("flash3::fwd: ", args, p, p.seqlen_q > 0);
}

void check_seqlens_on_device(const BwdArgs& args, const BwdProblem& p) {
  copy_and_check("flash3::bwd: ", args, p, true);
}

}  // namespace detail
}  // namespace flash3

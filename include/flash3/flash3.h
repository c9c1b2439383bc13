// flash3: FlashAttention-3 for NVIDIA Hopper (sm_90a).
//
// Public C++ API. Tensors are described by pointer, dtype, shape and strides (in elements),
// in the layout users of FlashAttention-3 know:
//   q   (batch, seqlen_q, nheads,    head_dim)
//   k,v (batch, seqlen_k, nheads_kv, head_dim)
//   out (batch, seqlen_q, nheads,    head_dim)           same dtype as q (FP8 q: bfloat16)
//   lse (batch, nheads, seqlen_q)  float32, optional     log-sum-exp of the scaled scores (natural log)
// Only the last dimension must be contiguous (stride 1). Every error is thrown as flash3::Error
// before anything is launched; its message names the argument, the value it got and what is
// allowed.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>

namespace flash3 {

enum class DType : int {
  kFloat16 = 0,
  kBFloat16 = 1,
  kFloat32 = 2,
  kFloat8E4M3 = 3,
  kFloat8E5M2 = 4,
  kInt32 = 5,
};

const char* dtype_name(DType dtype);
int dtype_size(DType dtype);

// A strided view of device memory. Rank up to 4; shape and stride are in elements.
struct TensorRef {
  void* data = nullptr;
  DType dtype = DType::kBFloat16;
  int rank = 0;
  int64_t shape[4] = {0, 0, 0, 0};
  int64_t stride[4] = {0, 0, 0, 0};

  // A contiguous (row-major) view of `shape`.
  static TensorRef contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape);
};

class Error : public std::invalid_argument {
 public:
  explicit Error(const std::string& what) : std::invalid_argument(what) {}
};

// A CUDA runtime failure inside fwd() (the message has the CUDA error string). A subclass of
// Error so that `catch (const flash3::Error&)` still sees it; the C API maps it to
// FLASH3_CUDA_ERROR and every other Error to FLASH3_INVALID_ARGUMENT.
class CudaError : public Error {
 public:
  explicit CudaError(const std::string& what) : Error(what) {}
};

// FP8 forward (q, k, v float8_e4m3, out bfloat16): the rows of one scale block. A block of q is
// kFp8BlockQ query rows (a consumer warpgroup's rows), one of k or v fp8_block_kv(head_dim) keys
// (the FP8 kernel's key tile at head dim 128, 192 keys; 128 keys at 64 and 256), each the full
// head_dim wide.
constexpr int kFp8BlockQ = 64;
constexpr int fp8_block_kv(int64_t head_dim) { return head_dim == 128 ? 192 : 128; }

struct FwdArgs {
  TensorRef q, k, v;
  TensorRef out;
  TensorRef lse;               // optional: lse.data == nullptr means "do not write it"
  // FP8 inputs only (q, k, v float8_e4m3; out bfloat16): dequantization scales, float32, each
  // optional (data == nullptr: 1). The true q is q * q_scale, likewise k and v. Each is either
  //   (batch, nheads_kv)                                   one scale per (batch, kv head), as
  //                                                        FlashAttention-3's q/k/v_descale
  //   q_scale (batch, nheads, ceil(seqlen_q / kFp8BlockQ))   block scales: one per block of
  //   k_scale, v_scale (batch, nheads_kv, ceil(seqlen_k / fp8_block_kv(head_dim)))  rows
  //                                                        (quantize_fp8)
  // with any strides.
  TensorRef q_scale, k_scale, v_scale;
  // <= 0 (or NaN) means the default 1/sqrt(head_dim). Any finite scale up to FLT_MAX / log2(e);
  // a huge one gives the limit (each row's output is the value of its largest-score key).
  float softmax_scale = 0.0f;
  // Causal mask aligned bottom-right (as FlashAttention-2/3): query i may attend key j iff
  // j <= i + seqlen_k - seqlen_q. Query rows that can see no key get out = 0 and lse = +inf.
  bool causal = false;
  cudaStream_t stream = nullptr;
  // Sliding window (FlashAttention-3's window_size = (left, right)): query i sees key j iff
  //   i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right,
  // -1 meaning unbounded on that side; causal sets right = 0. Key blocks outside the window are
  // skipped. Each >= -1.
  int window_left = -1, window_right = -1;
  // Softcap: > 0 replaces the scaled score x = softmax_scale * q.k by softcap * tanh(x / softcap)
  // before the softmax (lse is of these logits); 0: none. Finite, at most 2048; bfloat16 and
  // float16 only.
  float softcap = 0.0f;
  // Variable-length batches (FlashAttention-3's flash_attn_varlen_func); bfloat16 and float16.
  // With cu_seqlens_q (int32, batch + 1 entries, device memory) the query side is packed:
  //   q, out (total_q, nheads, head_dim)   sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1])
  //   lse    (nheads, total_q)             float32, as FlashAttention-3's varlen lse
  // and with cu_seqlens_k, k and v are (total_k, nheads_kv, head_dim) likewise. cu_seqlens starts
  // at 0, never decreases, and ends at the packed length. seqused_q / seqused_k (int32, batch
  // entries, optional, also without cu_seqlens): only the first seqused[b] rows of sequence b
  // take part (at most its length); out rows past them are not written. max_seqlen_q /
  // max_seqlen_k: at least every sequence's length (with cu_seqlens; else the dim 1 of q / k).
  // Masks (causal, windows) are aligned bottom-right per sequence. Decoding over a KV cache
  // (FlashAttention-3's flash_attn_with_kvcache, contiguous cache): q (batch, seqlen_q, ...), k
  // and v the cache (batch, seqlen_cache, nheads_kv, head_dim), seqused_k its lengths.
  TensorRef cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k;
  int max_seqlen_q = 0, max_seqlen_k = 0;
  // Whether fwd() checks the values of cu_seqlens and seqused against these rules (one small
  // device-to-host copy and a stream synchronization per call; skipped while the stream is being
  // captured into a CUDA graph). Unchecked, bad values give undefined results but no access out
  // of bounds: the kernels clamp every sequence to its tensor.
  bool check_seqlens = true;
};

// Forward attention: out = softmax(scale * q k^T [masked]) v, and the log-sum-exp.
// Throws flash3::Error on invalid arguments, and flash3::Error on CUDA failures
// (with the CUDA error string). seqlen_q == 0 or batch == 0 returns without a launch; empty
// tensors' strides are not checked. seqlen_q, seqlen_k <= 2^30 and ceil(seqlen_q / 64) x nheads x
// batch <= 2^30 (the kernels' 32-bit index arithmetic).
// Keeps per (device, stream) one buffer for two tile counters (causal) and, for the split of a
// partial last wave of non-causal tiles, scratch (up to ~35 MB at head dim 256), allocated by the
// first call on the stream that needs it; it only grows, and a buffer outgrown stays allocated
// (a CUDA graph captured earlier may use it). A call captured into a CUDA graph allocates
// nothing and, where the memory does not exist yet, runs without it (whole tiles: non-causal,
// the results of the static persistent order, bitwise; causal, the default's).
void fwd(const FwdArgs& args);

// ---------------------------------------------------------------------------------------------
// Host-side problem description after validation (exposed for tests and the benchmark).
// causal is also set by a window (-1, 0); window_left / window_right are -1 where the window
// excludes nothing on that side (a bound >= seqlen_k - 1, or >= seqlen_q - 1).
struct FwdProblem {
  DType dtype = DType::kBFloat16;
  int batch = 0, seqlen_q = 0, seqlen_k = 0, nheads = 0, nheads_kv = 0, head_dim = 0;
  float softmax_scale = 0.0f;
  bool causal = false;
  bool write_lse = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.0f;
  // Variable lengths (any of cu_seqlens_q/k, seqused_q/k given). Then batch is the number of
  // sequences, seqlen_q / seqlen_k the longest (max_seqlen_q/k with cu_seqlens, else the dim 1
  // of q / k), and total_q / total_k the rows of the packed q / k (batch x seqlen where not
  // packed).
  bool varlen = false;
  int64_t total_q = 0, total_k = 0;
  bool packed_q = false, packed_k = false;  // cu_seqlens_q / cu_seqlens_k given
};

// Whether a normalized problem (FwdProblem, BwdProblem) has a window beyond causal: key blocks
// skipped left of the diagonal, or (not causal) right of it.
template <class Problem>
bool has_window(const Problem& p) {
  return p.window_left >= 0 || (!p.causal && p.window_right >= 0);
}

// How validation learns where a pointer lives. The default asks the CUDA runtime; tests
// inject their own so that every rule can be checked on a machine without a GPU.
enum class PointerKind { kDevice, kHost, kUnknown };
using PointerInspector = PointerKind (*)(const void* ptr);
PointerKind cuda_pointer_kind(const void* ptr);

// Checks every precondition of fwd() and returns the normalized problem. Throws flash3::Error.
FwdProblem validate_fwd(const FwdArgs& args, PointerInspector inspect = &cuda_pointer_kind);

// The head dims and dtypes the forward kernels are built for.
bool is_supported_head_dim(int head_dim);

// True when a Hopper (sm_90) GPU is present and usable by this process.
bool hopper_available(std::string* why_not = nullptr);

// ---------------------------------------------------------------------------------------------
// Decoding over a KV cache (FlashAttention-3's flash_attn_with_kvcache): a few new query rows per
// sequence attend to that sequence's cached keys and values. One split-KV kernel (src/decode/):
// the query heads that share a KV head are packed into the rows of one tile (each K/V row is
// read once per group), the key range of a (sequence, KV head) is split over several blocks when
// the grid would not fill the GPU, and the last block of a split combines the pieces by their
// log-sum-exps.
//   q, out    (batch, seqlen_q, nheads, head_dim)        float16 or bfloat16, one dtype
//   k_cache, v_cache: contiguous (batch_cache, seqlen_cache, nheads_kv, head_dim), or paged
//             (num_pages, page_size, nheads_kv, head_dim) with page_table; q's dtype
//   lse       (batch, nheads, seqlen_q) float32, optional
// Only the last dim of each must be contiguous. Sequence b sees the keys at cache positions
// [cache_leftpad[b], cache_seqlens[b]) (positions past the cache count as its end); the masks
// (causal, window) are aligned bottom-right to them: query row i sits at key position
// (cache_seqlens[b] - cache_leftpad[b]) - seqlen_q + i. Rows that see no key: out 0, lse +inf.
struct KvcacheArgs {
  TensorRef q, k_cache, v_cache, out;
  TensorRef lse;  // optional: data == nullptr means "do not write it"
  // Optional int32 device tensors (a zero TensorRef: not given):
  TensorRef cache_seqlens;    // (batch): the end of each sequence's keys; default: the whole cache
                              // (seqlen_cache, or max_pages_per_seq x page_size when paged)
  TensorRef cache_batch_idx;  // (batch): the cache entry batch entry b reads (contiguous cache
                              // only); default b
  TensorRef cache_leftpad;    // (batch): the first key of each sequence; default 0
  TensorRef page_table;       // (batch, max_pages_per_seq): key position p of sequence b lives in
                              // page page_table[b][p / page_size], row p % page_size; any page size
  // Values on the device are not read by the host: cache_seqlens and cache_leftpad are clamped
  // to the cache, cache_batch_idx and page_table entries to [0, batch_cache) / [0, num_pages), so
  // that bad values never read out of bounds (results then undefined).
  float softmax_scale = 0.0f;  // as FwdArgs
  bool causal = false;
  int window_left = -1, window_right = -1;
  float softcap = 0.0f;
  // Key-range splits per (sequence, KV head, row tile): 1..kMaxKvcacheSplits, or 0 for the
  // heuristic (kvcache_num_splits). More than one split needs the stream's scratch memory; a
  // call captured into a CUDA graph before the stream has enough of it runs with one split.
  int num_splits = 0;
  cudaStream_t stream = nullptr;
  // Append (FlashAttention-3's k, v, rotary_cos, rotary_sin), inside the kernel: k_new, v_new
  // (batch, seqlen_new, nheads_kv, head_dim), q's dtype, last dim contiguous, are written into the
  // cache at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 (cache_seqlens
  // required: the lengths before the append) and attended to; sequence b then sees positions
  // [cache_leftpad[b], cache_seqlens[b] + seqlen_new). Positions past the cache are neither
  // written nor seen (the caller's precondition: they fit). rotary_cos, rotary_sin (optional,
  // together, only with k_new): (seqlen_ro, rotary_dim / 2) of one dtype, float32 or q's (as
  // FlashAttention-3's), rotary_dim a multiple of 16
  // and at most head_dim, last dim contiguous: the first rotary_dim dims of each new key are
  // rotated at its cache position and those of each query row at cache_seqlens[b] + i (causal or
  // a window) or cache_seqlens[b] (neither), pairs (2j, 2j + 1) when rotary_interleaved, else
  // (j, j + rotary_dim / 2); positions past seqlen_ro use its last row. Computed in float32,
  // rounded to q's dtype.
  TensorRef k_new, v_new, rotary_cos, rotary_sin;
  bool rotary_interleaved = false;
  // MLA (DeepSeek's multi-head latent attention; FlashAttention-3's qv), optional: qv (batch,
  // seqlen_q, nheads, 512), q's dtype, the queries' latent part, with q (..., 64) their rotary
  // part. The cache then holds per key its rotary part in k_cache (..., nheads_kv, 64) and its
  // latent in v_cache (..., nheads_kv, 512), which is also the value: the scores are q k^T +
  // qv v^T (head dim 576), out (batch, seqlen_q, nheads, 512) = softmax(scores) v. k_new (..., 64)
  // and v_new (..., 512) append; the rotary embedding applies to q and k_new (rotary_dim <= 64).
  // softmax_scale defaults to 1 / sqrt(576). Only these head dims (64 + 512) are supported.
  TensorRef qv;
};
constexpr int kMlaRotaryDim = 64, kMlaLatentDim = 512;
constexpr int kMaxKvcacheSplits = 64;

struct KvcacheProblem {
  DType dtype = DType::kBFloat16;
  int batch = 0, seqlen_q = 0, nheads = 0, nheads_kv = 0, head_dim = 0;
  int head_dim_v = 0;  // v_cache's and out's head dim: head_dim, or kMlaLatentDim with qv (MLA)
  bool mla = false;    // qv given: head_dim = kMlaRotaryDim, head_dim_v = kMlaLatentDim
  int batch_cache = 0;   // contiguous: dim 0 of k_cache; paged: num_pages
  int seqlen_cache = 0;  // the longest key range: seqlen_cache, or max_pages_per_seq x page_size
  bool paged = false;
  int page_size = 0, max_pages = 0;  // paged only
  bool has_seqlens = false, has_batch_idx = false, has_leftpad = false;
  float softmax_scale = 0.0f;
  bool causal = false;
  bool write_lse = false;
  int window_left = -1, window_right = -1;  // normalized as FwdProblem's
  float softcap = 0.0f;
  int num_splits = 0;  // as given (0: heuristic)
  int seqlen_new = 0;  // the append's rows (0: no append)
  int rotary_dim = 0;  // 0: no rotary
  bool rotary_interleaved = false;
  int seqlen_ro = 0;
};

// Checks every precondition of fwd_kvcache() and returns the normalized problem. Throws
// flash3::Error naming the argument (messages start "flash3::fwd_kvcache: ").
KvcacheProblem validate_kvcache(const KvcacheArgs& args, PointerInspector inspect = &cuda_pointer_kind);

// The split count num_splits = 0 chooses: 1 when batch x nheads_kv x row tiles (the tiles) fill
// half of one wave (the blocks the `sms` SMs hold at once: 3 / 2 / 1 per SM at head dim 64 / 128
// / 256, 1 for MLA), else as many splits as one wave holds, each at least 128 keys of
// seqlen_cache up to 32 splits, beyond 32 at least 1024 keys, at most 64.
int kvcache_num_splits(const KvcacheProblem& p, int sms);

// Runs the decoding kernel. Throws flash3::Error on invalid arguments and flash3::CudaError on
// CUDA failures. batch == 0 or seqlen_q == 0 returns without a launch.
void fwd_kvcache(const KvcacheArgs& args);

// ---------------------------------------------------------------------------------------------
// FP8 quantization for the FP8 forward: in (batch, seqlen, nheads, head_dim) bfloat16 or float16
// -> out (same shape) float8_e4m3 and scale (batch, nheads, ceil(seqlen / block_rows)) float32,
// with in ~= out * scale per block of block_rows rows (scale = the block's max |value| / 448,
// 1 for an all-zero block). With hadamard, each row (one head's head_dim vector) is first
// multiplied by M = diag(s) H / sqrt(head_dim), s random signs from `seed`, H the Sylvester
// Hadamard matrix (head_dim a power of two): M is orthogonal, so quantizing q and k with the
// same seed leaves q k^T, and the attention output, unchanged (incoherent processing, §3.3);
// v is quantized without it. Only the last dim must be contiguous, for in and out.
struct QuantizeArgs {
  TensorRef in;
  TensorRef out;
  TensorRef scale;
  int block_rows = 0;  // kFp8BlockQ for q, fp8_block_kv(head_dim) for k and v; 0: the latter
  bool hadamard = false;
  uint64_t seed = 0;
  cudaStream_t stream = nullptr;
};
void quantize_fp8(const QuantizeArgs& args);

// ---------------------------------------------------------------------------------------------
// Backward pass (FlashAttention-3, Algorithm 3). Given the forward's inputs, its output and
// log-sum-exp, and dout = dLoss/dout, writes dq, dk, dv = dLoss/d(q, k, v).
//   q, out, dout, dq (batch, seqlen_q, nheads, head_dim)     one dtype (float16 or bfloat16)
//   k, v, dk, dv     (batch, seqlen_k, nheads_kv, head_dim)  same dtype
//   lse              (batch, nheads, seqlen_q) float32        as written by fwd()
// Only the last dim must be contiguous. GQA/MQA: dk, dv are summed over the query heads that
// share a kv head. Rows that see no key (causal with seqlen_q > seqlen_k) get dq = 0.
struct BwdArgs {
  TensorRef q, k, v, out, dout, lse;
  TensorRef dq, dk, dv;
  // <= 0 (or NaN) means 1/sqrt(head_dim); must match the forward; at most 2^11 (P is recomputed
  // from the float32 lse, exactly only at such scales: src/validate.cpp).
  float softmax_scale = 0.0f;
  bool causal = false;         // must match the forward
  // Bitwise-identical gradients from run to run (dq partial sums are added in a fixed order).
  bool deterministic = false;
  cudaStream_t stream = nullptr;
  // Optional scratch device memory of at least bwd_workspace_size() bytes, 256-byte aligned.
  // nullptr: bwd() allocates it with cudaMallocAsync on `stream` and frees it after use.
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  // As the forward's (FwdArgs); must match it.
  int window_left = -1, window_right = -1;
  float softcap = 0.0f;
  // Variable-length batches, as the forward's (FwdArgs); must match it. With cu_seqlens_q, q,
  // out, dout and dq are (total_q, nheads, head_dim) and lse (nheads, total_q); with
  // cu_seqlens_k, k, v, dk and dv are (total_k, nheads_kv, head_dim). Gradient rows past
  // seqused are written as 0.
  TensorRef cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k;
  int max_seqlen_q = 0, max_seqlen_k = 0;
  bool check_seqlens = true;
};

struct BwdProblem {
  DType dtype = DType::kBFloat16;
  int batch = 0, seqlen_q = 0, seqlen_k = 0, nheads = 0, nheads_kv = 0, head_dim = 0;
  float softmax_scale = 0.0f;
  bool causal = false;
  bool deterministic = false;
  int window_left = -1, window_right = -1;  // normalized as FwdProblem's
  float softcap = 0.0f;
  bool varlen = false;  // as FwdProblem's
  int64_t total_q = 0, total_k = 0;
  bool packed_q = false, packed_k = false;
};

// Checks every precondition of bwd() (not the workspace size) and returns the normalized
// problem. Throws flash3::Error naming the argument (messages start "flash3::bwd: ").
BwdProblem validate_bwd(const BwdArgs& args, PointerInspector inspect = nullptr);

// Bytes of scratch memory bwd() needs for this problem (0 when there is nothing to compute).
size_t bwd_workspace_size(const BwdProblem& p);

// Sizes as fwd(), and also ceil(seqlen_k / 64) x nheads x batch <= 2^30. Empty tensors' strides
// are not checked.
// Throws flash3::Error on invalid arguments (including a too-small workspace) and
// flash3::CudaError on CUDA failures. batch == 0 returns without a launch; seqlen_q == 0
// writes dk = dv = 0 and seqlen_k == 0 writes dq = 0.
void bwd(const BwdArgs& args);

}  // namespace flash3

// flash3: the decoding entry point flash3::fwd_kvcache: validate, choose the split count, carve
// the split's scratch, and launch the decoding kernel (decode_kernel.h) for the dtype and head dim.
#include <algorithm>
#include <climits>
#include <string>

#include "decode/decode_kernel.h"
#include "dispatch.h"
#include "flash3/flash3.h"
#include "runtime/launch.h"
#include "runtime/runtime.h"

namespace flash3 {

namespace {
// A split gets at least this many keys of the longest key range: fewer, and each block's fixed
// cost (the Q load, the first stage's latency, the merge) outweighs its share of the cache.
constexpr int kMinSplitKeys = 128;
// Up to kManySplits splits of at least kMinSplitKeys; beyond, splits of at least kLongSplitKeys
// (batch 1 at head dim 128, bench_decode.py --splits: 32 splits best at 8k keys, 64 at 64k and
// 128k, 7% to 40% faster than 32 there).
constexpr int kManySplits = 32;
constexpr int kLongSplitKeys = 1024;
}  // namespace

int kvcache_num_splits(const KvcacheProblem& p, int sms) {
  const int rows = p.seqlen_q * (p.nheads / p.nheads_kv);
  const long long tiles = (long long)p.batch * p.nheads_kv * ((rows + 15) / 16);
  // Blocks per SM the shared memory allows (decode_kernel.h: 4 / 3 / 3 stages of 64 keys; MLA
  // 2 stages of 576 dims).
  const int per_sm = p.mla ? 1 : p.head_dim == 64 ? 3 : p.head_dim == 128 ? 2 : 1;
  const long long wave = (long long)sms * per_sm;
  if (tiles <= 0 || tiles * 2 > wave) return 1;
  const long long by_sms = wave / tiles;  // splits that still fit in one wave
  const long long by_keys = std::max(std::min(p.seqlen_cache / kMinSplitKeys, kManySplits),
                                     p.seqlen_cache / kLongSplitKeys);
  return int(std::clamp<long long>(std::min(by_sms, by_keys), 1, kMaxKvcacheSplits));
}

namespace detail {
namespace {

// The scratch of a split merged through global memory: a counter per tile in the zeroed head,
// then the pieces' O and log-sum-exps. False where there is none (a stream capture that would
// need it to grow, or more tiles than counters): then one split.
bool carve_split_scratch(DecodeParams& dp, const KvcacheProblem& p, unsigned tiles, unsigned splits,
                         cudaStream_t stream) {
  if (size_t(tiles) * sizeof(int) > kScratchCounterBytes) return false;  // the grid fills the GPU anyway
  const size_t rows = size_t(p.batch) * p.nheads * p.seqlen_q * size_t(splits);
  const size_t o_bytes = rows * p.head_dim_v * sizeof(float);
  const size_t lse_bytes = (rows * sizeof(float) + 255) / 256 * 256;
  char* scratch =
      stream_memory(stream, kScratchCounterBytes + o_bytes + lse_bytes, size_t(tiles) * sizeof(int)).scratch;
  if (scratch == nullptr) return false;
  dp.counters = reinterpret_cast<int*>(scratch);
  dp.part_o = reinterpret_cast<float*>(scratch + kScratchCounterBytes);
  dp.part_lse = reinterpret_cast<float*>(scratch + kScratchCounterBytes + o_bytes);
  return true;
}

// With a split (decode_kernel.h): up to kMaxClusterSplits splits whose clusters (a tile's
// blocks) all fit on the GPU at once, a cluster launch and the merge through shared memory;
// else, where the whole grid fits at once, a cooperative launch (which guarantees that) and the
// shared merge; else, or if the runtime turns the cooperative launch down (a GPU shared with
// other processes), the last block merges.
template <class Element, int kHeadDim, int kHeadDimV = kHeadDim>
void launch_decode(DecodeParams params, const KvcacheProblem& p, unsigned tiles, unsigned splits,
                   cudaStream_t stream) {
  using T = DecodeTraits<Element, kHeadDim, kHeadDimV>;
  constexpr auto kernel = &decode_kernel<Element, kHeadDim, kHeadDimV>;
  constexpr auto cluster_kernel = &decode_kernel<Element, kHeadDim, kHeadDimV, true>;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = ::dim3(tiles, splits);
  cfg.blockDim = ::dim3(unsigned(T::kThreads));
  cfg.dynamicSmemBytes = size_t(T::kSmemBytes);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  if (splits > 1 && splits <= unsigned(kMaxClusterSplits)) {
    set_max_dynamic_smem<cluster_kernel>(T::kSmemBytes);
    if ((long long)tiles <= max_active_clusters<cluster_kernel>(T::kThreads, T::kSmemBytes, int(splits))) {
      params.num_splits = int(splits);
      attr[0] = cluster_along_y(splits);
      cfg.attrs = attr;
      cfg.numAttrs = 1;
      check_cuda(cudaLaunchKernelEx(&cfg, cluster_kernel, params), "flash3::fwd_kvcache: kernel launch");
      return;
    }
  }
  set_max_dynamic_smem<kernel>(T::kSmemBytes);
  if (splits > 1 && !carve_split_scratch(params, p, tiles, splits, stream)) {
    splits = 1;
    cfg.gridDim.y = 1;
  }
  params.num_splits = int(splits);
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  params.merge_shared = splits > 1 && (long long)tiles * splits <=
                                          (long long)blocks_per_sm<kernel>(T::kThreads, T::kSmemBytes) *
                                              current_device_info().sms;
  if (params.merge_shared) {
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, params);
    if (e != cudaErrorCooperativeLaunchTooLarge) {
      check_cuda(e, "flash3::fwd_kvcache: kernel launch");
      return;
    }
    (void)cudaGetLastError();
    params.merge_shared = false;
    cfg.numAttrs = 0;
  }
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, params), "flash3::fwd_kvcache: kernel launch");
}

void strides3(int64_t (&dst)[3], const TensorRef& t, int d0, int d1, int d2) {
  dst[0] = t.stride[d0];
  dst[1] = t.stride[d1];
  dst[2] = t.stride[d2];
}

}  // namespace
}  // namespace detail

void fwd_kvcache(const KvcacheArgs& args) {
  using namespace detail;
  const KvcacheProblem p = validate_kvcache(args);
  if (p.batch == 0 || p.seqlen_q == 0) return;
  require_hopper("flash3::fwd_kvcache");

  DecodeParams dp{};
  dp.q = args.q.data;
  dp.qv = p.mla ? args.qv.data : nullptr;
  dp.out = args.out.data;
  dp.k = args.k_cache.data;
  dp.v = args.v_cache.data;
  dp.lse = p.write_lse ? static_cast<float*>(args.lse.data) : nullptr;
  strides3(dp.q_stride, args.q, 0, 1, 2);
  if (p.mla) strides3(dp.qv_stride, args.qv, 0, 1, 2);
  strides3(dp.o_stride, args.out, 0, 1, 2);
  strides3(dp.k_stride, args.k_cache, 0, 1, 2);
  strides3(dp.v_stride, args.v_cache, 0, 1, 2);
  if (p.write_lse) strides3(dp.lse_stride, args.lse, 0, 1, 2);
  dp.cache_seqlens = p.has_seqlens ? static_cast<const int*>(args.cache_seqlens.data) : nullptr;
  dp.batch_idx = p.has_batch_idx ? static_cast<const int*>(args.cache_batch_idx.data) : nullptr;
  dp.leftpad = p.has_leftpad ? static_cast<const int*>(args.cache_leftpad.data) : nullptr;
  dp.page_table = p.paged ? static_cast<const int*>(args.page_table.data) : nullptr;
  dp.page_table_stride = p.paged ? args.page_table.stride[0] : 0;
  dp.batch = p.batch;
  dp.seqlen_q = p.seqlen_q;
  dp.nheads_kv = p.nheads_kv;
  dp.group = p.nheads / p.nheads_kv;
  dp.group_div = make_divisor(dp.group);
  dp.rows = p.seqlen_q * dp.group;
  dp.row_tiles = (dp.rows + 15) / 16;
  dp.entries = p.batch_cache;
  dp.capacity = p.seqlen_cache;
  dp.page_size = p.paged ? p.page_size : 0;
  if (p.paged) dp.pages = make_divisor(p.page_size);
  constexpr float kLog2e = 1.4426950408889634f;
  dp.scale_log2 = p.softmax_scale * kLog2e;
  dp.softcap_log2 = p.softcap > 0.0f ? p.softcap * kLog2e : 0.0f;
  dp.scale_over_cap = p.softcap > 0.0f ? p.softmax_scale / p.softcap : 0.0f;
  if (p.seqlen_new > 0) {
    dp.k_new = args.k_new.data;
    dp.v_new = args.v_new.data;
    strides3(dp.k_new_stride, args.k_new, 0, 1, 2);
    strides3(dp.v_new_stride, args.v_new, 0, 1, 2);
    dp.seqlen_new = p.seqlen_new;
  }
  if (p.rotary_dim > 0) {
    dp.rot_cos = args.rotary_cos.data;
    dp.rot_sin = args.rotary_sin.data;
    dp.rot_f32 = args.rotary_cos.dtype == DType::kFloat32;
    dp.cos_stride = args.rotary_cos.stride[0];
    dp.sin_stride = args.rotary_sin.stride[0];
    dp.rot_half = p.rotary_dim / 2;
    dp.seqlen_ro = p.seqlen_ro;
    dp.rot_interleaved = p.rotary_interleaved;
  }
  // FlashAttention-3's rule: with a causal mask or a window, query row t is rotated at
  // cache_seqlens + t, else every row at cache_seqlens.
  dp.q_rot_by_token = p.causal || p.window_left >= 0 || p.window_right >= 0;
  dp.window_left = p.window_left;
  dp.window_right = p.causal ? 0 : p.window_right;

  // One block per (batch entry, KV head, row tile) and split.
  const long long tiles = (long long)p.batch * p.nheads_kv * dp.row_tiles;
  if (tiles > INT_MAX) {
    throw Error("flash3::fwd_kvcache: batch x nheads_kv x ceil(seqlen_q x nheads / nheads_kv / 16) is " +
                std::to_string(tiles) + "; at most " + std::to_string(INT_MAX));
  }
  int splits = p.num_splits > 0 ? p.num_splits : kvcache_num_splits(p, current_device_info().sms);
  splits = std::min(splits, std::max(1, (p.seqlen_cache + 63) / 64));  // no split without a key block

  // The 16-bit rows of the kernel table (those with a backward); MLA at its one shape.
  const bool found = dispatch<true>(p.dtype, p.head_dim, [&](auto dtype, auto head_dim) {
    using Element = std::conditional_t<decltype(dtype)::value == DType::kBFloat16, __nv_bfloat16, __half>;
    constexpr int kHeadDim = decltype(head_dim)::value;
    if constexpr (kHeadDim == kMlaRotaryDim) {
      if (p.mla) {
        return launch_decode<Element, kMlaRotaryDim, kMlaLatentDim>(dp, p, unsigned(tiles), unsigned(splits), args.stream);
      }
    }
    launch_decode<Element, kHeadDim>(dp, p, unsigned(tiles), unsigned(splits), args.stream);
  });
  if (!found) throw_no_kernel("flash3::fwd_kvcache", p.dtype, p.head_dim);
}

}  // namespace flash3

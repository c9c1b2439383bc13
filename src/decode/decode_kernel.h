// flash3: the decoding kernel (flash3::fwd_kvcache): a few query rows per sequence over that
// sequence's KV cache, which is memory-bound: the measure is how close reading the cache comes
// to the GPU's copy bandwidth.
//
//   grid  x: (batch entry, KV head, row tile), y: key-range split.
//   block 4 warps. Rows: the query heads that share the KV head, packed with the query tokens
//         (row r = token r / group, head r % group: GQA packing), 16 rows per tile; each K/V row
//         is read once per group instead of once per query head.
//   keys  the tile's visible key range, cut into num_splits pieces of whole 64-key blocks; each
//         block streams its piece through a ring of kStages shared-memory stages with cp.async
//         (any page size: each row's address is looked up, page by page); each warp takes 16
//         keys of a stage: S = Q K^T and O += P V with mma.sync m16n8k16, the online softmax in
//         registers. The 4 warps' partial results are merged in shared memory.
//   split more than one split: the pieces are merged by their log-sum-exps without a second
//         kernel. Up to kMaxClusterSplits splits whose clusters all fit on the GPU at once: the
//         tile's blocks are one thread-block cluster; each keeps its piece (O normalized, FP32)
//         in its shared memory and, past a cluster barrier, merges a 1 / num_splits share of the
//         tile from the others' shared memory (no global scratch, no fence, no counter). That
//         merge is a kernel of its own (kClusterMerge): with its cluster instructions in the
//         kernel, launches without clusters were 2-3 us slower (H200, docs/perf-log.md D37).
//         Otherwise each block writes its piece's O and log-sum-exp to the scratch and counts
//         itself done. Where the whole grid fits on the GPU at once (a cooperative launch),
//         each block waits for its tile's count and merges a 1 / num_splits share of the tile's
//         output: one round of loads per block. Otherwise the last block of the tile to finish
//         merges all of it. Either way the counter ends at zero for the next launch.
//   code  a block runs its prologue and its merges once, each instruction fetched from the L2 (or
//         DRAM) the first time on each SM: at small batches the kernel's time follows the size
//         of that code more than its instruction count (Nsight Compute, batch 1: 63% of the
//         warps' samples stalled on no instruction with a cold L2). So the loops outside the
//         key loop stay rolled (#pragma unroll 1), the prologue shares the key loop's code and
//         the split merge sums pieces at one site; the epilogue's store of the tile is unrolled
//         (a few rows per thread, so that its shared-memory reads all precede its stores).
//   MLA   (kHeadDimV = 512 > kHeadDim = 64): a stage row holds a key's latent (v_cache, 512
//         dims, also its value) then its rotary part (k_cache, 64), and a Q row qv then q, so
//         S is one product over 576 dims. O (16 x 512) is too wide for one warp's registers:
//         each warp computes S for its 16 keys as above, the block agrees on the row maxima
//         and shares P (16 x 64) through shared memory, and each warp accumulates O for its 128
//         of the 512 dims over all 64 keys.
#pragma once

#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "common/ptx.h"
#include "decode/divisor.h"
#include "flash3/flash3.h"

namespace flash3::detail {

struct DecodeParams {
  const void* q;
  const void* qv;  // MLA: the queries' latent part (q: their rotary part)
  void* out;
  void* k;  // the cache: written by the append
  void* v;
  float* lse;  // null: not written
  int64_t q_stride[3], qv_stride[3], o_stride[3];  // batch, token, head (elements)
  int64_t k_stride[3], v_stride[3];   // cache entry or page, row, KV head
  int64_t lse_stride[3];              // batch, head, token
  const int* cache_seqlens;           // each may be null
  const int* batch_idx;
  const int* leftpad;
  const int* page_table;
  int64_t page_table_stride;
  int batch, seqlen_q, nheads_kv, group;  // group = nheads / nheads_kv
  Divisor group_div;                       // row / group (divisor.h)
  int rows, row_tiles;                     // rows = seqlen_q x group, row_tiles = ceil(rows / 16)
  int entries;                             // batch_cache (contiguous) or num_pages (paged)
  int capacity;                            // keys a sequence can hold: seqlen_cache, max_pages x page_size
  int page_size;                           // 0: contiguous
  Divisor pages;                           // paged: pos / page_size
  float scale_log2;                        // softmax_scale x log2(e)
  float softcap_log2, scale_over_cap;      // softcap x log2(e), softmax_scale / softcap (softcap > 0)
  int window_left, window_right;           // -1: unbounded on that side (causal: right = 0)
  int num_splits;
  // Append (seqlen_new > 0): new keys and values (batch, seqlen_new, KV head), written into the
  // cache at positions cache_seqlens[b] + i by the (row tile 0, split 0) block of each (batch
  // entry, KV head), and read from here by every block that sees them.
  const void* k_new;
  const void* v_new;
  int64_t k_new_stride[3], v_new_stride[3];
  int seqlen_new;
  // Rotary (rot_half > 0): tables (seqlen_ro, rot_half), float32 (rot_f32) or of q's dtype, row
  // strides cos_stride, sin_stride (elements).
  const void* rot_cos;
  const void* rot_sin;
  int64_t cos_stride, sin_stride;
  int rot_half, seqlen_ro;
  bool rot_interleaved, rot_f32;
  bool q_rot_by_token;  // causal or a window: query row t at cache_seqlens + t, else all at cache_seqlens
  float* part_o;                           // num_splits > 1: (split, batch, head, token, head_dim_v)
  float* part_lse;                         //                 (split, batch, head, token)
  int* counters;                           //                 one per (batch, KV head, row tile), zero
  // num_splits > 1: every block of a tile waits until all its pieces are written and merges its
  // share of the tile (the grid is co-resident: a cooperative launch); else the last block to
  // finish merges the whole tile.
  bool merge_shared;
};

// The most splits merged within a thread-block cluster (the portable cluster size).
constexpr int kMaxClusterSplits = 8;

// kHeadDim: q's and k_cache's head dim; kHeadDimV: v_cache's and out's (MLA when they differ).
template <class Element, int kHeadDim, int kHeadDimV = kHeadDim>
struct DecodeTraits {
  static constexpr bool kMla = kHeadDimV != kHeadDim;
  static constexpr int kWarps = 4, kThreads = 32 * kWarps;
  static constexpr int kRows = 16;            // one m16 tile
  static constexpr int kBlockN = 16 * kWarps; // keys per stage: 16 per warp
  // The dims of a Q row and a stage row (MLA: latent then rotary part, V the first kHeadDimV).
  static constexpr int kDimQK = kMla ? kHeadDimV + kHeadDim : kHeadDim;
  static constexpr int kStages = kMla ? 2 : kHeadDim == 64 ? 4 : 3;
  static constexpr int kChunks = kDimQK / 8;  // 16-byte chunks per row
  static constexpr int kStageBytes = (kMla ? 1 : 2) * kBlockN * kDimQK * int(sizeof(Element));  // K (and V)
  // MLA: the warps' row maxima and P, shared every stage.
  static constexpr int kShareBytes = kMla ? kWarps * kRows * 4 + kRows * kBlockN * int(sizeof(Element)) : 0;
  static constexpr int kSmemBytes = kRows * kDimQK * int(sizeof(Element)) + kStages * kStageBytes + kShareBytes;
  // O's warp slots: MLA's warps hold disjoint dims of one O, the others whole O's to merge. Their
  // rows are kORowFloats apart: 8 floats of padding put the 8 rows of a warp's float2 stores in
  // different banks (unpadded, all rows start in bank 0: 8-way conflicts).
  static constexpr int kOSlots = kMla ? 1 : kWarps;
  static constexpr int kORowFloats = kHeadDimV + 8;
  // The warps' partial results (O, max, sum) and the rows' weights reuse the stages once the loop
  // is done.
  static_assert((kOSlots * kRows * kORowFloats + (2 * kWarps + kOSlots + 1) * kRows) * 4 <= kStages * kStageBytes);
  // So do the split merge's weights and partial sums (decode_kernel's end).
  static_assert((kMaxKvcacheSplits + 1) * kRows * 4 + kThreads * 16 <= kStages * kStageBytes);
  // And the cluster merge's piece (kRows x kORowFloats) and weights past them.
  static_assert(((kOSlots + 1) * kRows * kORowFloats + (2 * kWarps + kOSlots + 1 + kMaxClusterSplits + 1) * kRows) * 4 <=
                kStages * kStageBytes);
  static_assert(kHeadDim % 64 == 0 && kHeadDimV % 64 == 0);
  static_assert(!kMla || kHeadDimV == 4 * 128, "MLA: each of the 4 warps owns 128 dims of O");
};

namespace decode {

constexpr float kLn2 = 0.6931471805599453f;

// acc += w x, per component (the weighted sums of the warps' O slots and of the split pieces).
__device__ __forceinline__ void add_scaled(float4& acc, float w, float4 x) {
  acc.x += w * x.x;
  acc.y += w * x.y;
  acc.z += w * x.z;
  acc.w += w * x.w;
}

// A cluster barrier without memory ordering (no fence on the stores in flight): for leaving,
// once this thread's loads from the other blocks' shared memory have returned.
__device__ __forceinline__ void cluster_sync_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;\n" ::: "memory");
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// A 16-byte copy global -> shared; bytes = 0 fills the destination with zeros.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
// A 4-byte copy global -> shared (through L1).
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// c += a b: m16n8k16, row-major A (4 registers), column-major B (2), FP32 accumulators.
template <class Element>
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats as one register of two 16-bit elements (lo in the low half).
template <class Element>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

// Element (row, chunk) of a tile of kChunks 16-byte chunks per row, XOR-swizzled so that the 8
// rows an ldmatrix reads at one chunk fall in 8 different bank groups.
template <int kChunks>
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return row * kChunks * 8 + ((chunk ^ (row & 7)) * 8);
}

__device__ __forceinline__ int clampi(int x, int lo, int hi) { return x < lo ? lo : x > hi ? hi : x; }

// 16 bytes of 8 elements as floats, and back (rounded to nearest).
template <class Element>
__device__ __forceinline__ void unpack8(const uint4& v, float (&f)[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
      const float2 x = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    } else {
      const float2 x = __half22float2(*reinterpret_cast<const __half2*>(&w[i]));
      f[2 * i] = x.x;
      f[2 * i + 1] = x.y;
    }
  }
}
template <class Element>
__device__ __forceinline__ uint4 pack8(const float (&f)[8]) {
  return make_uint4(pack2<Element>(f[0], f[1]), pack2<Element>(f[2], f[3]), pack2<Element>(f[4], f[5]),
                    pack2<Element>(f[6], f[7]));
}

// Chunk c (dims 8c .. 8c + 7) of `row`, with the rotary embedding at position `pos` applied to
// the dims below 2 x rot_half (FlashAttention-3's: interleaved pairs (2j, 2j + 1), else (j, j +
// rot_half); rot_half a multiple of 8, so a chunk lies in one half), in float32.
template <class Element>
__device__ __forceinline__ uint4 rotated_chunk(const Element* row, int c, int pos, const DecodeParams& p) {
  const uint4 raw = *reinterpret_cast<const uint4*>(row + 8 * c);
  const int d0 = 8 * c;
  if (p.rot_half == 0 || d0 >= 2 * p.rot_half) return raw;
  const int at = min(pos, p.seqlen_ro - 1);
  const int64_t cs_row = int64_t(at) * p.cos_stride, sn_row = int64_t(at) * p.sin_stride;
  // Entry i of this position's row of a table (float32 or Element).
  auto entry = [&](const void* table, int64_t row, int i) -> float {
    return p.rot_f32 ? static_cast<const float*>(table)[row + i]
                     : float(static_cast<const Element*>(table)[row + i]);
  };
  float x[8], out[8];
  unpack8<Element>(raw, x);
  if (p.rot_interleaved) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float c0 = entry(p.rot_cos, cs_row, d0 / 2 + j), s0 = entry(p.rot_sin, sn_row, d0 / 2 + j);
      out[2 * j] = x[2 * j] * c0 - x[2 * j + 1] * s0;
      out[2 * j + 1] = x[2 * j] * s0 + x[2 * j + 1] * c0;
    }
  } else {
    const bool first = d0 < p.rot_half;
    float y[8];  // the partner chunk, rot_half dims away
    unpack8<Element>(*reinterpret_cast<const uint4*>(row + (first ? d0 + p.rot_half : d0 - p.rot_half)), y);
    const int i0 = first ? d0 : d0 - p.rot_half;  // the pairs' index into the tables
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float c0 = entry(p.rot_cos, cs_row, i0 + j), s0 = entry(p.rot_sin, sn_row, i0 + j);
      out[j] = first ? x[j] * c0 - y[j] * s0 : y[j] * s0 + x[j] * c0;
    }
  }
  return pack8<Element>(out);
}

}  // namespace decode

// kClusterMerge: launched in clusters of (1, num_splits) blocks, 1 < num_splits <=
// kMaxClusterSplits, which merge through each other's shared memory (part_o, part_lse and
// counters unused).
template <class Element, int kHeadDim, int kHeadDimV = kHeadDim, bool kClusterMerge = false>
__global__ void __launch_bounds__(DecodeTraits<Element, kHeadDim, kHeadDimV>::kThreads)
    decode_kernel(const __grid_constant__ DecodeParams p) {
  using T = DecodeTraits<Element, kHeadDim, kHeadDimV>;
  using namespace decode;
  constexpr bool kMla = T::kMla;
  constexpr int kChunks = T::kChunks, kBlockN = T::kBlockN, kStages = T::kStages, kRows = T::kRows;
  constexpr int kStageElems = kBlockN * T::kDimQK;
  // MLA: the chunks of a row that hold the latent (qv, v_cache); the rest hold the rotary part.
  constexpr int kLatentChunks = kMla ? kHeadDimV / 8 : 0;
  // O's n8 tiles per warp: MLA's warps own kHeadDimV / kWarps dims each, the others all of them.
  constexpr int kOTiles = kMla ? kHeadDimV / (8 * T::kWarps) : kHeadDim / 8;
  extern __shared__ __align__(128) char smem_raw[];
  Element* sQ = reinterpret_cast<Element*>(smem_raw);
  Element* sK = sQ + kRows * T::kDimQK;
  Element* sV = kMla ? sK : sK + kStages * kStageElems;  // MLA: V is the latent part of the K rows
  // MLA: the warps' row maxima (warp, row) and P (row, key), past the stages.
  float* sMax = reinterpret_cast<float*>(smem_raw + kRows * T::kDimQK * int(sizeof(Element)) + kStages * T::kStageBytes);
  Element* sP = reinterpret_cast<Element*>(sMax + T::kWarps * kRows);

  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int tile = blockIdx.x % p.row_tiles;
  const int head_kv = (blockIdx.x / p.row_tiles) % p.nheads_kv;
  const int b = blockIdx.x / (p.row_tiles * p.nheads_kv);
  const int split = blockIdx.y;
  const int row0 = tile * kRows;

  // ---- Q: the tile's 16 rows, zero past the last --------------------------------------------
  // MLA: the latent chunks from qv (never rotated), then q's. Element i of the tile: its row r,
  // chunk c, token t, and the source row and chunk.
  const Element* q = static_cast<const Element*>(p.q);
  const Element* qv = static_cast<const Element*>(p.qv);
  auto q_source = [&](int i, int& r, int& c, bool& ok, int& t, int& cs) {
    r = i / kChunks;
    c = i % kChunks;
    const int row = row0 + r;
    ok = row < p.rows;
    t = ok ? quotient(row, p.group_div) : 0;
    const int h = head_kv * p.group + (ok ? row - t * p.group : 0);
    const bool latent = c < kLatentChunks;
    cs = c - (latent ? 0 : kLatentChunks);
    return latent ? qv + b * p.qv_stride[0] + t * p.qv_stride[1] + h * p.qv_stride[2]
                  : q + b * p.q_stride[0] + t * p.q_stride[1] + h * p.q_stride[2];
  };
  // ---- this sequence's keys: positions [leftpad, end) of its cache, len of them -------------
  // (Their loads are issued first, their latency under the Q copies.)
  const int leftpad = p.leftpad != nullptr ? clampi(p.leftpad[b], 0, p.capacity) : 0;
  // The cache's end before the append; the append's rows follow it (those that fit).
  const int end_old = p.cache_seqlens != nullptr ? clampi(p.cache_seqlens[b], leftpad, p.capacity) : p.capacity;
  // Q's copies; chunks to rotate wait for the cache's end.
#pragma unroll 1
  for (int i = tid; i < kRows * kChunks; i += T::kThreads) {
    int r, c, t, cs;
    bool ok;
    const Element* src = q_source(i, r, c, ok, t, cs);
    if (p.rot_half == 0 || c < kLatentChunks) cp_async16(smem_addr(sQ + swizzled<kChunks>(r, c)), src + cs * 8, ok ? 16 : 0);
  }

  const int end = min(end_old + p.seqlen_new, p.capacity);
  const int len = end - leftpad;
  const int new_begin = end_old - leftpad;  // the first appended key (keys from here: k_new, v_new)
  // Key range of token t: [lo(t), hi(t)), the masks aligned bottom-right (token t at len - seqlen_q + t).
  auto key_lo = [&](int t) {
    return p.window_left < 0 ? 0 : max(0, len - p.seqlen_q + t - p.window_left);
  };
  auto key_hi = [&](int t) {
    return p.window_right < 0 ? len : clampi(len - p.seqlen_q + t + p.window_right + 1, 0, len);
  };
  const int t_first = quotient(row0, p.group_div), t_last = quotient(min(row0 + kRows, p.rows) - 1, p.group_div);
  const int k_lo = key_lo(t_first), k_hi = max(k_lo, key_hi(t_last));
  const int n_blocks = (k_hi - k_lo + kBlockN - 1) / kBlockN;
  const int per_split = (n_blocks + p.num_splits - 1) / p.num_splits;
  const int blk_begin = min(n_blocks, split * per_split), blk_end = min(n_blocks, blk_begin + per_split);

  // Q's rotated chunks: in registers, stored before the loop's first barrier.
#pragma unroll 1
  for (int i = tid; i < kRows * kChunks && p.rot_half > 0; i += T::kThreads) {
    int r, c, t, cs;
    bool ok;
    const Element* src = q_source(i, r, c, ok, t, cs);
    if (c < kLatentChunks) continue;
    const uint4 v = ok ? rotated_chunk<Element>(src, cs, end_old + (p.q_rot_by_token ? t : 0), p) : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(sQ + swizzled<kChunks>(r, c)) = v;
  }

  // ---- K and V of key block `blk` into stage `stage` ----------------------------------------
  // This KV head's K and V (cache_rows' offsets are from here).
  Element* kbase = static_cast<Element*>(p.k) + head_kv * p.k_stride[2];
  Element* vbase = static_cast<Element*>(p.v) + head_kv * p.v_stride[2];
  const int entry = p.batch_idx != nullptr ? clampi(p.batch_idx[b], 0, p.entries - 1) : b;
  const int* pages = p.page_table != nullptr ? p.page_table + b * p.page_table_stride : nullptr;
  // Paged: each row's page from the page table. The entries a block needs (at most 65) are
  // copied into a ring of shared-memory slots with cp.async, in the commit group of the block
  // loaded kStages - 1 iterations before it, so they have landed when its K/V copies are issued
  // and never stall them (the prologue's blocks look theirs up directly).
  constexpr int kSlotRing = kStages + 1;
  __shared__ int s_slots[kSlotRing][kBlockN + 1];
  auto page_of = [&](int pos) { return quotient(pos, p.pages); };
  auto fetch_slots = [&](int blk) {
    if (pages == nullptr || blk >= blk_end) return;
    const int key0 = k_lo + blk * kBlockN;
    const int s0 = page_of(leftpad + key0), s1 = page_of(leftpad + min(key0 + kBlockN, k_hi) - 1);
    if (tid <= s1 - s0) cp_async4(smem_addr(&s_slots[blk % kSlotRing][tid]), pages + s0 + tid);
  };
  // The offsets of cache position pos's K and V rows from kbase, vbase, through the page table.
  // (Page and row are unsigned 32-bit: each product is one wide multiply and one add.)
  auto cache_rows = [&](int pos, int page_entry, int64_t& ko, int64_t& vo) {
    if (pages != nullptr) {
      const uint64_t page = uint32_t(clampi(page_entry, 0, p.entries - 1));
      const uint64_t row = uint32_t(pos - page_of(pos) * p.page_size);
      ko = int64_t(page * uint64_t(p.k_stride[0]) + row * uint64_t(p.k_stride[1]));
      vo = int64_t(page * uint64_t(p.v_stride[0]) + row * uint64_t(p.v_stride[1]));
    } else {
      ko = entry * p.k_stride[0] + pos * p.k_stride[1];
      vo = entry * p.v_stride[0] + pos * p.v_stride[1];
    }
  };
  auto new_row = [&](const void* base, const int64_t (&stride)[3], int i) {  // row i of k_new or v_new
    return static_cast<const Element*>(base) + b * stride[0] + i * stride[1] + head_kv * stride[2];
  };
  // kPerRow threads share a row: each copies chunks c0, c0 + kPerRow, ... of rows r0, r0 +
  // kRowStep, ... of a block (two chunks of a K and a V row, MLA nine of its 72: the row's
  // address is computed once per two chunks or more). cache_copy issues the copies of row r from
  // the K and V rows at krow, vrow, offsets from k_ld, v_ld: kbase, vbase past the thread's first
  // chunk (MLA: cache_copy adds each chunk's).
  constexpr int kPerRow = kMla ? 8 : kChunks / 2, kRowStep = T::kThreads / kPerRow;
  const int c0 = tid % kPerRow, r0 = tid / kPerRow;
  const Element* k_ld = kbase + (kMla ? 0 : 8 * c0);
  const Element* v_ld = vbase + (kMla ? 0 : 8 * c0);
  auto cache_copy = [&](int stage, int r, const Element* krow, const Element* vrow, bool ok) {
    Element* dst_k = sK + stage * kStageElems;
    Element* dst_v = sV + stage * kStageElems;
#pragma unroll
    for (int j = 0; j < kChunks / kPerRow; ++j) {
      const int c = c0 + j * kPerRow;
      if constexpr (kMla) {
        const Element* src = c < kLatentChunks ? vrow + 8 * c : krow + 8 * (c - kLatentChunks);
        cp_async16(smem_addr(dst_k + swizzled<kChunks>(r, c)), src, ok ? 16 : 0);
      } else {
        cp_async16(smem_addr(dst_k + swizzled<kChunks>(r, c)), krow + 8 * j * kPerRow, ok ? 16 : 0);
        cp_async16(smem_addr(dst_v + swizzled<kChunks>(r, c)), vrow + 8 * j * kPerRow, ok ? 16 : 0);
      }
    }
  };
  // Contiguous cache: this sequence's first K and V rows (position leftpad) of this KV head.
  const Element* k_seq = k_ld + entry * p.k_stride[0] + int64_t(leftpad) * p.k_stride[1];
  const Element* v_seq = v_ld + entry * p.v_stride[0] + int64_t(leftpad) * p.v_stride[1];
  auto load_block = [&](int blk, int stage, const int* slots) {
    const int key0 = k_lo + blk * kBlockN;
    const int s0 = pages != nullptr ? page_of(leftpad + key0) : 0;
    // Page pg's entry is page_entry[pg]: the block's slots in shared memory, else the page table.
    const int* page_entry = slots != nullptr ? slots - s0 : pages;
    // The block's rows in one run of consecutive cache rows (contiguous, or paged with all of
    // them in one page), nothing appended: a row's pointers are a constant step from the last
    // (rows past the keys read nothing; their address is the block's first row).
    const bool one_page = pages == nullptr || page_of(leftpad + min(key0 + kBlockN, k_hi) - 1) == s0;
    if (one_page && key0 + kBlockN <= new_begin) {
      const Element* kfirst;
      const Element* vfirst;
      if (pages == nullptr) {
        kfirst = k_seq + int64_t(key0) * p.k_stride[1];
        vfirst = v_seq + int64_t(key0) * p.v_stride[1];
      } else {
        int64_t ko, vo;
        cache_rows(leftpad + key0, page_entry[s0], ko, vo);
        kfirst = k_ld + ko;
        vfirst = v_ld + vo;
      }
      const Element* krow = kfirst + int64_t(r0) * p.k_stride[1];
      const Element* vrow = vfirst + int64_t(r0) * p.v_stride[1];
      const int64_t k_step = int64_t(kRowStep) * p.k_stride[1], v_step = int64_t(kRowStep) * p.v_stride[1];
#pragma unroll
      for (int r = r0, j = 0; j < kBlockN / kRowStep; ++j, r += kRowStep) {
        const bool ok = key0 + r < k_hi;
        cache_copy(stage, r, ok ? krow : kfirst, ok ? vrow : vfirst, ok);
        krow += k_step;
        vrow += v_step;
      }
      return;
    }
    for (int r = r0; r < kBlockN; r += kRowStep) {
      const int key = key0 + r;
      const bool ok = key < k_hi;
      if (ok && key >= new_begin) {  // an appended key: from k_new (rotated), v_new
        const int i = key - new_begin;
        const Element* kr = new_row(p.k_new, p.k_new_stride, i);
        const Element* vr = new_row(p.v_new, p.v_new_stride, i);
        Element* dst_k = sK + stage * kStageElems;
        Element* dst_v = sV + stage * kStageElems;
#pragma unroll 1
        for (int j = 0; j < kChunks / kPerRow; ++j) {
          const int c = c0 + j * kPerRow;
          if constexpr (kMla) {
            *reinterpret_cast<uint4*>(dst_k + swizzled<kChunks>(r, c)) =
                c < kLatentChunks ? *reinterpret_cast<const uint4*>(vr + 8 * c)
                                  : rotated_chunk<Element>(kr, c - kLatentChunks, end_old + i, p);
          } else {
            *reinterpret_cast<uint4*>(dst_k + swizzled<kChunks>(r, c)) = rotated_chunk<Element>(kr, c, end_old + i, p);
            *reinterpret_cast<uint4*>(dst_v + swizzled<kChunks>(r, c)) = *reinterpret_cast<const uint4*>(vr + 8 * c);
          }
        }
        continue;
      }
      const int at = ok ? key : key0;  // a row past the keys reads nothing: the block's first row
      if (pages != nullptr) {
        const int pos = leftpad + at, pg = page_of(pos);
        int64_t ko, vo;
        cache_rows(pos, page_entry[pg], ko, vo);
        cache_copy(stage, r, k_ld + ko, v_ld + vo, ok);
      } else {
        cache_copy(stage, r, k_seq + int64_t(at) * p.k_stride[1], v_seq + int64_t(at) * p.v_stride[1], ok);
      }
    }
  };

  // ---- the append: block (row tile 0, split 0) of each (entry, KV head) writes the new rows ------
  if (p.seqlen_new > 0 && tile == 0 && split == 0) {
    for (int i = tid; i < p.seqlen_new * kChunks; i += T::kThreads) {
      const int n = i / kChunks, c = i % kChunks, pos = end_old + n;
      if (pos >= p.capacity) break;  // rows past the cache: neither written nor seen
      const Element* kr = new_row(p.k_new, p.k_new_stride, n);
      const Element* vr = new_row(p.v_new, p.v_new_stride, n);
      int64_t ko, vo;
      cache_rows(pos, pages != nullptr ? pages[page_of(pos)] : 0, ko, vo);
      if (kMla && c < kLatentChunks) {
        *reinterpret_cast<uint4*>(vbase + vo + 8 * c) = *reinterpret_cast<const uint4*>(vr + 8 * c);
      } else if (kMla) {
        *reinterpret_cast<uint4*>(kbase + ko + 8 * (c - kLatentChunks)) =
            rotated_chunk<Element>(kr, c - kLatentChunks, pos, p);
      } else {
        *reinterpret_cast<uint4*>(kbase + ko + 8 * c) = rotated_chunk<Element>(kr, c, pos, p);
        *reinterpret_cast<uint4*>(vbase + vo + 8 * c) = *reinterpret_cast<const uint4*>(vr + 8 * c);
      }
    }
  }

  // ---- the per-row state of this thread's two rows (lane / 4 and lane / 4 + 8) ---------------
  float o[kOTiles][4];
#pragma unroll
  for (int i = 0; i < kOTiles; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  int lo[2], hi[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int row = min(row0 + lane / 4 + 8 * i, p.rows - 1);
    lo[i] = key_lo(quotient(row, p.group_div));
    hi[i] = key_hi(quotient(row, p.group_div));
  }

  // One loop loads and computes: its first kStages - 1 turns (j < 0) are the prologue, which
  // loads blocks 0 .. kStages - 2 (Q rides with the first commit group) and looks their pages up
  // in the page table directly; each later turn j waits for block j, loads block j + kStages - 1
  // and computes block j. (One call site of load_block: its code is fetched once.)
  const uint32_t q_base = smem_addr(sQ), k_base = smem_addr(sK), v_base = smem_addr(sV);
#pragma unroll 1
  for (int j = 1 - kStages; j < blk_end - blk_begin; ++j) {
    const int blk = blk_begin + j, next = blk + kStages - 1;
    if (j >= 0) {
      cp_async_wait<kStages - 2>();
      __syncthreads();  // block j (and the slots of block next) landed; stage (j - 1) % kStages is free
    }
    if (next < blk_end) {
      load_block(next, (j + kStages - 1) % kStages, j >= 0 && pages != nullptr ? s_slots[next % kSlotRing] : nullptr);
    }
    fetch_slots(next + kStages - 1);
    cp_async_commit();
    if (j < 0) continue;
    const int stage = j % kStages;

    // S = Q K^T over this warp's 16 keys: two n8 tiles.
    float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    const int key_row = warp * 16 + (lane % 8) + 8 * (lane / 16);
#pragma unroll
    for (int kk = 0; kk < T::kDimQK / 16; ++kk) {
      uint32_t a[4], bk[4];
      ldmatrix_x4(a, q_base + 2 * swizzled<kChunks>((lane % 8) + 8 * ((lane / 8) % 2), 2 * kk + lane / 16));
      ldmatrix_x4(bk, k_base + 2 * (stage * kStageElems + swizzled<kChunks>(key_row, 2 * kk + (lane / 8) % 2)));
      mma16816<Element>(s[0], a, bk[0], bk[1]);
      mma16816<Element>(s[1], a, bk[2], bk[3]);
    }
    // Scale (softcap), mask, online softmax in the log2 domain.
    const int key_base = k_lo + blk * kBlockN + warp * 16 + 2 * (lane % 4);
    float mx[2] = {-INFINITY, -INFINITY};
    if (p.softcap_log2 > 0.0f) {  // one uniform branch around the scores, not one per score
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] = p.softcap_log2 * tanhf(s[n][e] * p.scale_over_cap);
      }
    } else {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[n][e] *= p.scale_log2;
      }
    }
    // The mask, unless the warp's 16 keys lie in both of every thread's rows' ranges.
    const int warp_key0 = k_lo + blk * kBlockN + warp * 16;
    if (!__all_sync(0xffffffffu, warp_key0 >= max(lo[0], lo[1]) && warp_key0 + 16 <= min(hi[0], hi[1]))) {
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = e / 2, key = key_base + 8 * n + e % 2;
          if (key < lo[i] || key >= hi[i]) s[n][e] = -INFINITY;
        }
      }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[n][e]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
      mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    }
    if constexpr (kMla) {  // the block's row maxima, so that every warp scales by the same m
      if (lane % 4 == 0) {
        sMax[warp * kRows + lane / 4] = mx[0];
        sMax[warp * kRows + lane / 4 + 8] = mx[1];
      }
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 2; ++i) {
#pragma unroll
        for (int w = 0; w < T::kWarps; ++w) mx[i] = fmaxf(mx[i], sMax[w * kRows + lane / 4 + 8 * i]);
      }
    }
    float base[2], corr[2];
    bool moved = false;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float m_new = fmaxf(m[i], mx[i]);
      base[i] = m_new == -INFINITY ? 0.0f : m_new;
      corr[i] = exp2f(m[i] - base[i]);
      moved |= m_new != m[i];
      m[i] = m_new;
      l[i] *= corr[i];
    }
    // O is rescaled only where a row's maximum moved (elsewhere corr is exactly 1): once the
    // maxima settle, most blocks of a long cache skip it.
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int d = 0; d < kOTiles; ++d) {
#pragma unroll
        for (int e = 0; e < 4; ++e) o[d][e] *= corr[e / 2];
      }
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[n][e] = exp2f(s[n][e] - base[e / 2]);
        l[e / 2] += s[n][e];
      }
    }
    // O += P V: P from the S accumulators (the m16n8 C layout of two n-tiles is the m16k16 A
    // layout), V^T by transposing loads.
    const uint32_t pa[4] = {pack2<Element>(s[0][0], s[0][1]), pack2<Element>(s[0][2], s[0][3]),
                            pack2<Element>(s[1][0], s[1][1]), pack2<Element>(s[1][2], s[1][3])};
    if constexpr (kMla) {
      // P (16 x 64) through shared memory; this warp's dims of O over all 64 keys.
      constexpr int kPChunks = kBlockN / 8, kWarpChunks = kHeadDimV / (8 * T::kWarps);
#pragma unroll
      for (int n = 0; n < 2; ++n) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          *reinterpret_cast<uint32_t*>(sP + swizzled<kPChunks>(lane / 4 + 8 * i, 2 * warp + n) + 2 * (lane % 4)) =
              pa[2 * n + i];
        }
      }
      __syncthreads();
      const uint32_t p_base = smem_addr(sP);
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        uint32_t a[4];
        ldmatrix_x4(a, p_base + 2 * swizzled<kPChunks>((lane % 8) + 8 * ((lane / 8) % 2), 2 * kk + lane / 16));
        const int v_row = kk * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
#pragma unroll
        for (int nn = 0; nn < kOTiles / 2; ++nn) {
          uint32_t bv[4];
          ldmatrix_x4_trans(bv, v_base + 2 * (stage * kStageElems +
                                              swizzled<kChunks>(v_row, warp * kWarpChunks + 2 * nn + lane / 16)));
          mma16816<Element>(o[2 * nn], a, bv[0], bv[1]);
          mma16816<Element>(o[2 * nn + 1], a, bv[2], bv[3]);
        }
      }
    } else {
      const int v_row = warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2);
#pragma unroll
      for (int nn = 0; nn < kHeadDim / 16; ++nn) {
        uint32_t bv[4];
        ldmatrix_x4_trans(bv, v_base + 2 * (stage * kStageElems + swizzled<kChunks>(v_row, 2 * nn + lane / 16)));
        mma16816<Element>(o[2 * nn], pa, bv[0], bv[1]);
        mma16816<Element>(o[2 * nn + 1], pa, bv[2], bv[3]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // the stages are free: the warps' partial results go there

  // ---- merge the 4 warps: O (16 x head_dim FP32), max and sum per row, per warp --------------
  // (MLA: one O whose dims the warps share out, one max, a partial sum per warp.)
  constexpr int kORow = T::kORowFloats;
  float* sO = reinterpret_cast<float*>(smem_raw);      // (slot, row, head_dim_v), rows kORow apart
  float* sM = sO + T::kOSlots * kRows * kORow;         // (warp, row)
  float* sL = sM + T::kWarps * kRows;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
    const int r = lane / 4 + 8 * i;
    if (lane % 4 == 0) {
      sM[warp * kRows + r] = m[i];
      sL[warp * kRows + r] = l[i];
    }
    const int slot = kMla ? 0 : warp, col0 = kMla ? warp * kOTiles * 8 : 0;
#pragma unroll
    for (int d = 0; d < kOTiles; ++d) {
      *reinterpret_cast<float2*>(sO + (slot * kRows + r) * kORow + col0 + 8 * d + 2 * (lane % 4)) =
          make_float2(o[d][2 * i], o[d][2 * i + 1]);
    }
  }
  __syncthreads();
  // Per row, once: each O slot's weight exp2(m_w - max) / sum, the row's log-sum-exp in the log2
  // domain (-inf: no key), and where the row goes: its offset in out (-1: past the last row), in
  // lse (-1: none), and its index among a piece's rows (split, batch, head, token) less the split.
  float* sWt = sL + T::kWarps * kRows;  // (slot, row)
  float* sLse2 = sWt + T::kOSlots * kRows;
  __shared__ int64_t s_out_at[kRows], s_lse_at[kRows], s_piece_at[kRows];
  const bool single = p.num_splits == 1;
  const int nheads = p.nheads_kv * p.group;
  if (tid < kRows) {
    const int row = min(row0 + tid, p.rows - 1), t = quotient(row, p.group_div);
    const int h = head_kv * p.group + row - t * p.group;
    const bool ok = row0 + tid < p.rows;
    s_out_at[tid] = ok ? b * p.o_stride[0] + t * p.o_stride[1] + h * p.o_stride[2] : -1;
    s_lse_at[tid] = ok && p.lse != nullptr ? b * p.lse_stride[0] + h * p.lse_stride[1] + t * p.lse_stride[2] : -1;
    s_piece_at[tid] = (int64_t(b) * nheads + h) * p.seqlen_q + t;
    float mw = -INFINITY;
#pragma unroll
    for (int w = 0; w < T::kWarps; ++w) mw = fmaxf(mw, sM[w * kRows + tid]);
    const float bw = mw == -INFINITY ? 0.0f : mw;
    float f[T::kWarps], sum = 0.0f;
#pragma unroll
    for (int w = 0; w < T::kWarps; ++w) {
      f[w] = exp2f(sM[w * kRows + tid] - bw);
      sum += f[w] * sL[w * kRows + tid];
    }
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
    for (int w = 0; w < T::kOSlots; ++w) sWt[w * kRows + tid] = f[w] * inv;
    sLse2[tid] = sum > 0.0f ? bw + log2f(sum) : -INFINITY;
  }
  __syncthreads();

  Element* out = static_cast<Element*>(p.out);
  // Float4 group d4 of row r's O, and (d4 = 0) its log-sum-exp (natural log, +inf: no key).
  auto store_out = [&](int r, int d4, float4 v, float lse_row) {
    uint2 packed;
    packed.x = pack2<Element>(v.x, v.y);
    packed.y = pack2<Element>(v.z, v.w);
    *reinterpret_cast<uint2*>(out + s_out_at[r] + 4 * d4) = packed;
    if (d4 == 0 && s_lse_at[r] >= 0) p.lse[s_lse_at[r]] = lse_row;
  };
  const int64_t split_stride = int64_t(p.batch) * nheads * p.seqlen_q;
  // Cluster merge: this block's piece, normalized (row, head_dim_v; rows kORow apart), and the
  // pieces' weights (rank, row) and the rows' log-sum-exps.
  float* sPiece = sLse2 + kRows;
  float* sCW = sPiece + kRows * kORow;
  float* sCLse = sCW + kMaxClusterSplits * kRows;
  // The tile's O: float4 group col4 of rows row_first, row_first + kOutRowStep, ..., a fixed
  // number of rows per thread, unrolled, so that every shared-memory read is issued before the
  // first store. Into out (one split), this split's piece in the scratch (FP32 O and the
  // log-sum-exp in the log2 domain) or the piece in shared memory (the cluster merge: its
  // log-sum-exps are sLse2).
  enum { kToOut, kToScratch, kToShared };
  constexpr int kD4 = kHeadDimV / 4, kOutRowStep = T::kThreads / kD4;
  static_assert(T::kThreads % kD4 == 0 && kRows % kOutRowStep == 0);
  const int col4 = tid % kD4, row_first = tid / kD4;
  auto store_tile = [&](auto to_c) {
#pragma unroll
    for (int k = 0; k < kRows / kOutRowStep; ++k) {
      const int r = row_first + k * kOutRowStep;
      float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int w = 0; w < T::kOSlots; ++w) {
        add_scaled(acc, sWt[w * kRows + r], *reinterpret_cast<const float4*>(sO + (w * kRows + r) * kORow + 4 * col4));
      }
      const float lse2 = sLse2[r];
      if (s_out_at[r] < 0) continue;
      constexpr int kTo = decltype(to_c)::value;
      if constexpr (kTo == kToOut) {
        store_out(r, col4, acc, lse2 == -INFINITY ? INFINITY : lse2 * kLn2);
      } else if constexpr (kTo == kToScratch) {
        const int64_t at = split * split_stride + s_piece_at[r];
        *reinterpret_cast<float4*>(p.part_o + at * kHeadDimV + 4 * col4) = acc;
        if (col4 == 0) p.part_lse[at] = lse2;
      } else {
        *reinterpret_cast<float4*>(sPiece + r * kORow + 4 * col4) = acc;
      }
    }
  };
  if (single) {
    store_tile(std::integral_constant<int, kToOut>{});
    return;
  }
  // This block's groups of the tile's merge (float4 groups of O): a 1 / num_splits share of the
  // tile's rows' groups (cluster or shared merge), or all of them (last block).
  const int groups = min(kRows, p.rows - row0) * kD4;
  const bool by_share = kClusterMerge || p.merge_shared;
  const int share = by_share ? (groups + p.num_splits - 1) / p.num_splits : groups;
  const int g0 = by_share ? split * share : 0;
  const int count = max(0, min(groups, g0 + share) - g0);

  if constexpr (kClusterMerge) {
    // ---- split within a cluster: merge the tile's pieces from the blocks' shared memory -------
    // Rank c of the cluster is split c. The barriers: every piece is in place before any is
    // read, and no block leaves (its shared memory reused) while another still reads it.
    store_tile(std::integral_constant<int, kToShared>{});
    const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
    const int n = p.num_splits;
    cluster.sync();
    if (tid < kRows) {  // row tid's weight per piece, exp2(lse - max) / sum, and its log-sum-exp
      float x[kMaxClusterSplits];
      float mw = -INFINITY;
#pragma unroll
      for (int c = 0; c < kMaxClusterSplits; ++c) {
        x[c] = c < n ? *cluster.map_shared_rank(sLse2 + tid, c) : -INFINITY;
        mw = fmaxf(mw, x[c]);
      }
      const float bw = mw == -INFINITY ? 0.0f : mw;
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kMaxClusterSplits; ++c) {
        x[c] = exp2f(x[c] - bw);
        sum += x[c];
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll
      for (int c = 0; c < kMaxClusterSplits; ++c) sCW[c * kRows + tid] = x[c] * inv;
      sCLse[tid] = sum > 0.0f ? (bw + log2f(sum)) * kLn2 : INFINITY;
    }
    __syncthreads();
    // kAtOnce groups per thread at a time, the loads of kBatch pieces of each issued before any
    // is summed.
    constexpr int kBatch = 4, kAtOnce = 4;
#pragma unroll 1
    for (int i0 = tid; i0 < count; i0 += kAtOnce * T::kThreads) {
      int r[kAtOnce], d4[kAtOnce];
      float4 acc[kAtOnce];
#pragma unroll
      for (int u = 0; u < kAtOnce; ++u) {
        const int g = g0 + min(i0 + u * T::kThreads, count - 1);
        r[u] = g / kD4;
        d4[u] = g % kD4;
        acc[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll 1
      for (int c0 = 0; c0 < n; c0 += kBatch) {
        float4 x[kAtOnce][kBatch];
#pragma unroll
        for (int u = 0; u < kAtOnce; ++u) {
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            const float4* src = reinterpret_cast<const float4*>(sPiece + r[u] * kORow + 4 * d4[u]);
            x[u][j] = c0 + j < n ? *cluster.map_shared_rank(src, c0 + j) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
        }
#pragma unroll
        for (int u = 0; u < kAtOnce; ++u) {
#pragma unroll
          for (int j = 0; j < kBatch; ++j) add_scaled(acc[u], c0 + j < n ? sCW[(c0 + j) * kRows + r[u]] : 0.0f, x[u][j]);
        }
      }
#pragma unroll
      for (int u = 0; u < kAtOnce; ++u) {
        if (i0 + u * T::kThreads < count) store_out(r[u], d4[u], acc[u], sCLse[r[u]]);
      }
    }
    cluster_sync_relaxed();
    return;
  }
  store_tile(std::integral_constant<int, kToScratch>{});

  // ---- split: merge the tile's pieces ----------------------------------------------------------
  __shared__ int last;
  int* counter = p.counters + blockIdx.x;
  if (p.merge_shared) {
    // Every block waits for all num_splits arrivals. The count wraps at 2 x num_splits: each
    // block adds once on arrival (a release of the block's pieces, ordered after every thread's
    // stores by the barrier) and once on leaving the wait, so it is back at zero once the last
    // block has seen it complete.
    __syncthreads();
    if (tid == 0) {
      const unsigned wrap = 2u * unsigned(p.num_splits) - 1u;
      asm volatile("red.release.gpu.global.inc.u32 [%0], %1;" ::"l"(counter), "r"(wrap) : "memory");
      while (ld_acquire_gpu(counter) < p.num_splits) __nanosleep(32);
      asm volatile("red.relaxed.gpu.global.inc.u32 [%0], %1;" ::"l"(counter), "r"(wrap) : "memory");
    }
    __syncthreads();
  } else {
    __threadfence();
    __syncthreads();
    if (tid == 0) {
      last = atomicAdd(counter, 1) == p.num_splits - 1;
      if (last) *counter = 0;  // zero again for the next launch
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
  }
  // The pieces' log-sum-exps into shared memory (loaded in parallel), then the weights
  // exp2(lse - max) / sum of the rows this block merges (a warp per row), then O as the weighted
  // sum of the pieces.
  float* sW = reinterpret_cast<float*>(smem_raw);  // (split, row): lse, then weight
  float* sLse = sW + kMaxKvcacheSplits * kRows;
  float4* sPart = reinterpret_cast<float4*>(sLse + kRows);  // (piece lane, group) partial sums
  {
    // All loads issued before any store: one round trip. Entry i = tid + j x kThreads is row
    // tid % kRows of piece i / kRows: each thread's row is the same for every j.
    constexpr int kLseLoads = (kMaxKvcacheSplits * kRows + T::kThreads - 1) / T::kThreads;
    static_assert(T::kThreads % kRows == 0);
    const int r = tid % kRows;
    const float* lse_row = p.part_lse + s_piece_at[r];
    const bool row_ok = row0 + r < p.rows;
    float x[kLseLoads];
#pragma unroll
    for (int j = 0; j < kLseLoads; ++j) {
      const int sp = tid / kRows + j * (T::kThreads / kRows);
      x[j] = sp < p.num_splits && row_ok ? __ldcg(lse_row + sp * split_stride) : -INFINITY;
    }
#pragma unroll
    for (int j = 0; j < kLseLoads; ++j) {
      if (tid + j * T::kThreads < p.num_splits * kRows) sW[tid + j * T::kThreads] = x[j];
    }
  }
  __syncthreads();
  // The rows of this block's groups, whose weights it needs.
  const int r_first = g0 / kD4, r_end = count > 0 ? (g0 + count - 1) / kD4 + 1 : 0;
  for (int r = r_first + warp; r < r_end; r += T::kWarps) {
    float mw = -INFINITY;
#pragma unroll 1
    for (int sp = lane; sp < p.num_splits; sp += 32) mw = fmaxf(mw, sW[sp * kRows + r]);
#pragma unroll
    for (int x = 16; x > 0; x /= 2) mw = fmaxf(mw, __shfl_xor_sync(0xffffffffu, mw, x));
    const float bw = mw == -INFINITY ? 0.0f : mw;
    float sum = 0.0f;
#pragma unroll 1
    for (int sp = lane; sp < p.num_splits; sp += 32) sum += exp2f(sW[sp * kRows + r] - bw);
#pragma unroll
    for (int x = 16; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
    const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
#pragma unroll 1
    for (int sp = lane; sp < p.num_splits; sp += 32) sW[sp * kRows + r] = exp2f(sW[sp * kRows + r] - bw) * inv;
    if (lane == 0) sLse[r] = sum > 0.0f ? (bw + log2f(sum)) * kLn2 : INFINITY;
  }
  __syncthreads();
  // With fewer groups than threads, `lanes` threads share a group's pieces (item i: group
  // g0 + i % count, pieces i / count, i / count + lanes, ...) and their sums meet in shared
  // memory. A thread sums kAtOnce items at a time (i, i + kThreads, ...), the loads of kBatch
  // pieces of each issued before any is summed: the pieces are read from L2, latency-bound.
  if (count > 0) {
    constexpr int kBatch = 4, kAtOnce = 4;
    const int lanes = count >= T::kThreads ? 1 : T::kThreads / count;
    const int items = lanes * count;
#pragma unroll 1
    for (int i0 = tid; i0 < items; i0 += kAtOnce * T::kThreads) {
      const float* src[kAtOnce];
      int r[kAtOnce], d4[kAtOnce], sp0[kAtOnce];
      float4 acc[kAtOnce];
#pragma unroll
      for (int u = 0; u < kAtOnce; ++u) {
        const int i = i0 + u * T::kThreads;
        int piece = 0, at = i;  // i = piece x count + at (lanes = 1: piece 0)
        if (lanes > 1) {
          piece = i / count;
          at = i - piece * count;
        }
        const int g = g0 + (i < items ? at : 0);
        r[u] = g / kD4;
        d4[u] = g % kD4;
        sp0[u] = i < items ? piece : p.num_splits;  // past the items: no piece
        src[u] = p.part_o + s_piece_at[r[u]] * kHeadDimV + 4 * d4[u];
        acc[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      }
#pragma unroll 1
      for (int sp = 0; sp < p.num_splits; sp += kBatch * lanes) {
        float4 x[kAtOnce][kBatch];
#pragma unroll
        for (int u = 0; u < kAtOnce; ++u) {
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            const int spj = sp0[u] + sp + j * lanes;
            x[u][j] = spj < p.num_splits ? __ldcg(reinterpret_cast<const float4*>(src[u] + spj * split_stride * kHeadDimV))
                                         : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
          }
        }
#pragma unroll
        for (int u = 0; u < kAtOnce; ++u) {
#pragma unroll
          for (int j = 0; j < kBatch; ++j) {
            const int spj = sp0[u] + sp + j * lanes;
            add_scaled(acc[u], spj < p.num_splits ? sW[spj * kRows + r[u]] : 0.0f, x[u][j]);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kAtOnce; ++u) {
        const int i = i0 + u * T::kThreads;
        if (i >= items) continue;
        if (lanes == 1) {
          store_out(r[u], d4[u], acc[u], sLse[r[u]]);
        } else {
          sPart[i] = acc[u];
        }
      }
    }
    if (lanes > 1) {
      __syncthreads();
      if (tid < count) {
        float4 acc = sPart[tid];
#pragma unroll 1
        for (int l = 1; l < lanes; ++l) {
          const float4 x = sPart[l * count + tid];
          acc.x += x.x;
          acc.y += x.y;
          acc.z += x.z;
          acc.w += x.w;
        }
        const int g = g0 + tid;
        store_out(g / kD4, g % kD4, acc, sLse[g / kD4]);
      }
    }
  }
}

}  // namespace flash3::detail

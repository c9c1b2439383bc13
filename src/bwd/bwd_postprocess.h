// flash3: the backward's postprocess (one block of 256 threads per (query tile, head, batch)):
// dQ = scale * accumulator in the input dtype; for GQA/MQA dK, dV summed over the query heads of
// each kv head.
#pragma once

#include <cstdint>

#include <cutlass/numeric_conversion.h>

#include "bwd/bwd_dq_writer.h"
#include "bwd/bwd_preprocess.h"
#include "bwd/bwd_traits.h"
#include "common/ptx.h"
#include "common/seqlen.h"

namespace flash3::detail {

// dQ = scale * accumulator, from the register order the main kernel stored it in.
// NOTES: the tile goes through shared memory, row-major with rows padded by 8 floats (the
// float2 stores of a half-warp, 4 rows x 4 threads, then hit 32 distinct banks), so that each
// thread writes 16 contiguous bytes of dQ. (Writing 4 bytes per thread straight from the
// register order scattered every warp store over 8 rows: 177 us where cuDNN's conversion
// takes 57, at 16k tokens x 16 heads x 128.)
// NOTES: with dq_done, a block waits only for its own pair's key blocks (all their writers have
// counted their adds complete, bwd_dq_writer), so that the postprocess runs on the SMs the main
// kernel's last wave leaves idle: the postprocess launches under the main kernel (programmatic
// dependent launch, once the preprocess is complete: bwd_pdl_wait_then_launch) and its blocks
// take SMs as the main kernel's blocks end. The grid's last block still waits for the whole main
// kernel, so that the postprocess ends after it (its dK, dV, and the GQA postprocess's FP32
// inputs, are complete when the stream moves on). Without dq_done (no main kernel: seqlen_k = 0),
// every block waits for the main kernel to end.
template <class Traits>
__global__ void __launch_bounds__(256) bwd_postprocess_dq(const BwdAuxParams p) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim, kStride = kHeadDim + 8;
  extern __shared__ float4 smem_dq_raw[];
  float* tile_s = reinterpret_cast<float*>(smem_dq_raw);
  const bool per_pair = p.dq_done != nullptr;
  int m, head, batch;
  aux_block_coords(p.m_blocks, p.nheads, m, head, batch, per_pair);
  const int64_t bh = int64_t(batch) * p.nheads + head;
  const SeqLen len = p.seqlens.template of<true>(batch);
  const int seqlen_q = len.q;
  if (!per_pair || blockIdx.x == gridDim.x - 1) pdl_wait();  // the whole main kernel
  if (m * kBlockM >= seqlen_q) return;  // (variable lengths: past this sequence's end)
  if (per_pair) {
    // Variable lengths: this sequence's key blocks' writers.
    const int target = p.seqlens.varlen() ? (len.k + p.block_n - 1) / p.block_n * p.dq_writers : p.dq_done_target;
    if (threadIdx.x == 0) {
      for (int sleep = 64;;) {
        if (ld_acquire_gpu(p.dq_done + bh) >= target) break;
        __nanosleep(sleep);
        sleep = sleep < 2048 ? 2 * sleep : sleep;
      }
    }
    __syncthreads();  // the acquire above, for the whole block
  }
  // Fragment thread t (bwd_dq_frag_thread), its pairs j0 .. j0 + kPairs - 1 (all of them where
  // the dQ GEMM has 256 threads; half where it has 128, kDQAlternate).
  constexpr int kFrag = Traits::kDQFragThreads;
  typename Traits::TiledMmadQ mma;
  const int t = bwd_dq_frag_thread<Traits>(threadIdx.x);
  auto thr = mma.get_thread_slice(t);
  Tensor coords = thr.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  const int64_t tile_at = (aux_q_row0<kBlockM>(p, batch, head) / kBlockM + m) * p.dq_groups;
  // (bwd_store_dq's order: the thread's values 4q .. 4q + 3 at float4 index q * kFrag + t.)
  const float4* tile = reinterpret_cast<const float4*>(p.dq_accum + tile_at * kBlockM * kHeadDim);
  constexpr int kPairs = decltype(size(coords))::value / 2 * kFrag / 256;
  static_assert(kPairs % 2 == 0);
  const int j0 = kFrag == 256 ? 0 : int(threadIdx.x) / kFrag * kPairs;
  float2 v[kPairs];
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < kPairs; ++j) v[j] = make_float2(0.f, 0.f);
  // The sum of the copies that were written, in order (bwd_config.h); 0 where none was. Without
  // dq_sem there is one copy, always written.
  for (int g = 0; g < p.dq_groups; ++g) {
    if (p.dq_sem != nullptr && p.dq_sem[tile_at + g] == 0) continue;
    const float4* copy = tile + g * (kBlockM * kHeadDim / 4);
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kPairs; j += 2) {
      const float4 x = copy[(j0 + j) / 2 * kFrag + t];
      v[j].x += x.x;
      v[j].y += x.y;
      v[j + 1].x += x.z;
      v[j + 1].y += x.w;
    }
  }
  // With j0 known at compile time (the coordinates are then constants plus the thread's offset).
  auto scatter = [&](auto j0_c) {
    constexpr int kJ0 = decltype(j0_c)::value;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kPairs; ++j) {
      const int r = get<0>(coords(2 * (kJ0 + j))), c = get<1>(coords(2 * (kJ0 + j)));
      *reinterpret_cast<float2*>(tile_s + r * kStride + c) = v[j];
    }
  };
  if (j0 == 0) {
    scatter(Int<0>{});
  } else {
    scatter(Int<kPairs>{});
  }
  __syncthreads();
  constexpr int kThreadsPerRow = kHeadDim / 8, kRowsPerPass = 256 / kThreadsPerRow;
  const int col = (threadIdx.x % kThreadsPerRow) * 8;
  Element* dq = static_cast<Element*>(p.dq) + p.seqlens.q_batch(batch) * p.dq_batch + head * p.dq_head +
               int64_t(len.q_start) * p.dq_row + col;
  cutlass::NumericArrayConverter<Element, float, 8> cvt;
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kBlockM / kRowsPerPass; ++i) {
    const int r = i * kRowsPerPass + int(threadIdx.x) / kThreadsPerRow, row = m * kBlockM + r;
    if (row >= seqlen_q) continue;
    const float4 a = *reinterpret_cast<const float4*>(tile_s + r * kStride + col);
    const float4 b = *reinterpret_cast<const float4*>(tile_s + r * kStride + col + 4);
    cutlass::Array<float, 8> x;
    x[0] = a.x * p.softmax_scale; x[1] = a.y * p.softmax_scale;
    x[2] = a.z * p.softmax_scale; x[3] = a.w * p.softmax_scale;
    x[4] = b.x * p.softmax_scale; x[5] = b.y * p.softmax_scale;
    x[6] = b.z * p.softmax_scale; x[7] = b.w * p.softmax_scale;
    const cutlass::Array<Element, 8> y = cvt(x);
    *reinterpret_cast<uint4*>(dq + row * p.dq_row) = *reinterpret_cast<const uint4*>(&y);
  }
}
template <class Traits>
constexpr int bwd_postprocess_dq_smem() {
  return Traits::kBlockM * (Traits::kHeadDim + 8) * int(sizeof(float));
}

// GQA/MQA: dK = scale * sum over the query heads of a kv head, dV likewise, in head order.
// One thread per pair of adjacent elements of (batch, seqlen_k, nheads_kv, head_dim), or of a
// packed (total_k, nheads_kv, head_dim) (its sequence found by a binary search of cu_seqlens_k);
// rows past a sequence's used length are left alone.
struct BwdDkvParams {
  const float* dk_accum;  // [batch][nheads][seqlen_k_pad][head_dim] (bwd_config.h)
  const float* dv_accum;
  void* dk;
  void* dv;
  int64_t dk_row, dk_head, dk_batch;
  int64_t dv_row, dv_head, dv_batch;
  int batch;
  SeqLens seqlens;
  int nheads_kv, group, head_dim;  // group: query heads per kv head
  int64_t seqlen_k_pad;
  int64_t k_head_rows = 0;  // a packed k side: workspace rows per head (bwd_ws_row)
  int block_n = 0;
  float softmax_scale;
};

template <class Element>
__global__ void bwd_postprocess_dkv(const BwdDkvParams p) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  const int pairs = p.head_dim / 2;
  const int* cu = p.seqlens.cu_k;
  const int rows = cu != nullptr ? p.seqlens.total_k : p.seqlens.max_k(), entries = cu != nullptr ? 1 : p.batch;
  const int64_t total = int64_t(entries) * rows * p.nheads_kv * pairs;
  if (i >= total) return;
  const int c = int(i % pairs) * 2;
  const int hk = int((i / pairs) % p.nheads_kv);
  const int row = int((i / pairs / p.nheads_kv) % rows);
  int b = int(i / pairs / p.nheads_kv / rows), local = row;
  if (cu != nullptr) {  // the last sequence starting at or before `row`
    int lo = 0, hi = p.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (cu[mid] <= row) lo = mid; else hi = mid - 1;
    }
    b = lo;
    local = row - cu[b];
  }
  const SeqLen len = p.seqlens.template of<true>(b);
  if (local < 0 || local >= len.k) return;
  float k0 = 0.f, k1 = 0.f, v0 = 0.f, v1 = 0.f;
  const int nheads = p.nheads_kv * p.group;
  for (int g = 0; g < p.group; ++g) {
    const int h = hk * p.group + g;
    const int64_t at = (bwd_ws_row(cu, p.seqlens.total_k, b, h, nheads, p.seqlen_k_pad, p.k_head_rows, p.block_n) +
                        local) * p.head_dim + c;
    const float2 kk = *reinterpret_cast<const float2*>(p.dk_accum + at);
    const float2 vv = *reinterpret_cast<const float2*>(p.dv_accum + at);
    k0 += kk.x;
    k1 += kk.y;
    v0 += vv.x;
    v1 += vv.y;
  }
  cutlass::NumericArrayConverter<Element, float, 2> cvt;
  cutlass::Array<float, 2> x;
  x[0] = k0 * p.softmax_scale;
  x[1] = k1 * p.softmax_scale;
  const int eb = cu != nullptr ? 0 : b;  // row: the packed row, or the entry's
  Element* dk = static_cast<Element*>(p.dk) + eb * p.dk_batch + row * p.dk_row + hk * p.dk_head + c;
  *reinterpret_cast<cutlass::Array<Element, 2>*>(dk) = cvt(x);
  x[0] = v0;
  x[1] = v1;
  Element* dv = static_cast<Element*>(p.dv) + eb * p.dv_batch + row * p.dv_row + hk * p.dv_head + c;
  *reinterpret_cast<cutlass::Array<Element, 2>*>(dv) = cvt(x);
}

}  // namespace flash3::detail

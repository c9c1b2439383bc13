// flash3: the backward's preprocess (Algorithm 3, line 4 of the FlashAttention-3 paper; one block
// of 256 threads per (query tile, head, batch)): D = rowsum(dO * O), lse * log2(e) (both padded
// per query tile), and the dQ accumulator cleared, or only its tiles' counters where the first
// add into a tile is a store (bwd_config.h, bwd_dq_store_first). BwdAuxParams serves the
// preprocess and the dQ postprocess.
#pragma once

#include <cmath>
#include <cstdint>

#include <cutlass/numeric_conversion.h>

#include "bwd/bwd_config.h"
#include "common/ptx.h"
#include "common/seqlen.h"

namespace flash3::detail {

// The pre- and postprocess's parameters.
struct BwdAuxParams {
  const void* out;
  const void* dout;
  const float* lse;
  void* dq;
  int64_t out_row, out_head, out_batch;
  int64_t dout_row, dout_head, dout_batch;
  int64_t lse_head, lse_batch;
  int64_t dq_row, dq_head, dq_batch;
  float* lse_log2;
  float* dpsum;
  float* dq_accum;
  int* dq_sem;
  int dq_groups;
  int batch;
  SeqLens seqlens;  // read per batch entry (variable lengths: packed tensors as batches of one)
  int nheads, head_dim, m_blocks;
  int64_t seqlen_q_pad;
  int64_t q_head_rows = 0;  // a packed q side: workspace rows per head (bwd_ws_row)
  float softmax_scale;
  int* dq_done = nullptr;  // per pair: the main kernel's writers done (bwd_config.h); null: see below
  int dq_done_target = 0;  // ... their number: key blocks x writers
  int block_n = 0;         // with variable lengths, each pair's: ceil(its seqlen_k / block_n) x writers
  int dq_writers = 0;
};

// The pair's first FP32 workspace row (bwd_ws_row), its first dQ tile (/ kBlockM).
template <int kBlockM>
__device__ __forceinline__ int64_t aux_q_row0(const BwdAuxParams& p, int batch, int head) {
  return bwd_ws_row(p.seqlens.cu_q, p.seqlens.total_q, batch, head, p.nheads, p.seqlen_q_pad, p.q_head_rows, kBlockM);
}

// Block -> (query tile, head, batch), the last (head, batch) first, or the first (`forward`).
// NOTES: the main kernel starts with the first (head, batch) pairs and ends with the last, so
// the preprocess, in reverse, leaves the first pairs' dO and cleared dQ tiles (or counters) in
// L2 for the main kernel's start. The postprocess, where it waits for the whole main kernel,
// in reverse reads the tiles the main kernel added into last while they are still in L2 (50 MB,
// about a third of the FP32 dQ at 16k tokens x hidden 2048; with programmatic dependent launch,
// bwd_launch.h: +0.3-2% at 512-4k, docs/perf-log.md B31); where it waits per pair (dq_done), it
// goes first to last, in the order the main kernel finishes the pairs.
__device__ __forceinline__ void aux_block_coords(int m_blocks, int nheads, int& m, int& head, int& batch,
                                                 bool forward = false) {
  const int b = forward ? int(blockIdx.x) : int(gridDim.x) - 1 - int(blockIdx.x);
  m = b % m_blocks;
  head = (b / m_blocks) % nheads;
  batch = (b / m_blocks) / nheads;
}

// 16 bytes of 16-bit elements as 8 floats, and back.
template <class Element>
__device__ __forceinline__ void load8(const Element* src, float (&x)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  cutlass::NumericArrayConverter<float, Element, 8> cvt;
  const cutlass::Array<float, 8> f = cvt(*reinterpret_cast<const cutlass::Array<Element, 8>*>(&raw));
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < 8; ++i) x[i] = f[i];
}

// NOTES: one thread per 16 bytes of a row (kHeadDim / 8 threads per row): 16-byte loads, the
// row's dot product reduced over those threads with shuffles. (Per-lane 4-byte loads, one row
// per warp, measured 81 us at 16k tokens x 16 heads x 128, against 71 us for cuDNN's.)
template <class Element, int kBlockM, int kHeadDim>
__global__ void __launch_bounds__(256) bwd_preprocess(const BwdAuxParams p) {
  pdl_launch_dependents();
  int m, head, batch;
  aux_block_coords(p.m_blocks, p.nheads, m, head, batch);
  const int64_t bh = int64_t(batch) * p.nheads + head;
  // (Variable lengths: the grid covers the longest sequence; the blocks past this one's end
  // have nothing to do.)
  const SeqLen len = p.seqlens.template of<true>(batch);
  const int seqlen_q = len.q;
  if (m > 0 && m * kBlockM >= seqlen_q) return;
  if (p.dq_done != nullptr && m == 0 && threadIdx.x == 0) p.dq_done[bh] = 0;
  if (seqlen_q == 0) return;
  const int qb = p.seqlens.q_batch(batch);
  constexpr int kThreadsPerRow = kHeadDim / 8, kRowsPerPass = 256 / kThreadsPerRow;
  static_assert(kBlockM % kRowsPerPass == 0);
  const int col = (threadIdx.x % kThreadsPerRow) * 8;
  const Element* out = static_cast<const Element*>(p.out) + qb * p.out_batch + head * p.out_head +
                       int64_t(len.q_start) * p.out_row + col;
  const Element* dout = static_cast<const Element*>(p.dout) + qb * p.dout_batch + head * p.dout_head +
                        int64_t(len.q_start) * p.dout_row + col;
  const int64_t row0 = aux_q_row0<kBlockM>(p, batch, head), tile = row0 / kBlockM + m;
  float d[kBlockM / kRowsPerPass];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kBlockM / kRowsPerPass; ++i) {  // all loads first, then the reductions
    const int row = m * kBlockM + i * kRowsPerPass + int(threadIdx.x) / kThreadsPerRow;
    d[i] = 0.0f;
    if (row < seqlen_q) {
      float o[8], g[8];
      load8(out + row * p.out_row, o);
      load8(dout + row * p.dout_row, g);
      CUTLASS_PRAGMA_UNROLL
      for (int e = 0; e < 8; ++e) d[i] = fmaf(o[e], g[e], d[i]);
    }
  }
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < kBlockM / kRowsPerPass; ++i) {
    CUTLASS_PRAGMA_UNROLL
    for (int mask = 1; mask < kThreadsPerRow; mask *= 2) d[i] += __shfl_xor_sync(0xffffffffu, d[i], mask);
    const int row = m * kBlockM + i * kRowsPerPass + int(threadIdx.x) / kThreadsPerRow;
    if (threadIdx.x % kThreadsPerRow == 0) {
      const int64_t at = row0 + row;
      p.dpsum[at] = d[i];
      // Padding rows get +inf, so that P = exp2(S - lse) = 0 there; rows that saw no key in the
      // forward pass already have lse = +inf.
      p.lse_log2[at] = row < seqlen_q
                           ? p.lse[qb * p.lse_batch + head * p.lse_head + len.q_start + row] * float(M_LOG2E)
                           : INFINITY;
    }
  }
  if (p.dq_sem != nullptr) {  // each copy's first add is a store (bwd_config.h)
    if (int(threadIdx.x) < p.dq_groups) p.dq_sem[tile * p.dq_groups + threadIdx.x] = 0;
  } else {
    float4* acc = reinterpret_cast<float4*>(p.dq_accum + tile * kBlockM * kHeadDim);
    CUTLASS_PRAGMA_UNROLL
    for (int i = threadIdx.x; i < kBlockM * kHeadDim / 4; i += 256) acc[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

}  // namespace flash3::detail

// flash3: the backward's epilogue (Algorithm 3, line 16 of the FlashAttention-3 paper): dK_j
// (scaled) and dV_j of one item out of the consumers' registers, to the outputs (MHA) or to the
// FP32 buffers of GQA/MQA (added per kv head, or per query head in the deterministic mode;
// converted by bwd_postprocess_dkv).
#pragma once

#include "bwd/bwd_traits.h"
#include "common/ptx.h"
#include "common/wgmma.h"

namespace flash3::detail {

// dK (scaled) and dV of one block of work (keys col0.., pair bh) out of the registers: to the
// outputs, or (GQA, dk_accum) into the FP32 buffers: added into the kv head's (dkv_add), or
// stored in the query head's (the deterministic mode). The 16-bit tiles go through
// shared memory at sdk and sdv (each kBlockN x kHeadDim, free once every consumer thread is here).
// NOTES: so that each warp then writes whole row segments (32 lanes x 4 bytes contiguous) instead
// of 16 bytes in each of 8 rows per store; 16-byte chunks XOR-swizzled by row (chunk ^ row % 8):
// both the accumulator-order writes (8 rows, one chunk) and the row reads (one row, 8 chunks) hit
// 32 distinct banks.
template <class Traits, class AccKV>
__device__ __forceinline__ void bwd_store_dkdv(typename Traits::Params const& params, AccKV& tdKrdK, AccKV& tdVrdV,
                                               int tidx, int col0, int head_kv, int batch, int64_t bh,
                                               typename Traits::Element* sdk, typename Traits::Element* sdv) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  warpgroup_fence_operand(tdKrdK);
  warpgroup_fence_operand(tdVrdV);
  typename Traits::TiledMmadKV mma_dkv;
  Tensor tdKcdK = mma_dkv.get_thread_slice(tidx).partition_C(make_identity_tensor(TileKV{}));
  if (params.dk_accum == nullptr) {
    using Pair = cutlass::Array<Element, 2>;
    auto swz = [](int r, int c) { return xor_swizzled_offset<kHeadDim>(r, c); };
    named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);  // the staging buffers are free
    cutlass::NumericArrayConverter<Element, float, 2> cvt;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size(tdKrdK) / 2; ++j) {
      const int r = get<0>(tdKcdK(2 * j)), c = get<1>(tdKcdK(2 * j));
      cutlass::Array<float, 2> k2, v2;
      k2[0] = tdKrdK(2 * j) * params.softmax_scale;
      k2[1] = tdKrdK(2 * j + 1) * params.softmax_scale;
      v2[0] = tdVrdV(2 * j);
      v2[1] = tdVrdV(2 * j + 1);
      *reinterpret_cast<Pair*>(sdk + swz(r, c)) = cvt(k2);
      *reinterpret_cast<Pair*>(sdv + swz(r, c)) = cvt(v2);
    }
    named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);
    // (Variable lengths: the sequence's rows from its first, in its batch entry: seqlen.h.)
    const SeqLen len = params.seqlens.template of<Traits::kGeneral>(batch);
    const int seqlen_k = len.k;
    const int kb = Traits::kGeneral ? params.seqlens.k_batch(batch) : batch;
    Element* dk = params.dk + kb * params.dk_batch_stride + head_kv * params.dk_head_stride +
                  int64_t(len.k_start) * params.dk_row_stride;
    Element* dv = params.dv + kb * params.dv_batch_stride + head_kv * params.dv_head_stride +
                  int64_t(len.k_start) * params.dv_row_stride;
    const int warp = tidx / 32, lane = tidx % 32;
    for (int r = warp; r < kBlockN; r += Traits::kNumConsumerThreads / 32) {
      const int row = col0 + r;
      if (row >= seqlen_k) break;
      CUTLASS_PRAGMA_UNROLL
      for (int c = 2 * lane; c < kHeadDim; c += 64) {
        *reinterpret_cast<Pair*>(dk + row * params.dk_row_stride + c) = *reinterpret_cast<const Pair*>(sdk + swz(r, c));
        *reinterpret_cast<Pair*>(dv + row * params.dv_row_stride + c) = *reinterpret_cast<const Pair*>(sdv + swz(r, c));
      }
    }
  } else {
    const int64_t row0 = params.dkv_add ? bwd_kv_row0<Traits>(params, batch, head_kv)
                                        : bwd_row0<Traits, false>(params, batch, int(bh % params.nheads), bh);
    float* dk = params.dk_accum + row0 * kHeadDim;
    float* dv = params.dv_accum + row0 * kHeadDim;
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < size(tdKrdK) / 2; ++j) {
      const int r = get<0>(tdKcdK(2 * j)), c = get<1>(tdKcdK(2 * j));
      const int64_t at = int64_t(col0 + r) * kHeadDim + c;
      const float2 k2 = make_float2(tdKrdK(2 * j), tdKrdK(2 * j + 1)), v2 = make_float2(tdVrdV(2 * j), tdVrdV(2 * j + 1));
      if (params.dkv_add) {
        atomicAdd(reinterpret_cast<float2*>(dk + at), k2);
        atomicAdd(reinterpret_cast<float2*>(dv + at), v2);
      } else {
        *reinterpret_cast<float2*>(dk + at) = k2;
        *reinterpret_cast<float2*>(dv + at) = v2;
      }
    }
  }
}

// Thread 0: the staged tiles sK, sV out to gK, gV by the TMA maps tma_k, tma_v (stores or
// reduce-adds, as the maps were made), committed as one bulk group.
template <class TmaK, class TmaV, class SK, class SV, class GK, class GV>
__device__ __forceinline__ void bwd_tma_out_kv(TmaK const& tma_k, TmaV const& tma_v, SK const& sK, SV const& sV,
                                               GK const& gK, GV const& gV) {
  auto k_parts = tma_partition(tma_k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
  auto v_parts = tma_partition(tma_v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
  copy(tma_k, get<1>(k_parts), get<0>(k_parts));
  copy(tma_v, get<1>(v_parts), get<0>(v_parts));
  tma_store_arrive();
}

// GQA, default mode (Traits::kTmaAddKV, dkv_add_tma): dK (unscaled: bwd_postprocess_dkv scales
// the sum) and dV of one block of work added into the kv head's FP32 buffers from row `row` on
// (bwd_kv_row0 + the block's first key; whole tiles: padding rows get zeros) by two TMA
// reduce-adds from the staging tiles sdk_stage, sdv_stage (SmemLayoutAccKV), instead of one
// atomic add per pair of values from the registers. (One block per item: the caller waits for
// the reads before the block exits.)
// NOTES: the 128-byte swizzle of the FP32 tiles puts the 8 rows of a warp's pair stores in 8
// different 16-byte chunks of the 128-byte bank window (two wavefronts per 256 bytes).
template <class Traits, class AccKV>
__device__ __forceinline__ void bwd_add_dkdv_tma(typename Traits::Params const& params, AccKV& tdKrdK,
                                                 AccKV& tdVrdV, int tidx, int row, float* sdk_stage,
                                                 float* sdv_stage) {
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  warpgroup_fence_operand(tdKrdK);
  warpgroup_fence_operand(tdVrdV);
  Tensor sdK = make_tensor(make_smem_ptr(sdk_stage), typename Traits::SmemLayoutAccKV{});
  Tensor sdV = make_tensor(make_smem_ptr(sdv_stage), typename Traits::SmemLayoutAccKV{});
  typename Traits::TiledMmadKV mma_dkv;
  Tensor tdKcdK = mma_dkv.get_thread_slice(tidx).partition_C(make_identity_tensor(TileKV{}));
  static_assert(!Traits::kPersistent);
  named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);  // the staging tiles are free
  CUTLASS_PRAGMA_UNROLL
  for (int j = 0; j < size(tdKrdK) / 2; ++j) {
    const int r = get<0>(tdKcdK(2 * j)), c = get<1>(tdKcdK(2 * j));
    *reinterpret_cast<float2*>(&sdK(r, c)) = make_float2(tdKrdK(2 * j), tdKrdK(2 * j + 1));
    *reinterpret_cast<float2*>(&sdV(r, c)) = make_float2(tdVrdV(2 * j), tdVrdV(2 * j + 1));
  }
  cutlass::arch::fence_view_async_shared();  // st.shared -> TMA (async proxy)
  named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);
  if (tidx == 0) {
    auto shape = make_shape(params.dkv_rows, Int<kHeadDim>{});
    Tensor gdK = local_tile(domain_offset(make_coord(row, _0{}), params.tma_dk_add.get_tma_tensor(shape)), TileKV{},
                            make_coord(_0{}, _0{}));
    Tensor gdV = local_tile(domain_offset(make_coord(row, _0{}), params.tma_dv_add.get_tma_tensor(shape)), TileKV{},
                            make_coord(_0{}, _0{}));
    bwd_tma_out_kv(params.tma_dk_add, params.tma_dv_add, sdK, sdV, gdK, gdV);
  }
}

// Whether key block n_block of batch entry `batch` may leave by TMA stores (dkv_tma): always with
// fixed lengths; with variable lengths where its kBlockN rows all lie in the sequence.
template <class Traits>
__device__ __forceinline__ bool bwd_dkdv_tma_fits(typename Traits::Params const& params, int n_block, int batch) {
  if constexpr (Traits::kGeneral) {
    if (params.varlen_items != nullptr) return (n_block + 1) * Traits::kBlockN <= params.seqlens.template of<true>(batch).k;
  }
  return true;
}

// dK (scaled) and dV of one block of work (MHA, Traits::kTmaEpilogue): into the SmemLayoutK
// tiles at sdk_stage and sdv_stage (stmatrix; free once every consumer thread is here), then out
// by two TMA stores that thread 0 issues and commits as one group; the stores clip the rows past
// seqlen_k (variable lengths: past the packed end only, so there a sequence's last, partial key
// block goes out by bwd_store_dkdv instead: bwd_dkdv_tma_fits). Thread 0 waits for the group's
// shared-memory reads (tma_store_wait) before anything writes the tiles again, or before the
// block exits.
// NOTES: the row-by-row stores of bwd_store_dkdv kept the consumers ~1.5 us per block with the
// tensor pipe idle (docs/perf-log.md B54); here they go on as soon as the tiles are in shared
// memory (B56, B57).
template <class Traits, class AccKV>
__device__ __forceinline__ void bwd_store_dkdv_tma(typename Traits::Params const& params, AccKV& tdKrdK,
                                                   AccKV& tdVrdV, int tidx, int n_block, int head_kv, int batch,
                                                   typename Traits::Element* sdk_stage,
                                                   typename Traits::Element* sdv_stage) {
  using Element = typename Traits::Element;
  constexpr int kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  using SmemLayoutK = typename Traits::SmemLayoutK;
  warpgroup_fence_operand(tdKrdK);
  warpgroup_fence_operand(tdVrdV);
  CUTLASS_PRAGMA_UNROLL
  for (int i = 0; i < size(tdKrdK); ++i) tdKrdK(i) *= params.softmax_scale;
  Tensor tdKrOut = make_tensor<Element>(tdKrdK.layout());
  Tensor tdVrOut = make_tensor<Element>(tdVrdV.layout());
  convert_into<Element>(tdKrdK, tdKrOut);
  convert_into<Element>(tdVrdV, tdVrOut);
  Tensor sdK = make_tensor(make_smem_ptr(sdk_stage), SmemLayoutK{});
  Tensor sdV = make_tensor(make_smem_ptr(sdv_stage), SmemLayoutK{});
  typename Traits::TiledMmadKV mma_dkv;
  auto smem_copy = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_dkv);
  auto thr_copy = smem_copy.get_thread_slice(tidx);
  if (tidx == 0) tma_store_wait<0>();  // the last stores from these tiles have read them
  named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);  // the staging tiles are free
  copy(smem_copy, thr_copy.retile_S(tdKrOut), thr_copy.partition_D(sdK));
  copy(smem_copy, thr_copy.retile_S(tdVrOut), thr_copy.partition_D(sdV));
  cutlass::arch::fence_view_async_shared();  // stmatrix -> TMA (async proxy)
  named_barrier_sync(Traits::kNumConsumerThreads, kBwdBarEpilogue);
  if (tidx == 0) {
    Tensor mdK = params.tma_dk.get_tma_tensor(params.layout_k.shape());
    Tensor mdV = params.tma_dv.get_tma_tensor(params.layout_k.shape());
    Tensor gdK = local_tile(bwd_seq_rows<Traits, false>(mdK, params, batch, head_kv), TileKV{}, make_coord(n_block, _0{}));
    Tensor gdV = local_tile(bwd_seq_rows<Traits, false>(mdV, params, batch, head_kv), TileKV{}, make_coord(n_block, _0{}));
    bwd_tma_out_kv(params.tma_dk, params.tma_dv, sdK, sdV, gdK, gdV);
  }
}

}  // namespace flash3::detail

// flash3: the forward's epilogue (Algorithm 1, line 25): the log-sum-exp straight from
// registers, and O in the input precision, by one of three paths chosen per tile shape
// (fwd_config.h): through the Q buffer and one TMA store (kStageOInQ), straight from registers,
// or through a per-warp staging buffer written with stmatrix (kOStageWarp).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "common/ptx.h"
#include "common/wgmma.h"
#include "fwd/fwd_barriers.h"

namespace flash3::detail {

using namespace cute;

template <class Element, class TmaO, class LayoutO>
struct FwdEpilogueParams {
  TmaO tma_o;        // kStageOInQ: the TMA store of O
  LayoutO layout_o;  // its logical shape (TMA bounds) and strides
  Element* out;
  int64_t out_row_stride, out_head_stride, out_batch_stride;
  float* lse;  // may be null
  int64_t lse_head_stride, lse_batch_stride;
};

template <class Element, int kStageElems>
struct FwdEpilogueStorage {
  alignas(128) cute::array_aligned<Element, kStageElems> smem_o_stage;  // kOStageWarp
};

template <class Traits>
struct FwdEpilogue {
  using Element = typename Traits::ElementOut;
  static constexpr int kBlockM = Traits::kBlockM, kHeadDim = Traits::kHeadDim;

  // Thread 0 of the block, before the kernel's __syncthreads.
  template <class Params>
  __device__ static void init(const Params& p) {
    if constexpr (Traits::kStageOInQ) cute::prefetch_tma_descriptor(p.tma_o.get_tma_descriptor());
  }

  // The consumers: O (normalized, FP32 accumulators) and lse of `tile` out; rows past len.q
  // are not written. The sequence is batch entry q_batch of out (and lse), from its row
  // len.q_start (packed tensors: common/seqlen.h). tiles_done rotates the staging buffer's
  // swizzle (see below).
  template <class Params, class Tile, class TensorO, int kRows>
  __device__ __forceinline__ static void store(const Params& p, typename Traits::SharedStorage& shared,
                                               const Tile& tile, const SeqLen& len, int q_batch, TensorO& tOrO,
                                               const float (&lse)[kRows], int tidx, int tiles_done) {
    const int seqlen_q = len.q;
    // The sequence's rows of this head's O.
    Element* const out = p.out + q_batch * p.out_batch_stride + tile.head * p.out_head_stride +
                         int64_t(len.q_start) * p.out_row_stride;
    using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
    const int thread_in_wg = threadIdx.x % 128;
    const int row0 = tile.m_block * kBlockM;
    typename Traits::TiledMmaPV mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(tidx);
    Tensor tOcO = thr_pv.partition_C(make_identity_tensor(TileQ{}));
    Tensor tOcO_rc = make_tensor(tOcO.data(), acc_layout_rowcol(tOcO.layout()));
    // Line 25: the log-sum-exp straight from registers (one thread of each quad owns a row) ...
    if (p.lse != nullptr && thread_in_wg % 4 == 0) {
      float* lse_out = p.lse + q_batch * p.lse_batch_stride + tile.head * p.lse_head_stride + len.q_start;
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < kRows; ++m) {
        const int row = row0 + get<0>(tOcO_rc(m, 0));
        if (row < seqlen_q) lse_out[row] = lse[m];
      }
    }
    Tensor tOrOut = make_tensor<Element>(tOrO.layout());
    convert_into<Element>(tOrO, tOrOut);
    if constexpr (Traits::kStageOInQ) {
      Tensor sQ = make_tensor(make_smem_ptr(shared.smem_q.data()), typename Traits::SmemLayoutQ{});
      // ... and O through the Q buffer: each warpgroup writes its own 64 rows (only its own S
      // GEMMs read them, and they are done), then one thread sends the tile out with a TMA
      // store, which clips the rows past seqlen_q, and frees the Q buffer once it has read it.
      auto smem_copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
      auto thr_copy_o = smem_copy_o.get_thread_slice(tidx);
      copy(smem_copy_o, thr_copy_o.retile_S(tOrOut), thr_copy_o.partition_D(sQ));
      cutlass::arch::fence_view_async_shared();  // st.shared / stmatrix -> TMA (async proxy)
      named_barrier_sync(Traits::kNumConsumerThreads, kFwdBarrierEpilogue);
      if (Traits::kGeneral && row0 + kBlockM > seqlen_q) {
        // The last tile of a sequence in a packed out (general kernels): the rows past it are
        // the next sequence's, so the consumers copy the tile's rows below seqlen_q, 16 bytes at
        // a time (the swizzle keeps each 8-element chunk of a row together).
        constexpr int kChunks = kHeadDim / 8;
        for (int c = tidx; c < kBlockM * kChunks; c += Traits::kNumConsumerThreads) {
          const int r = c / kChunks, col = c % kChunks * 8;
          if (row0 + r < seqlen_q) {
            *reinterpret_cast<uint4*>(out + int64_t(row0 + r) * p.out_row_stride + col) =
                *reinterpret_cast<const uint4*>(&sQ(r, col));
          }
        }
        named_barrier_sync(Traits::kNumConsumerThreads, kFwdBarrierEpilogue);
        if (tidx == 0) shared.load.barrier_q_free.arrive();
        return;
      }
      if (tidx == 0) {
        Tensor mO = p.tma_o.get_tma_tensor(p.layout_o.shape());
        Tensor gO = local_tile(domain_offset(make_coord(len.q_start, _0{}), mO(_, _, tile.head, q_batch)), TileQ{},
                               make_coord(tile.m_block, _0{}));
        auto o_parts = tma_partition(p.tma_o, group_modes<0, 2>(sQ), group_modes<0, 2>(gO));
        copy(p.tma_o, get<1>(o_parts), get<0>(o_parts));
        tma_store_arrive();
        tma_store_wait<0>();             // the store has read the Q buffer ...
        shared.load.barrier_q_free.arrive();  // ... so the producer may load the next Q into it
      }
    } else if constexpr (!Traits::kOStageWarp) {
      // ... and O straight from registers (the Q buffer is already the next tile's).
      // NOTES: values (2i, 2i+1) of an accumulator row are adjacent columns: one 4-byte store
      // per pair; rows past seqlen_q are not written.
      Tensor tOrOut_rc = make_tensor(tOrOut.data(), acc_layout_rowcol(tOrO.layout()));
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < kRows; ++m) {
        const int row = row0 + get<0>(tOcO_rc(m, 0));
        if (row >= seqlen_q) continue;
        Element* out_row = out + row * p.out_row_stride;
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < size<1>(tOrOut_rc); n += 2) {
          *reinterpret_cast<uint32_t*>(out_row + get<1>(tOcO_rc(m, n))) =
              *reinterpret_cast<const uint32_t*>(&tOrOut_rc(m, n));
        }
      }
    } else {
      // ... and O from registers (the Q buffer is already the next tile's), through a
      // staging buffer of this warp's own: its 16 rows, kOStageCols = 64 columns at a time, go
      // to shared memory with stmatrix (four 8x8 blocks per instruction: the accumulator's
      // pairs are exactly stmatrix's), 16-byte chunks XOR-swizzled by row, then leave as whole
      // row segments (8 lanes x 16 bytes per row). NOTES: stored straight from registers, each
      // warp store wrote 4 bytes in each of 8 rows; staged with 4-byte shared stores (one per
      // pair, each with its own swizzled address) the epilogue was ~400 instructions per warp
      // and 11% of the warps' samples at seqlen 512 (ncu, docs/perf-log.md step 18).
      constexpr int kCols = Traits::kOStageCols;
      static_assert(kCols == 64 && kHeadDim % kCols == 0, "rows of 8 16-byte chunks");
      Tensor tOrOut_rc = make_tensor(tOrOut.data(), acc_layout_rowcol(tOrO.layout()));
      static_assert(decltype(size<0>(tOrOut_rc))::value == 2, "a warp's accumulator rows: r and r + 8");
      const int lane = tidx % 32;
      Element* stage = shared.epilogue.smem_o_stage.data() + (tidx / 32) * 16 * kCols;
      const int warp_row0 = get<0>(tOcO_rc(0, 0)) - lane / 4;  // the warp's first row in the tile
      // NOTES: the XOR key also rotates with the tile count (any row -> key bijection is
      // conflict-free), so that ptxas does not hoist the addresses out of the tile loop and
      // spill them. The offsets below are common/ptx.h's xor_swizzled_offset<kCols>(row, col, key),
      // written out: calling the helper measured even (docs/perf-log.md step 23)
      // but cost 8-16 more instructions per kernel and 2 more local-memory accesses.
      const int key = tiles_done;
      // stmatrix k of a pass stores 8-column groups 2k, 2k+1 of rows 0-7 and 8-15; lane l gives
      // the address of row l % 8 of block l / 8 = (row half, group 2k + l / 16).
      const int st_row = (lane / 8) % 2 * 8 + lane % 8;
      const int st_swz = (st_row + key) & 7;
      uint32_t st_addr[kCols / 16];
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < kCols / 16; ++k) {
        st_addr[k] = cute::cast_smem_ptr_to_uint(stage + st_row * kCols + (((2 * k + lane / 16) ^ st_swz) * 8));
      }
      CUTLASS_PRAGMA_UNROLL
      for (int pass = 0; pass < kHeadDim / kCols; ++pass) {
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < kCols / 16; ++k) {
          // Column pair of 8-column group G in the (row, col) view: columns 2G, 2G + 1 (common/wgmma.h).
          const int g = pass * (kCols / 8) + 2 * k;
          auto pair = [&](int m, int grp) {
            return *reinterpret_cast<const uint32_t*>(&tOrOut_rc(m, 2 * grp));
          };
          asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(st_addr[k]),
                       "r"(pair(0, g)), "r"(pair(1, g)), "r"(pair(0, g + 1)), "r"(pair(1, g + 1))
                       : "memory");
        }
        __syncwarp();
        constexpr int kChunksPerRow = kCols / 8;  // 16-byte chunks
        constexpr int kRowsPerStore = 32 / kChunksPerRow;
        const int c = lane % kChunksPerRow;
        CUTLASS_PRAGMA_UNROLL
        for (int r = lane / kChunksPerRow; r < 16; r += kRowsPerStore) {
          const int row = row0 + warp_row0 + r;
          if (row < seqlen_q) {
            *reinterpret_cast<uint4*>(out + row * p.out_row_stride + pass * kCols + c * 8) =
                *reinterpret_cast<const uint4*>(stage + r * kCols + ((c ^ ((r + key) & 7)) * 8));
          }
        }
        __syncwarp();
      }
    }
  }
};

}  // namespace flash3::detail

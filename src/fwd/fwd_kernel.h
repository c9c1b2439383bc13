// flash3: the warp-specialized forward kernel, Algorithm 1 of the FlashAttention-3 paper
// (shared/paper, §3.1), with pingpong (§3.1), the intra-warpgroup overlap (Algorithm 2, §3.2) and
// a persistent tile loop (tile_scheduler.h). A tile is (kBlockM query rows, head, batch) of O.
//   warpgroup 0      producer: TMA loads of Q_i once and of K_j, V_j into rings of kStages
//                    (V: kStagesV) shared-memory buffers, each stage guarded by a full/empty
//                    mbarrier pair.
//   warpgroups 1..   consumers, 64 query rows each: S = Q K^T (WGMMA, both from shared memory),
//                    online softmax in FP32, O += P V (WGMMA, P from registers), then O and LSE.
#pragma once

#include <type_traits>

#include <cutlass/arch/reg_reconfig.h>

#include "fwd/kernel_traits.h"
#include "fwd/mask.h"
#include "fwd/softmax.h"
#include "fwd/tile_scheduler.h"
#include "fwd/utils.h"

namespace flash3::detail {

// The key blocks [0, n_block_max) that query block m_block must visit. Causal: blocks entirely
// in the future of the block's last query row are skipped, not computed.
template <class Traits>
__device__ __forceinline__ int num_key_blocks(int m_block, int seqlen_q, int seqlen_k) {
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN;
  int n_max = (seqlen_k + kBlockN - 1) / kBlockN;
  if constexpr (Traits::kCausal) {
    const int last_row = min((m_block + 1) * kBlockM, seqlen_q) - 1;
    const int last_col = last_row + seqlen_k - seqlen_q;  // may be negative: no visible key
    n_max = min(n_max, last_col < 0 ? 0 : last_col / kBlockN + 1);
  }
  return n_max;
}

// Stores the sum of `values` to shared memory with a volatile st.shared, so its computation stays ahead of the
// next wgmma.wait_group in the SASS.
template <int N>
__device__ __forceinline__ void pin_before_wait(float* slot, const float (&values)[N]) {
  float v = values[0];
  CUTLASS_PRAGMA_UNROLL
  for (int i = 1; i < N; ++i) v += values[i];
  const uint32_t addr = cute::cast_smem_ptr_to_uint(slot);
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}

// Named barriers (id 0 is __syncthreads).
enum : int { kBarrierEpilogue = 1, kBarrierPingpongBase = 2 };

// Pingpong (§3.1): consumer warpgroups take turns issuing their GEMMs, so that one warpgroup's
// softmax runs while another's GEMMs run. Warpgroup w waits on barrier (base + w) before
// issuing, and after issuing lets warpgroup (w + 1) % n go. Warpgroup 0 holds the first turn.
// Every warpgroup of a block issues the same number of GEMM batches, so the turns stay matched.
template <class Traits>
struct PingpongScheduler {
  int wg;
  __device__ explicit PingpongScheduler(int consumer_wg) : wg(consumer_wg) {
    if constexpr (Traits::kPingpong) {
      if (wg == 0) named_barrier_arrive(256, kBarrierPingpongBase);
    }
  }
  __device__ __forceinline__ void before_gemms() const {
    if constexpr (Traits::kPingpong) named_barrier_sync(256, kBarrierPingpongBase + wg);
  }
  __device__ __forceinline__ void after_gemms() const {
    if constexpr (Traits::kPingpong) {
      named_barrier_arrive(256, kBarrierPingpongBase + (wg + 1) % Traits::kNumConsumerWG);
    }
  }
};

template <class Traits>
__global__ void __launch_bounds__(Traits::kNumThreads, 1)
    fwd_kernel(const __grid_constant__ typename Traits::Params params) {
  using Element = typename Traits::Element;
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;

  extern __shared__ __align__(1024) char smem_raw[];
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(smem_raw);

  const int warpgroup = cutlass::canonical_warp_group_idx();
  const int thread_in_wg = threadIdx.x % 128;
  const FwdTileScheduler<Traits::kCausal> scheduler(params.seqlen_q, kBlockM, params.nheads,
                                                    params.batch, params.l2_section, params.l2_tail_first);
  const int tiles_end = params.tiles_end;
  const FwdTileStream<Traits::kDynamicTiles> tiles{params.tile_counter, tiles_end};
  // This block's k-th piece of work: key blocks [n_lo, n_hi) of tile `tile`; tile >= tiles_end:
  // no more. The main kernel: whole tiles from the tile stream (n_lo = 0, known at compile
  // time, so that its code is that of a kernel without pieces). The tail kernel: its pieces of
  // the last wave's tiles (tail_split.h).
  const int tail_pieces = Traits::kTailPieces ? tail_piece_count(params.split, int(blockIdx.x)) : 0;
  auto piece_at = [&](int k) {
    TailPiece piece{};
    if constexpr (Traits::kTailPieces) {
      if (k < tail_pieces) return tail_piece(params.split, int(blockIdx.x), k);
      piece.tile = tiles_end;
    } else {
      piece.tile = tiles.tile(k, shared);  // n_lo, n_hi: see key_blocks
      piece.part = -1;
    }
    return piece;
  };
  // The key blocks [n_lo, n_hi) of `piece` of `tile`.
  auto key_blocks = [&](const TailPiece& piece, const FwdTile& tile, int& n_lo, int& n_hi) {
    if constexpr (Traits::kTailPieces) {
      n_lo = piece.n_lo;
      n_hi = piece.n_hi;
    } else {
      n_lo = 0;
      n_hi = num_key_blocks<Traits>(tile.m_block, params.seqlen_q, params.seqlen_k);
    }
  };

  // Line 1: the pipeline objects over the shared-memory ring, and the two barriers of the Q
  // buffer: "Q has landed" (producer -> consumers) and "Q is free" (consumers -> producer,
  // once the tile's last S = Q K^T has completed, or its O store through the Q buffer).
  const bool is_producer_thread = warpgroup == 0 && thread_in_wg == 0;
  using PipelineV = typename Traits::PipelineV;
  using PipelineStateV = typename Traits::PipelineStateV;
  // The parameters of the K or the V pipeline (P: its type; V's ring may be deeper).
  auto pipeline_params = [&](auto* pipeline_type) {
    using P = std::remove_pointer_t<decltype(pipeline_type)>;
    typename P::Params pp;
    pp.transaction_bytes = Traits::kTmaBytesKV;
    pp.role = warpgroup == 0 ? P::ThreadCategory::Producer : P::ThreadCategory::Consumer;
    pp.is_leader = is_producer_thread;
    pp.num_consumers = Traits::kNumConsumerThreads;
    return pp;
  };
  if (threadIdx.x == 0) {
    shared.barrier_q.init(1);
    shared.barrier_q_free.init(Traits::kQFreeArrivals);
    for (int i = 0; i < 2; ++i) {
      shared.tile_full[i].init(1);
      shared.tile_empty[i].init(Traits::kNumConsumerThreads + 1);  // + the producer thread
    }
    shared.tile_request.init(1);
    cutlass::arch::fence_barrier_init();
    if constexpr (Traits::kStageOInQ) cute::prefetch_tma_descriptor(params.tma_o.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
  }
  Pipeline pipeline_k(shared.pipeline_k, pipeline_params(static_cast<Pipeline*>(nullptr)), Shape<_1, _1, _1>{});
  PipelineV pipeline_v(shared.pipeline_v, pipeline_params(static_cast<PipelineV*>(nullptr)), Shape<_1, _1, _1>{});
  __syncthreads();
  // The tail kernel, if one follows, may take each SM as soon as this kernel's block leaves it.
  if constexpr (!Traits::kCausal && !Traits::kTailPieces) pdl_launch_dependents();

  Tensor sQ = make_tensor(make_smem_ptr(shared.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(shared.smem_k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.smem_v.data()), typename Traits::SmemLayoutV{});
  Tensor sVt = make_tensor(make_smem_ptr(shared.smem_v.data()), typename Traits::SmemLayoutVt{});

  if (warpgroup == 0) {
    // ===================================== producer ======================================
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();  // line 3
    if (Traits::kDynamicTiles && threadIdx.x == 32) {
      // Scheduler (one thread of warp 1): draws this block's k-th tile when the producer has
      // issued the last load of tile k-1, and hands it to the producer and the consumers.
      // NOTES: in the producer thread itself, the draw made ptxas spill (380 bytes at head dim
      // 256: 24 registers leave no room).
      for (int k = 0;; ++k) {
        if (k > 0) shared.tile_request.wait((k - 1) & 1);
        const int t = tiles.draw(k);
        tiles.publish(k, t, shared.tile_ring, shared.tile_full, shared.tile_empty);
        if (t >= tiles_end) break;
      }
      return;
    }
    if (!is_producer_thread) return;
    Tensor mQ = params.tma_q.get_tma_tensor(params.layout_q.shape());
    Tensor mK = params.tma_k.get_tma_tensor(params.layout_k.shape());
    Tensor mV = params.tma_v.get_tma_tensor(params.layout_k.shape());
    PipelineState write_k = cutlass::make_producer_start_state<Pipeline>();
    PipelineStateV write_v = cutlass::make_producer_start_state<PipelineV>();
    for (int tiles_done = 0;; ++tiles_done) {
      const TailPiece piece = piece_at(tiles_done);
      if (piece.tile >= tiles_end) break;
      const FwdTile tile = scheduler.tile(piece.tile);
      const int head_kv = tile.head / params.nheads_per_kv;  // GQA/MQA by indexing
      int n_lo, n_block_max;  // key blocks n_block_max - 1 down to n_lo
      key_blocks(piece, tile, n_lo, n_block_max);
      Tensor gQ = local_tile(mQ(_, _, tile.head, tile.batch), TileQ{}, make_coord(tile.m_block, _0{}));
      Tensor gK = local_tile(mK(_, _, head_kv, tile.batch), TileKV{}, make_coord(_, _0{}));
      Tensor gV = local_tile(mV(_, _, head_kv, tile.batch), TileKV{}, make_coord(_, _0{}));
      auto q_parts = tma_partition(params.tma_q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto k_parts = tma_partition(params.tma_k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto v_parts = tma_partition(params.tma_v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      Tensor tKgK = get<0>(k_parts);  // (TMA, n_block)
      Tensor tKsK = get<1>(k_parts);  // (TMA, stage)
      Tensor tVgV = get<0>(v_parts);
      Tensor tVsV = get<1>(v_parts);
      auto load_k = [&](int n_block) {
        pipeline_k.producer_acquire(write_k);  // line 7
        copy(params.tma_k.with(*pipeline_k.producer_get_barrier(write_k)), tKgK(_, n_block),
             tKsK(_, write_k.index()));
        ++write_k;
      };
      auto load_v = [&](int n_block) {
        pipeline_v.producer_acquire(write_v);
        copy(params.tma_v.with(*pipeline_v.producer_get_barrier(write_v)), tVgV(_, n_block),
             tVsV(_, write_v.index()));
        ++write_v;
      };
      // NOTES: the first K of this tile is issued before waiting for the consumers to be done
      // with the previous tile's Q, so it streams in meanwhile; the next Q is loaded as soon
      // as the previous tile's last S = Q K^T has completed, while its last PV GEMM, softmax
      // finalization and O store still run (with kStageOInQ: once its O store has read the
      // Q buffer).
      if (n_block_max > n_lo) load_k(n_block_max - 1);
      if (tiles_done > 0) shared.barrier_q_free.wait((tiles_done - 1) & 1);
      // Lines 4-5: Q_i, loaded for every tile (also one with no visible key), so that Q loads
      // and "Q is free" signals strictly alternate.
      shared.barrier_q.arrive_and_expect_tx(Traits::kTmaBytesQ);
      copy(params.tma_q.with(reinterpret_cast<uint64_t&>(shared.barrier_q)), get<0>(q_parts),
           get<1>(q_parts));
      // Lines 6-10, in the order the consumers use them: K_{j+1} is needed before V_j (the
      // 3-stage pipeline: K_{j+2} before V_j).
      if constexpr (Traits::kThreeStage) {
        if (n_block_max > 1) load_k(n_block_max - 2);
        for (int n_block = n_block_max - 2; n_block >= 0; --n_block) {
          if (n_block > 0) load_k(n_block - 1);
          load_v(n_block + 1);
        }
      } else {
        for (int n_block = n_block_max - 2; n_block >= n_lo; --n_block) {
          load_k(n_block);
          load_v(n_block + 1);
        }
      }
      if (n_block_max > n_lo) load_v(n_lo);
      if constexpr (Traits::kDynamicTiles) shared.tile_request.arrive();  // the next tile, please
    }
    // NOTES: the tail kernel is launched behind the main one with programmatic dependent launch
    // (fwd_launch.h) and reads nothing the main kernel writes; this wait only keeps it from
    // completing before the main kernel does, so that the stream's next work waits for both.
    if constexpr (Traits::kTailPieces) pdl_wait();
    return;
  }

  // ====================================== consumers =======================================
  cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();  // line 12
  const int tidx = threadIdx.x - 128;
  typename Traits::TiledMmaQK mma_qk;
  typename Traits::TiledMmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tidx);
  auto thr_pv = mma_pv.get_thread_slice(tidx);

  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // descriptors into shared memory
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stage)
  Tensor tOrO = partition_fragment_C(mma_pv, TileQ{});
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tSrS_rc = make_tensor(tSrS.data(), acc_layout_rowcol(tSrS.layout()));
  Tensor tOrO_rc = make_tensor(tOrO.data(), acc_layout_rowcol(tOrO.layout()));
  // P in the input precision, laid out as the A operand of the PV WGMMA.
  Tensor tOrP = make_tensor<Element>(acc_layout_as_a_operand(tSrS.layout()));
  // (row, col) coordinates of this thread's scores / outputs inside the tile.
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor tScS_rc = make_tensor(tScS.data(), acc_layout_rowcol(tScS.layout()));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(TileQ{}));
  Tensor tOcO_rc = make_tensor(tOcO.data(), acc_layout_rowcol(tOcO.layout()));
  constexpr int kRows = decltype(size<0>(tSrS_rc))::value;

  PingpongScheduler<Traits> turns(warpgroup - 1);
  PipelineState read_k;
  PipelineStateV read_v;
  for (int tiles_done = 0;; ++tiles_done) {
    const TailPiece piece = piece_at(tiles_done);
    if (piece.tile >= tiles_end) break;
    const FwdTile tile = scheduler.tile(piece.tile);
    int n_lo, n_block_max;  // key blocks n_block_max - 1 down to n_lo
    key_blocks(piece, tile, n_lo, n_block_max);
    const int row0 = tile.m_block * kBlockM;
    OnlineSoftmax<kRows> softmax(params.scale_log2);  // line 13
    clear(tOrO);

    // S = Q K_j^T landed in tSrS: mask it where the block crosses the end of the keys or the
    // causal diagonal, then the online softmax (lines 18-19), which gives the O rescale factors
    // and whether any row of the warp needs them (softmax.h).
    auto softmax_step_on = [&](decltype(tSrS_rc)& s_rc, int n_block, float (&rescale)[kRows]) -> bool {
      const int col0 = n_block * kBlockN;
      bool need_mask = col0 + kBlockN > params.seqlen_k;
      if constexpr (Traits::kCausal) {
        need_mask |= col0 + kBlockN - 1 > row0 + params.seqlen_k - params.seqlen_q;
      }
      if (need_mask) {
        apply_mask<Traits::kCausal>(s_rc, tScS_rc, row0, col0, params.seqlen_q, params.seqlen_k);
      }
      return softmax.step(s_rc, rescale);
    };
    auto softmax_step = [&](int n_block, float (&rescale)[kRows]) -> bool {
      return softmax_step_on(tSrS_rc, n_block, rescale);
    };
    auto gemm_qk_into = [&](decltype(tSrS)& s) {
      warpgroup_gemm</*zero_init=*/true, /*wait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), s);
    };
    auto gemm_qk = [&]() { gemm_qk_into(tSrS); };
    // The same without fences after the commit (the 3-stage pipeline fences the tile after the
    // wait that completes it: a fence on a tile still in flight serializes every WGMMA, C7514).
    auto gemm_qk_async_into = [&](decltype(tSrS)& s) {
      warpgroup_gemm_async</*zero_init=*/true>(mma_qk, tSrQ, tSrK(_, _, _, read_k.index()), s);
    };
    auto gemm_pv = [&]() {
      warpgroup_gemm</*zero_init=*/false, /*wait=*/-1>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
    };
    // One GEMM on its own, waited for (the pingpong turn taken around its issue).
    auto qk_alone = [&]() {
      pipeline_k.consumer_wait(read_k);
      turns.before_gemms();
      gemm_qk();
      turns.after_gemms();
      warpgroup_wait<0>();
      pipeline_k.consumer_release(read_k);
      ++read_k;
    };
    auto pv_alone = [&]() {
      pipeline_v.consumer_wait(read_v);
      turns.before_gemms();
      gemm_pv();
      turns.after_gemms();
      warpgroup_wait<0>();
      pipeline_v.consumer_release(read_v);
      ++read_v;
    };
    auto release_q = [&]() {
      if constexpr (!Traits::kStageOInQ) shared.barrier_q_free.arrive();
    };

    float inv_sum[kRows], lse[kRows];
    bool finalized = false;
    shared.barrier_q.wait(tiles_done & 1);  // line 14
    if (n_block_max <= n_lo) release_q();
    if (n_block_max > n_lo) {
      if constexpr (Traits::kThreeStage) {
        // Appendix B.3 (Algorithm 4): while the softmax of block j runs, the tensor cores run
        // both S_{j-1} = Q K_{j-1}^T and O += P_{j+1} V_{j+1}. Two score tiles alternate roles
        // (the loop is unrolled by two, so no register copies).
        // The second score tile (S_{j-1} in flight while S_j is under softmax).
        Tensor tSrS2 = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
        Tensor tSrS2_rc = make_tensor(tSrS2.data(), acc_layout_rowcol(tSrS2.layout()));
        float rescale[kRows];
        qk_alone();
        if (n_block_max == 1) release_q();
        softmax_step(n_block_max - 1, rescale);  // O is 0: no rescale needed
        convert_into<Element>(tSrS, tOrP);
        PipelineState k_cur = read_k;  // the stage of the K whose S GEMM is in flight
        auto issue_second = [&]() {
          pipeline_k.consumer_wait(read_k);
          turns.before_gemms();
          gemm_qk_async_into(tSrS2);
          turns.after_gemms();
          ++read_k;
        };
        // s_cur: S_j (in flight), s_next: receives S_{j-1}; tOrP holds P_{j+1}.
        // NOTES: forced inline: called from three places, it was otherwise compiled as a function
        // taking the score tiles by reference, i.e. through local memory.
        // `more` (compile time): an S GEMM for block j - 1 is issued (j > 0). NOTES: as a run-time
        // flag ptxas serialized every WGMMA of the kernel (C7514).
        auto step = [&](auto more_c, decltype(tSrS)& s_cur, decltype(tSrS_rc)& s_cur_rc, decltype(tSrS)& s_next,
                        int j) __attribute__((always_inline)) {
          constexpr bool more = decltype(more_c)::value;
          PipelineState k_next = read_k;
          if constexpr (more) pipeline_k.consumer_wait(read_k);
          pipeline_v.consumer_wait(read_v);
          turns.before_gemms();
          if constexpr (more) gemm_qk_async_into(s_next);
          warpgroup_fence_operand(tOrP);
          warpgroup_gemm_async</*zero_init=*/false>(mma_pv, tOrP, tOrV(_, _, _, read_v.index()), tOrO);
          turns.after_gemms();
          if constexpr (more) {
            ++read_k;
            warpgroup_wait<2>();  // S_j is ready; S_{j-1} and O += P_{j+1} V_{j+1} may still run
          } else {
            warpgroup_wait<1>();
          }
          warpgroup_fence_operand(s_cur);
          pipeline_k.consumer_release(k_cur);
          k_cur = k_next;
          if (j == 0) release_q();
          const bool rescale_o = softmax_step_on(s_cur_rc, j, rescale);
          pin_before_wait(&shared.softmax_pin[tidx], softmax.row_sum);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          warpgroup_fence_operand(tOrP);
          pipeline_v.consumer_release(read_v);
          ++read_v;
          if (rescale_o) scale_rows(tOrO_rc, rescale);
          convert_into<Element>(s_cur, tOrP);
        };
        if (n_block_max > 1) {
          issue_second();
          int j = n_block_max - 2;
          for (; j >= 2; j -= 2) {
            step(cute::true_type{}, tSrS2, tSrS2_rc, tSrS, j);
            step(cute::true_type{}, tSrS, tSrS_rc, tSrS2, j - 1);
          }
          if (j == 1) {
            step(cute::true_type{}, tSrS2, tSrS2_rc, tSrS, 1);
            step(cute::false_type{}, tSrS, tSrS_rc, tSrS2, 0);
          } else {
            step(cute::false_type{}, tSrS2, tSrS2_rc, tSrS, 0);
          }
        }
        pv_alone();
      } else if constexpr (!Traits::kIntraWGOverlap) {
        // Algorithm 1 as written: each GEMM is waited for before the softmax that follows it.
        for (int n_block = n_block_max - 1; n_block >= 0; --n_block) {
          qk_alone();  // lines 16-17
          if (n_block == 0) release_q();
          float rescale[kRows];
          if (softmax_step(n_block, rescale)) scale_rows(tOrO_rc, rescale);
          convert_into<Element>(tSrS, tOrP);
          pv_alone();  // lines 20-22
        }
      } else {
        // Algorithm 2: the PV GEMM of block j runs on the tensor cores while the softmax of
        // block j+1 runs on the FP32 and exp units. The first S is computed alone.
        float rescale[kRows];
        qk_alone();
        if (n_block_max - n_lo == 1) release_q();
        softmax_step(n_block_max - 1, rescale);  // O is 0: no rescale needed
        convert_into<Element>(tSrS, tOrP);
        for (int n_block = n_block_max - 2; n_block >= n_lo; --n_block) {
          pipeline_k.consumer_wait(read_k);
          turns.before_gemms();
          gemm_qk();
          pipeline_v.consumer_wait(read_v);
          gemm_pv();
          turns.after_gemms();
          warpgroup_wait<1>();  // S_{j+1} is ready; O += P_j V_j may still be running
          pipeline_k.consumer_release(read_k);
          ++read_k;
          if (n_block == n_lo) release_q();
          const bool rescale_o = softmax_step(n_block, rescale);
          // NOTES: pin the softmax before the wait below; otherwise ptxas (13.0) hoists
          // wgmma.wait_group 0 above the exponentials and the overlap of Algorithm 2 is gone
          // (seen in the SASS: WARPGROUP.DEPBAR.LE gsb0, 0x0 ahead of every MUFU.EX2; the
          // order in the PTX was right). A shared-memory store of the row sum, which needs
          // every exponential of the row, is kept before the wait by ptxas.
          pin_before_wait(&shared.softmax_pin[tidx], softmax.row_sum);
          warpgroup_wait<0>();  // O += P_j V_j is done: P_j's registers are free
          pipeline_v.consumer_release(read_v);
          ++read_v;
          if (rescale_o) scale_rows(tOrO_rc, rescale);
          convert_into<Element>(tSrS, tOrP);
        }
        if constexpr (Traits::kLastPvOwnTurn) {
          pv_alone();
        } else {
          // NOTES: with two consumer warpgroups the tile's last PV GEMM takes no pingpong turn
          // (as in FlashAttention-3), and the softmax's final sums (line 24) are computed while
          // it runs: the warpgroup goes on to its epilogue without waiting for the other's
          // turn. Each warpgroup then takes n_block_max turns per tile, so the turns stay
          // matched across tiles. Measured +2-4% at head dims 128 and 256 for seqlen <= 2k, even
          // beyond; with three warpgroups (head dim 64) 4-8% slower, so not there
          // (docs/perf-log.md, step 17).
          pipeline_v.consumer_wait(read_v);
          gemm_pv();
          softmax.finalize(params.softmax_scale, inv_sum, lse);
          warpgroup_wait<0>();
          pipeline_v.consumer_release(read_v);
          ++read_v;
          finalized = true;
        }
      }
    }

    // Line 24: O / rowsum, LSE = m + log(rowsum).
    if (!finalized) softmax.finalize(params.softmax_scale, inv_sum, lse);
    scale_rows(tOrO_rc, inv_sum);

    if constexpr (Traits::kTailPieces) {
      if (piece.part >= 0) {
        // A piece of a cut tile (tail_split.h): its normalized O and lse go to its slot; the
        // last piece of the tile to get here combines every piece's slot, in piece order, as
        // O = sum_p exp(lse_p - lse) O_p with lse = log sum_p exp(lse_p), and writes the tile.
        // NOTES: its own piece is read back from its slot too, so that the sums run in the
        // same order whichever piece finishes last: the output is the same from run to run.
        constexpr int N = Traits::kNumConsumerThreads;
        constexpr int kCols = decltype(size<1>(tOrO_rc))::value;
        static_assert(kRows * kCols * N + kRows * N <= Traits::kSplitSlotFloats);
        const TailSplit& sp = params.split;
        const int i = piece.tile - sp.full_tiles;
        auto slot_of = [&](int s) { return params.split_o + size_t(s) * Traits::kSplitSlotFloats; };
        float* mine = slot_of(2 * int(blockIdx.x) + piece.part);
        CUTLASS_PRAGMA_UNROLL
        for (int m = 0; m < kRows; ++m) {
          CUTLASS_PRAGMA_UNROLL
          for (int n = 0; n < kCols; ++n) __stcg(mine + (m * kCols + n) * N + tidx, tOrO_rc(m, n));
          __stcg(mine + (kRows * kCols + m) * N + tidx, lse[m]);
        }
        __threadfence();
        named_barrier_sync(N, kBarrierEpilogue);
        const int first = tail_first_block(sp, i), last = tail_last_block(sp, i);
        if (tidx == 0) {
          const int done = atomicAdd(params.split_counter + i, 1);
          const int is_last = done == last - first;
          if (is_last) params.split_counter[i] = 0;  // left zero for the next launch
          // NOTES: the flag goes through the tile ring, unused by the static order: a shared int
          // of its own shifted the main kernel's layout too, and ptxas spilled 48 bytes there.
          *reinterpret_cast<volatile int*>(&shared.tile_ring[0]) = is_last;
        }
        named_barrier_sync(N, kBarrierEpilogue);
        if (!*reinterpret_cast<volatile int*>(&shared.tile_ring[0])) {
          // Not the last: no output. (With O staged in the Q buffer the O store frees Q; here
          // nothing else does.)
          if constexpr (Traits::kStageOInQ) {
            if (tidx == 0) shared.barrier_q_free.arrive();
          }
          continue;
        }
        __threadfence();
        float lse_max[kRows], weight_sum[kRows];
        CUTLASS_PRAGMA_UNROLL
        for (int m = 0; m < kRows; ++m) {
          lse_max[m] = -INFINITY;
          weight_sum[m] = 0.f;
        }
        for (int p = first; p <= last; ++p) {
          const float* other = slot_of(tail_slot(sp, i, p));
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < kRows; ++m) lse_max[m] = fmaxf(lse_max[m], __ldcg(other + (kRows * kCols + m) * N + tidx));
        }
        clear(tOrO);
        for (int p = first; p <= last; ++p) {
          const float* other = slot_of(tail_slot(sp, i, p));
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < kRows; ++m) {
            const float w = expf(__ldcg(other + (kRows * kCols + m) * N + tidx) - lse_max[m]);
            weight_sum[m] += w;
            CUTLASS_PRAGMA_UNROLL
            for (int n = 0; n < kCols; ++n) tOrO_rc(m, n) += w * __ldcg(other + (m * kCols + n) * N + tidx);
          }
        }
        CUTLASS_PRAGMA_UNROLL
        for (int m = 0; m < kRows; ++m) {
          const float inv = 1.0f / weight_sum[m];
          CUTLASS_PRAGMA_UNROLL
          for (int n = 0; n < kCols; ++n) tOrO_rc(m, n) *= inv;
          lse[m] = lse_max[m] + logf(weight_sum[m]);
        }
      }
    }

    // Line 25: the log-sum-exp straight from registers (one thread of each quad owns a row) ...
    if (params.lse != nullptr && thread_in_wg % 4 == 0) {
      float* lse_out = params.lse + tile.batch * params.lse_batch_stride + tile.head * params.lse_head_stride;
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < kRows; ++m) {
        const int row = row0 + get<0>(tOcO_rc(m, 0));
        if (row < params.seqlen_q) lse_out[row] = lse[m];
      }
    }
    Tensor tOrOut = make_tensor<Element>(tOrO.layout());
    convert_into<Element>(tOrO, tOrOut);
    if constexpr (Traits::kStageOInQ) {
      // ... and O through the Q buffer: each warpgroup writes its own 64 rows (only its own S
      // GEMMs read them, and they are done), then one thread sends the tile out with a TMA
      // store, which clips the rows past seqlen_q, and frees the Q buffer once it has read it.
      auto smem_copy_o = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_pv);
      auto thr_copy_o = smem_copy_o.get_thread_slice(tidx);
      copy(smem_copy_o, thr_copy_o.retile_S(tOrOut), thr_copy_o.partition_D(sQ));
      cutlass::arch::fence_view_async_shared();  // st.shared / stmatrix -> TMA (async proxy)
      named_barrier_sync(Traits::kNumConsumerThreads, kBarrierEpilogue);
      if (tidx == 0) {
        Tensor mO = params.tma_o.get_tma_tensor(params.layout_q.shape());
        Tensor gO = local_tile(mO(_, _, tile.head, tile.batch), TileQ{}, make_coord(tile.m_block, _0{}));
        auto o_parts = tma_partition(params.tma_o, group_modes<0, 2>(sQ), group_modes<0, 2>(gO));
        copy(params.tma_o, get<1>(o_parts), get<0>(o_parts));
        tma_store_arrive();
        tma_store_wait<0>();             // the store has read the Q buffer ...
        shared.barrier_q_free.arrive();  // ... so the producer may load the next Q into it
      }
    } else if constexpr (!Traits::kOStageWarp) {
      // ... and O straight from registers (the Q buffer is already the next tile's).
      // NOTES: values (2i, 2i+1) of an accumulator row are adjacent columns: one 4-byte store
      // per pair; rows past seqlen_q are not written.
      Tensor tOrOut_rc = make_tensor(tOrOut.data(), acc_layout_rowcol(tOrO.layout()));
      Element* out = params.out + tile.batch * params.out_batch_stride + tile.head * params.out_head_stride;
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < kRows; ++m) {
        const int row = row0 + get<0>(tOcO_rc(m, 0));
        if (row >= params.seqlen_q) continue;
        Element* out_row = out + row * params.out_row_stride;
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
      Element* stage = shared.smem_o_stage.data() + (tidx / 32) * 16 * kCols;
      const int warp_row0 = get<0>(tOcO_rc(0, 0)) - lane / 4;  // the warp's first row in the tile
      Element* out = params.out + tile.batch * params.out_batch_stride + tile.head * params.out_head_stride;
      // NOTES: the XOR key also rotates with the tile count (any row -> key bijection is
      // conflict-free), so that ptxas does not hoist the addresses out of the tile loop and
      // spill them. The offsets below are utils.h's xor_swizzled_offset<kCols>(row, col, key),
      // written out: calling the helper measured even (session 13, docs/perf-log.md step 23)
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
          // Column pair of 8-column group G in the (row, col) view: columns 2G, 2G + 1 (utils.h).
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
          if (row < params.seqlen_q) {
            *reinterpret_cast<uint4*>(out + row * params.out_row_stride + pass * kCols + c * 8) =
                *reinterpret_cast<const uint4*>(stage + r * kCols + ((c ^ ((r + key) & 7)) * 8));
          }
        }
        __syncwarp();
      }
    }
  }
}

}  // namespace flash3::detail

// flash3: the forward's load part, the producer of Algorithm 1 (lines 3-10): one thread of the
// producer warpgroup issues the TMA loads of Q_i once per tile and of K_j, V_j into rings of
// kStages (V: kStagesV) shared-memory buffers, each stage guarded by a full/empty mbarrier pair
// (CUTLASS's PipelineTmaAsync), in the order the consumers use them.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

namespace flash3::detail {

using namespace cute;

template <class TmaQ, class TmaKV, class LayoutQKV>
struct FwdLoadParams {
  TmaQ tma_q;
  TmaKV tma_k, tma_v;
  LayoutQKV layout_q, layout_k;  // logical shapes (TMA bounds) and strides
};

// The two barriers of the Q buffer: "Q has landed" (producer -> consumers) and "Q is free"
// (consumers -> producer, once the tile's last S = Q K^T has completed, or its O store through
// the Q buffer has read it).
struct FwdLoadBarriers {
  cutlass::arch::ClusterTransactionBarrier barrier_q;
  cutlass::arch::ClusterBarrier barrier_q_free;
};

template <class Traits>
struct FwdLoad {
  static constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using Pipeline = typename Traits::Pipeline;
  using PipelineV = typename Traits::PipelineV;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;

  // Thread 0 of the block, before the kernel's __syncthreads.
  template <class Params>
  __device__ static void init(typename Traits::SharedStorage& shared, const Params& p) {
    shared.load.barrier_q.init(1);
    shared.load.barrier_q_free.init(Traits::kQFreeArrivals);
    cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
  }

  // The parameters of the K or the V pipeline (P: its type; V's ring may be deeper).
  template <class P>
  __device__ static typename P::Params pipeline_params(bool producer_wg, bool leader) {
    typename P::Params pp;
    pp.transaction_bytes = Traits::kTmaBytesKV;
    pp.role = producer_wg ? P::ThreadCategory::Producer : P::ThreadCategory::Consumer;
    pp.is_leader = leader;
    pp.num_consumers = Traits::kNumConsumerThreads;
    return pp;
  }

  // The producer thread's loop over this block's work.
  template <class Params, class Scheduler>
  __device__ static void run(const Params& p, typename Traits::SharedStorage& shared, Pipeline& pipeline_k,
                             PipelineV& pipeline_v, const Scheduler& scheduler,
                             const typename Scheduler::Params& sched_params, int nheads_per_kv) {
    Tensor sQ = make_tensor(make_smem_ptr(shared.smem_q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(shared.smem_k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(shared.smem_v.data()), typename Traits::SmemLayoutV{});
    Tensor mQ = p.tma_q.get_tma_tensor(p.layout_q.shape());
    Tensor mK = p.tma_k.get_tma_tensor(p.layout_k.shape());
    Tensor mV = p.tma_v.get_tma_tensor(p.layout_k.shape());
    auto write_k = cutlass::make_producer_start_state<Pipeline>();
    auto write_v = cutlass::make_producer_start_state<PipelineV>();
    for (int tiles_done = 0;; ++tiles_done) {
      auto work = scheduler.work(sched_params, tiles_done, shared);
      if (scheduler.done(work)) break;
      scheduler.locate(work);
      const int head_kv = work.tile.head / nheads_per_kv;  // GQA/MQA by indexing
      const int n_lo = work.n_lo, n_block_max = work.n_hi;  // key blocks n_block_max - 1 down to n_lo
      // A sequence of a packed tensor starts at its row q_start (k_start) of batch entry 0.
      const SeqLens& lens = scheduler.seqlens;
      const SeqLen len = lens.template of<Traits::kGeneral>(work.tile.batch);
      const int bq = Traits::kGeneral ? lens.q_batch(work.tile.batch) : work.tile.batch;
      const int bk = Traits::kGeneral ? lens.k_batch(work.tile.batch) : work.tile.batch;
      Tensor gQ = local_tile(domain_offset(make_coord(len.q_start, _0{}), mQ(_, _, work.tile.head, bq)), TileQ{},
                             make_coord(work.tile.m_block, _0{}));
      Tensor gK = local_tile(domain_offset(make_coord(len.k_start, _0{}), mK(_, _, head_kv, bk)), TileKV{},
                             make_coord(_, _0{}));
      Tensor gV = local_tile(domain_offset(make_coord(len.k_start, _0{}), mV(_, _, head_kv, bk)), TileKV{},
                             make_coord(_, _0{}));
      auto q_parts = tma_partition(p.tma_q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto k_parts = tma_partition(p.tma_k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto v_parts = tma_partition(p.tma_v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      Tensor tKgK = get<0>(k_parts);  // (TMA, n_block)
      Tensor tKsK = get<1>(k_parts);  // (TMA, stage)
      Tensor tVgV = get<0>(v_parts);
      Tensor tVsV = get<1>(v_parts);
      // L2 cache hints: K and V are read by every query tile of their (head, batch) pair (and GQA
      // group), Q by one: K and V are kept, Q is evicted first (docs/perf-log.md step 43).
      constexpr auto kKeep = TMA::CacheHintSm90::EVICT_LAST, kOnce = TMA::CacheHintSm90::EVICT_FIRST;
      auto load_k = [&](int n_block) {
        pipeline_k.producer_acquire(write_k);  // line 7
        copy(p.tma_k.with(*pipeline_k.producer_get_barrier(write_k), 0, kKeep), tKgK(_, n_block),
             tKsK(_, write_k.index()));
        ++write_k;
      };
      auto load_v = [&](int n_block) {
        pipeline_v.producer_acquire(write_v);
        copy(p.tma_v.with(*pipeline_v.producer_get_barrier(write_v), 0, kKeep), tVgV(_, n_block),
             tVsV(_, write_v.index()));
        ++write_v;
      };
      // NOTES: the first K of this tile is issued before waiting for the consumers to be done
      // with the previous tile's Q, so it streams in meanwhile; the next Q is loaded as soon
      // as the previous tile's last S = Q K^T has completed, while its last PV GEMM, softmax
      // finalization and O store still run (with kStageOInQ: once its O store has read the
      // Q buffer).
      if (n_block_max > n_lo) load_k(n_block_max - 1);
      if (tiles_done > 0) shared.load.barrier_q_free.wait((tiles_done - 1) & 1);
      // Lines 4-5: Q_i, loaded for every tile (also one with no visible key), so that Q loads
      // and "Q is free" signals strictly alternate.
      shared.load.barrier_q.arrive_and_expect_tx(Traits::kTmaBytesQ);
      copy(p.tma_q.with(reinterpret_cast<uint64_t&>(shared.load.barrier_q), 0, kOnce), get<0>(q_parts),
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
      scheduler.request_next(shared);
    }
    if constexpr (Traits::kFp8) pipeline_v.producer_stop(write_v);  // the V transposers' end
  }
};

}  // namespace flash3::detail

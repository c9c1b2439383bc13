// flash3: the backward's producer (one thread of warp 0): TMA loads of K_j, V_j once per item,
// then of Q_i, dO_i with their log-sum-exps and D through a kStages-deep ring of buffers
// (Algorithm 3, lines 6-8 of the FlashAttention-3 paper).
#pragma once

#include "bwd/bwd_scheduler.h"
#include "bwd/bwd_traits.h"
#include "common/ptx.h"

namespace flash3::detail {

// The producer thread: wait for the preprocess, then let the postprocess launch.
// NOTES: the postprocess launches once every block of the main kernel has been here (or has
// ended), so the preprocess is complete by then: the postprocess reads the pair counts the
// preprocess zeroed (dq_done) without a wait of its own (bwd_postprocess_dq). (One thread's
// launch_dependents counts for its block.)
__device__ __forceinline__ void bwd_pdl_wait_then_launch() {
  pdl_wait();
  pdl_launch_dependents();
}

// The loads for one visit, query block m: Q with its log-sum-exps and dO with its D (lse,
// dpsum: the pair's rows), each into the next stage of its pipeline.
template <class Traits, class Pipeline, class State, class QParts, class DOParts>
__device__ __forceinline__ void bwd_load_visit(typename Traits::Params const& params,
                                               typename Traits::SharedStorage& shared, Pipeline& pipeline_q,
                                               Pipeline& pipeline_do, State& write_q, State& write_do,
                                               QParts const& q_parts, DOParts const& do_parts, int m,
                                               const float* lse, const float* dpsum) {
  constexpr int kBlockM = Traits::kBlockM;
  constexpr uint32_t kRowBytes = kBlockM * sizeof(float);
  pipeline_q.producer_acquire(write_q);
  uint64_t* bar_q = pipeline_q.producer_get_barrier(write_q);
  copy(params.tma_q.with(*bar_q), get<0>(q_parts)(_, m), get<1>(q_parts)(_, write_q.index()));
  bulk_load_1d(shared.smem_lse + write_q.index() * kBlockM, lse + m * kBlockM, kRowBytes, bar_q);
  ++write_q;
  pipeline_do.producer_acquire(write_do);
  uint64_t* bar_do = pipeline_do.producer_get_barrier(write_do);
  copy(params.tma_do.with(*bar_do), get<0>(do_parts)(_, m), get<1>(do_parts)(_, write_do.index()));
  bulk_load_1d(shared.smem_dpsum + write_do.index() * kBlockM, dpsum + m * kBlockM, kRowBytes, bar_do);
  ++write_do;
}

// The producer thread's whole work: every item of this thread block (BwdScheduler; static:
// `it`). Static: K, V, then the item's visits. Persistent: the next item's K, V and first Q, dO
// load while this one finishes (see the two branches).
template <class Traits>
__device__ __forceinline__ void bwd_load(typename Traits::Params const& params, typename Traits::SharedStorage& shared,
                                         typename Traits::Pipeline& pipeline_q, typename Traits::Pipeline& pipeline_do,
                                         BwdItem const& it) {
  using Pipeline = typename Traits::Pipeline;
  using PipelineState = typename Traits::PipelineState;
  using Sched = BwdScheduler<Traits>;
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kHeadDim = Traits::kHeadDim;
  using TileQ = Shape<Int<kBlockM>, Int<kHeadDim>>;
  using TileKV = Shape<Int<kBlockN>, Int<kHeadDim>>;
  Tensor sQ = make_tensor(make_smem_ptr(shared.smem_q.data()), typename Traits::SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(shared.smem_do.data()), typename Traits::SmemLayoutdO{});
  Tensor sK = make_tensor(make_smem_ptr(shared.smem_k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(shared.smem_v.data()), typename Traits::SmemLayoutV{});
  Tensor mQ = params.tma_q.get_tma_tensor(params.layout_q.shape());
  Tensor mdO = params.tma_do.get_tma_tensor(params.layout_q.shape());
  Tensor mK = params.tma_k.get_tma_tensor(params.layout_k.shape());
  Tensor mV = params.tma_v.get_tma_tensor(params.layout_k.shape());
  uint64_t& kv_bar = reinterpret_cast<uint64_t&>(shared.barrier_kv);
  PipelineState write_q = cutlass::make_producer_start_state<Pipeline>();
  PipelineState write_do = cutlass::make_producer_start_state<Pipeline>();

  if constexpr (!Traits::kPersistent) {
    Tensor gQ = local_tile(bwd_seq_rows<Traits, true>(mQ, params, it.batch, it.head), TileQ{}, make_coord(_, _0{}));  // (M, D, m)
    Tensor gdO = local_tile(bwd_seq_rows<Traits, true>(mdO, params, it.batch, it.head), TileQ{}, make_coord(_, _0{}));
    Tensor gK = local_tile(bwd_seq_rows<Traits, false>(mK, params, it.batch, it.head_kv), TileKV{}, make_coord(it.n_block, _0{}));
    Tensor gV = local_tile(bwd_seq_rows<Traits, false>(mV, params, it.batch, it.head_kv), TileKV{}, make_coord(it.n_block, _0{}));
    auto q_parts = tma_partition(params.tma_q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto do_parts = tma_partition(params.tma_do, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
    auto k_parts = tma_partition(params.tma_k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto v_parts = tma_partition(params.tma_v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    shared.barrier_kv.arrive_and_expect_tx(Traits::kTmaBytesKV);
    copy(params.tma_k.with(kv_bar), get<0>(k_parts), get<1>(k_parts));
    copy(params.tma_v.with(kv_bar), get<0>(v_parts), get<1>(v_parts));
    bwd_pdl_wait_then_launch();  // the preprocess's lse, D (K, V are inputs: loaded before)
    const float* lse = params.lse_log2 + bwd_row0<Traits, true>(params, it.batch, it.head, it.bh);
    const float* dpsum = params.dpsum + bwd_row0<Traits, true>(params, it.batch, it.head, it.bh);
    // NOTES: with 24 registers (head dims 64, 128) ptxas's 4-way unrolled copy spilled its loop
    // counters, so it is not unrolled there; at head dim 256 (40 registers, one stage: every load
    // waits for the consumers' release) the rolled loop measured 5-32% slower on the causal
    // sweep, so it stays unrolled as ptxas chose (4).
#pragma unroll(Traits::kProducerRegs < 32 ? 1 : 4)
    for (int i = 0; i < it.m_count; ++i) {
      bwd_load_visit<Traits>(params, shared, pipeline_q, pipeline_do, write_q, write_do, q_parts, do_parts,
                             Sched::at(it, i), lse, dpsum);
    }
  } else if constexpr (Traits::kEarlyKV) {
    // The next item is requested as soon as this one is known, and its K, V are loaded once this
    // item's first loads are out (as many as there are stages), the consumers have copied this
    // item's V into registers, and the K buffer's previous item is done. With
    // params.late_request (deterministic, and non-causal: bwd_launch.h) the next item is
    // requested, and its K, V loaded, only once this item's last load is out.
    // NOTES: an item drawn early waits, drawn but not started, for up to an item's length while
    // its SM finishes the current one; in the deterministic mode the key blocks whose adds wait
    // for its adds stall (head dim 64 0.55-0.83x the default from 2k, B59).
    const TileStream<true> items = Sched::stream(params);
    auto load_kv = [&](const BwdItem& nx, int k_next) {
      Tensor gK = local_tile(bwd_seq_rows<Traits, false>(mK, params, nx.batch, nx.head_kv), TileKV{}, make_coord(nx.n_block, _0{}));
      Tensor gV = local_tile(bwd_seq_rows<Traits, false>(mV, params, nx.batch, nx.head_kv), TileKV{}, make_coord(nx.n_block, _0{}));
      Tensor sKb = make_tensor(make_smem_ptr((k_next & 1) ? shared.smem_k_alt.data() : shared.smem_k.data()),
                               typename Traits::SmemLayoutK{});
      auto k_parts = tma_partition(params.tma_k, group_modes<0, 2>(sKb), group_modes<0, 2>(gK));
      auto v_parts = tma_partition(params.tma_v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      shared.barrier_kv.arrive_and_expect_tx(Traits::kTmaBytesKV);
      copy(params.tma_k.with(kv_bar), get<0>(k_parts), get<1>(k_parts));
      copy(params.tma_v.with(kv_bar), get<0>(v_parts), get<1>(v_parts));
    };
    int t = items.tile(0, shared);
    if (t < items.num_tiles) {
      load_kv(Sched::item(params, t), 0);
      bwd_pdl_wait_then_launch();  // the preprocess's lse, D (K, V are inputs: loaded before)
    }
    for (int k = 0; t < items.num_tiles; ++k) {
      const BwdItem item = Sched::item(params, t);
      const bool late = params.late_request;
      if (!late) shared.tile_request.arrive();  // the next item, please (drawn while this one loads)
      Tensor gQ = local_tile(bwd_seq_rows<Traits, true>(mQ, params, item.batch, item.head), TileQ{}, make_coord(_, _0{}));  // (M, D, m)
      Tensor gdO = local_tile(bwd_seq_rows<Traits, true>(mdO, params, item.batch, item.head), TileQ{}, make_coord(_, _0{}));
      auto q_parts = tma_partition(params.tma_q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto do_parts = tma_partition(params.tma_do, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      const float* lse = params.lse_log2 + bwd_row0<Traits, true>(params, item.batch, item.head, item.bh);
      const float* dpsum = params.dpsum + bwd_row0<Traits, true>(params, item.batch, item.head, item.bh);
      int t_next = items.num_tiles;
      auto prefetch = [&]() {
        if (late) shared.tile_request.arrive();
        t_next = items.tile(k + 1, shared);
        if (t_next >= items.num_tiles) return;
        shared.barrier_v_free.wait(k & 1);  // this item's V is in registers
        if (k + 1 >= 2) shared.barrier_k_free[(k + 1) & 1].wait((((k + 1) >> 1) - 1) & 1);  // item k - 1
        load_kv(Sched::item(params, t_next), k + 1);
      };
      const int at = (late || item.m_count < Traits::kStages ? item.m_count : Traits::kStages) - 1;
      if (at < 0) prefetch();
#pragma unroll 1
      for (int i = 0; i < item.m_count; ++i) {
        bwd_load_visit<Traits>(params, shared, pipeline_q, pipeline_do, write_q, write_do, q_parts, do_parts,
                               bwd_m_at(item.m_base, i), lse, dpsum);
        if (i == at) prefetch();
      }
      t = t_next;
    }
  } else {
    // K, V of item k once the consumers are done with item k - 1's (barrier_kv_free; its
    // epilogue then runs while they load), after item k's first Q, dO loads.
    const TileStream<true> items = Sched::stream(params);
    for (int k = 0;; ++k) {
      const int t = items.tile(k, shared);
      if (t >= items.num_tiles) break;
      const BwdItem item = Sched::item(params, t);
      Tensor gQ = local_tile(bwd_seq_rows<Traits, true>(mQ, params, item.batch, item.head), TileQ{}, make_coord(_, _0{}));  // (M, D, m)
      Tensor gdO = local_tile(bwd_seq_rows<Traits, true>(mdO, params, item.batch, item.head), TileQ{}, make_coord(_, _0{}));
      Tensor gK = local_tile(bwd_seq_rows<Traits, false>(mK, params, item.batch, item.head_kv), TileKV{}, make_coord(item.n_block, _0{}));
      Tensor gV = local_tile(bwd_seq_rows<Traits, false>(mV, params, item.batch, item.head_kv), TileKV{}, make_coord(item.n_block, _0{}));
      auto q_parts = tma_partition(params.tma_q, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto do_parts = tma_partition(params.tma_do, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
      auto load_kv = [&]() {
        if (k > 0) shared.barrier_kv_free.wait((k - 1) & 1);
        auto k_parts = tma_partition(params.tma_k, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
        auto v_parts = tma_partition(params.tma_v, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
        shared.barrier_kv.arrive_and_expect_tx(Traits::kTmaBytesKV);
        copy(params.tma_k.with(kv_bar), get<0>(k_parts), get<1>(k_parts));
        copy(params.tma_v.with(kv_bar), get<0>(v_parts), get<1>(v_parts));
      };
      if (k == 0) {
        load_kv();
        bwd_pdl_wait_then_launch();  // the preprocess's lse, D (K, V are inputs: loaded before)
      }
      const float* lse = params.lse_log2 + bwd_row0<Traits, true>(params, item.batch, item.head, item.bh);
      const float* dpsum = params.dpsum + bwd_row0<Traits, true>(params, item.batch, item.head, item.bh);
#pragma unroll 1
      for (int i = 0; i < item.m_count; ++i) {
        bwd_load_visit<Traits>(params, shared, pipeline_q, pipeline_do, write_q, write_do, q_parts, do_parts,
                               bwd_m_at(item.m_base, i), lse, dpsum);
        if (k > 0 && i == 0) load_kv();
      }
      if (k > 0 && item.m_count == 0) load_kv();
      shared.tile_request.arrive();  // the next item, please
    }
  }
}

}  // namespace flash3::detail

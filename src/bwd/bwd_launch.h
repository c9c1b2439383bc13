// flash3: host-side launch of the backward pass for one (dtype, head dim): preprocess, the main
// kernel (causal or not), postprocess.
#pragma once

#include <algorithm>
#include <cmath>

#include "bwd/bwd_kernel.h"
#include "common/block_order.h"
#include "common/element.h"
#include "dispatch.h"
#include "runtime/launch.h"
#include "runtime/runtime.h"
#include "runtime/varlen_tiles.h"

namespace flash3::detail {

// Sections of the causal block order (bwd_scheduler.h; block_order.h).
inline BwdSections bwd_l2_sections(const BwdProblem& p, int elem_bytes) {
  const int section = bwd_section_pairs(p.seqlen_q, p.head_dim, elem_bytes, current_device_info().l2_bytes);
  return bwd_sections(p.batch * p.nheads, section);
}

// The arguments with packed tensors (variable lengths) as batches of one (as_batch).
inline BwdArgs bwd_batched_views(const BwdArgs& in) {
  BwdArgs a = in;
  for (TensorRef* t : {&a.q, &a.k, &a.v, &a.out, &a.dout, &a.dq, &a.dk, &a.dv}) *t = as_batch(*t);
  a.lse = as_batch(a.lse, 3);
  return a;
}

template <class Traits>
void launch_bwd_main(const BwdProblem& p, const BwdArgs& args_in, const BwdWorkspaceLayout& ws, char* base) {
  using Element = typename Traits::Element;
  using Params = typename Traits::Params;
  const BwdArgs args = bwd_batched_views(args_in);
  const bool gqa = p.nheads != p.nheads_kv;
  Params params{};
  params.tma_q = Traits::make_tma_q(static_cast<const Element*>(args.q.data), qkv_layout(args.q));
  params.tma_do = Traits::make_tma_q(static_cast<const Element*>(args.dout.data), qkv_layout(args.dout));
  params.tma_k = Traits::make_tma_kv(static_cast<const Element*>(args.k.data), qkv_layout(args.k));
  params.tma_v = Traits::make_tma_kv(static_cast<const Element*>(args.v.data), qkv_layout(args.v));
  params.layout_q = qkv_layout(args.q);
  params.layout_k = qkv_layout(args.k);
  params.lse_log2 = reinterpret_cast<const float*>(base + ws.lse_log2);
  params.dpsum = reinterpret_cast<const float*>(base + ws.dpsum);
  params.dq_accum = reinterpret_cast<float*>(base + ws.dq_accum);
  params.dq_sem = ws.dq_store_first ? reinterpret_cast<int*>(base + ws.dq_sem) : nullptr;
  params.dq_groups = ws.dq_groups;
  params.dq_ordered = int(p.deterministic);
  params.dk_accum = gqa ? reinterpret_cast<float*>(base + ws.dk_accum) : nullptr;
  params.dv_accum = gqa ? reinterpret_cast<float*>(base + ws.dv_accum) : nullptr;
  params.dkv_add = ws.dkv_add;
  params.dk = static_cast<Element*>(args.dk.data);
  params.dv = static_cast<Element*>(args.dv.data);
  params.dk_row_stride = args.dk.stride[1];
  params.dk_head_stride = args.dk.stride[2];
  params.dk_batch_stride = args.dk.stride[0];
  params.dv_row_stride = args.dv.stride[1];
  params.dv_head_stride = args.dv.stride[2];
  params.dv_batch_stride = args.dv.stride[0];
  params.batch = p.batch;
  params.seqlens = make_seqlens(p, args);
  params.q_head_rows = ws.q_head_rows;
  params.k_head_rows = ws.k_head_rows;
  params.nheads = p.nheads;
  params.nheads_per_kv = p.nheads / p.nheads_kv;
  params.m_blocks = ws.m_blocks;
  params.n_blocks = ws.n_blocks;
  // Sections of (head, batch) pairs whose Q and dO fit in half the L2 (block_order.h).
  const BwdSections sections = bwd_l2_sections(p, int(sizeof(Element)));
  params.l2_section = sections.size;
  params.l2_big = sections.big;
  params.seqlen_q_pad = ws.seqlen_q_pad;
  params.seqlen_k_pad = ws.seqlen_k_pad;
  params.softmax_scale = p.softmax_scale;
  params.scale_log2 = float(p.softmax_scale * M_LOG2E);
  params.softcap_coef = 0.0f;
  if (p.softcap > 0.0f) {  // as the forward's (fwd_launch.h); dQ, dK still scaled by softmax_scale
    params.softcap_coef = float(double(p.softmax_scale) / p.softcap);
    params.scale_log2 = float(double(p.softcap) * M_LOG2E);
  }
  params.mask = Traits::MaskT::offsets(SeqLen{p.seqlen_q, p.seqlen_k}, Window{p.window_left, p.window_right});
  // The postprocess waits per pair (dq_done) rather than for the whole main kernel.
  params.dq_done = reinterpret_cast<int*>(base + ws.dq_done);
  // MHA: dK, dV leave through TMA stores (bwd_store_dkdv_tma) where kTmaEpilogue; GQA adds FP32
  // per query head. (Variable lengths: the packed tensors' maps, for the key blocks that lie
  // whole in their sequence, bwd_dkdv_tma_fits.)
  if (Traits::kTmaEpilogue && !gqa) {
    params.tma_dk = Traits::make_tma_dkv_store(static_cast<Element*>(args.dk.data), qkv_layout(args.dk));
    params.tma_dv = Traits::make_tma_dkv_store(static_cast<Element*>(args.dv.data), qkv_layout(args.dv));
    params.dkv_tma = 1;
  }
  // GQA, default mode: dK, dV added by TMA (bwd_add_dkdv_tma) where the kernel has the staging
  // room (kTmaAddKV) and the buffers' rows fit the maps' 32-bit coordinates; else by atomic adds
  // (bwd_store_dkdv).
  if (Traits::kTmaAddKV && gqa && ws.dkv_add && ws.dkv_rows < (int64_t(1) << 31)) {
    params.dkv_rows = int32_t(ws.dkv_rows);
    params.tma_dk_add = Traits::make_tma_dkv_add(reinterpret_cast<float*>(base + ws.dk_accum), params.dkv_rows);
    params.tma_dv_add = Traits::make_tma_dkv_add(reinterpret_cast<float*>(base + ws.dv_accum), params.dkv_rows);
    params.dkv_add_tma = 1;
  }
  constexpr int kSmem = Traits::kSmemBytes;
  int64_t blocks = int64_t(ws.n_blocks) * p.nheads * p.batch;
  if (p.varlen) {
    // The key blocks of every sequence, listed on the device (runtime/varlen_tiles.h; causal:
    // each sequence's first key block, which the most query blocks visit, first); the grid is
    // sized by a bound on the list. Causal: in sections of heads whose Q and dO fit half the L2,
    // as in the fixed-length order.
    const long long rows =
        causal_section_rows(Traits::kHeadDim, int(sizeof(Element)), current_device_info().l2_bytes / 2);
    VarlenTilesArgs list = varlen_tiles_args(params.seqlens, p.batch, p.nheads, Traits::kBlockN, true, Traits::kCausal,
                                             ws.varlen_item_capacity, rows);
    varlen_tiles_place(list, base + ws.items);
    build_varlen_tiles(list, args.stream);
    params.varlen_items = list.tiles;
    params.varlen_count = list.count;
    blocks = list.capacity;
  }
  int64_t grid = blocks;  // static: one block per item (BwdScheduler)
  if constexpr (Traits::kPersistent) {
    // One block per SM (two SMs short at causal lengths up to 8k: bwd_persistent_grid), taking
    // the items from the stream's counter (or, where a graph capture found no per-stream memory,
    // in a fixed round-robin order).
    params.tile_counter = stream_memory(args.stream, 0, 0).tile_counter;
    params.num_items = int(blocks);
    // The next item asked for late (bwd_load.h) where the dQ adds wait for other key blocks'
    // (deterministic) and non-causal (measured 0-5% faster; causal early 0-2% faster; B59).
    params.late_request = p.deterministic || !Traits::kCausal;
    grid = bwd_persistent_grid(current_device_info().sms, blocks, Traits::kCausal, p.seqlen_q);
  }
  set_max_dynamic_smem<&bwd_kernel<Traits>>(kSmem);
  launch_pdl(&bwd_kernel<Traits>, dim3(unsigned(grid)), Traits::kNumThreads, kSmem, args.stream,
             "backward kernel launch", params);
}

// The general kernel (variable lengths, sliding windows, softcap: common/mask.h) of Traits' head
// dim and dtype, causal or not; softcap's own one where the config has it (kSoftcapOwnKernel,
// bwd_config.h).
template <class Element, int kHeadDim, bool kCausal>
void launch_bwd_general(const BwdProblem& p, const BwdArgs& args, const BwdWorkspaceLayout& ws, char* base) {
  constexpr bool kSoftcapKernel = BwdTileConfig<kHeadDim>::kSoftcapOwnKernel;
  if (kSoftcapKernel && p.softcap > 0.0f) {
    launch_bwd_main<BwdTraits<Element, kHeadDim, kCausal, true, kSoftcapKernel>>(p, args, ws, base);
  } else {
    launch_bwd_main<BwdTraits<Element, kHeadDim, kCausal, true>>(p, args, ws, base);
  }
}

template <DType kDType, int kHeadDim>
void run_bwd(const BwdProblem& p, const BwdArgs& args_given, const BwdWorkspaceLayout& ws, char* base) {
  using Element = detail::Element<kDType>;
  const BwdArgs args = bwd_batched_views(args_given);
  using Traits = BwdTraits<Element, kHeadDim, false>;
  constexpr int kBlockM = Traits::kBlockM;
  BwdAuxParams aux{};
  aux.out = args.out.data;
  aux.dout = args.dout.data;
  aux.lse = static_cast<const float*>(args.lse.data);
  aux.dq = args.dq.data;
  aux.out_row = args.out.stride[1];
  aux.out_head = args.out.stride[2];
  aux.out_batch = args.out.stride[0];
  aux.dout_row = args.dout.stride[1];
  aux.dout_head = args.dout.stride[2];
  aux.dout_batch = args.dout.stride[0];
  aux.lse_head = args.lse.stride[1];
  aux.lse_batch = args.lse.stride[0];
  aux.dq_row = args.dq.stride[1];
  aux.dq_head = args.dq.stride[2];
  aux.dq_batch = args.dq.stride[0];
  aux.lse_log2 = reinterpret_cast<float*>(base + ws.lse_log2);
  aux.dpsum = reinterpret_cast<float*>(base + ws.dpsum);
  aux.dq_accum = reinterpret_cast<float*>(base + ws.dq_accum);
  aux.dq_sem = ws.dq_store_first ? reinterpret_cast<int*>(base + ws.dq_sem) : nullptr;
  aux.dq_groups = ws.dq_groups;
  aux.batch = p.batch;
  aux.seqlens = make_seqlens(p, args);
  aux.q_head_rows = ws.q_head_rows;
  aux.block_n = Traits::kBlockN;
  aux.dq_writers = Traits::kDQWriters;
  aux.nheads = p.nheads;
  aux.head_dim = p.head_dim;
  aux.m_blocks = ws.m_blocks;
  aux.seqlen_q_pad = ws.seqlen_q_pad;
  aux.softmax_scale = p.softmax_scale;
  // The postprocess converts each pair's dQ once the main kernel's writers are done with it
  // (bwd_postprocess_dq), where there is a main kernel.
  if (p.seqlen_k > 0) {
    aux.dq_done = reinterpret_cast<int*>(base + ws.dq_done);
    aux.dq_done_target = ws.n_blocks * Traits::kDQWriters;
  }
  const int64_t aux_blocks = int64_t(ws.m_blocks) * p.nheads * p.batch;
  // GQA, default mode: the main kernel adds every query head's dK, dV into its kv head's.
  if (ws.dkv_add && p.seqlen_k > 0) {
    check_cuda(cudaMemsetAsync(base + ws.dk_accum, 0, ws.dkv_bytes, args.stream), "backward dK, dV clear");
  }
  bwd_preprocess<Element, kBlockM, kHeadDim><<<dim3(unsigned(aux_blocks)), 256, 0, args.stream>>>(aux);
  check_cuda(cudaGetLastError(), "backward preprocess launch");
  if (p.seqlen_k > 0) {
    // Variable lengths, sliding windows and softcap: the general kernels (common/mask.h).
    const bool general = general_kernels(p);
    if (general && p.causal) {
      launch_bwd_general<Element, kHeadDim, true>(p, args_given, ws, base);
    } else if (general) {
      launch_bwd_general<Element, kHeadDim, false>(p, args_given, ws, base);
    } else if (p.causal) {
      launch_bwd_main<BwdTraits<Element, kHeadDim, true>>(p, args_given, ws, base);
    } else {
      launch_bwd_main<Traits>(p, args_given, ws, base);
    }
  }
  // The dQ tiles are in the register order of the main kernel's dQ GEMM: one postprocess serves
  // the causal and non-causal kernels (with or without windows) while they share it.
  static_assert(BwdTraits<Element, kHeadDim, true>::kDQFragThreads == Traits::kDQFragThreads);
  static_assert(BwdTraits<Element, kHeadDim, true, true>::kDQFragThreads == Traits::kDQFragThreads);
  constexpr int kPostSmem = bwd_postprocess_dq_smem<Traits>();
  if constexpr (kPostSmem > 48 * 1024) {
    set_max_dynamic_smem<&bwd_postprocess_dq<Traits>>(kPostSmem,
                                                       "cudaFuncSetAttribute(backward postprocess shared memory)");
  }
  launch_pdl(bwd_postprocess_dq<Traits>, dim3(unsigned(aux_blocks)), 256, kPostSmem, args.stream,
             "backward postprocess (dq) launch", aux);
  if (p.nheads != p.nheads_kv && p.seqlen_k > 0) {
    BwdDkvParams dkv{};
    dkv.dk_accum = reinterpret_cast<const float*>(base + ws.dk_accum);
    dkv.dv_accum = reinterpret_cast<const float*>(base + ws.dv_accum);
    dkv.dk = args.dk.data;
    dkv.dv = args.dv.data;
    dkv.dk_row = args.dk.stride[1];
    dkv.dk_head = args.dk.stride[2];
    dkv.dk_batch = args.dk.stride[0];
    dkv.dv_row = args.dv.stride[1];
    dkv.dv_head = args.dv.stride[2];
    dkv.dv_batch = args.dv.stride[0];
    dkv.batch = p.batch;
    dkv.seqlens = make_seqlens(p, args);
    dkv.k_head_rows = ws.k_head_rows;
    dkv.block_n = Traits::kBlockN;
    dkv.nheads_kv = p.nheads_kv;
    dkv.group = ws.dkv_heads / p.nheads_kv;  // 1 where the main kernel added them already
    dkv.head_dim = p.head_dim;
    dkv.seqlen_k_pad = ws.seqlen_k_pad;
    dkv.softmax_scale = p.softmax_scale;
    const int64_t rows = dkv.seqlens.cu_k != nullptr ? p.total_k : int64_t(p.batch) * p.seqlen_k;
    const int64_t total = rows * p.nheads_kv * (p.head_dim / 2);
    const int threads = 256;
    bwd_postprocess_dkv<Element><<<dim3(unsigned((total + threads - 1) / threads)), threads, 0, args.stream>>>(dkv);
    check_cuda(cudaGetLastError(), "backward postprocess (dk, dv) launch");
  }
}

}  // namespace flash3::detail

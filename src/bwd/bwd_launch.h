// flash3: host-side launch of the backward pass for one (dtype, head dim): preprocess, the main
// kernel (causal or not), postprocess.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#include "bwd/bwd_kernel.h"
#include "common/block_order.h"
#include "common/element.h"
#include "dispatch.h"
#include "runtime/launch.h"
#include "runtime/runtime.h"

namespace flash3::detail {

// Sections of the causal block order (bwd_kernel.h, bwd_block_coords; causal_order.h).
inline BwdSections bwd_l2_sections(const BwdProblem& p, int elem_bytes) {
  const int section = bwd_section_pairs(p.seqlen_q, p.head_dim, elem_bytes, current_device_info().l2_bytes);
  return bwd_sections(p.batch * p.nheads, section);
}

#ifdef FLASH3_EXP_PERSIST_AB
// A/B experiments: whether the environment turns the switch `name` off (its value starts with 0).
inline bool exp_switch_off(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr && *e == '0';
}
#endif

// Whether the postprocess waits per pair (dq_done) rather than for the whole main kernel.
inline bool bwd_dq_overlap() {
#ifdef FLASH3_EXP_PERSIST_AB
  // FLASH3_EXP_DQ_OVERLAP=0: every postprocess block waits for the whole main kernel (A/B).
  if (exp_switch_off("FLASH3_EXP_DQ_OVERLAP")) return false;
#endif
  return true;
}

template <class Traits>
void launch_bwd_main(const BwdProblem& p, const BwdArgs& args, const BwdWorkspaceLayout& ws, char* base) {
  using Element = typename Traits::Element;
  using Params = typename Traits::Params;
  const bool gqa = p.nheads != p.nheads_kv;
  const BwdSections sections = bwd_l2_sections(p, int(sizeof(Element)));
  Params params{
      Traits::make_tma_q(static_cast<const Element*>(args.q.data), qkv_layout(args.q)),
      Traits::make_tma_q(static_cast<const Element*>(args.dout.data), qkv_layout(args.dout)),
      Traits::make_tma_kv(static_cast<const Element*>(args.k.data), qkv_layout(args.k)),
      Traits::make_tma_kv(static_cast<const Element*>(args.v.data), qkv_layout(args.v)),
      qkv_layout(args.q),
      qkv_layout(args.k),
      reinterpret_cast<const float*>(base + ws.lse_log2),
      reinterpret_cast<const float*>(base + ws.dpsum),
      reinterpret_cast<float*>(base + ws.dq_accum),
      ws.dq_store_first ? reinterpret_cast<int*>(base + ws.dq_sem) : nullptr,
      ws.dq_groups,
      int(p.deterministic),
      gqa ? reinterpret_cast<float*>(base + ws.dk_accum) : nullptr,
      gqa ? reinterpret_cast<float*>(base + ws.dv_accum) : nullptr,
      static_cast<Element*>(args.dk.data),
      static_cast<Element*>(args.dv.data),
      args.dk.stride[1], args.dk.stride[2], args.dk.stride[0],
      args.dv.stride[1], args.dv.stride[2], args.dv.stride[0],
      p.batch, p.seqlen_q, p.seqlen_k, p.nheads, p.nheads / p.nheads_kv,
      ws.m_blocks, ws.n_blocks,
      // Sections of (head, batch) pairs whose Q and dO fit in half the L2 (causal_order.h).
      sections.size, sections.big,
      ws.seqlen_q_pad, ws.seqlen_k_pad,
      p.softmax_scale,
      float(p.softmax_scale * M_LOG2E),
  };
  if (bwd_dq_overlap()) params.dq_done = reinterpret_cast<int*>(base + ws.dq_done);
  // MHA: dK, dV leave through TMA stores (bwd_store_dkdv_tma) where kTmaEpilogue; GQA adds FP32
  // per query head.
  if (Traits::kTmaEpilogue && !gqa) {
    params.tma_dk = Traits::make_tma_dkv_store(static_cast<Element*>(args.dk.data), qkv_layout(args.dk));
    params.tma_dv = Traits::make_tma_dkv_store(static_cast<Element*>(args.dv.data), qkv_layout(args.dv));
    params.dkv_tma = 1;
#ifdef FLASH3_EXP_PERSIST_AB
    // FLASH3_EXP_TMA_EPI=0: the row-by-row epilogue of bwd_store_dkdv instead (A/B experiments).
    if (exp_switch_off("FLASH3_EXP_TMA_EPI")) params.dkv_tma = 0;
#endif
  }
  constexpr int kSmem = Traits::kSmemBytes;
  const int64_t blocks = int64_t(ws.n_blocks) * p.nheads * p.batch;
  if constexpr (Traits::kPersistent) {
#ifdef FLASH3_EXP_PERSIST_AB
    // A/B experiments (docs/perf-log.md B53): FLASH3_EXP_PERSIST=0 runs the one-block-per-item kernel.
    if (exp_switch_off("FLASH3_EXP_PERSIST")) {
      set_max_dynamic_smem<&bwd_kernel<Traits>>(kSmem);
      launch_pdl(&bwd_kernel<Traits>, dim3(unsigned(blocks)), Traits::kNumThreads, kSmem, args.stream,
                 "backward kernel launch", params);
      return;
    }
#endif
    // One block per SM (two SMs short at causal lengths up to 8k: bwd_persistent_grid), taking
    // the blocks of work from the stream's counter (or, where a graph capture found no per-stream
    // memory, in a fixed round-robin order).
    params.tile_counter = stream_memory(args.stream, 0, 0).tile_counter;
    params.num_items = int(blocks);
    // The next item asked for late (bwd_kernel_persistent) where the dQ adds wait for other key
    // blocks' (deterministic) and non-causal (measured 0-5% faster; causal early 0-2% faster; B59).
    params.late_request = p.deterministic || !Traits::kCausal;
#ifdef FLASH3_EXP_PERSIST_AB
    if (const char* e = std::getenv("FLASH3_EXP_LATE"); e != nullptr) params.late_request = *e == '1';
#endif
    const int grid = bwd_persistent_grid(current_device_info().sms, blocks, Traits::kCausal, p.seqlen_q);
    set_max_dynamic_smem<&bwd_kernel_persistent<Traits>>(kSmem);
    launch_pdl(&bwd_kernel_persistent<Traits>, dim3(unsigned(grid)), Traits::kNumThreads, kSmem, args.stream,
               "backward kernel launch", params);
  } else {
    set_max_dynamic_smem<&bwd_kernel<Traits>>(kSmem);
    launch_pdl(&bwd_kernel<Traits>, dim3(unsigned(blocks)), Traits::kNumThreads, kSmem, args.stream,
               "backward kernel launch", params);
  }
}

template <DType kDType, int kHeadDim>
void run_bwd(const BwdProblem& p, const BwdArgs& args, const BwdWorkspaceLayout& ws, char* base) {
  using Element = detail::Element<kDType>;
  using Traits = BwdTraits<Element, kHeadDim, false>;
  constexpr int kBlockM = Traits::kBlockM;
  BwdAuxParams aux{
      args.out.data, args.dout.data, static_cast<const float*>(args.lse.data), args.dq.data,
      args.out.stride[1], args.out.stride[2], args.out.stride[0],
      args.dout.stride[1], args.dout.stride[2], args.dout.stride[0],
      args.lse.stride[1], args.lse.stride[0],
      args.dq.stride[1], args.dq.stride[2], args.dq.stride[0],
      reinterpret_cast<float*>(base + ws.lse_log2),
      reinterpret_cast<float*>(base + ws.dpsum),
      reinterpret_cast<float*>(base + ws.dq_accum),
      ws.dq_store_first ? reinterpret_cast<int*>(base + ws.dq_sem) : nullptr,
      ws.dq_groups,
      p.batch, p.seqlen_q, p.nheads, p.head_dim, ws.m_blocks, ws.seqlen_q_pad, p.softmax_scale,
  };
  // The postprocess converts each pair's dQ once the main kernel's writers are done with it
  // (bwd_postprocess_dq), where there is a main kernel.
  if (p.seqlen_k > 0 && bwd_dq_overlap()) {
    aux.dq_done = reinterpret_cast<int*>(base + ws.dq_done);
    aux.dq_done_target = ws.n_blocks * Traits::kDQWriters;
  }
  const int64_t aux_blocks = int64_t(ws.m_blocks) * p.nheads * p.batch;
  bwd_preprocess<Element, kBlockM, kHeadDim><<<dim3(unsigned(aux_blocks)), 256, 0, args.stream>>>(aux);
  check_cuda(cudaGetLastError(), "backward preprocess launch");
  if (p.seqlen_k > 0) {
    if (p.causal) {
      launch_bwd_main<BwdTraits<Element, kHeadDim, true>>(p, args, ws, base);
    } else {
      launch_bwd_main<Traits>(p, args, ws, base);
    }
  }
  // The dQ tiles are in the register order of the main kernel's dQ GEMM: one postprocess serves
  // the causal and non-causal kernels while they share it.
  static_assert(BwdTraits<Element, kHeadDim, true>::kDQFragThreads == Traits::kDQFragThreads);
  constexpr int kPostSmem = bwd_postprocess_dq_smem<Traits>();
  if constexpr (kPostSmem > 48 * 1024) {
    set_max_dynamic_smem<&bwd_postprocess_dq<Traits>>(kPostSmem,
                                                       "cudaFuncSetAttribute(backward postprocess shared memory)");
  }
  launch_pdl(bwd_postprocess_dq<Traits>, dim3(unsigned(aux_blocks)), 256, kPostSmem, args.stream,
             "backward postprocess (dq) launch", aux);
  if (p.nheads != p.nheads_kv && p.seqlen_k > 0) {
    const int64_t total = int64_t(p.batch) * p.seqlen_k * p.nheads_kv * (p.head_dim / 2);
    const int threads = 256;
    bwd_postprocess_dkv<Element><<<dim3(unsigned((total + threads - 1) / threads)), threads, 0, args.stream>>>(
        reinterpret_cast<const float*>(base + ws.dk_accum), reinterpret_cast<const float*>(base + ws.dv_accum),
        static_cast<Element*>(args.dk.data), static_cast<Element*>(args.dv.data), args.dk.stride[1],
        args.dk.stride[2], args.dk.stride[0], args.dv.stride[1], args.dv.stride[2], args.dv.stride[0],
        p.batch, p.seqlen_k, p.nheads_kv, p.nheads / p.nheads_kv, p.head_dim, ws.seqlen_k_pad,
        p.softmax_scale);
    check_cuda(cudaGetLastError(), "backward postprocess (dk, dv) launch");
  }
}

}  // namespace flash3::detail

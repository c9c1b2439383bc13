// flash3: host-side launch of the forward kernel for one (dtype, head dim): builds the TMA
// descriptors and the parameters, picks the causal or non-causal kernel, and launches.
#pragma once

#include <algorithm>
#include <cmath>
#include <string>
#include <type_traits>

#include "common/block_order.h"
#include "common/element.h"
#include "common/tail_split.h"
#include "dispatch.h"
#include "fwd/fwd_ablation.h"
#include "fwd/fwd_fp8_traits.h"
#include "fwd/fwd_kernel.h"
#include "runtime/launch.h"
#include "runtime/runtime.h"
#include "runtime/varlen_tiles.h"

namespace flash3::detail {

inline long long l2_bytes() { return current_device_info().l2_bytes; }
inline int num_sms() { return current_device_info().sms; }
// The causal order's L2 budget for a section's K and V (block_order.h).
inline long long causal_l2_budget() { return std::min(kCausalL2Budget, l2_bytes()); }

template <class Traits>
typename Traits::Params make_fwd_params(const FwdProblem& p, const FwdArgs& args_in, int* tile_counter) {
  using Element = typename Traits::Element;
  // Packed tensors (variable lengths) as batches of one (as_batch).
  FwdArgs args = args_in;
  for (TensorRef* t : {&args.q, &args.k, &args.v, &args.out}) *t = as_batch(*t);
  args.lse = as_batch(args.lse, 3);
  const auto layout_q = qkv_layout(args.q);
  const auto layout_k = qkv_layout(args.k);
  const int section =
      causal_section(p.seqlen_k, Traits::kHeadDim, int(sizeof(Element)), causal_l2_budget(), p.nheads / p.nheads_kv);
  const int m_blocks = (p.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM;
  typename Traits::Params params{};
  params.load.tma_q = Traits::make_tma_q(static_cast<const Element*>(args.q.data), layout_q);
  params.load.tma_k = Traits::make_tma_kv(static_cast<const Element*>(args.k.data), layout_k);
  params.load.tma_v = Traits::make_tma_kv(static_cast<const Element*>(args.v.data), qkv_layout(args.v));
  params.load.layout_q = layout_q;
  params.load.layout_k = layout_k;
  params.mainloop.softmax_scale = p.softmax_scale;
  params.mainloop.scale_log2 = float(p.softmax_scale * M_LOG2E);
  params.mainloop.softcap_coef = 0.0f;
  if (p.softcap > 0.0f) {  // t = tanh(S * scale / softcap), then the softmax of softcap * t
    params.mainloop.softcap_coef = float(double(p.softmax_scale) / p.softcap);
    params.mainloop.softmax_scale = p.softcap;
    params.mainloop.scale_log2 = float(double(p.softcap) * M_LOG2E);
    // Taken where the config has kSoftcapBounded (fwd_mainloop.h).
    params.mainloop.softcap_bounded =
        std::is_same_v<Element, cutlass::bfloat16_t> && p.softcap <= kSoftcapBoundedMax;
  }
  params.epilogue.layout_o = qkv_layout(args.out);
  using ElementOut = typename Traits::ElementOut;
  params.epilogue.tma_o = Traits::make_tma_o(static_cast<ElementOut*>(args.out.data), params.epilogue.layout_o);
  params.epilogue.out = static_cast<ElementOut*>(args.out.data);
  params.epilogue.out_row_stride = args.out.stride[1];
  params.epilogue.out_head_stride = args.out.stride[2];
  params.epilogue.out_batch_stride = args.out.stride[0];
  params.epilogue.lse = p.write_lse ? static_cast<float*>(args.lse.data) : nullptr;
  params.epilogue.lse_head_stride = p.write_lse ? args.lse.stride[1] : 0;
  params.epilogue.lse_batch_stride = p.write_lse ? args.lse.stride[0] : 0;
  params.scheduler.batch = p.batch;
  params.scheduler.nheads = p.nheads;
  params.scheduler.l2_section = section;
  params.scheduler.l2_tail_first = causal_tail_first(p.nheads * p.batch, section, m_blocks, num_sms());
  params.scheduler.tile_counter = tile_counter;
  params.scheduler.tiles_end = m_blocks * p.nheads * p.batch;  // all tiles
  params.scheduler.split = TailSplit{};
  params.scheduler.varlen_tiles = nullptr;
  params.scheduler.varlen_count = nullptr;
  params.combine.split_counter = nullptr;
  params.combine.split_o = nullptr;
  params.seqlens = make_seqlens(p, args);
  params.mask = Traits::MaskT::offsets(SeqLen{p.seqlen_q, p.seqlen_k}, Window{p.window_left, p.window_right});
  params.nheads_per_kv = p.nheads / p.nheads_kv;
  if constexpr (Traits::kFp8) {
    // (batch, nheads_kv): one scale per (batch, kv head), block stride 0; rank 3: block scales.
    auto scale = [](const TensorRef& t) {
      Fp8Scale s{nullptr, 0, 0, 0};
      if (t.data != nullptr) {
        s.ptr = static_cast<const float*>(t.data);
        s.batch_stride = t.stride[0];
        s.head_stride = t.stride[1];
        s.block_stride = t.rank == 3 ? t.stride[2] : 0;
      }
      return s;
    };
    params.mainloop.q = scale(args.q_scale);
    params.mainloop.k = scale(args.k_scale);
    params.mainloop.v = scale(args.v_scale);
    params.mainloop.q_per_kv_head = args.q_scale.rank == 2;
  }
  return params;
}

// TailTraits (non-causal, default variant; void: none): the kernel of the tail split
// (tail_split.h), launched behind the main one where the split pays.
template <class Traits, class TailTraits = void>
void launch_fwd(const FwdProblem& p, const FwdArgs& args, bool persistent, int* tile_counter) {
  using Params = typename Traits::Params;
  Params params = make_fwd_params<Traits>(p, args, persistent ? tile_counter : nullptr);
  auto kernel = &fwd_kernel<Traits>;
  constexpr int kSmem = Traits::kSmemBytes;
  set_max_dynamic_smem<&fwd_kernel<Traits>>(kSmem);
  // Variable lengths: the tile list, built on the device (varlen_tiles.h) in the stream's
  // scratch (in stream-ordered memory where a graph capture finds too little); the grid is sized
  // by a bound on its length.
  // NOTES: with cudaMallocAsync on every call, the pool (release threshold 0) gave its memory
  // back at each synchronization and mapped it again on the next call, which then started late:
  // varlen 1.25-1.54x the fixed-length call on the same tokens (bench_varlen.py, equal).
  char* varlen_memory = nullptr;
  bool varlen_owned = false;
  if (p.varlen) {
    const long long capacity = varlen_tile_capacity(p.total_q, p.batch, p.nheads, Traits::kBlockM);
    // Causal: in sections of kv-head groups whose K and V fit the L2 budget, as in the fixed-length
    // order (make_fwd_params).
    const long long rows =
        causal_section_rows(Traits::kHeadDim, int(sizeof(typename Traits::Element)), causal_l2_budget());
    VarlenTilesArgs list = varlen_tiles_args(params.seqlens, p.batch, p.nheads, Traits::kBlockM, false, Traits::kCausal,
                                             capacity, rows, p.nheads / p.nheads_kv);
    const size_t bytes = varlen_tiles_bytes(capacity, p.batch);
    char* scratch = stream_memory(args.stream, kScratchCounterBytes + bytes, 0).scratch;
    if (scratch != nullptr) {
      varlen_memory = scratch + kScratchCounterBytes;
    } else {
      check_cuda(cudaMallocAsync(reinterpret_cast<void**>(&varlen_memory), bytes, args.stream),
                 "cudaMallocAsync (variable-length tile list)");
      varlen_owned = true;
    }
    varlen_tiles_place(list, varlen_memory);
    build_varlen_tiles(list, args.stream);
    params.scheduler.varlen_tiles = list.tiles;
    params.scheduler.varlen_count = list.count;
    params.scheduler.tiles_end = list.capacity;
  }
  const int num_tiles = params.scheduler.tiles_end;
  TailSplit split;  // none: every tile whole in the main kernel
  split.full_tiles = num_tiles;
  int* split_counter = nullptr;
  float* split_o = nullptr;
  if constexpr (!std::is_void_v<TailTraits>) {
    static_assert(!Traits::kCausal && TailTraits::kTailPieces && TailTraits::kBlockM == Traits::kBlockM &&
                  TailTraits::kBlockN == Traits::kBlockN && std::is_same_v<typename TailTraits::Params, Params>);
    if (persistent) {
      const int n_blocks = (p.seqlen_k + Traits::kBlockN - 1) / Traits::kBlockN;
      const TailSplit s = make_tail_split(num_tiles, n_blocks, num_sms());
      if (s.tail_tiles > 0) {
        // Scratch: one counter per tail tile (at most one per SM) in the zeroed head, then 2 slots
        // per tail block; without it (a stream capture that would need it to grow), whole tiles.
        const size_t counter_bytes = sizeof(int) * size_t(num_sms());
        const size_t slot_bytes = sizeof(float) * size_t(TailTraits::kSplitSlotFloats) * 2 * size_t(s.grid);
        char* scratch = stream_memory(args.stream, kScratchCounterBytes + slot_bytes, counter_bytes).scratch;
        if (scratch != nullptr) {
          split = s;
          split_counter = reinterpret_cast<int*>(scratch);
          split_o = reinterpret_cast<float*>(scratch + kScratchCounterBytes);
        }
      }
    }
  }
  // Persistent: one block per SM (the shared memory allows no more), each looping over tiles.
  params.scheduler.tiles_end = split.full_tiles;
  if (split.full_tiles > 0) {
    const int blocks = persistent ? std::min(split.full_tiles, num_sms()) : split.full_tiles;
    kernel<<<dim3(blocks), Traits::kNumThreads, kSmem, args.stream>>>(params);
    check_cuda(cudaGetLastError(), "forward kernel launch");
  }
  if (varlen_owned) check_cuda(cudaFreeAsync(varlen_memory, args.stream), "cudaFreeAsync (variable-length tile list)");
  if constexpr (!std::is_void_v<TailTraits>) {
    if (split.tail_tiles > 0) {
      Params tail = params;  // the same TMA descriptors
      tail.scheduler.tile_counter = nullptr;
      tail.scheduler.tiles_end = num_tiles;
      tail.scheduler.split = split;
      tail.combine.split_counter = split_counter;
      tail.combine.split_o = split_o;
      auto tail_kernel = &fwd_kernel<TailTraits>;
      set_max_dynamic_smem<&fwd_kernel<TailTraits>>(TailTraits::kSmemBytes);
      // NOTES: right behind the main kernel it is launched with programmatic dependent launch
      // (it reads nothing the main kernel writes, and the main kernel lets it start at once), so
      // its blocks take the SMs as the main kernel's blocks leave them. Without a main kernel
      // the kernel before it in the stream may have written q, k or v: a plain launch then.
      if (split.full_tiles > 0) {
        launch_pdl(tail_kernel, dim3(split.grid), TailTraits::kNumThreads, TailTraits::kSmemBytes, args.stream,
                   "forward tail kernel launch", tail);
      } else {
        tail_kernel<<<dim3(split.grid), TailTraits::kNumThreads, TailTraits::kSmemBytes, args.stream>>>(tail);
        check_cuda(cudaGetLastError(), "forward tail kernel launch");
      }
    }
  }
}

// Whether the forward runs persistent, and the tile counter of the causal and general kernels
// (null: the static order).
// NOTES: non-causal tiles are all the same length: persistent (one block per SM) with the
// static round-robin order. Causal tiles, and the general kernels' (sequences of different
// lengths, windows), differ in length: persistent with the dynamic
// scheduler (each block draws its next tile from a counter, in LPT order), which balances them
// like the hardware's block dispatcher while overlapping one tile's end with the next one's
// start (docs/perf-log.md, step 10). Without a counter (first call on a stream inside a CUDA
// graph capture) the earlier rule, measured in step 6: static persistent while seqlen_k <=
// 1024, one block per tile beyond. FwdAblation::kPersistent forces the static persistent loop.
inline bool fwd_schedule(const FwdProblem& p, const FwdArgs& args, FwdAblation ablation, int*& counter) {
  counter = nullptr;
  if ((p.causal || general_kernels(p)) && ablation == FwdAblation::kDefault) {
    counter = stream_memory(args.stream, 0, 0).tile_counter;
  }
  return ablation == FwdAblation::kPersistent || counter != nullptr ||
         (ablation != FwdAblation::kNoPersistent && (!p.causal || p.seqlen_k <= 1024));
}

// The FP8 forward: no technique ablations, no tail split (FwdFp8Traits).
template <int kHeadDim>
void run_fwd_fp8(const FwdProblem& p, const FwdArgs& args, FwdAblation ablation) {
  if (is_technique_ablation(ablation)) throw Error("flash3::fwd: the ablations are built for bfloat16 only");
  int* counter = nullptr;
  const bool persistent = fwd_schedule(p, args, ablation, counter);
  if (p.causal) return launch_fwd<FwdFp8Traits<kHeadDim, true>>(p, args, persistent, counter);
  launch_fwd<FwdFp8Traits<kHeadDim, false>>(p, args, persistent, counter);
}

template <DType kDType, int kHeadDim>
void run_fwd(const FwdProblem& p, const FwdArgs& args, FwdAblation ablation) {
  if constexpr (kDType == DType::kFloat8E4M3) {
    return run_fwd_fp8<kHeadDim>(p, args, ablation);
  } else {
    using Element = detail::Element<kDType>;
    int* counter = nullptr;
    const bool persistent = fwd_schedule(p, args, ablation, counter);
    if (is_technique_ablation(ablation)) {
      if (kDType != DType::kBFloat16 || kHeadDim != 128 || p.causal || general_kernels(p)) {
        throw Error("flash3::fwd: ablation " + std::to_string(int(ablation)) +
                    " is built for bfloat16, head_dim 128, non-causal without a window or softcap only");
      }
      return run_fwd_technique_ablation(p, args, ablation, persistent);
    }
    // Variable lengths, sliding windows and softcap: the general kernels (common/mask.h), without
    // the tail split.
    if (general_kernels(p)) {
      if (p.causal) return launch_fwd<FwdTraits<Element, kHeadDim, true, FwdGeneral>>(p, args, persistent, counter);
      return launch_fwd<FwdTraits<Element, kHeadDim, false, FwdGeneral>>(p, args, persistent, counter);
    }
    if (p.causal) {
      if constexpr (kHeadDim == 64) {
        if (p.seqlen_q <= kFwdCausal64ShortMax) {
          return launch_fwd<FwdTraits<Element, kHeadDim, true, FwdBlockM128>>(p, args, persistent, counter);
        }
      }
      if constexpr (kHeadDim == 128) {
        if (p.seqlen_k - p.seqlen_q / 2 >= kFwdCausal128LongMin) {
          return launch_fwd<FwdTraits<Element, kHeadDim, true, FwdBlockN176>>(p, args, persistent, counter);
        }
      }
      launch_fwd<FwdTraits<Element, kHeadDim, true>>(p, args, persistent, counter);
    } else {
      if constexpr (kHeadDim != 64) {  // FwdTailPieces (fwd_config.h)
        if (ablation == FwdAblation::kDefault) {
          return launch_fwd<FwdTraits<Element, kHeadDim, false>,
                            FwdTraits<Element, kHeadDim, false, FwdTailPieces>>(p, args, persistent, counter);
        }
      }
      launch_fwd<FwdTraits<Element, kHeadDim, false>>(p, args, persistent, counter);
    }
  }
}

}  // namespace flash3::detail

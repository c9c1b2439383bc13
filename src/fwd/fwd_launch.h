// flash3: host-side launch of the forward kernel for one (dtype, head dim): builds the TMA
// descriptors and the parameters, picks the causal or non-causal kernel, and launches.
#pragma once

#include <cmath>

#include "fwd/fwd_dispatch.h"
#include "fwd/fwd_kernel.h"

namespace flash3::detail {

template <class Traits>
void launch_fwd(const FwdProblem& p, const FwdArgs& args) {
  using Element = typename Traits::Element;
  using Params = typename Traits::Params;
  auto qkv_layout = [](const TensorRef& t) {
    // (seqlen, head_dim, heads, batch) view of a (batch, seqlen, heads, head_dim) tensor.
    return make_layout(make_shape(int32_t(t.shape[1]), int32_t(t.shape[3]), int32_t(t.shape[2]),
                                  int32_t(t.shape[0])),
                       make_stride(t.stride[1], _1{}, t.stride[2], t.stride[0]));
  };
  const auto layout_q = qkv_layout(args.q);
  const auto layout_k = qkv_layout(args.k);
  const auto layout_v = qkv_layout(args.v);
  Params params{
      Traits::make_tma_q(static_cast<const Element*>(args.q.data), layout_q),
      Traits::make_tma_kv(static_cast<const Element*>(args.k.data), layout_k),
      Traits::make_tma_kv(static_cast<const Element*>(args.v.data), layout_v),
      Traits::make_tma_o(static_cast<Element*>(args.out.data), qkv_layout(args.out)),
      layout_q,
      layout_k,
      p.write_lse ? static_cast<float*>(args.lse.data) : nullptr,
      p.write_lse ? args.lse.stride[1] : 0,
      p.write_lse ? args.lse.stride[0] : 0,
      p.seqlen_q,
      p.seqlen_k,
      p.nheads,
      p.nheads / p.nheads_kv,
      p.softmax_scale,
      float(p.softmax_scale * M_LOG2E),
  };
  auto kernel = &fwd_kernel<Traits>;
  constexpr int kSmem = Traits::kSmemBytes;
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem),
             "cudaFuncSetAttribute(max dynamic shared memory)");
  const dim3 grid(cute::ceil_div(p.seqlen_q, Traits::kBlockM), p.nheads, p.batch);
  kernel<<<grid, Traits::kNumThreads, kSmem, args.stream>>>(params);
  check_cuda(cudaGetLastError(), "forward kernel launch");
}

template <class Element, int kHeadDim>
void run_fwd(const FwdProblem& p, const FwdArgs& args) {
  if (p.causal) {
    launch_fwd<FwdTraits<Element, kHeadDim, true>>(p, args);
  } else {
    launch_fwd<FwdTraits<Element, kHeadDim, false>>(p, args);
  }
}

}  // namespace flash3::detail

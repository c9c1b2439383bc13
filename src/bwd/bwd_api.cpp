// flash3: the public backward entry point: validate, size and (if needed) allocate the
// workspace, then dispatch over the kernel table.
#include <string>

#include "bwd/bwd_config.h"
#include "dispatch.h"
#include "flash3/flash3.h"
#include "runtime/runtime.h"
#include "varlen_check.h"

namespace flash3 {

namespace {
detail::BwdWorkspaceLayout workspace_layout(const BwdProblem& p) {
  return detail::BwdWorkspaceLayout(p.batch, p.nheads, p.seqlen_q, p.seqlen_k, p.head_dim, p.causal, p.deterministic,
                                    p.nheads_kv, p.varlen, p.packed_q, p.packed_k, p.total_q, p.total_k);
}
}  // namespace

size_t bwd_workspace_size(const BwdProblem& p) {
  if (p.batch == 0 || p.seqlen_q == 0 || p.nheads == 0) return 0;
  return workspace_layout(p).bytes;
}

void bwd(const BwdArgs& args) {
  const BwdProblem p = validate_bwd(args);
  if (p.batch == 0 || p.nheads == 0) return;
  if (p.seqlen_q == 0) {  // no query: dk = dv = 0
    if (p.seqlen_k > 0) {
      detail::require_hopper("flash3::bwd");
      detail::zero_16bit(args.dk, args.stream);
      detail::zero_16bit(args.dv, args.stream);
    }
    return;
  }
  const detail::BwdWorkspaceLayout ws = workspace_layout(p);
  if (args.workspace != nullptr && args.workspace_bytes < ws.bytes) {
    throw Error("flash3::bwd: workspace_bytes is " + std::to_string(args.workspace_bytes) +
                "; this problem needs at least " + std::to_string(ws.bytes) +
                " bytes (bwd_workspace_size)");
  }
  detail::require_hopper("flash3::bwd");
  detail::check_seqlens_on_device(args, p);

  if (!detail::kernel_built</*kBackward=*/true>(p.dtype, p.head_dim)) {
    detail::throw_no_kernel("flash3::bwd", p.dtype, p.head_dim);
  }

  char* base = static_cast<char*>(args.workspace);
  const bool own = base == nullptr;
  if (own) {
    void* ptr = nullptr;
    detail::check_cuda(cudaMallocAsync(&ptr, ws.bytes, args.stream), "cudaMallocAsync(backward workspace)");
    base = static_cast<char*>(ptr);
  }
  try {
    detail::dispatch</*kBackward=*/true>(p.dtype, p.head_dim, [&](auto dtype, auto head_dim) {
      detail::run_bwd<decltype(dtype)::value, decltype(head_dim)::value>(p, args, ws, base);
    });
  } catch (...) {
    if (own) cudaFreeAsync(base, args.stream);
    throw;
  }
  if (own) detail::check_cuda(cudaFreeAsync(base, args.stream), "cudaFreeAsync(backward workspace)");
  // Rows past seqused take no part: their gradients are 0.
  const int* cu_q = static_cast<const int*>(args.cu_seqlens_q.data);
  const int* cu_k = static_cast<const int*>(args.cu_seqlens_k.data);
  detail::zero_unused_rows(args.dq, cu_q, static_cast<const int*>(args.seqused_q.data), p.batch, args.stream);
  for (const TensorRef* t : {&args.dk, &args.dv}) {
    detail::zero_unused_rows(*t, cu_k, static_cast<const int*>(args.seqused_k.data), p.batch, args.stream);
  }
}

}  // namespace flash3

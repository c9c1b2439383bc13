// flash3: the public forward entry point: validate, then dispatch over the kernel table.
#include <string>

#include "dispatch.h"
#include "flash3/flash3.h"
#include "fwd/fwd_ablation.h"
#include "runtime/runtime.h"
#include "varlen_check.h"

namespace flash3 {

namespace detail {
void fwd_ablation(const FwdArgs& args, FwdAblation ablation) {
  const FwdProblem p = validate_fwd(args);
  if (p.batch == 0 || p.seqlen_q == 0 || p.nheads == 0) return;
  require_hopper("flash3::fwd");
  check_seqlens_on_device(args, p);
  if (p.seqlen_k == 0 || (p.varlen && p.total_k == 0)) return fill_no_keys(p, args);
  const bool found = dispatch(p.dtype, p.head_dim, [&](auto dtype, auto head_dim) {
    run_fwd<decltype(dtype)::value, decltype(head_dim)::value>(p, args, ablation);
  });
  if (!found) throw_no_kernel("flash3::fwd", p.dtype, p.head_dim);
}
}  // namespace detail

void fwd(const FwdArgs& args) { detail::fwd_ablation(args, detail::FwdAblation::kDefault); }

}  // namespace flash3

// flash3: forward kernels for fp16, head dim 128 (causal and non-causal).
#include "fwd/fwd_launch.h"

namespace flash3::detail {
void run_fwd_fp16_hdim128(const FwdProblem& problem, const FwdArgs& args) {
  run_fwd<cutlass::half_t, 128>(problem, args);
}
}  // namespace flash3::detail

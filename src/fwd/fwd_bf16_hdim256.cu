// flash3: forward kernels for bf16, head dim 256 (causal and non-causal).
#include "fwd/fwd_launch.h"

namespace flash3::detail {
void run_fwd_bf16_hdim256(const FwdProblem& problem, const FwdArgs& args) {
  run_fwd<cutlass::bfloat16_t, 256>(problem, args);
}
}  // namespace flash3::detail

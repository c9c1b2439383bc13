// flash3: forward kernels for bf16, head dim 64 (causal and non-causal).
#include "fwd/fwd_launch.h"

namespace flash3::detail {
void run_fwd_bf16_hdim64(const FwdProblem& problem, const FwdArgs& args) {
  run_fwd<cutlass::bfloat16_t, 64>(problem, args);
}
}  // namespace flash3::detail

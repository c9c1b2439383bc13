// flash3: forward kernels for fp16, head dim 256 (causal and non-causal).
#include "fwd/fwd_launch.h"

namespace flash3::detail {
void run_fwd_fp16_hdim256(const FwdProblem& problem, const FwdArgs& args) {
  run_fwd<cutlass::half_t, 256>(problem, args);
}
}  // namespace flash3::detail

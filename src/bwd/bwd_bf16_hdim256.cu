// flash3: backward kernels for bf16, head dim 256 (causal and non-causal).
#include "bwd/bwd_launch.h"

namespace flash3::detail {
void run_bwd_bf16_hdim256(const BwdProblem& problem, const BwdArgs& args, const BwdWorkspaceLayout& ws,
                         char* base) {
  run_bwd<cutlass::bfloat16_t, 256>(problem, args, ws, base);
}
}  // namespace flash3::detail

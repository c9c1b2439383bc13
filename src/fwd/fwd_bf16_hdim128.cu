// flash3: forward kernels for bf16, head dim 128 (causal and non-causal), and the
// ablation variants of the paper's Table 2 (non-causal).
#include "fwd/fwd_launch.h"

namespace flash3::detail {
void run_fwd_bf16_hdim128(const FwdProblem& problem, const FwdArgs& args) {
  run_fwd<cutlass::bfloat16_t, 128, /*kAblations=*/true>(problem, args);
}
}  // namespace flash3::detail

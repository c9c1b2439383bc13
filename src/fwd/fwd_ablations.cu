// flash3: the forward's technique ablations (fwd_ablation.h): the paper's Table 2 (no pingpong,
// no intra-warpgroup overlap) and Appendix B.3's 3-stage pipeline with its 2-stage comparison,
// for bfloat16, head dim 128, non-causal. Their kernels are compiled only with the CMake option
// FLASH3_BUILD_ABLATIONS (FLASH3_ABLATIONS), which the benchmark's build uses; otherwise the
// entry point says they are not built.
#include <string>

#include "fwd/fwd_ablation.h"

#ifdef FLASH3_ABLATIONS
#include "fwd/fwd_launch.h"
#endif

namespace flash3::detail {

bool fwd_ablations_built() {
#ifdef FLASH3_ABLATIONS
  return true;
#else
  return false;
#endif
}

void run_fwd_technique_ablation(const FwdProblem& p, const FwdArgs& args, FwdAblation ablation, bool persistent) {
#ifdef FLASH3_ABLATIONS
  using Element = cutlass::bfloat16_t;
  int* const counter = nullptr;  // non-causal: the static order
  switch (ablation) {
    case FwdAblation::kNoPingpong:
      return launch_fwd<FwdTraits<Element, 128, false, FwdNoPingpong>>(p, args, persistent, counter);
    case FwdAblation::kNoOverlap:
      return launch_fwd<FwdTraits<Element, 128, false, FwdNoOverlap>>(p, args, persistent, counter);
    case FwdAblation::kThreeStage:
      return launch_fwd<FwdTraits<Element, 128, false, FwdThreeStage>>(p, args, persistent, counter);
    case FwdAblation::kTwoStageBlockN96:
      return launch_fwd<FwdTraits<Element, 128, false, FwdTwoStageBlockN96>>(p, args, persistent, counter);
    default:
      break;
  }
#endif
  throw Error("flash3::fwd: ablation " + std::to_string(int(ablation)) +
              " is not built (configure with -DFLASH3_BUILD_ABLATIONS=ON)");
}

}  // namespace flash3::detail

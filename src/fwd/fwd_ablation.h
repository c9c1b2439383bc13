// flash3: the forward with one technique switched off or changed, for the benchmark's ablation
// (the paper's Table 2) and the tests of the tile schedules. Not part of the public API: the
// library exports fwd_ablation for flash3's own tests and benchmark. The schedule switches
// (kNoPersistent, kPersistent) are run-time choices of every kernel; the technique switches
// (kNoPingpong, kNoOverlap, kThreeStage, kTwoStageBlockN96) are kernels of their own, built for
// bfloat16, head dim 128, non-causal only, and only with the CMake option
// FLASH3_BUILD_ABLATIONS (fwd_ablations_built() says whether they are in this build).
#pragma once

#include "flash3/flash3.h"

namespace flash3::detail {

enum class FwdAblation : int {
  kDefault = 0,
  kNoPersistent = 1,  // one block per tile instead of one persistent block per SM
  kNoPingpong = 2,    // consumer warpgroups issue their GEMMs without taking turns
  kNoOverlap = 3,     // no intra-warpgroup GEMM-softmax pipelining (Algorithm 1 as written)
  kPersistent = 4,    // persistent with the static tile order also for causal masks
  kThreeStage = 5,    // the 3-stage GEMM-softmax pipeline of the paper's Appendix B.3 (kBlockN 96)
  kTwoStageBlockN96 = 6,  // the default pipeline at the 3-stage variant's tile (comparison)
};

// Whether `a` needs a kernel of its own (built only with FLASH3_BUILD_ABLATIONS).
inline bool is_technique_ablation(FwdAblation a) {
  return a == FwdAblation::kNoPingpong || a == FwdAblation::kNoOverlap || a == FwdAblation::kThreeStage ||
         a == FwdAblation::kTwoStageBlockN96;
}

// flash3::fwd with `ablation`; throws flash3::Error where that ablation is not built.
void fwd_ablation(const FwdArgs& args, FwdAblation ablation);
bool fwd_ablations_built();

// The technique ablations' launcher (fwd_ablations.cu; without FLASH3_BUILD_ABLATIONS, a stub
// that throws).
void run_fwd_technique_ablation(const FwdProblem& problem, const FwdArgs& args, FwdAblation ablation,
                                bool persistent);

}  // namespace flash3::detail

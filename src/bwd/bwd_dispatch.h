// flash3: entry points of the backward kernels, one per (dtype, head dim); each handles causal
// and non-causal. Plain C++ so that host code compiled by the C++ compiler can call them.
#pragma once

#include "bwd/bwd_config.h"
#include "flash3/flash3.h"

namespace flash3::detail {

// `base` is the workspace, laid out as `ws` says.
#define FLASH3_DECLARE_BWD(NAME) \
  void NAME(const BwdProblem& problem, const BwdArgs& args, const BwdWorkspaceLayout& ws, char* base);
FLASH3_DECLARE_BWD(run_bwd_bf16_hdim64)
FLASH3_DECLARE_BWD(run_bwd_bf16_hdim128)
FLASH3_DECLARE_BWD(run_bwd_bf16_hdim256)
FLASH3_DECLARE_BWD(run_bwd_fp16_hdim64)
FLASH3_DECLARE_BWD(run_bwd_fp16_hdim128)
FLASH3_DECLARE_BWD(run_bwd_fp16_hdim256)
#undef FLASH3_DECLARE_BWD

}  // namespace flash3::detail

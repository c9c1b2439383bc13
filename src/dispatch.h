// flash3: dispatch over the kernel table's built rows (kernel_rows.inc, which CMake writes from
// kernel_table.inc: every row, or those FLASH3_KERNELS names). Plain C++: the entry points,
// compiled by the C++ compiler, call the kernels' launchers through these declarations; each is
// defined once per row, in the row's generated translation unit.
#pragma once

#include <string>
#include <type_traits>

#include "flash3/flash3.h"

namespace flash3::detail {

enum class FwdAblation : int;
struct BwdWorkspaceLayout;

// The forward (fwd/fwd_launch.h) and backward (bwd/bwd_launch.h) launchers of one row.
template <DType kDType, int kHeadDim>
void run_fwd(const FwdProblem& problem, const FwdArgs& args, FwdAblation ablation);
template <DType kDType, int kHeadDim>
void run_bwd(const BwdProblem& problem, const BwdArgs& args, const BwdWorkspaceLayout& ws, char* base);

// Whether a problem runs the general kernels: variable lengths, sliding windows, softcap
// (common/mask.h).
template <class Problem>
bool general_kernels(const Problem& p) {
  return p.varlen || has_window(p) || p.softcap > 0.0f;
}

// Calls visit(std::integral_constant<DType, kDType>, std::integral_constant<int, kHeadDim>) for
// the row of (dtype, head_dim) and returns true, or returns false when the table has no such row.
// kBackward: only the rows with a backward (FLASH3_KERNEL, not FLASH3_FWD_KERNEL).
template <bool kBackward = false, class Visit>
bool dispatch(DType dtype, int head_dim, Visit&& visit) {
#define FLASH3_KERNEL(DT, HD)                                                               \
  if (dtype == DType::DT && head_dim == HD) {                                               \
    visit(std::integral_constant<DType, DType::DT>{}, std::integral_constant<int, HD>{});   \
    return true;                                                                            \
  }
#define FLASH3_FWD_KERNEL(DT, HD)                                                           \
  if constexpr (!kBackward) {                                                               \
    FLASH3_KERNEL(DT, HD)                                                                   \
  }
#include "kernel_rows.inc"
#undef FLASH3_FWD_KERNEL
#undef FLASH3_KERNEL
  return false;
}

// Whether the table has a row for (dtype, head_dim) (kBackward: with a backward).
template <bool kBackward = false>
inline bool kernel_built(DType dtype, int head_dim) {
  return dispatch<kBackward>(dtype, head_dim, [](auto, auto) {});
}

// The built rows as "bfloat16 x 64, ..."; the head dims built for one dtype as "64, 128, 256"
// (dtype.cpp).
std::string built_kernels();
std::string built_head_dims(DType dtype);

// What an entry point throws when the library has no kernel for (dtype, head_dim): validation
// admits the built rows only, so this is reached where a build left rows out (FLASH3_KERNELS).
[[noreturn]] void throw_no_kernel(const char* entry, DType dtype, int head_dim);

}  // namespace flash3::detail

// flash3: the CUTLASS element type of each flash3::DType the kernels are built for.
#pragma once

#include <cutlass/numeric_types.h>

#include "flash3/flash3.h"

namespace flash3::detail {

template <DType kDType>
struct ElementOf;
template <>
struct ElementOf<DType::kBFloat16> {
  using type = cutlass::bfloat16_t;
};
template <>
struct ElementOf<DType::kFloat16> {
  using type = cutlass::half_t;
};
template <>
struct ElementOf<DType::kFloat8E4M3> {
  using type = cutlass::float_e4m3_t;
};
template <DType kDType>
using Element = typename ElementOf<kDType>::type;

}  // namespace flash3::detail

// flash3: quantize_fp8's validated problem and its validation (plain C++, for the launcher and
// the CPU tests).
#pragma once

#include <cstdint>

#include "flash3/flash3.h"

namespace flash3 {

// The problem of one quantize_fp8 call after validation.
struct QuantizeProblem {
  DType dtype = DType::kBFloat16;  // of in: float16 or bfloat16
  int batch = 0, seqlen = 0, nheads = 0, head_dim = 0;
  int block_rows = 0;
  int num_blocks = 0;   // ceil(seqlen / block_rows): scale.shape[2]
  int64_t units = 0;    // batch x nheads x num_blocks: the (batch, head, row block) work items
  bool hadamard = false;
  uint64_t seed = 0;
  // in's data and strides allow 16-byte loads of 8 elements, out's 8-byte stores (every row
  // start 16-byte aligned in in, 8-byte aligned in out); else the kernel uses scalar accesses.
  bool vectorized = false;
  bool empty() const { return batch == 0 || seqlen == 0 || nheads == 0; }
};

// Checks every precondition of quantize_fp8 and returns the problem. Throws flash3::Error whose
// message starts "flash3::quantize_fp8: " and names the argument, the value it got and what is
// allowed. Pointers are checked (non-null, device memory, element-aligned) only when there is
// something to compute; `inspect` says where a pointer lives (tests inject their own).
QuantizeProblem validate_quantize(const QuantizeArgs& args, PointerInspector inspect = &cuda_pointer_kind);

}  // namespace flash3

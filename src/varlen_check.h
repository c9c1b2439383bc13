// flash3: the checks of the values of cu_seqlens and seqused (variable-length batches), which
// validate_fwd / validate_bwd cannot see: they live in device memory. Plain C++ (src/validate.cpp).
#pragma once

#include <cstdint>

#include "flash3/flash3.h"

namespace flash3::detail {

// One side's (the queries' or the keys') lengths, as host arrays.
struct SeqlenSide {
  const int* cu_seqlens = nullptr;  // batch + 1 entries; nullptr: the side is not packed
  const int* seqused = nullptr;     // batch entries; nullptr: none
  int64_t total = 0;                // with cu_seqlens: the packed length (dim 0 of q or k)
  int64_t max_seqlen = 0;           // max_seqlen_q / max_seqlen_k with cu_seqlens, else dim 1 of q / k
};

// Checks the values against FwdArgs' rules: cu_seqlens starts at 0, never decreases, ends at
// `total`, and no sequence is longer than max_seqlen; 0 <= seqused[b] <= the length of sequence
// b (max_seqlen, the dim 1, without cu_seqlens). Throws flash3::Error whose message starts with
// `op` ("flash3::fwd: ") and names the entry and its value.
void check_seqlen_values(const char* op, int batch, const SeqlenSide& q, const SeqlenSide& k);

// For fwd() and bwd(), after validate_fwd / validate_bwd: copies the cu_seqlens and seqused that
// are given to the host (cudaMemcpyAsync on args.stream, then cudaStreamSynchronize) and checks
// them with check_seqlen_values. Does nothing unless p.varlen and args.check_seqlens, when there
// is nothing to compute (batch 0; forward: seqlen_q 0), or while args.stream is being captured
// into a CUDA graph. Throws flash3::Error on a bad value, flash3::CudaError on a failed copy.
void check_seqlens_on_device(const FwdArgs& args, const FwdProblem& p);
void check_seqlens_on_device(const BwdArgs& args, const BwdProblem& p);

}  // namespace flash3::detail

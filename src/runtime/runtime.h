// flash3: host runtime helpers shared by the forward and backward entry points (plain C++):
// CUDA error checks, cached device attributes, per-stream device memory, the Hopper check, and
// the small fill kernels of the degenerate shapes.
#pragma once

#include <cstddef>

#include "flash3/flash3.h"

namespace flash3::detail {

// A packed tensor of a variable-length batch ((total, heads, head_dim), batched rank 4; or the
// lse (heads, total), batched rank 3) as a batch of one; a tensor of the batched rank as it is. The launchers index packed sequences by their first row
// (SeqLen::q_start, k_start) in batch entry 0.
inline TensorRef as_batch(const TensorRef& t, int batched_rank = 4) {
  TensorRef r = t;
  if (t.rank == batched_rank - 1) {
    r.rank = batched_rank;
    for (int d = t.rank; d > 0; --d) {
      r.shape[d] = t.shape[d - 1];
      r.stride[d] = t.stride[d - 1];
    }
    // (A batch of one: the stride is never stepped; TMA wants it nonzero, 16-byte multiple.)
    r.shape[0] = 1;
    r.stride[0] = t.shape[0] * t.stride[0];
  }
  return r;
}

// seqlen_k == 0: out = 0 and lse = +inf, without the main kernel.
void fill_no_keys(const FwdProblem& problem, const FwdArgs& args);

// Sets a rank-4 (or packed rank-3) tensor of 2-byte elements (last dim contiguous) to +0.
void zero_16bit(const TensorRef& t, cudaStream_t stream);
// The rows of each sequence past seqused (used: batch ints on the device) of a 16-bit tensor,
// (batch, seqlen, heads, d) or packed (total, heads, d) with cu_seqlens cu, set to 0 (the
// backward's gradients there).
void zero_unused_rows(const TensorRef& t, const int* cu, const int* used, int batch, cudaStream_t stream);

// Throws flash3::CudaError naming `what` when `err` is not cudaSuccess.
void check_cuda(cudaError_t err, const char* what);

// Attributes of the current device, queried once per device and cached.
struct DeviceInfo {
  int major = 0, minor = 0, sms = 0;
  long long l2_bytes = 0;
};
const DeviceInfo& current_device_info();

// Device memory for kernels launched on `stream` of the current device, one buffer per
// (device, stream): `tile_counter`, two ints for the dynamic tile scheduler, and `scratch`, at
// least `scratch_bytes` whose first `scratch_zeroed` bytes are zero; both zero between launches
// (the kernels that use them leave them zero). While the stream is being captured into a CUDA
// graph nothing can be allocated: `scratch` is nullptr if the buffer would have to grow, and both
// are nullptr if the stream has none yet.
// The scratch's zeroed head: the kernels' counters (each left zero when its kernel ends) live in
// its first kScratchCounterBytes, their data (tile lists, partial outputs) past them, so that no
// data ever lands where another kernel expects a zero counter.
constexpr size_t kScratchCounterBytes = size_t(64) << 10;
struct StreamMemory {
  int* tile_counter = nullptr;
  char* scratch = nullptr;
};
StreamMemory stream_memory(cudaStream_t stream, size_t scratch_bytes, size_t scratch_zeroed);

// Throws flash3::CudaError unless the current device is Hopper (compute capability 9.x);
// `op` ("flash3::fwd") starts the message.
void require_hopper(const char* op);

}  // namespace flash3::detail

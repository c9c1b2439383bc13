// flash3: PTX wrappers and warp-level helpers shared by the kernels: named barriers,
// programmatic dependent launch (device side), gpu-scope acquire loads, quad reductions, exp2,
// the XOR swizzle of staged tiles, and 1-D bulk copies (TMA without a tensor map).
#pragma once

#include <cstdint>

#include <cute/arch/util.hpp>

namespace flash3::detail {

// Element offset of (r, c) in a row-major shared-memory tile of kRowElems 16-bit elements per row
// whose 16-byte chunks are XOR-swizzled by (row + key) % 8 within each group of 8 chunks: the 8
// rows of one accumulator-order store (same chunk) and the 8 chunks of one row read hit 32
// distinct banks. `key` only rotates the pattern.
template <int kRowElems>
__device__ __forceinline__ int xor_swizzled_offset(int r, int c, int key = 0) {
  return r * kRowElems + ((((c >> 3) ^ (r + key)) & 7) | ((c >> 3) & ~7)) * 8 + (c & 7);
}

// The 4 threads of a quad hold the columns of the same accumulator rows.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Named barriers: `threads` threads (a multiple of 32) meet at barrier `id` (0 is __syncthreads).
__device__ __forceinline__ void named_barrier_sync(int threads, int id) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_barrier_arrive(int threads, int id) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Programmatic dependent launch (griddepcontrol; the host side is runtime/launch.h's
// launch_pdl): let the next kernel of the stream start launching (its blocks take SMs as this
// kernel's blocks leave them, and run up to their pdl_wait), and wait until the previous kernel has completed with its writes visible.
// Both are no-ops in a kernel launched without the attribute.
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// A gpu-scope acquire load of a counter (the backward's dq_sem and dq_done, the decoding
// kernel's split counters).
__device__ __forceinline__ int ld_acquire_gpu(const int* counter) {
  int seen;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
  return seen;
}

// NOTES: MUFU.EX2 directly; exp(x) is computed as exp2(x * log2(e)) with the softmax scale
// folded into the same multiply-add.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Stores the sum of `values` to shared memory with a volatile st.shared, so that their
// computation stays ahead of the next wgmma.wait_group in the SASS.
template <int N>
__device__ __forceinline__ void pin_before_wait(float* slot, const float (&values)[N]) {
  float v = values[0];
#pragma unroll
  for (int i = 1; i < N; ++i) v += values[i];
  const uint32_t addr = cute::cast_smem_ptr_to_uint(slot);
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}

// 1-D bulk copies: global -> shared completing on an mbarrier, shared -> global, and a reduce-add
// of FP32 shared -> global, each committed as its own bulk group.
__device__ __forceinline__ void bulk_load_1d(void* smem_dst, const void* gmem_src, uint32_t bytes,
                                             uint64_t* mbar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          cute::cast_smem_ptr_to_uint(smem_dst)),
      "l"(gmem_src), "r"(bytes), "r"(cute::cast_smem_ptr_to_uint(mbar))
      : "memory");
}

// stmatrix x4 (8 x 8 b16 matrices, not transposed) to a 32-bit shared-memory address (CuTe's
// SM90_U32x4_STSM_N takes a reference, whose address the compiler forms anew at each use).
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_addr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(smem_addr), "r"(r0),
               "r"(r1), "r"(r2), "r"(r3));
}

__device__ __forceinline__ void bulk_store_f32(float* gmem_dst, const float* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst),
               "r"(cute::cast_smem_ptr_to_uint(smem_src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem_dst, const float* smem_src, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem_dst),
               "r"(cute::cast_smem_ptr_to_uint(smem_src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

}  // namespace flash3::detail

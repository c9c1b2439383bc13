// flash3: small device helpers shared by the forward and backward kernels: the WGMMA issue wrapper, register
// layout conversions of the WGMMA accumulator, type conversion, quad reductions, exp2, and the
// programmatic-dependent-launch pair (device side, and the host launch that enables it).
#pragma once

#include <atomic>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include "flash3/flash3.h"
#include "fwd/fwd_dispatch.h"

namespace flash3::detail {

using namespace cute;

// The (seqlen, head_dim, heads, batch) CuTe view, head dim contiguous, of a (batch, seqlen,
// heads, head_dim) tensor: what the TMA descriptors are built from (host side).
inline auto qkv_layout(const TensorRef& t) {
  return make_layout(make_shape(int32_t(t.shape[1]), int32_t(t.shape[3]), int32_t(t.shape[2]),
                                int32_t(t.shape[0])),
                     make_stride(t.stride[1], _1{}, t.stride[2], t.stride[0]));
}

// True when a WGMMA operand fragment holds registers, false when it holds shared-memory
// descriptors.
template <class T>
constexpr bool kOperandInRegisters =
    !is_same_v<typename remove_cvref_t<T>::engine_type::iterator, GMMA::DescriptorIterator>;

// Issues one tile GEMM C (+)= A * B as a batch of WGMMAs for the calling warpgroup and commits
// it, without waiting and without operand fences after the commit: the caller fences C after
// the wait that completes it. NOTES: in the backward kernel's overlapped schedule of then
// (docs/perf-log.md B2, B10; since replaced), a fence on an accumulator still in flight made
// ptxas serialize every WGMMA of the kernel (C7514: "non wgmma instructions reading accumulator
// registers ... between start and end of the pipeline stage").
template <bool kZeroInit, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm_async(TiledMma& mma, TA const& tA, TB const& tB, TC& tC) {
  warpgroup_fence_operand(tC);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTLASS_PRAGMA_UNROLL
  for (int k = 0; k < size<2>(tA); ++k) {
    cute::gemm(mma, tA(_, _, k), tB(_, _, k), tC);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
}

// The same with operand fences (A too when it comes from registers) after the commit.
// kZeroInit: C = A*B instead of C += A*B. kWait: wgmma.wait_group<kWait> after the commit
// (-1: do not wait; the caller waits later, so the GEMM overlaps what follows).
template <bool kZeroInit, int kWait, class TiledMma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm(TiledMma& mma, TA const& tA, TB const& tB, TC& tC) {
  constexpr bool kAFromRegisters = kOperandInRegisters<TA>;
  if constexpr (kAFromRegisters) warpgroup_fence_operand(const_cast<TA&>(tA));
  warpgroup_gemm_async<kZeroInit>(mma, tA, tB, tC);
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(tC);
  if constexpr (kAFromRegisters) warpgroup_fence_operand(const_cast<TA&>(tA));
}

// NOTES: an SM90 WGMMA accumulator fragment has layout ((2, 2, N/8), MMA_M, MMA_N): value mode
// 0 is a pair of adjacent columns, mode 1 the row 8 below, mode 2 the next 8-column group. The
// (row, col) view groups the row modes and the column modes so softmax can loop over rows.
template <class Layout>
__device__ __forceinline__ constexpr auto acc_layout_rowcol(Layout l) {
  static_assert(decltype(rank(l))::value == 3 && decltype(rank(get<0>(l)))::value == 3);
  auto v = get<0>(l);
  return make_layout(make_layout(get<1>(v), get<1>(l)),
                     make_layout(get<0>(v), get<2>(v), get<2>(l)));
}

// The S accumulator reinterpreted as the A operand (from registers) of the next WGMMA, whose
// k-step is 16 columns: ((2, 2, N/8), M, N') -> ((2, 2, 2), M, (N/16, N')).
template <class Layout>
__device__ __forceinline__ constexpr auto acc_layout_as_a_operand(Layout l) {
  auto v = get<0>(l);
  auto col_groups = logical_divide(get<2>(v), Int<2>{});  // (2, N/16)
  return make_layout(make_layout(get<0>(v), get<1>(v), get<0>(col_groups)), get<1>(l),
                     make_layout(get<1>(col_groups), get<2>(l)));
}

// Element-wise conversion of a compact register tensor (e.g. float accumulators to bf16).
template <class To, class Engine, class Layout, class OutTensor>
__device__ __forceinline__ void convert_into(Tensor<Engine, Layout> const& in, OutTensor& out) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(size(in.layout()))::value;
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(out.data()) =
      convert(*reinterpret_cast<cutlass::Array<From, N> const*>(in.data()));
}

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

// Programmatic dependent launch (griddepcontrol; launch_pdl below): let the next kernel of the
// stream start launching (its blocks take SMs as this kernel's blocks leave them, and run up to
// their pdl_wait), and wait until the previous kernel has completed with its writes visible.
// Both are no-ops in a kernel launched without the attribute.
__device__ __forceinline__ void pdl_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// A launch with programmatic dependent launch: the kernel may start while the previous kernel of
// the stream finishes, and must call pdl_wait before it reads that kernel's output or writes what
// that kernel may read (docs/perf-log.md B31, step 24).
template <class... KArgs, class... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, int threads, int smem, cudaStream_t stream,
                const char* what, Args const&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, args...), what);
}

// Raises kKernel's dynamic shared-memory limit to `bytes`, once per device: the attribute holds
// for the rest of the process, and the driver call would otherwise cost host time on every
// forward and backward call. (Keyed by the kernel itself: kernels of one signature, as the main
// and tail forward kernels, are set apart.) Devices 64 and up are set on every call.
template <auto kKernel>
void set_max_dynamic_smem(int bytes, const char* what = "cudaFuncSetAttribute(max dynamic shared memory)") {
  static std::atomic<unsigned long long> done{0};  // bit d: set on device d
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const unsigned long long bit = device >= 0 && device < 64 ? 1ull << device : 0ull;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return;
  check_cuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what);
  done.fetch_or(bit, std::memory_order_release);
}

// NOTES: MUFU.EX2 directly; exp(x) is computed as exp2(x * log2(e)) with the softmax scale
// folded into the same multiply-add.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

}  // namespace flash3::detail

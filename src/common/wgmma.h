// flash3: WGMMA helpers shared by the forward and backward kernels: the tile-GEMM issue
// wrappers, the register layouts of the WGMMA accumulator, and element-wise conversion.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

namespace flash3::detail {

using namespace cute;

// True when a WGMMA operand fragment holds registers, false when it holds shared-memory
// descriptors.
template <class T>
constexpr bool kOperandInRegisters =
    !is_same_v<typename remove_cvref_t<T>::engine_type::iterator, GMMA::DescriptorIterator>;

// The first thread index of tidx's warpgroup (tidx: the thread's index among the consumer
// warpgroups), made warp-uniform by a shuffle. Shared-memory operand fragments (descriptors)
// depend only on the warpgroup: partitioned with this index instead of tidx, ptxas keeps them in
// uniform registers instead of rebuilding them per thread and moving them (R2UR) before every
// WGMMA (docs/perf-log.md B98).
__device__ __forceinline__ int warpgroup_first_thread(int tidx) {
  return __shfl_sync(0xffffffffu, tidx / 128, 0) * 128;
}

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

}  // namespace flash3::detail

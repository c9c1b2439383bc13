// Scratch: WGMMA m64nNk16 bf16 throughput with both operands in shared memory (SS) against A in
// registers (RS), two warpgroups per block, one block per SM. Question: is a small-N SS GEMM
// (head dim 256's S, dP: m64n32k16 per warpgroup) limited by shared-memory operand bandwidth?
#include <cstdio>
#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>
using namespace cute;
using bf16 = cutlass::bfloat16_t;

template <int N, bool RS, int K = 256>
__global__ void __launch_bounds__(256, 1) rate(long long* cycles, float* sink, int reps) {
  extern __shared__ __align__(1024) char smem[];
  using Atom = GMMA::Layout_K_SW128_Atom<bf16>;
  bf16* pa = reinterpret_cast<bf16*>(smem);
  bf16* pb = reinterpret_cast<bf16*>(smem + 64 * K * 2);
  for (int i = threadIdx.x; i < (64 + N) * K; i += blockDim.x) pa[i] = bf16(float((i * 37) % 17) * 0.01f);
  __syncthreads();
  auto sA = make_tensor(make_smem_ptr(pa), tile_to_shape(Atom{}, Shape<_64, Int<K>>{}));
  auto sB = make_tensor(make_smem_ptr(pb), tile_to_shape(Atom{}, Shape<Int<N>, Int<K>>{}));
  using Shp = Shape<_64, Int<N>, Int<K>>;
  auto mma = make_tiled_mma(conditional_t<RS, decltype(GMMA::rs_op_selector<bf16, bf16, float, Shp>()),
                                          decltype(GMMA::ss_op_selector<bf16, bf16, float, Shp>())>{});
  auto thr = mma.get_thread_slice(threadIdx.x % 128);
  auto tB = thr.partition_fragment_B(sB);
  auto tC0 = partition_fragment_C(mma, Shape<_64, Int<N>>{});
  auto tC1 = partition_fragment_C(mma, Shape<_64, Int<N>>{});
  clear(tC0); clear(tC1);
  auto run = [&](auto const& tA) {
    auto one = [&](auto& tC) {
      warpgroup_fence_operand(tC);
      warpgroup_arrive();
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < size<2>(tA); ++k) cute::gemm(mma, tA(_, _, k), tB(_, _, k), tC);
      warpgroup_commit_batch();
    };
    __syncthreads();
    long long t0 = clock64();
    for (int r = 0; r < reps; ++r) {
      one(tC0);
      warpgroup_wait<1>();
      warpgroup_fence_operand(tC1);
      one(tC1);
      warpgroup_wait<1>();
      warpgroup_fence_operand(tC0);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tC0);
    warpgroup_fence_operand(tC1);
    long long t1 = clock64();
    if (threadIdx.x % 128 == 0) cycles[blockIdx.x * 2 + threadIdx.x / 128] = t1 - t0;
  };
  if constexpr (RS) {
    Tensor tA = thr.partition_fragment_A(sA);  // registers for an RS tiling
    for (int i = 0; i < size(tA); ++i) tA(i) = pa[(threadIdx.x * 7 + i) % (64 * K)];
    run(tA);
  } else {
    run(thr.partition_fragment_A(sA));
  }
  float s = 0;
  for (int i = 0; i < size(tC0); ++i) s += tC0(i) + tC1(i);
  if (s == 12345.f) sink[threadIdx.x] = s;
}

template <int N, bool RS>
void go(int sms, long long* d_cyc, float* d_sink) {
  const int reps = 2000;
  const int smem = (64 + N) * 256 * 2;
  auto k = rate<N, RS>;
  cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  k<<<sms, 256, smem>>>(d_cyc, d_sink, 50);
  k<<<sms, 256, smem>>>(d_cyc, d_sink, reps);
  cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) { printf("N=%d RS=%d: %s\n", N, int(RS), cudaGetErrorString(e)); return; }
  long long h[2 * 200];
  cudaMemcpy(h, d_cyc, sizeof(long long) * 2 * sms, cudaMemcpyDeviceToHost);
  long long mx = 0; double avg = 0;
  for (int i = 0; i < 2 * sms; ++i) { mx = h[i] > mx ? h[i] : mx; avg += h[i]; }
  avg /= 2 * sms;
  const double macs = 2.0 * reps * 2 * 64.0 * N * 256;  // two WGs, two GEMMs per rep
  printf("m64n%dk16 %s: %.0f MAC/clk/SM (avg cycles %.0f, max %lld); operand bytes/clk (A+B from smem): %.0f\n",
         N, RS ? "RS" : "SS", macs / avg, avg, mx,
         (RS ? 0.0 : 2.0 * reps * 2 * 64 * 256 * 2) / avg + 2.0 * reps * 2 * N * 256 * 2 / avg);
}

int main() {
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  long long* d_cyc; float* d_sink;
  cudaMalloc(&d_cyc, sizeof(long long) * 2 * sms);
  cudaMalloc(&d_sink, 4096);
  go<32, false>(sms, d_cyc, d_sink);
  go<40, false>(sms, d_cyc, d_sink);
  go<64, false>(sms, d_cyc, d_sink);
  go<80, false>(sms, d_cyc, d_sink);
  go<128, false>(sms, d_cyc, d_sink);

  go<32, true>(sms, d_cyc, d_sink);
  go<64, true>(sms, d_cyc, d_sink);
  go<128, true>(sms, d_cyc, d_sink);
  return 0;
}

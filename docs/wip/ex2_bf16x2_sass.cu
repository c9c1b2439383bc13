#include <cuda_bf16.h>
__global__ void k(const float* x, unsigned* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x[2*i], x[2*i+1]);
    unsigned r, a = *reinterpret_cast<unsigned*>(&v);
    asm("ex2.approx.ftz.bf16x2 %0, %1;" : "=r"(r) : "r"(a));
    y[i] = r;
  }
}
__global__ void k2(const float* x, float* y, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) {
    float r; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x[i])); y[i] = r;
  }
}

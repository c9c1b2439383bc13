// flash3: FLASH3_HD marks the plain C++ helpers that the kernels, the launchers and the CPU tests
// share (scheduling math, masks, sequence lengths): __host__ __device__ under nvcc, inline in
// the C++ compiler.
#pragma once

#if defined(__CUDACC__)
#define FLASH3_HD __host__ __device__ __forceinline__
#else
#define FLASH3_HD inline
#endif

// flash3: quantize_fp8, the FP8 (e4m3) block quantization of q, k, v for the FP8 forward, with the
// optional Hadamard rotation of incoherent processing: the kernel, its launcher and the entry point.
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "flash3/flash3.h"
#include "quant/hadamard.h"
#include "quant/quantize.h"
#include "runtime/runtime.h"

namespace flash3::detail {
namespace {

// NOTES: the design. One CTA handles one (batch, head, block of block_rows rows) at a time
// (grid-stride over them, head fastest so that neighbouring CTAs read neighbouring memory). A row
// of head_dim values is held by G = head_dim / 32 lanes, 32 FP32 values each (the map of
// hadamard.h), so a warp holds 32 / G rows per step and the Hadamard transform costs log2(G) <= 3
// shuffles per value (the other log2(32) butterflies stay in registers): a few instructions per
// byte moved, so the kernel stays bound by memory bandwidth. Each thread keeps kSlots rows; the
// CTA's warps are sized on the host so that CTA x kSlots covers the block (up to kMaxWarps):
// then the block is read once into registers, its max |y| reduced (warp REDUX, then shared
// memory), and the registers quantized and written: one read and one write per element. A block
// larger than the CTA's registers (block_rows >= 513 at head dim 64, 257 at 128, 129 at 256) is
// done in chunks, twice: a first pass transforms every chunk for the max, keeping the last one,
// which the second pass writes first before it reads and transforms the others again (their
// second reads mostly hit L2: a CTA's block is at most its chunk count x 64 KB and is reread at
// once).
constexpr int kSlots = 2;        // rows per thread held in registers (each 32 values)
constexpr int kMaxWarps = 16;    // 512 threads: <= 128 registers each
constexpr int kMaxThreads = kMaxWarps * 32;
constexpr int kValues = kHadamardValuesPerLane;
constexpr float kE4M3Max = 448.0f;

struct QuantizeParams {
  const uint16_t* in;  // float16 or bfloat16 bits
  uint8_t* out;        // e4m3 bits
  float* scale;
  int64_t in_stride[3], out_stride[3], scale_stride[3];  // batch, seqlen, nheads / batch, nheads, block
  int seqlen, nheads, block_rows, num_blocks;
  int64_t units;  // batch x nheads x num_blocks
  // Hadamard only: bit r of sign_mask[g] set when register r of group lane g holds an element
  // whose random sign is -1 (hadamard_lane_sign_mask, computed on the host).
  uint32_t sign_mask[8];
  // scale = max |transformed value| x scale_factor, in double: 1 / (448 sqrt(head_dim)) with the
  // Hadamard transform (the kernel's transform is unnormalized), 1 / 448 without.
  double scale_factor;
};

// Two 16-bit inputs packed in a word, to float; the first (low half) in .x.
template <DType kDType>
__device__ __forceinline__ float2 unpack2(uint32_t w) {
  if constexpr (kDType == DType::kBFloat16) {
    return make_float2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
  } else {
    return __half22float2(*reinterpret_cast<const __half2*>(&w));
  }
}
template <DType kDType>
__device__ __forceinline__ float unpack1(uint16_t h) {
  return unpack2<kDType>(uint32_t(h)).x;
}

// Four values to four e4m3 bytes, rounded to nearest even and saturated to +-448; the first in
// the lowest byte.
__device__ __forceinline__ uint32_t pack4_e4m3(float a, float b, float c, float d) {
  const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(a, b), __NV_SATFINITE, __NV_E4M3);
  const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(c, d), __NV_SATFINITE, __NV_E4M3);
  return lo | (hi << 16);
}

// The per-thread constants of the row transform.
struct LaneState {
  uint32_t sign;        // bit r: flip the sign of register r (Hadamard only)
  uint32_t flip[16];    // the same as xor masks of the packed 16-bit pairs (registers 2w, 2w+1)
};

template <bool kHadamard>
__device__ __forceinline__ LaneState lane_state(const QuantizeParams& p, int g) {
  LaneState s{};
  if constexpr (kHadamard) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (g == j) s.sign = p.sign_mask[j];
    }
#pragma unroll
    for (int w = 0; w < 16; ++w) {
      s.flip[w] = (((s.sign >> (2 * w)) & 1u) << 15) | (((s.sign >> (2 * w + 1)) & 1u) << 31);
    }
  }
  return s;
}

// Loads row `row` of one head (elements at `head` + row * row_stride) into v in the hadamard.h
// map, or zeros when the row is past the block (valid == false), and transforms it in place
// (unnormalized: the 1 / sqrt(head_dim) is folded into the scale). Every lane of the warp must
// call it (the shuffles), with the same `valid` for the G lanes of a row.
template <DType kDType, int kHeadDim, bool kHadamard, bool kVec>
__device__ __forceinline__ void load_transform(float (&v)[kValues], const uint16_t* row, bool valid,
                                               int g, const LaneState& ls) {
  constexpr int G = kHeadDim / kValues;
  if (!valid) {
#pragma unroll
    for (int r = 0; r < kValues; ++r) v[r] = 0.0f;
  } else if constexpr (kVec) {
#pragma unroll
    for (int c = 0; c < kValues / kHadamardChunk; ++c) {
      const uint4 q = __ldg(reinterpret_cast<const uint4*>(row + (c * G + g) * kHadamardChunk));
      const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const float2 f = unpack2<kDType>(kHadamard ? w[k] ^ ls.flip[c * 4 + k] : w[k]);
        v[c * kHadamardChunk + 2 * k] = f.x;
        v[c * kHadamardChunk + 2 * k + 1] = f.y;
      }
    }
  } else {
#pragma unroll
    for (int r = 0; r < kValues; ++r) {
      uint16_t h = __ldg(row + hadamard_element(G, g, r));
      if (kHadamard) h ^= uint16_t(((ls.sign >> r) & 1u) << 15);
      v[r] = unpack1<kDType>(h);
    }
  }
  if constexpr (kHadamard) {
    hadamard_registers(v);
#pragma unroll
    for (int m = 1; m < G; m *= 2) {
      const float sign = (g & m) ? -1.0f : 1.0f;
#pragma unroll
      for (int r = 0; r < kValues; ++r) {
        v[r] = hadamard_lane_step(v[r], __shfl_xor_sync(0xffffffffu, v[r], m), sign);
      }
    }
  }
}

// Writes v x inv as e4m3 to `row` (same map), unless the row is past the block.
template <int kHeadDim, bool kVec>
__device__ __forceinline__ void quantize_store(const float (&v)[kValues], uint8_t* row, bool valid,
                                               int g, float inv) {
  constexpr int G = kHeadDim / kValues;
  if (!valid) return;
  if constexpr (kVec) {
#pragma unroll
    for (int c = 0; c < kValues / kHadamardChunk; ++c) {
      const float* x = v + c * kHadamardChunk;
      const uint2 q = make_uint2(pack4_e4m3(x[0] * inv, x[1] * inv, x[2] * inv, x[3] * inv),
                                 pack4_e4m3(x[4] * inv, x[5] * inv, x[6] * inv, x[7] * inv));
      *reinterpret_cast<uint2*>(row + (c * G + g) * kHadamardChunk) = q;
    }
  } else {
#pragma unroll
    for (int r = 0; r < kValues; ++r) {
      row[hadamard_element(G, g, r)] = __nv_cvt_float_to_fp8(v[r] * inv, __NV_SATFINITE, __NV_E4M3);
    }
  }
}

template <DType kDType, int kHeadDim, bool kHadamard, bool kVec>
__global__ void __launch_bounds__(kMaxThreads) quantize_kernel(const QuantizeParams p) {
  constexpr int G = kHeadDim / kValues;
  __shared__ uint32_t warp_max[kMaxWarps];

  const int tid = threadIdx.x, g = tid % G, lane = tid % 32, warp = tid / 32;
  const int warps = blockDim.x / 32;
  const int rows_per_step = blockDim.x / G;   // rows the CTA holds per slot
  const int chunk = rows_per_step * kSlots;   // rows the CTA holds in registers
  const int my_row = tid / G;                 // this thread's row within a step
  const LaneState ls = lane_state<kHadamard>(p, g);

  for (int64_t unit = blockIdx.x; unit < p.units; unit += gridDim.x) {
    const int h = int(unit % p.nheads);
    const int64_t rest = unit / p.nheads;
    const int blk = int(rest % p.num_blocks);
    const int64_t b = rest / p.num_blocks;
    const int64_t row0 = int64_t(blk) * p.block_rows;
    const int rows = int(min(int64_t(p.block_rows), p.seqlen - row0));  // >= 1
    const uint16_t* in = p.in + b * p.in_stride[0] + row0 * p.in_stride[1] + h * p.in_stride[2];
    uint8_t* out = p.out + b * p.out_stride[0] + row0 * p.out_stride[1] + h * p.out_stride[2];

    // Pass 1: transform each chunk and take the max |value|; the last chunk stays in v.
    float v[kSlots][kValues];
    float amax = 0.0f;
    int base = 0;
    for (;;) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int r = base + s * rows_per_step + my_row;
        load_transform<kDType, kHeadDim, kHadamard, kVec>(v[s], in + r * p.in_stride[1], r < rows, g, ls);
#pragma unroll
        for (int i = 0; i < kValues; ++i) amax = fmaxf(amax, fabsf(v[s][i]));
      }
      if (base + chunk >= rows) break;
      base += chunk;
    }

    // The block's max: non-negative floats order as their bits, so an unsigned max reduces them.
    const uint32_t wmax = __reduce_max_sync(0xffffffffu, __float_as_uint(amax));
    if (lane == 0) warp_max[warp] = wmax;
    __syncthreads();
    uint32_t bmax = 0;
    for (int w = 0; w < warps; ++w) bmax = max(bmax, warp_max[w]);
    __syncthreads();  // warp_max is rewritten by the next unit
    amax = __uint_as_float(bmax);

    if (tid == 0) {
      float* scale = p.scale + b * p.scale_stride[0] + h * p.scale_stride[1] + blk * p.scale_stride[2];
      *scale = amax > 0.0f ? float(double(amax) * p.scale_factor) : 1.0f;
    }
    // out = y / scale = (unnormalized y) x 448 / amax. A block whose max is below 2^-100 (448 /
    // amax would overflow float32 near 2^-120) is first multiplied by 2^64, exactly.
    const bool tiny = amax < 0x1p-100f;
    const float pre = tiny ? 0x1p64f : 1.0f;
    const float inv = amax > 0.0f ? kE4M3Max / (amax * pre) : 0.0f;

    // Pass 2: the chunk in registers (the last) first, then the others again, in order.
    const int last = base;
    for (int next = 0;; next += chunk) {
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int r = base + s * rows_per_step + my_row;
        if (tiny) {
#pragma unroll
          for (int i = 0; i < kValues; ++i) v[s][i] *= pre;
        }
        quantize_store<kHeadDim, kVec>(v[s], out + r * p.out_stride[1], r < rows, g, inv);
      }
      if (next >= last) break;
      base = next;
#pragma unroll
      for (int s = 0; s < kSlots; ++s) {
        const int r = base + s * rows_per_step + my_row;
        load_transform<kDType, kHeadDim, kHadamard, kVec>(v[s], in + r * p.in_stride[1], r < rows, g, ls);
      }
    }
  }
}

template <DType kDType, int kHeadDim, bool kHadamard, bool kVec>
void launch(const QuantizeParams& params, int threads, int64_t grid, cudaStream_t stream) {
  quantize_kernel<kDType, kHeadDim, kHadamard, kVec><<<dim3(unsigned(grid)), threads, 0, stream>>>(params);
}

template <DType kDType, int kHeadDim>
void launch_variant(const QuantizeProblem& pr, const QuantizeParams& params, int threads,
                    int64_t grid, cudaStream_t stream) {
  if (pr.hadamard) {
    if (pr.vectorized) return launch<kDType, kHeadDim, true, true>(params, threads, grid, stream);
    return launch<kDType, kHeadDim, true, false>(params, threads, grid, stream);
  }
  if (pr.vectorized) return launch<kDType, kHeadDim, false, true>(params, threads, grid, stream);
  return launch<kDType, kHeadDim, false, false>(params, threads, grid, stream);
}

template <DType kDType>
void launch_head_dim(const QuantizeProblem& pr, const QuantizeParams& params, int threads,
                     int64_t grid, cudaStream_t stream) {
  switch (pr.head_dim) {
    case 64: return launch_variant<kDType, 64>(pr, params, threads, grid, stream);
    case 128: return launch_variant<kDType, 128>(pr, params, threads, grid, stream);
    case 256: return launch_variant<kDType, 256>(pr, params, threads, grid, stream);
  }
  throw Error("flash3::quantize_fp8: no kernel for head_dim " + std::to_string(pr.head_dim));
}

}  // namespace

void run_quantize(const QuantizeProblem& pr, const QuantizeArgs& args) {
  QuantizeParams params{};
  params.in = static_cast<const uint16_t*>(args.in.data);
  params.out = static_cast<uint8_t*>(args.out.data);
  params.scale = static_cast<float*>(args.scale.data);
  for (int d = 0; d < 3; ++d) {
    params.in_stride[d] = args.in.stride[d];
    params.out_stride[d] = args.out.stride[d];
    params.scale_stride[d] = args.scale.stride[d];
  }
  params.seqlen = pr.seqlen;
  params.nheads = pr.nheads;
  params.block_rows = pr.block_rows;
  params.num_blocks = pr.num_blocks;
  params.units = pr.units;
  const int group_lanes = hadamard_group_lanes(pr.head_dim);
  if (pr.hadamard) {
    for (int g = 0; g < group_lanes; ++g) params.sign_mask[g] = hadamard_lane_sign_mask(pr.seed, pr.head_dim, g);
  }
  params.scale_factor = (pr.hadamard ? 1.0 / std::sqrt(double(pr.head_dim)) : 1.0) / double(kE4M3Max);

  // Warps: enough for the block's rows (at most seqlen) in kSlots rows per thread, at most
  // kMaxWarps (larger blocks take the two-pass path).
  const int rows_per_warp = kSlots * 32 / group_lanes;
  const int block = std::min(pr.block_rows, pr.seqlen);
  const int warps = std::max(1, std::min(kMaxWarps, (block + rows_per_warp - 1) / rows_per_warp));
  const int threads = warps * 32;
  // Grid: every unit its own CTA up to a few waves of resident CTAs (2048 threads per SM), then
  // each CTA loops over several units.
  const int64_t resident = int64_t(current_device_info().sms) * std::max(1, 2048 / threads);
  const int64_t grid = std::max<int64_t>(1, std::min(pr.units, 4 * resident));

  switch (pr.dtype) {
    case DType::kBFloat16: launch_head_dim<DType::kBFloat16>(pr, params, threads, grid, args.stream); break;
    case DType::kFloat16: launch_head_dim<DType::kFloat16>(pr, params, threads, grid, args.stream); break;
    default: throw Error("flash3::quantize_fp8: no kernel for in.dtype " + std::string(dtype_name(pr.dtype)));
  }
  check_cuda(cudaGetLastError(), "quantize_fp8 launch");
}

}  // namespace flash3::detail

namespace flash3 {

void quantize_fp8(const QuantizeArgs& args) {
  const QuantizeProblem p = validate_quantize(args);
  if (p.empty()) return;
  detail::require_hopper("flash3::quantize_fp8");
  detail::run_quantize(p, args);
}

}  // namespace flash3

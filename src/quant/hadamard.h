// flash3: the Hadamard transform of quantize_fp8's incoherent processing: the random signs, the
// element-to-register map of the kernel, its butterfly steps, and a scalar reference; FLASH3_HD
// plain C++ shared by the kernel, its launcher and the CPU tests.
//
// The transform of one row x (head_dim = d values, d a power of two) is
//   y_j = (1 / sqrt(d)) * sum_i s_i x_i H_ij,   H_ij = (-1)^popcount(i & j)   (Sylvester),
// with s_i = +-1 a function of (seed, i) only. H / sqrt(d) is orthogonal and symmetric and
// diag(s) is orthogonal, so rows transformed with the same seed keep their dot products.
#pragma once

#include <cmath>
#include <cstdint>

#include "common/host_device.h"

namespace flash3::detail {

// ---- the random signs --------------------------------------------------------------------------

// A 64-bit mix of (seed, i): the splitmix64 step (golden-ratio increment, then two
// xor-shift-multiply rounds and a final xor-shift) applied to seed + (i + 1) * increment.
FLASH3_HD uint64_t hadamard_hash(uint64_t seed, uint32_t i) {
  uint64_t z = seed + (uint64_t(i) + 1u) * 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// 1 when s_i = -1, 0 when s_i = +1: the top bit of the hash.
FLASH3_HD uint32_t hadamard_sign_bit(uint64_t seed, uint32_t i) {
  return uint32_t(hadamard_hash(seed, i) >> 63);
}

// s_i as +1 or -1.
FLASH3_HD int hadamard_sign(uint64_t seed, uint32_t i) { return hadamard_sign_bit(seed, i) ? -1 : 1; }

// ---- the kernel's element map ------------------------------------------------------------------
// A row of d elements is held by a group of G = d / 32 consecutive lanes of a warp, each lane
// holding 32 values in registers: register r = c * 8 + e (c in [0, 4), e in [0, 8)) of lane g of
// the group holds element (c * G + g) * 8 + e. So each c is one 16-byte load of 8 contiguous
// 16-bit inputs (one 8-byte store of 8 fp8 outputs), and the G lanes of a group cover G * 8
// contiguous elements per c. Element bits 0-2 are e, bits 3 .. 3 + log2(G) - 1 are g, the two
// top bits are c: the butterflies over e and c stay in a lane's registers, those over g go
// across lanes.
constexpr int kHadamardValuesPerLane = 32;
constexpr int kHadamardChunk = 8;  // contiguous elements per (lane, c)

FLASH3_HD constexpr int hadamard_group_lanes(int head_dim) { return head_dim / kHadamardValuesPerLane; }

// The element held by register r of lane g of a group of G lanes.
FLASH3_HD constexpr int hadamard_element(int group_lanes, int g, int r) {
  return ((r / kHadamardChunk) * group_lanes + g) * kHadamardChunk + r % kHadamardChunk;
}

// Bit r set when register r of lane g holds an element whose sign is -1.
FLASH3_HD uint32_t hadamard_lane_sign_mask(uint64_t seed, int head_dim, int g) {
  uint32_t mask = 0;
  for (int r = 0; r < kHadamardValuesPerLane; ++r) {
    mask |= hadamard_sign_bit(seed, uint32_t(hadamard_element(hadamard_group_lanes(head_dim), g, r))) << r;
  }
  return mask;
}

// The butterflies over the 5 register bits (e and c) of one lane's 32 values, unnormalized:
// for each register bit h, the pair (v[r], v[r + h]) with bit h of r clear becomes
// (v[r] + v[r + h], v[r] - v[r + h]).
template <class T>
FLASH3_HD void hadamard_registers(T (&v)[kHadamardValuesPerLane]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int h = 1; h < kHadamardValuesPerLane; h *= 2) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int r = 0; r < kHadamardValuesPerLane; ++r) {
      if ((r & h) == 0) {
        const T a = v[r], b = v[r + h];
        v[r] = a + b;
        v[r + h] = a - b;
      }
    }
  }
}

// One butterfly across lanes: `partner` is the same register of the lane whose group index
// differs in one bit; the lane with that bit set (sign = -1) keeps partner - mine, the other
// (sign = +1) mine + partner. Written as mine * sign + partner, one exact fused multiply-add.
template <class T>
FLASH3_HD T hadamard_lane_step(T mine, T partner, T sign) {
  return mine * sign + partner;
}

// ---- the scalar reference ----------------------------------------------------------------------

// In-place unnormalized fast Walsh-Hadamard transform of v[0 .. n), n a power of two:
// v <- v H, O(n log n).
template <class T>
FLASH3_HD void fwht_reference(T* v, int n) {
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int j = i; j < i + h; ++j) {
        const T a = v[j], b = v[j + h];
        v[j] = a + b;
        v[j + h] = a - b;
      }
    }
  }
}

// y = (x o s) H / sqrt(n), the full row transform of quantize_fp8 (x and y may be the same).
template <class T>
FLASH3_HD void hadamard_rotate_reference(const T* x, T* y, int n, uint64_t seed) {
  for (int i = 0; i < n; ++i) y[i] = hadamard_sign_bit(seed, uint32_t(i)) ? -x[i] : x[i];
  fwht_reference(y, n);
  const T norm = T(1) / T(sqrt(double(n)));
  for (int i = 0; i < n; ++i) y[i] *= norm;
}

}  // namespace flash3::detail

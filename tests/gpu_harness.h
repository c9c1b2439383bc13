// flash3 tests: helpers for tests that run kernels on the GPU: device buffers, random inputs in
// the input dtype, poisoning, and the skip-when-no-Hopper guard.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flash3/flash3.h"
#include "reference.h"

namespace flash3::testing {

#define FLASH3_REQUIRE_HOPPER()                                       \
  do {                                                                \
    std::string why_not;                                              \
    if (!flash3::hopper_available(&why_not)) GTEST_SKIP() << why_not; \
  } while (0)

#define FLASH3_CUDA_OK(expr) ASSERT_EQ((expr), cudaSuccess) << #expr << ": " << cudaGetErrorString(expr)

// A device allocation of 2-byte or 4-byte elements, freed on scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n_bytes) : bytes(n_bytes) {
    if (cudaMalloc(&ptr, bytes < 16 ? 16 : bytes) != cudaSuccess) ptr = nullptr;
  }
  ~DeviceBuffer() { if (ptr) cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <class T> void upload(const std::vector<T>& h) {
    cudaMemcpy(ptr, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
  }
  template <class T> std::vector<T> download(size_t n) const {
    std::vector<T> h(n);
    cudaMemcpy(h.data(), ptr, n * sizeof(T), cudaMemcpyDeviceToHost);
    return h;
  }
};

inline uint16_t to_bits(DType dtype, double x) {
  return dtype == DType::kBFloat16 ? ref::float_to_bf16_bits(float(x)) : ref::float_to_half_bits(float(x));
}
inline double from_bits(DType dtype, uint16_t b) {
  return dtype == DType::kBFloat16 ? ref::bf16_bits_to_float(b) : ref::half_bits_to_float(b);
}

// n values ~ N(0, 1) rounded to the dtype: `bits` for the device, `values` (exact) for the
// references.
inline void random_tensor(DType dtype, size_t n, std::mt19937_64& rng, std::vector<uint16_t>& bits,
                          std::vector<double>& values) {
  std::normal_distribution<double> normal(0.0, 1.0);
  bits.resize(n);
  values.resize(n);
  for (size_t i = 0; i < n; ++i) {
    bits[i] = to_bits(dtype, normal(rng));
    values[i] = from_bits(dtype, bits[i]);
  }
}

// Query rows the reference computes: all of them for small problems, else a sample that
// includes the first and last rows and the rows around tile boundaries.
inline std::vector<int> reference_rows(int seqlen_q, std::mt19937_64& rng) {
  std::vector<int> rows;
  if (seqlen_q <= 1024) {
    for (int i = 0; i < seqlen_q; ++i) rows.push_back(i);
    return rows;
  }
  for (int i : {0, 1, 63, 64, 127, 128, 129, seqlen_q - 129, seqlen_q - 2, seqlen_q - 1}) rows.push_back(i);
  std::uniform_int_distribution<int> pick(0, seqlen_q - 1);
  for (int i = 0; i < 54; ++i) rows.push_back(pick(rng));
  std::sort(rows.begin(), rows.end());
  rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
  return rows;
}

// NaN in both fp16 (0x7E00 family) and bf16 (0x7FC0 family): 0x7FFF is NaN in both.
constexpr uint16_t kPoison16 = 0x7FFF;

// The name of one case of a (dtype, head dim, causal, heads) test matrix: "bf16_d128_causal_gqa".
inline std::string matrix_case_name(DType dtype, int head_dim, bool causal, int nheads, int nheads_kv) {
  const char* heads = nheads_kv == nheads ? "mha" : nheads_kv == 1 ? "mqa" : "gqa";
  return std::string(dtype == DType::kBFloat16 ? "bf16" : "fp16") + "_d" + std::to_string(head_dim) +
         (causal ? "_causal_" : "_full_") + heads;
}

// A (batch, seqlen, heads, head_dim) tensor laid out with padding: each head's head_dim elements
// are followed by head_pad unused ones, and each seqlen row by row_pad more. Offsets are in
// elements; "dense" is the contiguous [batch][seqlen][heads][head_dim] order of the references.
struct PaddedLayout {
  int64_t batch, seqlen, heads, head_dim;
  int64_t head_pad = 0, row_pad = 0;

  int64_t head_stride() const { return head_dim + head_pad; }
  int64_t row_stride() const { return heads * head_stride() + row_pad; }
  size_t size() const { return size_t(batch * seqlen * row_stride()); }  // padding included
  size_t dense_size() const { return size_t(batch * seqlen * heads * head_dim); }
  // The padded offset of the element at dense index i.
  size_t offset(size_t i) const {
    const int64_t c = int64_t(i) % head_dim, h = int64_t(i) / head_dim % heads, row = int64_t(i) / head_dim / heads;
    return size_t(row * row_stride() + h * head_stride() + c);
  }
  bool is_padding(size_t offset) const {
    const int64_t in_row = int64_t(offset) % row_stride();
    return in_row >= heads * head_stride() || in_row % head_stride() >= head_dim;
  }
  TensorRef view(void* data, DType dtype) const {
    TensorRef t;
    t.data = data;
    t.dtype = dtype;
    t.rank = 4;
    const int64_t shape[4] = {batch, seqlen, heads, head_dim};
    const int64_t stride[4] = {seqlen * row_stride(), row_stride(), head_stride(), 1};
    std::memcpy(t.shape, shape, sizeof shape);
    std::memcpy(t.stride, stride, sizeof stride);
    return t;
  }
  template <class T> std::vector<T> dense(const std::vector<T>& padded) const {
    std::vector<T> out(dense_size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = padded[offset(i)];
    return out;
  }
};

}  // namespace flash3::testing

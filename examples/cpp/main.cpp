// flash3 example consumer: built against the installed package (find_package(flash3)).
// Without a Hopper GPU it checks what runs on the host: the version, hopper_available() and the
// validation of arguments (flash3::Error naming the argument), and exits 0. With one, it also
// runs one small causal forward (bf16, batch 1, 256 tokens, 4 heads, head dim 64) and prints a
// checksum of the output and a check of one row against a host computation.
#include <flash3/flash3.h>
#include <flash3/flash3_c.h>

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

namespace {

int failures = 0;

void expect(bool ok, const std::string& what) {
  std::printf("%s: %s\n", ok ? "ok  " : "FAIL", what.c_str());
  if (!ok) ++failures;
}

// bfloat16 <-> float on the host (round to nearest even; the values here are finite).
uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// An invalid argument must throw flash3::Error before anything touches the GPU, with a message
// that names it: a head dim the kernels are not built for.
void check_validation() {
  static uint16_t dummy[8];
  flash3::FwdArgs a;
  a.q = flash3::TensorRef::contiguous(dummy, flash3::DType::kBFloat16, {1, 16, 2, 96});
  a.k = a.q;
  a.v = a.q;
  a.out = a.q;
  try {
    flash3::fwd(a);
    expect(false, "fwd with head_dim 96 throws flash3::Error");
  } catch (const flash3::Error& e) {
    const std::string msg = e.what();
    std::printf("      flash3::Error: %s\n", msg.c_str());
    expect(msg.find("head_dim") != std::string::npos && msg.find("96") != std::string::npos,
           "fwd with head_dim 96 throws flash3::Error naming head_dim and the value");
  }
}

#define CUDA_OK(x)                                                                      \
  do {                                                                                  \
    cudaError_t err_ = (x);                                                             \
    if (err_ != cudaSuccess) {                                                          \
      std::printf("FAIL: %s: %s\n", #x, cudaGetErrorString(err_));                      \
      return 1;                                                                         \
    }                                                                                   \
  } while (0)

// One causal forward; returns the number of failures (0 when it ran and matched).
int run_forward() {
  const int b = 1, s = 256, h = 4, d = 64;
  const size_t n = size_t(b) * s * h * d;
  std::vector<uint16_t> q(n), k(n), v(n), out(n);
  for (size_t i = 0; i < n; ++i) {  // deterministic values in [-1, 1]
    q[i] = to_bf16(std::sin(0.37f * float(i % 997)));
    k[i] = to_bf16(std::cos(0.11f * float(i % 991)));
    v[i] = to_bf16(std::sin(0.05f * float(i % 983) + 1.0f));
  }
  void *dq = nullptr, *dk = nullptr, *dv = nullptr, *dout = nullptr;
  const size_t bytes = n * sizeof(uint16_t);
  CUDA_OK(cudaMalloc(&dq, bytes));
  CUDA_OK(cudaMalloc(&dk, bytes));
  CUDA_OK(cudaMalloc(&dv, bytes));
  CUDA_OK(cudaMalloc(&dout, bytes));
  CUDA_OK(cudaMemcpy(dq, q.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dk, k.data(), bytes, cudaMemcpyHostToDevice));
  CUDA_OK(cudaMemcpy(dv, v.data(), bytes, cudaMemcpyHostToDevice));

  flash3::FwdArgs a;
  const auto bf16 = flash3::DType::kBFloat16;
  a.q = flash3::TensorRef::contiguous(dq, bf16, {b, s, h, d});
  a.k = flash3::TensorRef::contiguous(dk, bf16, {b, s, h, d});
  a.v = flash3::TensorRef::contiguous(dv, bf16, {b, s, h, d});
  a.out = flash3::TensorRef::contiguous(dout, bf16, {b, s, h, d});
  a.causal = true;
  flash3::fwd(a);
  CUDA_OK(cudaDeviceSynchronize());
  CUDA_OK(cudaMemcpy(out.data(), dout, bytes, cudaMemcpyDeviceToHost));

  double checksum = 0;
  for (uint16_t x : out) checksum += from_bf16(x);
  std::printf("      forward bf16 (1, %d, %d, %d) causal: checksum %.6f\n", s, h, d, checksum);

  // Host reference for the last query row of head 1 (it sees every key).
  const int row = s - 1, head = 1;
  const float scale = 1.0f / std::sqrt(float(d));
  auto at = [&](const std::vector<uint16_t>& t, int i, int dd) {
    return from_bf16(t[(size_t(i) * h + head) * d + dd]);
  };
  std::vector<double> p(s);
  double mx = -1e30, sum = 0, max_err = 0;
  for (int j = 0; j <= row; ++j) {
    double dot = 0;
    for (int dd = 0; dd < d; ++dd) dot += double(at(q, row, dd)) * at(k, j, dd);
    p[j] = dot * scale;
    mx = std::max(mx, p[j]);
  }
  for (int j = 0; j <= row; ++j) sum += (p[j] = std::exp(p[j] - mx));
  for (int dd = 0; dd < d; ++dd) {
    double ref = 0;
    for (int j = 0; j <= row; ++j) ref += p[j] / sum * at(v, j, dd);
    max_err = std::max(max_err, std::fabs(ref - at(out, row, dd)));
  }
  expect(max_err < 2e-2, "forward row " + std::to_string(row) + " matches the host reference (max error " +
                             std::to_string(max_err) + ")");
  cudaFree(dq);
  cudaFree(dk);
  cudaFree(dv);
  cudaFree(dout);
  return 0;
}

}  // namespace

int main() {
  std::printf("flash3 %s\n", flash3_version());
  std::string why;
  const bool hopper = flash3::hopper_available(&why);
  std::printf("flash3::hopper_available() = %s%s%s\n", hopper ? "true" : "false", hopper ? "" : ": ",
              why.c_str());
  check_validation();
  if (hopper && run_forward() != 0) ++failures;
  if (!hopper) std::printf("skip: the forward (no Hopper GPU)\n");
  std::printf("%s\n", failures == 0 ? "PASSED" : "FAILED");
  return failures == 0 ? 0 : 1;
}

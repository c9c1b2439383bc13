// flash3: the public forward entry point: validate, then dispatch on (dtype, head dim).
#include <string>

#include "flash3/flash3.h"
#include "fwd/fwd_dispatch.h"

namespace flash3 {

namespace detail {
void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw CudaError(std::string("flash3: ") + what + " failed: " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")");
  }
}
}  // namespace detail

void fwd(const FwdArgs& args) {
  const FwdProblem p = validate_fwd(args);
  if (p.batch == 0 || p.seqlen_q == 0 || p.nheads == 0) return;
  int device = 0, major = 0, minor = 0;
  detail::check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  detail::check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                     "cudaDeviceGetAttribute");
  cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
  if (major != 9) {
    throw CudaError("flash3::fwd: the current device has compute capability " +
                    std::to_string(major) + "." + std::to_string(minor) +
                    "; flash3's kernels need Hopper (9.0)");
  }
  if (p.seqlen_k == 0) return detail::fill_no_keys(p, args);

  using Run = void (*)(const FwdProblem&, const FwdArgs&);
  Run run = nullptr;
  const bool bf16 = p.dtype == DType::kBFloat16;
  switch (p.head_dim) {
    case 64: run = bf16 ? detail::run_fwd_bf16_hdim64 : detail::run_fwd_fp16_hdim64; break;
    case 128: run = bf16 ? detail::run_fwd_bf16_hdim128 : detail::run_fwd_fp16_hdim128; break;
    case 256: run = bf16 ? detail::run_fwd_bf16_hdim256 : detail::run_fwd_fp16_hdim256; break;
  }
  if (run == nullptr) {  // validate_fwd admits only built head dims; keep the guard anyway
    throw Error("flash3::fwd: no kernel for head_dim " + std::to_string(p.head_dim));
  }
  run(p, args);
}

}  // namespace flash3

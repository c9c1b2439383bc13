// dtype names and sizes, TensorRef helpers, and the host-side CUDA queries used by validation.
#include "flash3/flash3.h"
#include "dispatch.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <string>
#include <vector>

namespace flash3 {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat32: return "float32";
    case DType::kFloat8E4M3: return "float8_e4m3";
    case DType::kFloat8E5M2: return "float8_e5m2";
    case DType::kInt32: return "int32";
  }
  return "unknown";
}

int dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
    case DType::kBFloat16: return 2;
    case DType::kFloat32:
    case DType::kInt32: return 4;
    case DType::kFloat8E4M3:
    case DType::kFloat8E5M2: return 1;
  }
  return 0;
}

TensorRef TensorRef::contiguous(void* data, DType dtype, std::initializer_list<int64_t> shape) {
  if (shape.size() > 4) {
    throw Error("flash3::TensorRef::contiguous: rank is " + std::to_string(shape.size()) +
                "; at most 4 dims are supported");
  }
  TensorRef t;
  t.data = data;
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) t.shape[d++] = s;
  int64_t stride = 1;
  for (d = t.rank - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

bool is_supported_head_dim(int head_dim) {
  return detail::kernel_built(DType::kBFloat16, head_dim) || detail::kernel_built(DType::kFloat16, head_dim);
}

namespace detail {
namespace {

// Calls f(dtype, head_dim) for every row built into this library (kernel_rows.inc), the
// forward-only ones included.
template <class F>
void for_each_built_row(F&& f) {
#define FLASH3_KERNEL(DT, HD) f(DType::DT, HD);
#define FLASH3_FWD_KERNEL(DT, HD) f(DType::DT, HD);
#include "kernel_rows.inc"
#undef FLASH3_FWD_KERNEL
#undef FLASH3_KERNEL
}

}  // namespace

std::string built_kernels() {
  std::string out;
  for_each_built_row([&](DType dtype, int head_dim) {
    out += (out.empty() ? "" : ", ") + std::string(dtype_name(dtype)) + " x " + std::to_string(head_dim);
  });
  return out.empty() ? "none" : out;
}

std::string built_head_dims(DType dtype) {
  std::vector<int> dims;  // the table has one row per (dtype, head dim)
  for_each_built_row([&](DType row_dtype, int head_dim) {
    if (row_dtype == dtype) dims.push_back(head_dim);
  });
  std::sort(dims.begin(), dims.end());
  std::string out;
  for (int d : dims) out += (out.empty() ? "" : ", ") + std::to_string(d);
  return out.empty() ? "none" : out;
}

void throw_no_kernel(const char* entry, DType dtype, int head_dim) {
  throw Error(std::string(entry) + ": this library has no kernel for " + dtype_name(dtype) + " with head_dim " +
              std::to_string(head_dim) + "; it was built with (dtype x head_dim) " + built_kernels() +
              " (CMake's FLASH3_KERNELS chooses the rows)");
}

}  // namespace detail

bool hopper_available(std::string* why_not) {
  auto no = [&](const std::string& why) {
    cudaGetLastError();  // do not leave a sticky error for the caller
    if (why_not) *why_not = why;
    return false;
  };
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
    return no(std::string("no usable CUDA GPU or driver: ") + cudaGetErrorString(err));
  }
  if (err != cudaSuccess) return no(std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(err));
  if (count == 0) return no("no CUDA GPU found");
  int device = 0;
  cudaDeviceProp prop{};
  if ((err = cudaGetDevice(&device)) != cudaSuccess ||
      (err = cudaGetDeviceProperties(&prop, device)) != cudaSuccess) {
    return no(std::string("cannot query the current CUDA device: ") + cudaGetErrorString(err));
  }
  if (prop.major != 9) {
    return no("device " + std::to_string(device) + " (" + prop.name + ") has compute capability " +
              std::to_string(prop.major) + "." + std::to_string(prop.minor) +
              "; flash3 needs a Hopper GPU (compute capability 9.x)");
  }
  if (why_not) why_not->clear();
  return true;
}

PointerKind cuda_pointer_kind(const void* ptr) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, ptr) != cudaSuccess) {
    cudaGetLastError();
    return PointerKind::kUnknown;
  }
  switch (attr.type) {
    case cudaMemoryTypeDevice:
    case cudaMemoryTypeManaged: return PointerKind::kDevice;
    case cudaMemoryTypeHost:
    case cudaMemoryTypeUnregistered: return PointerKind::kHost;
  }
  return PointerKind::kUnknown;
}

}  // namespace flash3

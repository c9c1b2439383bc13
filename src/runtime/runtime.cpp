// flash3: host runtime helpers shared by the forward and backward entry points: CUDA error
// checks, the cached device attributes, the per-stream device memory, the Hopper check.
#include "runtime/runtime.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>

namespace flash3 {

namespace detail {
void check_cuda(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw CudaError(std::string("flash3: ") + what + " failed: " + cudaGetErrorName(err) + " (" +
                    cudaGetErrorString(err) + ")");
  }
}
const DeviceInfo& current_device_info() {
  // NOTES: every fwd()/bwd() call needs these; cudaDeviceGetAttribute costs microseconds of
  // host time per call, which showed in the benchmark at short sequences. One slot per device.
  constexpr int kMaxDevices = 64;
  static DeviceInfo cache[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  auto query = [](int dev, DeviceInfo& info) {
    int l2 = 0;
    check_cuda(cudaDeviceGetAttribute(&info.major, cudaDevAttrComputeCapabilityMajor, dev), "cudaDeviceGetAttribute");
    check_cuda(cudaDeviceGetAttribute(&info.minor, cudaDevAttrComputeCapabilityMinor, dev), "cudaDeviceGetAttribute");
    check_cuda(cudaDeviceGetAttribute(&info.sms, cudaDevAttrMultiProcessorCount, dev), "cudaDeviceGetAttribute");
    check_cuda(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, dev), "cudaDeviceGetAttribute");
    info.l2_bytes = l2;
  };
  if (device < 0 || device >= kMaxDevices) {
    thread_local DeviceInfo uncached;
    query(device, uncached);
    return uncached;
  }
  std::call_once(once[device], query, device, cache[device]);
  return cache[device];
}

namespace {
// Whether `stream` is being captured into a CUDA graph (allocating and clearing memory is not
// allowed then); an error of the query counts as capturing, and is cleared.
bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return capture != cudaStreamCaptureStatusNone;
}
}  // namespace

StreamMemory stream_memory(cudaStream_t stream, size_t scratch_bytes, size_t scratch_zeroed) {
  // NOTES: one buffer per (device, stream): kernels on one stream run in order, so they may
  // share it, while kernels on other streams may run at the same time and get their own. Its
  // head holds the dynamic tile scheduler's two counters (next tile, blocks done), the scratch
  // follows. It only grows, at least twofold, into a new buffer with its head and first zeroed
  // bytes cleared; the old one is kept, not freed, for the life of the process: a CUDA graph
  // captured on the stream may still use it (the kernels leave the counters and zeroed bytes
  // zero when they end, so it stays usable). The scratch is bounded (at most two tail slots per
  // SM), so the buffers kept are too.
  constexpr size_t kHead = 256;  // the counters, padded to keep the scratch aligned
  struct Buffer {
    char* ptr = nullptr;
    size_t scratch_bytes = 0, scratch_zeroed = 0;
  };
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, Buffer> buffers;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mutex);
  Buffer& buf = buffers[std::make_pair(device, stream)];
  auto view = [&buf](bool with_scratch) {
    StreamMemory m;
    if (buf.ptr != nullptr) m.tile_counter = reinterpret_cast<int*>(buf.ptr);
    if (with_scratch && buf.ptr != nullptr) m.scratch = buf.ptr + kHead;
    return m;
  };
  if (buf.ptr != nullptr && buf.scratch_bytes >= scratch_bytes && buf.scratch_zeroed >= scratch_zeroed) {
    return view(true);
  }
  // Allocating (and clearing) is not allowed while the stream is being captured into a graph:
  // what exists already is handed out, the caller does without the rest.
  if (stream_capturing(stream)) return view(false);
  const Buffer want{nullptr, std::max(scratch_bytes, 2 * buf.scratch_bytes), std::max(scratch_zeroed, buf.scratch_zeroed)};
  char* ptr = nullptr;
  check_cuda(cudaMalloc(reinterpret_cast<void**>(&ptr), kHead + want.scratch_bytes), "cudaMalloc(per-stream memory)");
  check_cuda(cudaMemsetAsync(ptr, 0, kHead + want.scratch_zeroed, stream), "cudaMemsetAsync(per-stream memory)");
  buf = Buffer{ptr, want.scratch_bytes, want.scratch_zeroed};
  return view(true);
}

void require_hopper(const char* op) {
  const DeviceInfo& info = current_device_info();
  if (info.major != 9) {
    throw CudaError(std::string(op) + ": the current device has compute capability " +
                    std::to_string(info.major) + "." + std::to_string(info.minor) +
                    "; flash3's kernels need Hopper (9.0)");
  }
}

}  // namespace detail

}  // namespace flash3

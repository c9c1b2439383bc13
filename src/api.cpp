// flash3: the public forward entry point: validate, then dispatch on (dtype, head dim).
#include <map>
#include <mutex>
#include <utility>
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

int* tile_counter(cudaStream_t stream) {
  // NOTES: the dynamic tile scheduler's two counters (next tile, blocks done) must not be shared
  // by kernels that may run at the same time, so each (device, stream) gets its own pair; the
  // kernel sets them back to 0 when it ends, so the next launch on the stream finds them clear.
  // Pairs come out of chunks of 256 allocated once per device and kept for the process.
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, int*> counters;
  static std::map<int, std::pair<int*, int>> chunks;  // device -> (chunk, pairs used)
  constexpr int kPairsPerChunk = 256;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device, stream);
  if (auto it = counters.find(key); it != counters.end()) return it->second;
  // Allocating (and clearing) is not allowed while the stream is being captured into a graph:
  // the caller falls back to a schedule without counters then.
  if (stream_capturing(stream)) return nullptr;
  auto& chunk = chunks[device];
  if (chunk.first == nullptr || chunk.second == kPairsPerChunk) {
    int* ptr = nullptr;
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&ptr), sizeof(int) * 2 * kPairsPerChunk),
               "cudaMalloc(tile counters)");
    chunk = {ptr, 0};
  }
  int* pair = chunk.first + 2 * chunk.second++;
  check_cuda(cudaMemsetAsync(pair, 0, sizeof(int) * 2, stream), "cudaMemsetAsync(tile counters)");
  counters.emplace(key, pair);
  return pair;
}

void* stream_scratch(cudaStream_t stream, size_t bytes, size_t zeroed) {
  // NOTES: one buffer per (device, stream), as for the tile counters: kernels on one stream run
  // in order, so they may share it. It only grows: the old buffer is freed once the stream's
  // work so far is done. Its first `zeroed` bytes are cleared when it is allocated; the kernels
  // that use them leave them zero.
  struct Scratch {
    void* ptr = nullptr;
    size_t bytes = 0;
  };
  static std::mutex mutex;
  static std::map<std::pair<int, cudaStream_t>, Scratch> buffers;
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mutex);
  Scratch& buf = buffers[std::make_pair(device, stream)];
  if (buf.bytes >= bytes) return buf.ptr;
  if (stream_capturing(stream)) return nullptr;
  if (buf.ptr != nullptr) {
    check_cuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize (growing scratch memory)");
    check_cuda(cudaFree(buf.ptr), "cudaFree(scratch memory)");
    buf = Scratch{};
  }
  void* ptr = nullptr;
  check_cuda(cudaMalloc(&ptr, bytes), "cudaMalloc(scratch memory)");
  check_cuda(cudaMemsetAsync(ptr, 0, zeroed, stream), "cudaMemsetAsync(scratch memory)");
  buf = Scratch{ptr, bytes};
  return ptr;
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

void fwd(const FwdArgs& args) {
  const FwdProblem p = validate_fwd(args);
  if (p.batch == 0 || p.seqlen_q == 0 || p.nheads == 0) return;
  detail::require_hopper("flash3::fwd");
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

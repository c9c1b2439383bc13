// flash3: host-side launch helpers shared by the forward and backward launchers: the CuTe view
// the TMA descriptors are built from, launches with programmatic dependent launch, the
// once-per-device shared-memory attribute and occupancy (blocks per SM, clusters per GPU).
#pragma once

#include <atomic>

#include <cute/tensor.hpp>

#include "common/seqlen.h"
#include "flash3/flash3.h"
#include "runtime/runtime.h"

namespace flash3::detail {

using namespace cute;

// The sequence lengths the kernels read (common/seqlen.h), from a validated problem and its
// arguments (FwdArgs or BwdArgs).
template <class Problem, class Args>
SeqLens make_seqlens(const Problem& p, const Args& args) {
  SeqLens s;
  s.seqlen_q = p.seqlen_q;
  s.seqlen_k = p.seqlen_k;
  if (p.varlen) {
    s.cu_q = static_cast<const int*>(args.cu_seqlens_q.data);
    s.cu_k = static_cast<const int*>(args.cu_seqlens_k.data);
    s.used_q = static_cast<const int*>(args.seqused_q.data);
    s.used_k = static_cast<const int*>(args.seqused_k.data);
    s.total_q = int(p.total_q);
    s.total_k = int(p.total_k);
  }
  return s;
}

// The (seqlen, head_dim, heads, batch) CuTe view, head dim contiguous, of a (batch, seqlen,
// heads, head_dim) tensor: what the TMA descriptors are built from (host side).
inline auto qkv_layout(const TensorRef& t) {
  return make_layout(make_shape(int32_t(t.shape[1]), int32_t(t.shape[3]), int32_t(t.shape[2]),
                                int32_t(t.shape[0])),
                     make_stride(t.stride[1], _1{}, t.stride[2], t.stride[0]));
}

// A launch with programmatic dependent launch: the kernel may start while the previous kernel of
// the stream finishes, and must call pdl_wait (common/ptx.h) before it reads that kernel's output or writes what
// that kernel may read (docs/perf-log.md B31, step 24).
template <class... KArgs, class... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 grid, int threads, int smem, cudaStream_t stream,
                const char* what, Args const&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(unsigned(threads));
  cfg.dynamicSmemBytes = size_t(smem);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  check_cuda(cudaLaunchKernelEx(&cfg, kernel, args...), what);
}

// Raises kKernel's dynamic shared-memory limit to `bytes`, once per device: the attribute holds
// for the rest of the process, and the driver call would otherwise cost host time on every
// forward and backward call. (Keyed by the kernel itself: kernels of one signature, as the main
// and tail forward kernels, are set apart.) Devices 64 and up are set on every call.
template <auto kKernel>
void set_max_dynamic_smem(int bytes, const char* what = "cudaFuncSetAttribute(max dynamic shared memory)") {
  static std::atomic<unsigned long long> done{0};  // bit d: set on device d
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  const unsigned long long bit = device >= 0 && device < 64 ? 1ull << device : 0ull;
  if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return;
  check_cuda(cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), what);
  done.fetch_or(bit, std::memory_order_release);
}

// ask()'s answer for the current device, asked once per device and kept in known[device] (the
// answer + 1, 0 before the first call; known: 64 entries). Devices 64 and up, or a null known,
// ask on every call.
template <class Ask>
int once_per_device(std::atomic<int>* known, Ask ask) {
  int device = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  std::atomic<int>* slot = known != nullptr && device >= 0 && device < 64 ? known + device : nullptr;
  if (slot != nullptr) {
    const int k = slot->load(std::memory_order_acquire);
    if (k > 0) return k - 1;
  }
  const int n = ask();
  if (slot != nullptr) slot->store(n + 1, std::memory_order_release);
  return n;
}

// How many blocks of kKernel (threads each, smem bytes of dynamic shared memory) fit on one SM at
// once, asked of the runtime once per device (after set_max_dynamic_smem).
template <auto kKernel>
int blocks_per_sm(int threads, int smem) {
  static std::atomic<int> known[64] = {};
  return once_per_device(known, [&] {
    int n = 0;
    check_cuda(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, threads, size_t(smem)),
               "cudaOccupancyMaxActiveBlocksPerMultiprocessor");
    return n;
  });
}

// The launch attribute of clusters of (1, blocks, 1).
inline cudaLaunchAttribute cluster_along_y(unsigned blocks) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = 1;
  attr.val.clusterDim.y = blocks;
  attr.val.clusterDim.z = 1;
  return attr;
}

// How many clusters of `cluster` blocks along y (threads each, smem bytes of dynamic shared
// memory) fit on the GPU at once, asked of the runtime once per device and cluster size (after
// set_max_dynamic_smem); sizes past 8 are asked on every call.
template <auto kKernel>
int max_active_clusters(int threads, int smem, int cluster) {
  static std::atomic<int> known[9][64] = {};  // per size and device
  return once_per_device(cluster >= 0 && cluster <= 8 ? known[cluster] : nullptr, [&] {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(1, unsigned(cluster));
    cfg.blockDim = dim3(unsigned(threads));
    cfg.dynamicSmemBytes = size_t(smem);
    cudaLaunchAttribute attr[1] = {cluster_along_y(unsigned(cluster))};
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    int n = 0;
    if (cudaOccupancyMaxActiveClusters(&n, kKernel, &cfg) != cudaSuccess) {
      (void)cudaGetLastError();  // clusters unavailable (e.g. a shared GPU): none
      n = 0;
    }
    return n;
  });
}

}  // namespace flash3::detail

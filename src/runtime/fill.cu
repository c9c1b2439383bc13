// flash3: the forward result when there are no keys (seqlen_k == 0): out = 0, lse = +inf,
// the same values the main kernel writes for query rows that can see no key; and a zero fill
// for the backward's dk, dv when there are no queries.
#include "runtime/runtime.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

namespace flash3::detail {

namespace {
// One thread per (batch, row, head); 2-byte elements.
__global__ void fill_no_keys_kernel(uint16_t* out, int64_t sb, int64_t ss, int64_t sh, float* lse,
                                    int64_t lb, int64_t lh, int seqlen_q, int nheads,
                                    int head_dim, int64_t total) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const int h = int(i % nheads), s = int((i / nheads) % seqlen_q), b = int(i / (int64_t(nheads) * seqlen_q));
  uint16_t* row = out + b * sb + s * ss + h * sh;
  for (int d = 0; d < head_dim; ++d) row[d] = 0;  // +0.0 in both fp16 and bf16
  if (lse != nullptr) lse[b * lb + h * lh + s] = INFINITY;
}
// One thread per (batch, row, head) of a rank-4 tensor with 2-byte elements: the row of
// head_dim elements set to +0.
__global__ void zero_rows_kernel(uint16_t* t, int64_t sb, int64_t ss, int64_t sh, int seqlen,
                                 int nheads, int head_dim, int64_t total) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const int h = int(i % nheads), s = int((i / nheads) % seqlen), b = int(i / (int64_t(nheads) * seqlen));
  uint16_t* row = t + b * sb + s * ss + h * sh;
  for (int d = 0; d < head_dim; ++d) row[d] = 0;
}
// One block per sequence: rows [seqused[b], its length) of a 16-bit (batch, seqlen, heads, d)
// tensor, or of a packed (total, heads, d) one (cu: its cu_seqlens), set to +0.
// rows: the tensor's dim 1 (seqlen, or the packed total).
__global__ void zero_unused_rows_kernel(uint16_t* t, int64_t sb, int64_t ss, int64_t sh, const int* cu,
                                        const int* used, int rows, int nheads, int head_dim) {
  const int b = blockIdx.x;
  int start = 0, len = rows;
  if (cu != nullptr) {
    start = min(max(cu[b], 0), rows);
    len = min(max(cu[b + 1], start), rows) - start;
  }
  const int from = min(max(used[b], 0), len);
  uint16_t* base = t + (cu != nullptr ? 0 : b * sb) + int64_t(start) * ss;
  const int64_t n = int64_t(len - from) * nheads * head_dim;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const int d = int(i % head_dim), h = int((i / head_dim) % nheads), r = from + int(i / head_dim / nheads);
    base[r * ss + h * sh + d] = 0;
  }
}
}  // namespace


void zero_unused_rows(const TensorRef& t, const int* cu, const int* used, int batch, cudaStream_t stream) {
  if (used == nullptr || batch == 0) return;
  const TensorRef v = as_batch(t);
  zero_unused_rows_kernel<<<dim3(unsigned(batch)), 256, 0, stream>>>(
      static_cast<uint16_t*>(v.data), v.stride[0], v.stride[1], v.stride[2], t.rank == 3 ? cu : nullptr, used,
      int(v.shape[1]), int(v.shape[2]), int(v.shape[3]));
  check_cuda(cudaGetLastError(), "zero fill (rows past seqused) launch");
}

void zero_16bit(const TensorRef& t_in, cudaStream_t stream) {
  const TensorRef t = as_batch(t_in);
  const int64_t total = t.shape[0] * t.shape[1] * t.shape[2];
  if (total == 0 || t.shape[3] == 0) return;
  const int threads = 256;
  zero_rows_kernel<<<dim3(unsigned((total + threads - 1) / threads)), threads, 0, stream>>>(
      static_cast<uint16_t*>(t.data), t.stride[0], t.stride[1], t.stride[2], int(t.shape[1]),
      int(t.shape[2]), int(t.shape[3]), total);
  check_cuda(cudaGetLastError(), "zero fill launch");
}

void fill_no_keys(const FwdProblem& p, const FwdArgs& args) {
  // A packed q side (out (total_q, nheads, head_dim), lse (nheads, total_q)) as one sequence of
  // total_q rows (rows past seqused_q included).
  const TensorRef out = as_batch(args.out), lse = as_batch(args.lse, 3);
  const int batch = int(out.shape[0]), seqlen_q = int(out.shape[1]);
  const int64_t lb = p.write_lse ? lse.stride[0] : 0, lh = p.write_lse ? lse.stride[1] : 0;
  const int64_t total = int64_t(batch) * seqlen_q * p.nheads;
  if (total == 0) return;
  const int threads = 256;
  const int64_t blocks = (total + threads - 1) / threads;
  fill_no_keys_kernel<<<dim3(unsigned(blocks)), threads, 0, args.stream>>>(
      static_cast<uint16_t*>(out.data), out.stride[0], out.stride[1], out.stride[2],
      p.write_lse ? static_cast<float*>(args.lse.data) : nullptr,
      lb, lh, seqlen_q, p.nheads, p.head_dim, total);
  check_cuda(cudaGetLastError(), "fill_no_keys launch");
}

}  // namespace flash3::detail

// The C ABI (flash3_c.h) over the C++ API: no exception crosses it.
#include "flash3/flash3_c.h"

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <exception>
#include <string>

#include "flash3/flash3.h"

namespace {

using flash3::TensorRef;
static_assert(sizeof(flash3_tensor) == sizeof(TensorRef), "flash3_tensor and TensorRef differ");
static_assert(offsetof(flash3_tensor, data) == offsetof(TensorRef, data), "flash3_tensor.data");
static_assert(offsetof(flash3_tensor, dtype) == offsetof(TensorRef, dtype), "flash3_tensor.dtype");
static_assert(offsetof(flash3_tensor, rank) == offsetof(TensorRef, rank), "flash3_tensor.rank");
static_assert(offsetof(flash3_tensor, shape) == offsetof(TensorRef, shape), "flash3_tensor.shape");
static_assert(offsetof(flash3_tensor, stride) == offsetof(TensorRef, stride), "flash3_tensor.stride");
static_assert(sizeof(flash3::DType) == sizeof(int32_t), "DType must be 32-bit");

TensorRef to_ref(const flash3_tensor* t) {
  TensorRef r;  // a NULL tensor is rank 0: rejected by validation, except fwd's lse ("not written")
  if (t != nullptr) std::memcpy(static_cast<void*>(&r), t, sizeof r);
  return r;
}

// Copies msg into buf (truncated, always NUL-terminated when len > 0) and returns code.
int report(int code, const char* msg, char* buf, int len) {
  if (buf != nullptr && len > 0) {
    const size_t n = std::min(std::strlen(msg), static_cast<size_t>(len) - 1);
    std::memcpy(buf, msg, n);
    buf[n] = '\0';
  }
  return code;
}

// Runs body() (which returns nothing and may throw) and maps the outcome to a return code and
// message: no exception crosses the C ABI.
template <class Body>
int guarded(char* err, int err_len, Body body) {
  try {
    body();
    return report(FLASH3_OK, "", err, err_len);
  } catch (const flash3::CudaError& e) {
    return report(FLASH3_CUDA_ERROR, e.what(), err, err_len);
  } catch (const flash3::Error& e) {
    return report(FLASH3_INVALID_ARGUMENT, e.what(), err, err_len);
  } catch (const std::exception& e) {
    const std::string msg = std::string("flash3: internal error: ") + e.what();
    return report(FLASH3_INTERNAL_ERROR, msg.c_str(), err, err_len);
  } catch (...) {
    return report(FLASH3_INTERNAL_ERROR, "flash3: internal error: unknown exception", err, err_len);
  }
}

// The BwdArgs that flash3_bwd and flash3_bwd_workspace_size share (no workspace, no stream).
flash3::BwdArgs bwd_args(const flash3_tensor* q, const flash3_tensor* k, const flash3_tensor* v,
                         const flash3_tensor* out, const flash3_tensor* dout, const flash3_tensor* lse,
                         const flash3_tensor* dq, const flash3_tensor* dk, const flash3_tensor* dv,
                         float softmax_scale, int causal, int deterministic) {
  flash3::BwdArgs args;
  args.q = to_ref(q);
  args.k = to_ref(k);
  args.v = to_ref(v);
  args.out = to_ref(out);
  args.dout = to_ref(dout);
  args.lse = to_ref(lse);
  args.dq = to_ref(dq);
  args.dk = to_ref(dk);
  args.dv = to_ref(dv);
  args.softmax_scale = softmax_scale;
  args.causal = causal != 0;
  args.deterministic = deterministic != 0;
  return args;
}

}  // namespace

extern "C" {

int flash3_fwd(const flash3_tensor* q, const flash3_tensor* k, const flash3_tensor* v,
               const flash3_tensor* out, const flash3_tensor* lse, float softmax_scale, int causal,
               void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    flash3::FwdArgs args;
    args.q = to_ref(q);
    args.k = to_ref(k);
    args.v = to_ref(v);
    args.out = to_ref(out);
    args.lse = to_ref(lse);
    args.softmax_scale = softmax_scale;
    args.causal = causal != 0;
    args.stream = static_cast<cudaStream_t>(stream);
    flash3::fwd(args);
  });
}

int flash3_bwd(const flash3_tensor* q, const flash3_tensor* k, const flash3_tensor* v,
               const flash3_tensor* out, const flash3_tensor* dout, const flash3_tensor* lse,
               const flash3_tensor* dq, const flash3_tensor* dk, const flash3_tensor* dv,
               float softmax_scale, int causal, int deterministic, void* workspace,
               uint64_t workspace_bytes, void* stream, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    flash3::BwdArgs args = bwd_args(q, k, v, out, dout, lse, dq, dk, dv, softmax_scale, causal, deterministic);
    args.workspace = workspace;
    args.workspace_bytes = static_cast<size_t>(workspace_bytes);
    args.stream = static_cast<cudaStream_t>(stream);
    flash3::bwd(args);
  });
}

int flash3_bwd_workspace_size(const flash3_tensor* q, const flash3_tensor* k,
                              const flash3_tensor* v, const flash3_tensor* out,
                              const flash3_tensor* dout, const flash3_tensor* lse,
                              const flash3_tensor* dq, const flash3_tensor* dk,
                              const flash3_tensor* dv, float softmax_scale, int causal,
                              int deterministic, uint64_t* bytes, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    if (bytes == nullptr) throw flash3::Error("flash3::bwd: bytes is null; it must point to a uint64_t");
    const flash3::BwdArgs args =
        bwd_args(q, k, v, out, dout, lse, dq, dk, dv, softmax_scale, causal, deterministic);
    *bytes = static_cast<uint64_t>(flash3::bwd_workspace_size(flash3::validate_bwd(args)));
  });
}

int flash3_hopper_available(char* why, int why_len) {
  std::string why_not;
  bool ok = false;
  try {
    ok = flash3::hopper_available(&why_not);
  } catch (const std::exception& e) {
    why_not = e.what();
  }
  return report(ok ? 1 : 0, why_not.c_str(), why, why_len);
}

const char* flash3_version(void) { return "0.1.0"; }

}  // extern "C"

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
// The first versions' layouts (LP64), without padding (flash3_c.h): fixed for good.
static_assert(FLASH3_FWD_ARGS_SIZE_V1 == 16 + 5 * sizeof(flash3_tensor) + 8, "flash3_fwd_args v1 layout");
static_assert(FLASH3_BWD_ARGS_SIZE_V1 == 16 + 9 * sizeof(flash3_tensor) + 24, "flash3_bwd_args v1 layout");
static_assert(offsetof(flash3_fwd_args, q) == 16 && offsetof(flash3_bwd_args, q) == 16, "args header");
static_assert(FLASH3_FWD_ARGS_SIZE_V2 == FLASH3_FWD_ARGS_SIZE_V1 + 3 * sizeof(flash3_tensor), "flash3_fwd_args v2 layout");
static_assert(FLASH3_FWD_ARGS_SIZE_V3 == FLASH3_FWD_ARGS_SIZE_V2 + 16, "flash3_fwd_args v3 layout");
static_assert(FLASH3_BWD_ARGS_SIZE_V2 == FLASH3_BWD_ARGS_SIZE_V1 + 16, "flash3_bwd_args v2 layout");
static_assert(offsetof(flash3_fwd_args, cu_seqlens_q) == FLASH3_FWD_ARGS_SIZE_V3 &&
                  FLASH3_FWD_ARGS_SIZE_V4 == FLASH3_FWD_ARGS_SIZE_V3 + 4 * sizeof(flash3_tensor) + 16,
              "flash3_fwd_args v4 layout");
static_assert(offsetof(flash3_bwd_args, cu_seqlens_q) == FLASH3_BWD_ARGS_SIZE_V2 &&
                  FLASH3_BWD_ARGS_SIZE_V3 == FLASH3_BWD_ARGS_SIZE_V2 + 4 * sizeof(flash3_tensor) + 16,
              "flash3_bwd_args v3 layout");
static_assert(sizeof(flash3_fwd_args) == FLASH3_FWD_ARGS_SIZE_V4, "flash3_fwd_args is v4 (update when appending)");
static_assert(sizeof(flash3_bwd_args) == FLASH3_BWD_ARGS_SIZE_V3, "flash3_bwd_args is v3 (update when appending)");
static_assert(FLASH3_QUANTIZE_FP8_ARGS_SIZE_V1 == 8 + 3 * sizeof(flash3_tensor) + 24,
              "flash3_quantize_fp8_args v1 layout");
static_assert(offsetof(flash3_quantize_fp8_args, in) == 8, "flash3_quantize_fp8_args header");
static_assert(sizeof(flash3_quantize_fp8_args) == FLASH3_QUANTIZE_FP8_ARGS_SIZE_V1,
              "flash3_quantize_fp8_args is v1 (update when appending)");
static_assert(FLASH3_KVCACHE_ARGS_SIZE_V1 == 16 + 9 * sizeof(flash3_tensor) + 24, "flash3_kvcache_args v1 layout");
static_assert(offsetof(flash3_kvcache_args, q) == 16 && offsetof(flash3_kvcache_args, stream) % 8 == 0,
              "flash3_kvcache_args header");
static_assert(offsetof(flash3_kvcache_args, k_new) == FLASH3_KVCACHE_ARGS_SIZE_V1 &&
                  FLASH3_KVCACHE_ARGS_SIZE_V2 == FLASH3_KVCACHE_ARGS_SIZE_V1 + 5 * sizeof(flash3_tensor) + 8,
              "flash3_kvcache_args v2 layout");
static_assert(sizeof(flash3_kvcache_args) == FLASH3_KVCACHE_ARGS_SIZE_V2,
              "flash3_kvcache_args is v2 (update when appending)");

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

// The caller's args struct as this library's T: the first struct_size bytes of *args, the
// fields past them at their defaults (zero bytes). Rejects NULL, a size below the first
// version's (v1_size), and a larger struct with a nonzero byte past the fields known here (an
// option this library does not have): see flash3_c.h. `op` ("flash3::fwd: ") starts messages.
template <class T>
T read_args(const T* args, uint32_t v1_size, const char* op, const char* type) {
  const std::string init = std::string("; set it up with ") + type + "_init";
  if (args == nullptr) throw flash3::Error(std::string(op) + "args is null; pass a " + type + init);
  uint32_t size = 0;
  std::memcpy(&size, args, sizeof size);
  if (size < v1_size) {
    throw flash3::Error(std::string(op) + "args->struct_size is " + std::to_string(size) + "; it must be at least " +
                        std::to_string(v1_size) + " (sizeof(" + type + ") of the first version)" + init);
  }
  T a;
  std::memset(static_cast<void*>(&a), 0, sizeof a);
  std::memcpy(static_cast<void*>(&a), args, std::min<size_t>(size, sizeof a));
  const auto* bytes = reinterpret_cast<const unsigned char*>(args);
  for (size_t i = sizeof a; i < size; ++i) {
    if (bytes[i] != 0) {
      throw flash3::Error(std::string(op) + "args->struct_size is " + std::to_string(size) + " and byte " +
                          std::to_string(i) + " is not zero; this library knows the first " +
                          std::to_string(sizeof a) + " bytes of " + type +
                          ": the caller sets an option it does not have (use a newer libflash3)");
    }
  }
  return a;
}

// A reserved field (`name`) must be zero: it may carry an option in a later version.
void require_zero(const char* op, const char* name, uint32_t value) {
  if (value != 0) {
    throw flash3::Error(std::string(op) + "args->" + name + " is " + std::to_string(value) + "; it must be 0");
  }
}

// The window and softcap fields (fwd v3, bwd v2, kvcache v1; zero in an older struct: none).
template <class C, class Args>
void set_mask(const C& a, Args& args) {
  if (a.window != 0) {
    args.window_left = a.window_left;
    args.window_right = a.window_right;
  }
  args.softcap = a.softcap;
}

// The variable-length fields (fwd v4, bwd v3; zero in an older struct: none, values checked).
template <class C, class Args>
void set_varlen(const C& a, Args& args) {
  args.cu_seqlens_q = to_ref(&a.cu_seqlens_q);
  args.cu_seqlens_k = to_ref(&a.cu_seqlens_k);
  args.seqused_q = to_ref(&a.seqused_q);
  args.seqused_k = to_ref(&a.seqused_k);
  args.max_seqlen_q = a.max_seqlen_q;
  args.max_seqlen_k = a.max_seqlen_k;
  args.check_seqlens = a.no_seqlens_check == 0;
}

flash3::FwdArgs fwd_args(const flash3_fwd_args* c) {
  const flash3_fwd_args a = read_args(c, FLASH3_FWD_ARGS_SIZE_V1, "flash3::fwd: ", "flash3_fwd_args");
  require_zero("flash3::fwd: ", "reserved", a.reserved);
  require_zero("flash3::fwd: ", "reserved_v4", a.reserved_v4);
  flash3::FwdArgs args;
  args.q = to_ref(&a.q);
  args.k = to_ref(&a.k);
  args.v = to_ref(&a.v);
  args.out = to_ref(&a.out);
  args.lse = to_ref(&a.lse);
  args.q_scale = to_ref(&a.q_scale);
  args.k_scale = to_ref(&a.k_scale);
  args.v_scale = to_ref(&a.v_scale);
  args.softmax_scale = a.softmax_scale;
  args.causal = a.causal != 0;
  args.stream = static_cast<cudaStream_t>(a.stream);
  set_mask(a, args);
  set_varlen(a, args);
  return args;
}

flash3::BwdArgs bwd_args(const flash3_bwd_args* c) {
  const flash3_bwd_args a = read_args(c, FLASH3_BWD_ARGS_SIZE_V1, "flash3::bwd: ", "flash3_bwd_args");
  require_zero("flash3::bwd: ", "reserved_v3", a.reserved_v3);
  flash3::BwdArgs args;
  args.q = to_ref(&a.q);
  args.k = to_ref(&a.k);
  args.v = to_ref(&a.v);
  args.out = to_ref(&a.out);
  args.dout = to_ref(&a.dout);
  args.lse = to_ref(&a.lse);
  args.dq = to_ref(&a.dq);
  args.dk = to_ref(&a.dk);
  args.dv = to_ref(&a.dv);
  args.softmax_scale = a.softmax_scale;
  args.causal = a.causal != 0;
  args.deterministic = a.deterministic != 0;
  args.workspace = a.workspace;
  args.workspace_bytes = static_cast<size_t>(a.workspace_bytes);
  args.stream = static_cast<cudaStream_t>(a.stream);
  set_mask(a, args);
  set_varlen(a, args);
  return args;
}

flash3::QuantizeArgs quantize_args(const flash3_quantize_fp8_args* c) {
  const flash3_quantize_fp8_args a = read_args(c, FLASH3_QUANTIZE_FP8_ARGS_SIZE_V1, "flash3::quantize_fp8: ",
                                               "flash3_quantize_fp8_args");
  require_zero("flash3::quantize_fp8: ", "reserved", a.reserved);
  flash3::QuantizeArgs args;
  args.in = to_ref(&a.in);
  args.out = to_ref(&a.out);
  args.scale = to_ref(&a.scale);
  args.block_rows = a.block_rows;
  args.hadamard = a.hadamard != 0;
  args.seed = a.seed;
  args.stream = static_cast<cudaStream_t>(a.stream);
  return args;
}

flash3::KvcacheArgs kvcache_args(const flash3_kvcache_args* c) {
  const flash3_kvcache_args a =
      read_args(c, FLASH3_KVCACHE_ARGS_SIZE_V1, "flash3::fwd_kvcache: ", "flash3_kvcache_args");
  require_zero("flash3::fwd_kvcache: ", "reserved_v2", a.reserved_v2);
  flash3::KvcacheArgs args;
  args.q = to_ref(&a.q);
  args.k_cache = to_ref(&a.k_cache);
  args.v_cache = to_ref(&a.v_cache);
  args.out = to_ref(&a.out);
  args.lse = to_ref(&a.lse);
  args.cache_seqlens = to_ref(&a.cache_seqlens);
  args.cache_batch_idx = to_ref(&a.cache_batch_idx);
  args.cache_leftpad = to_ref(&a.cache_leftpad);
  args.page_table = to_ref(&a.page_table);
  args.softmax_scale = a.softmax_scale;
  args.causal = a.causal != 0;
  args.num_splits = a.num_splits;
  args.stream = static_cast<cudaStream_t>(a.stream);
  set_mask(a, args);
  // v2 (zero in a v1 struct: no append, no rotary, no MLA)
  args.k_new = to_ref(&a.k_new);
  args.v_new = to_ref(&a.v_new);
  args.rotary_cos = to_ref(&a.rotary_cos);
  args.rotary_sin = to_ref(&a.rotary_sin);
  args.qv = to_ref(&a.qv);
  args.rotary_interleaved = a.rotary_interleaved != 0;
  return args;
}

}  // namespace

extern "C" {

int flash3_fwd(const flash3_fwd_args* args, char* err, int err_len) {
  return guarded(err, err_len, [&] { flash3::fwd(fwd_args(args)); });
}

int flash3_bwd(const flash3_bwd_args* args, char* err, int err_len) {
  return guarded(err, err_len, [&] { flash3::bwd(bwd_args(args)); });
}

int flash3_bwd_workspace_size(const flash3_bwd_args* args, uint64_t* bytes, char* err, int err_len) {
  return guarded(err, err_len, [&] {
    flash3::BwdArgs a = bwd_args(args);
    if (bytes == nullptr) throw flash3::Error("flash3::bwd: bytes is null; it must point to a uint64_t");
    a.workspace = nullptr;  // not read: the size is asked before there is one
    *bytes = static_cast<uint64_t>(flash3::bwd_workspace_size(flash3::validate_bwd(a)));
  });
}

int flash3_quantize_fp8(const flash3_quantize_fp8_args* args, char* err, int err_len) {
  return guarded(err, err_len, [&] { flash3::quantize_fp8(quantize_args(args)); });
}

int flash3_fwd_kvcache(const flash3_kvcache_args* args, char* err, int err_len) {
  return guarded(err, err_len, [&] { flash3::fwd_kvcache(kvcache_args(args)); });
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

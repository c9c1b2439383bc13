/* flash3: C ABI over the C++ API, for ctypes / FFI callers (the Python binding uses it).
 * flash3_tensor has the same layout as flash3::TensorRef. */
#ifndef FLASH3_C_H_
#define FLASH3_C_H_

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* dtype codes, as flash3::DType */
enum {
  FLASH3_FLOAT16 = 0,
  FLASH3_BFLOAT16 = 1,
  FLASH3_FLOAT32 = 2,
  FLASH3_FLOAT8_E4M3 = 3,
  FLASH3_FLOAT8_E5M2 = 4,
  FLASH3_INT32 = 5
};

typedef struct flash3_tensor {
  void* data;
  int32_t dtype;
  int32_t rank;
  int64_t shape[4];
  int64_t stride[4]; /* in elements */
} flash3_tensor;

/* Return codes */
enum { FLASH3_OK = 0, FLASH3_INVALID_ARGUMENT = 1, FLASH3_CUDA_ERROR = 2, FLASH3_INTERNAL_ERROR = 3 };

/* Forward attention. lse may be NULL or have data == NULL (not written).
 * softmax_scale <= 0 means 1/sqrt(head_dim). stream is a cudaStream_t (NULL: default stream).
 * On failure returns a nonzero code and writes a NUL-terminated message into err (if err_len > 0). */
int flash3_fwd(const flash3_tensor* q, const flash3_tensor* k, const flash3_tensor* v,
               const flash3_tensor* out, const flash3_tensor* lse, float softmax_scale, int causal,
               void* stream, char* err, int err_len);

/* Backward attention: writes dq, dk, dv (see flash3::BwdArgs in flash3.h). workspace may be NULL
 * (the library allocates with cudaMallocAsync on stream); else at least
 * flash3_bwd_workspace_size() bytes. Same return codes and err convention as flash3_fwd. */
int flash3_bwd(const flash3_tensor* q, const flash3_tensor* k, const flash3_tensor* v,
               const flash3_tensor* out, const flash3_tensor* dout, const flash3_tensor* lse,
               const flash3_tensor* dq, const flash3_tensor* dk, const flash3_tensor* dv,
               float softmax_scale, int causal, int deterministic, void* workspace,
               uint64_t workspace_bytes, void* stream, char* err, int err_len);

/* Scratch bytes flash3_bwd needs for these arguments, written to *bytes. Validates like
 * flash3_bwd (same codes and messages). */
int flash3_bwd_workspace_size(const flash3_tensor* q, const flash3_tensor* k,
                              const flash3_tensor* v, const flash3_tensor* out,
                              const flash3_tensor* dout, const flash3_tensor* lse,
                              const flash3_tensor* dq, const flash3_tensor* dk,
                              const flash3_tensor* dv, float softmax_scale, int causal,
                              int deterministic, uint64_t* bytes, char* err, int err_len);

/* 1 if a Hopper GPU is usable, else 0 (and a reason in why, if why_len > 0). */
int flash3_hopper_available(char* why, int why_len);

/* Library version string. */
const char* flash3_version(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASH3_C_H_ */

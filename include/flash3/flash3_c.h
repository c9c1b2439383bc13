/* flash3: C ABI over the C++ API, for ctypes / FFI callers (the Python binding uses it).
 * flash3_tensor has the same layout as flash3::TensorRef. */
#ifndef FLASH3_C_H_
#define FLASH3_C_H_

#include <stddef.h>
#include <stdint.h>
#include <string.h>

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

/* Arguments travel in structs that carry their own size, so that options can be added without
 * breaking callers. Rules:
 *  - Set a struct up with flash3_*_args_init, then fill what you need:
 *    struct_size is then sizeof the struct as your header declares it, and every other field is
 *    at its default. Every default is all-zero bytes, and the structs have no padding.
 *  - The library reads the first struct_size bytes. A struct older (smaller) than the library's
 *    works: the fields past it take their defaults. A newer (larger) one works while every byte
 *    past the fields the library knows is zero (those options at their defaults); a nonzero one
 *    is an option this library does not have, and is rejected rather than ignored.
 *  - NULL, or struct_size below the first version's (FLASH3_*_ARGS_SIZE_V1), is rejected.
 *  - New fields are only ever appended. */

/* Forward attention (see flash3::FwdArgs in flash3.h). */
typedef struct flash3_fwd_args {
  uint32_t struct_size; /* bytes: sizeof(flash3_fwd_args) of the caller's header */
  int32_t causal;       /* nonzero: causal mask, aligned bottom-right */
  float softmax_scale;  /* <= 0 (or NaN): 1/sqrt(head_dim) */
  uint32_t reserved;    /* 0 */
  flash3_tensor q, k, v, out;
  flash3_tensor lse;    /* data == NULL: not written */
  void* stream;         /* a cudaStream_t; NULL: the default stream */
  /* v2: FP8 (float8_e4m3 q, k, v) dequantization scales, float32; data == NULL: none (1). Shapes
   * (batch, nheads_kv) or block scales, as flash3::FwdArgs::q_scale, k_scale, v_scale. */
  flash3_tensor q_scale, k_scale, v_scale;
  /* v3: sliding window and softcap (see flash3::FwdArgs). */
  int32_t window;       /* nonzero: window_left, window_right apply; 0: no window (both -1) */
  int32_t window_left;  /* >= 0, or -1 for no bound on that side */
  int32_t window_right;
  float softcap;        /* > 0: softcap * tanh(score / softcap); 0: none */
  /* v4: variable-length batches (see flash3::FwdArgs): int32 device tensors; one with data == NULL
   * and rank 0 is not given. With cu_seqlens_q, q and out are (total_q, nheads, head_dim) and lse
   * (nheads, total_q); with cu_seqlens_k, k and v are (total_k, nheads_kv, head_dim). */
  flash3_tensor cu_seqlens_q, cu_seqlens_k; /* (batch + 1) */
  flash3_tensor seqused_q, seqused_k;       /* (batch) */
  int32_t max_seqlen_q, max_seqlen_k;       /* with cu_seqlens: at least every sequence's length */
  int32_t no_seqlens_check; /* nonzero: the values of cu_seqlens and seqused are not checked (no
                               device-to-host copy and stream synchronization) */
  uint32_t reserved_v4;     /* 0 */
} flash3_fwd_args;

/* Backward attention (see flash3::BwdArgs in flash3.h). */
typedef struct flash3_bwd_args {
  uint32_t struct_size; /* bytes: sizeof(flash3_bwd_args) of the caller's header */
  int32_t causal;       /* as the forward's */
  int32_t deterministic;/* nonzero: bitwise-identical gradients from run to run */
  float softmax_scale;  /* as the forward's */
  flash3_tensor q, k, v, out, dout, lse;
  flash3_tensor dq, dk, dv;
  void* workspace;      /* NULL: the library allocates (cudaMallocAsync on stream); else at least
                           flash3_bwd_workspace_size() bytes, 256-byte aligned */
  uint64_t workspace_bytes;
  void* stream;         /* a cudaStream_t; NULL: the default stream */
  /* v2: as the forward's (flash3_fwd_args v3); must match it. */
  int32_t window;
  int32_t window_left;
  int32_t window_right;
  float softcap;
  /* v3: as the forward's (flash3_fwd_args v4); must match it. With cu_seqlens_q, dout and dq are
   * packed as q; with cu_seqlens_k, dk and dv as k. */
  flash3_tensor cu_seqlens_q, cu_seqlens_k;
  flash3_tensor seqused_q, seqused_k;
  int32_t max_seqlen_q, max_seqlen_k;
  int32_t no_seqlens_check;
  uint32_t reserved_v3;     /* 0 */
} flash3_bwd_args;

/* FP8 quantization for the FP8 forward (see flash3::QuantizeArgs in flash3.h): in (batch, seqlen,
 * nheads, head_dim) float16 or bfloat16 -> out (same shape) float8_e4m3 and scale (batch, nheads,
 * ceil(seqlen / block_rows)) float32, in ~= out * scale per block of block_rows rows. */
typedef struct flash3_quantize_fp8_args {
  uint32_t struct_size; /* bytes: sizeof(flash3_quantize_fp8_args) of the caller's header */
  uint32_t reserved;    /* 0 (keeps the tensors 8-byte aligned without padding) */
  flash3_tensor in, out, scale;
  int32_t block_rows;   /* rows per scale block; 0: fp8_block_kv(head_dim) (k, v; 64 for q) */
  int32_t hadamard;     /* nonzero: rotate each row by the seeded Hadamard transform first */
  uint64_t seed;        /* the rotation's random signs (the same seed for q and k) */
  void* stream;         /* a cudaStream_t; NULL: the default stream */
} flash3_quantize_fp8_args;

/* Decoding over a KV cache (see flash3::KvcacheArgs in flash3.h): q attends to the cached keys
 * and values of its batch entry, contiguous (batch_cache, seqlen_cache, nheads_kv, head_dim) or
 * paged (num_pages, page_size, nheads_kv, head_dim) through page_table. */
typedef struct flash3_kvcache_args {
  uint32_t struct_size; /* bytes: sizeof(flash3_kvcache_args) of the caller's header */
  int32_t causal;       /* nonzero: causal mask, aligned bottom-right to each sequence's keys */
  float softmax_scale;  /* <= 0 (or NaN): 1/sqrt(head_dim); with qv 1/sqrt(576) */
  int32_t num_splits;   /* key-range splits, 1..64; 0: the library's heuristic */
  flash3_tensor q, k_cache, v_cache, out;
  flash3_tensor lse;    /* data == NULL: not written */
  /* int32 device tensors; one with data == NULL and rank 0 is not given */
  flash3_tensor cache_seqlens;   /* (batch): the end of each sequence's keys; default the whole cache */
  flash3_tensor cache_batch_idx; /* (batch): the cache entry of each batch entry (contiguous cache only) */
  flash3_tensor cache_leftpad;   /* (batch): the first key of each sequence; default 0 */
  flash3_tensor page_table;      /* (batch, max_pages_per_seq): the pages of a paged cache */
  int32_t window;       /* nonzero: window_left, window_right apply; 0: no window (both -1) */
  int32_t window_left;  /* >= 0, or -1 for no bound on that side */
  int32_t window_right;
  float softcap;        /* > 0: softcap * tanh(score / softcap); 0: none */
  void* stream;         /* a cudaStream_t; NULL: the default stream */
  /* v2: the append and MLA (see flash3::KvcacheArgs); a tensor with data == NULL and rank 0 is not
   * given. k_new, v_new (batch, seqlen_new, nheads_kv, head_dim), q's dtype, together and with
   * cache_seqlens: written into the cache at cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1
   * and attended to. rotary_cos, rotary_sin (seqlen_ro, rotary_dim / 2), float32 or q's dtype,
   * together and only with k_new: the new keys and q rotated first. qv (batch, seqlen_q, nheads,
   * 512), q's dtype: MLA, the queries' latent part (q then (..., 64), k_cache and k_new (..., 64),
   * v_cache and v_new (..., 512), out (batch, seqlen_q, nheads, 512); softmax_scale <= 0: 1/sqrt(576)). */
  flash3_tensor k_new, v_new;
  flash3_tensor rotary_cos, rotary_sin;
  flash3_tensor qv;
  int32_t rotary_interleaved; /* nonzero: rotated pairs (2j, 2j + 1); 0: (j, j + rotary_dim / 2) */
  uint32_t reserved_v2;       /* 0 */
} flash3_kvcache_args;

/* The size of each version (the end of its last field); the first version's (V1) is the smallest
 * struct_size accepted. */
#define FLASH3_FWD_ARGS_SIZE_V1 ((uint32_t)(offsetof(flash3_fwd_args, stream) + sizeof(void*)))
#define FLASH3_FWD_ARGS_SIZE_V2 ((uint32_t)(offsetof(flash3_fwd_args, v_scale) + sizeof(flash3_tensor)))
#define FLASH3_FWD_ARGS_SIZE_V3 ((uint32_t)(offsetof(flash3_fwd_args, softcap) + sizeof(float)))
#define FLASH3_FWD_ARGS_SIZE_V4 ((uint32_t)(offsetof(flash3_fwd_args, reserved_v4) + sizeof(uint32_t)))
#define FLASH3_BWD_ARGS_SIZE_V1 ((uint32_t)(offsetof(flash3_bwd_args, stream) + sizeof(void*)))
#define FLASH3_BWD_ARGS_SIZE_V2 ((uint32_t)(offsetof(flash3_bwd_args, softcap) + sizeof(float)))
#define FLASH3_BWD_ARGS_SIZE_V3 ((uint32_t)(offsetof(flash3_bwd_args, reserved_v3) + sizeof(uint32_t)))
#define FLASH3_QUANTIZE_FP8_ARGS_SIZE_V1 \
  ((uint32_t)(offsetof(flash3_quantize_fp8_args, stream) + sizeof(void*)))
#define FLASH3_KVCACHE_ARGS_SIZE_V1 ((uint32_t)(offsetof(flash3_kvcache_args, stream) + sizeof(void*)))
#define FLASH3_KVCACHE_ARGS_SIZE_V2 ((uint32_t)(offsetof(flash3_kvcache_args, reserved_v2) + sizeof(uint32_t)))

/* Set a struct up: all zero (every default), struct_size = sizeof. Inline, so that struct_size
 * is the caller's sizeof, not the library's. */
static inline void flash3_fwd_args_init(flash3_fwd_args* args) {
  memset(args, 0, sizeof *args);
  args->struct_size = (uint32_t)sizeof *args;
}
static inline void flash3_bwd_args_init(flash3_bwd_args* args) {
  memset(args, 0, sizeof *args);
  args->struct_size = (uint32_t)sizeof *args;
}
static inline void flash3_quantize_fp8_args_init(flash3_quantize_fp8_args* args) {
  memset(args, 0, sizeof *args);
  args->struct_size = (uint32_t)sizeof *args;
}
static inline void flash3_kvcache_args_init(flash3_kvcache_args* args) {
  memset(args, 0, sizeof *args);
  args->struct_size = (uint32_t)sizeof *args;
}

/* Forward attention: out, and lse where given. On failure returns a nonzero code and writes a
 * NUL-terminated message into err (if err_len > 0). */
int flash3_fwd(const flash3_fwd_args* args, char* err, int err_len);

/* Backward attention: writes dq, dk, dv. Same return codes and err convention as flash3_fwd. */
int flash3_bwd(const flash3_bwd_args* args, char* err, int err_len);

/* Scratch bytes flash3_bwd needs for these arguments (workspace and stream are not read),
 * written to *bytes. Validates like flash3_bwd (same codes and messages). */
int flash3_bwd_workspace_size(const flash3_bwd_args* args, uint64_t* bytes, char* err, int err_len);

/* FP8 quantization: writes out and scale. Same return codes and err convention as flash3_fwd;
 * an empty in (batch, seqlen or nheads 0) returns FLASH3_OK without a launch. */
int flash3_quantize_fp8(const flash3_quantize_fp8_args* args, char* err, int err_len);

/* Decoding over a KV cache: writes out, and lse where given (and, with k_new, the new keys and
 * values into the cache). Same return codes and err convention as flash3_fwd; batch or seqlen_q 0
 * returns FLASH3_OK without a launch. */
int flash3_fwd_kvcache(const flash3_kvcache_args* args, char* err, int err_len);

/* 1 if a Hopper GPU is usable, else 0 (and a reason in why, if why_len > 0). */
int flash3_hopper_available(char* why, int why_len);

/* Library version string. */
const char* flash3_version(void);

#ifdef __cplusplus
}
#endif

#endif /* FLASH3_C_H_ */

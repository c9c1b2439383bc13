"""ctypes view of libflash3.so (include/flash3/flash3_c.h). Needs no torch."""
import ctypes
import ctypes.util
import os
import re
import threading

# dtype codes and return codes, as in flash3_c.h
FLOAT16, BFLOAT16, FLOAT32, FLOAT8_E4M3, FLOAT8_E5M2, INT32 = range(6)
OK, INVALID_ARGUMENT, CUDA_ERROR, INTERNAL_ERROR = range(4)
ERR_LEN = 1024


class Tensor(ctypes.Structure):
    """flash3_tensor: void* data; int32 dtype, rank; int64 shape[4], stride[4] (in elements)."""
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("dtype", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("shape", ctypes.c_int64 * 4),
        ("stride", ctypes.c_int64 * 4),
    ]


assert ctypes.sizeof(Tensor) == 80, "flash3_tensor layout changed"


_VARLEN_FIELDS = [  # flash3_fwd_args v4, flash3_bwd_args v3: variable-length batches
    ("cu_seqlens_q", Tensor), ("cu_seqlens_k", Tensor), ("seqused_q", Tensor), ("seqused_k", Tensor),
    ("max_seqlen_q", ctypes.c_int32),
    ("max_seqlen_k", ctypes.c_int32),
    ("no_seqlens_check", ctypes.c_int32),
]


class FwdArgs(ctypes.Structure):
    """flash3_fwd_args (fourth version): the layout _kernels._FWD_VARLEN packs (_kernels._FWD: its
    first FWD_ARGS_SIZE_V3 bytes)."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("causal", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float),
        ("reserved", ctypes.c_uint32),
        ("q", Tensor), ("k", Tensor), ("v", Tensor), ("out", Tensor), ("lse", Tensor),
        ("stream", ctypes.c_void_p),
        ("q_scale", Tensor), ("k_scale", Tensor), ("v_scale", Tensor),  # v2: FP8 scales
        ("window", ctypes.c_int32),  # v3: sliding window (nonzero: window_left/right apply), softcap
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("softcap", ctypes.c_float),
        *_VARLEN_FIELDS,  # v4
        ("reserved_v4", ctypes.c_uint32),
    ]


class BwdArgs(ctypes.Structure):
    """flash3_bwd_args (third version): the layout _kernels._BWD_VARLEN packs (_kernels._BWD: its
    first BWD_ARGS_SIZE_V2 bytes)."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("causal", ctypes.c_int32),
        ("deterministic", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float),
        ("q", Tensor), ("k", Tensor), ("v", Tensor), ("out", Tensor), ("dout", Tensor), ("lse", Tensor),
        ("dq", Tensor), ("dk", Tensor), ("dv", Tensor),
        ("workspace", ctypes.c_void_p),
        ("workspace_bytes", ctypes.c_uint64),
        ("stream", ctypes.c_void_p),
        ("window", ctypes.c_int32),  # v2: as the forward's (v3); must match it
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("softcap", ctypes.c_float),
        *_VARLEN_FIELDS,  # v3
        ("reserved_v3", ctypes.c_uint32),
    ]


class QuantizeFp8Args(ctypes.Structure):
    """flash3_quantize_fp8_args (first version): the layout _kernels._QUANTIZE packs."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("reserved", ctypes.c_uint32),
        ("in_", Tensor), ("out", Tensor), ("scale", Tensor),  # C: in, out, scale
        ("block_rows", ctypes.c_int32),
        ("hadamard", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
        ("stream", ctypes.c_void_p),
    ]


class KvcacheArgs(ctypes.Structure):
    """flash3_kvcache_args (second version: the append and MLA): the layout _kernels._KVCACHE_APPEND packs
    (_kernels._KVCACHE: its first KVCACHE_ARGS_SIZE_V1 bytes)."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32),
        ("causal", ctypes.c_int32),
        ("softmax_scale", ctypes.c_float),
        ("num_splits", ctypes.c_int32),
        ("q", Tensor), ("k_cache", Tensor), ("v_cache", Tensor), ("out", Tensor), ("lse", Tensor),
        ("cache_seqlens", Tensor), ("cache_batch_idx", Tensor), ("cache_leftpad", Tensor), ("page_table", Tensor),
        ("window", ctypes.c_int32),
        ("window_left", ctypes.c_int32),
        ("window_right", ctypes.c_int32),
        ("softcap", ctypes.c_float),
        ("stream", ctypes.c_void_p),
        ("k_new", Tensor), ("v_new", Tensor), ("rotary_cos", Tensor), ("rotary_sin", Tensor),  # v2: the append
        ("qv", Tensor),  # v2: MLA (the queries' latent part)
        ("rotary_interleaved", ctypes.c_int32),
        ("reserved_v2", ctypes.c_uint32),
    ]


# struct_size as this package fills the structs (flash3_c.h): the variable-length calls the whole
# structs (FLASH3_FWD_ARGS_SIZE_V4, FLASH3_BWD_ARGS_SIZE_V3), every other call the versions before
# them (FLASH3_FWD_ARGS_SIZE_V3, FLASH3_BWD_ARGS_SIZE_V2: what a library without variable lengths
# reads too); FLASH3_QUANTIZE_FP8_ARGS_SIZE_V1; the KV-cache calls with an append or qv (MLA) the
# whole struct (FLASH3_KVCACHE_ARGS_SIZE_V2), the others the first version
# (FLASH3_KVCACHE_ARGS_SIZE_V1).
FWD_ARGS_SIZE = ctypes.sizeof(FwdArgs)
BWD_ARGS_SIZE = ctypes.sizeof(BwdArgs)
FWD_ARGS_SIZE_V3 = FwdArgs.cu_seqlens_q.offset
BWD_ARGS_SIZE_V2 = BwdArgs.cu_seqlens_q.offset
QUANTIZE_FP8_ARGS_SIZE = ctypes.sizeof(QuantizeFp8Args)
KVCACHE_ARGS_SIZE = ctypes.sizeof(KvcacheArgs)
KVCACHE_ARGS_SIZE_V1 = KvcacheArgs.k_new.offset
assert (FWD_ARGS_SIZE, BWD_ARGS_SIZE, FWD_ARGS_SIZE_V3, BWD_ARGS_SIZE_V2, QUANTIZE_FP8_ARGS_SIZE, KVCACHE_ARGS_SIZE,
        KVCACHE_ARGS_SIZE_V1) == (1016, 1112, 680, 776, 272, 1168, 760), "flash3 args layout changed"

_lib = None
_load_error = None


def _candidates():
    """Where libflash3.so is looked for, in order: $FLASH3_LIB (alone: an explicit choice does not
    silently fall back to another build); the copy inside this package (pip install .); the
    build tree of a source checkout (python/flash3 -> build/libflash3.so); the loader's paths."""
    env = os.environ.get("FLASH3_LIB")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    out = []
    packaged = os.path.join(here, "libflash3.so")
    if os.path.exists(packaged):
        out.append(packaged)
    out.append(os.path.normpath(os.path.join(here, "..", "..", "build", "libflash3.so")))
    found = ctypes.util.find_library("flash3")
    if found:
        out.append(found)
    return out


def _bind_bwd(handle, ptr):
    """Declares flash3_bwd and flash3_bwd_workspace_size where the library has them (a library
    built before the backward existed still loads; has_bwd() then says False)."""
    if not (hasattr(handle, "flash3_bwd") and hasattr(handle, "flash3_bwd_workspace_size")):
        return
    handle.flash3_bwd.argtypes = [ptr, ctypes.c_char_p, ctypes.c_int]
    handle.flash3_bwd.restype = ctypes.c_int
    handle.flash3_bwd_workspace_size.argtypes = [ptr, ctypes.POINTER(ctypes.c_uint64), ctypes.c_char_p,
                                                 ctypes.c_int]
    handle.flash3_bwd_workspace_size.restype = ctypes.c_int


def _bind_optional(handle, ptr, name):
    """Declares the entry point `name` (int name(const args*, char* err, int err_len)) where the
    library has it: flash3_quantize_fp8, flash3_fwd_kvcache (a library built before them still
    loads; has_quantize() / has_kvcache() then say False)."""
    if not hasattr(handle, name):
        return
    getattr(handle, name).argtypes = [ptr, ctypes.c_char_p, ctypes.c_int]
    getattr(handle, name).restype = ctypes.c_int


def has_kvcache():
    """True when the loaded library exports flash3_fwd_kvcache (decoding over a KV cache)."""
    return hasattr(lib(), "flash3_fwd_kvcache")


def has_quantize():
    """True when the loaded library exports flash3_quantize_fp8."""
    return hasattr(lib(), "flash3_quantize_fp8")


def has_bwd():
    """True when the loaded library exports the backward entry points."""
    handle = lib()
    return hasattr(handle, "flash3_bwd") and hasattr(handle, "flash3_bwd_workspace_size")


# An older library's answer to a struct with a nonzero byte past the fields it has (c_api.cpp,
# read_args): "... byte N is not zero; this library knows the first M bytes of ...".
_KNOWN_BYTES = re.compile(r"this library knows the first (\d+) bytes")
_varlen = {}  # (library handle, bwd) -> whether it reads the variable-length fields


def _reads_varlen(call, args_type):
    """Whether the library reads the variable-length fields of args_type (FwdArgs, BwdArgs): `call`
    (args, err) hands it an otherwise empty struct of this package's size with a nonzero byte
    among those fields. The library refuses it either way (q is missing) without touching the
    GPU; an older one says which bytes it knows instead of naming q."""
    args = args_type()
    args.struct_size = ctypes.sizeof(args_type)
    args.no_seqlens_check = 1
    buf = err_buffer()
    call(ctypes.byref(args), buf)
    known = _KNOWN_BYTES.search(buf.value.decode(errors="replace"))
    return known is None or int(known.group(1)) >= ctypes.sizeof(args_type)


def has_varlen(bwd=False):
    """True when the loaded library has variable-length batches: reads the fields of
    flash3_fwd_args v4 (bwd: flash3_bwd_args v3, and has the backward). Asked once per library."""
    handle = lib()
    key = (handle, bool(bwd))
    known = _varlen.get(key)
    if known is None:
        if not bwd:
            known = _reads_varlen(lambda args, buf: handle.flash3_fwd(args, buf, ERR_LEN), FwdArgs)
        else:
            nbytes = ctypes.c_uint64(0)
            known = has_bwd() and _reads_varlen(
                lambda args, buf: handle.flash3_bwd_workspace_size(args, ctypes.byref(nbytes), buf, ERR_LEN), BwdArgs)
        _varlen[key] = known
    return known


def lib():
    """The loaded library; raises RuntimeError (once, with every path tried) if none loads."""
    global _lib, _load_error
    if _lib is not None:
        return _lib
    if _load_error is None:
        errors = []
        for path in _candidates():
            try:
                handle = ctypes.CDLL(path)
            except OSError as e:
                errors.append(f"{path}: {e}")
                continue
            # flash3_fwd_args / flash3_bwd_args / flash3_quantize_fp8_args / flash3_kvcache_args go as
            # addresses (c_void_p: a bytes object, a ctypes buffer, an int, or ctypes.byref of a FwdArgs /
            # BwdArgs): the package packs each call's struct into bytes with one struct.Struct.pack
            # (_kernels.py).
            ptr = ctypes.c_void_p
            handle.flash3_fwd.argtypes = [ptr, ctypes.c_char_p, ctypes.c_int]
            handle.flash3_fwd.restype = ctypes.c_int
            _bind_bwd(handle, ptr)
            _bind_optional(handle, ptr, "flash3_quantize_fp8")
            _bind_optional(handle, ptr, "flash3_fwd_kvcache")
            handle.flash3_hopper_available.argtypes = [ctypes.c_char_p, ctypes.c_int]
            handle.flash3_hopper_available.restype = ctypes.c_int
            handle.flash3_version.argtypes = []
            handle.flash3_version.restype = ctypes.c_char_p
            _lib = handle
            return _lib
        _load_error = ("libflash3.so not found (pip install . puts it inside the package; or set "
                       "FLASH3_LIB, or build it with CMake into build/); "
                       "tried " + "; ".join(errors or ["nothing"]))
    raise RuntimeError(_load_error)


_local = threading.local()


def err_buffer():
    """This thread's buffer for the library's error message, emptied (one per thread, reused)."""
    buf = getattr(_local, "err", None)
    if buf is None:
        buf = _local.err = ctypes.create_string_buffer(ERR_LEN)
    else:
        buf[0] = 0
    return buf

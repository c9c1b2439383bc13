"""flash3's ctypes path: the flash3_fwd_args / flash3_bwd_args / flash3_quantize_fp8_args /
flash3_kvcache_args structs packed for one call, the library called on torch's current stream,
and the allocating kernels the operators (_ops.py) and the eager paths share (fwd, bwd,
quantize_fp8, fwd_varlen, bwd_varlen, fwd_kvcache). Loads libflash3.so at the first call.
"""
import contextlib
import ctypes
import math
import numbers
import operator
import re
import struct
import weakref

import torch

from . import _lib

_DTYPES = {torch.float16: _lib.FLOAT16, torch.bfloat16: _lib.BFLOAT16, torch.float32: _lib.FLOAT32,
           torch.int32: _lib.INT32}
for _name, _code in (("float8_e4m3fn", _lib.FLOAT8_E4M3), ("float8_e5m2", _lib.FLOAT8_E5M2)):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code

_E4M3 = getattr(torch, "float8_e4m3fn", None)
_E5M2 = getattr(torch, "float8_e5m2", None)
FP8_DTYPES = frozenset(t for t in (_E4M3, _E5M2) if t is not None)

_FLOAT32 = torch.float32

_WORKSPACE_ALIGN = 256  # bytes: flash3::BwdArgs::workspace
_BWD_WORKSPACE_BYTES = {}  # (q.shape, k.shape, device, causal, deterministic, window, softcap) -> bytes


def hopper_available():
    """(True, "") when the library loads and sees a usable Hopper GPU, else (False, reason)."""
    try:
        lib = _lib.lib()
    except RuntimeError as e:
        return False, str(e)
    buf = _lib.err_buffer()
    ok = bool(lib.flash3_hopper_available(buf, len(buf)))
    return ok, "" if ok else (buf.value.decode(errors="replace") or "no usable Hopper GPU")


def version():
    return _lib.lib().flash3_version().decode()


# flash3_tensor (flash3_c.h): void* data; int32 dtype, rank; int64 shape[4], stride[4] (elements).
# flash3_fwd_args: uint32 struct_size; int32 causal; float softmax_scale; uint32 reserved; then
# q, k, v, out, lse; void* stream; q_scale, k_scale, v_scale (FP8, v2); int32 window, window_left,
# window_right; float softcap (v3); cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k; int32
# max_seqlen_q, max_seqlen_k, no_seqlens_check; uint32 reserved_v4 (v4). flash3_bwd_args: uint32
# struct_size; int32 causal, deterministic; float softmax_scale; then q, k, v, out, dout, lse, dq,
# dk, dv; void* workspace; uint64 workspace_bytes; void* stream; int32 window, window_left,
# window_right; float softcap (v2); the variable-length fields as the forward's, then uint32
# reserved_v3 (v3). flash3_quantize_fp8_args: uint32 struct_size, reserved; in, out, scale; int32
# block_rows, hadamard; uint64 seed; void* stream. flash3_kvcache_args: uint32 struct_size; int32
# causal; float softmax_scale; int32 num_splits; q, k_cache, v_cache, out, lse, cache_seqlens,
# cache_batch_idx, cache_leftpad, page_table; int32 window, window_left, window_right; float
# softcap; void* stream; k_new, v_new, rotary_cos, rotary_sin, qv; int32 rotary_interleaved; uint32
# reserved_v2 (v2). Each struct is packed whole into a bytes object by one Struct.pack and
# passed by address (the library only reads it): the cheapest way to fill it
# from Python (measured: about half the time of packing a ctypes buffer tensor by tensor). The
# calls without variable lengths pack the versions before them (_FWD, _BWD: fewer fields to
# pack, and read by libraries without variable lengths as well); so do the KV-cache calls
# without an append or qv (_KVCACHE, the first version; _KVCACHE_APPEND, the second, with either).
_TENSOR = "Qii4q4q"
_MASK = "iiif"  # int32 window, window_left, window_right; float softcap
_VARLEN = _TENSOR * 4 + "iiiI"  # cu_seqlens_q/k, seqused_q/k; max_seqlen_q/k, no_seqlens_check, reserved
_FWD = struct.Struct("<IifI" + _TENSOR * 5 + "Q" + _TENSOR * 3 + _MASK)
_BWD = struct.Struct("<Iiif" + _TENSOR * 9 + "QQQ" + _MASK)
_FWD_VARLEN = struct.Struct(_FWD.format + _VARLEN)
_BWD_VARLEN = struct.Struct(_BWD.format + _VARLEN)
_QUANTIZE = struct.Struct("<II" + _TENSOR * 3 + "iiQQ")
_KVCACHE = struct.Struct("<Iifi" + _TENSOR * 9 + _MASK + "Q")
# v2: k_new, v_new, rotary_cos, rotary_sin, qv; rotary_interleaved, reserved_v2
_KVCACHE_APPEND = struct.Struct(_KVCACHE.format + _TENSOR * 5 + "iI")
assert (_FWD.size, _BWD.size, _FWD_VARLEN.size, _BWD_VARLEN.size, _QUANTIZE.size, _KVCACHE.size,
        _KVCACHE_APPEND.size) == (
    _lib.FWD_ARGS_SIZE_V3, _lib.BWD_ARGS_SIZE_V2, _lib.FWD_ARGS_SIZE, _lib.BWD_ARGS_SIZE,
    _lib.QUANTIZE_FP8_ARGS_SIZE, _lib.KVCACHE_ARGS_SIZE_V1, _lib.KVCACHE_ARGS_SIZE), "flash3 args layout changed"
assert _KVCACHE.size - struct.calcsize("<" + _MASK + "Q") == _lib.KvcacheArgs.window.offset
assert _KVCACHE.size + 4 * ctypes.sizeof(_lib.Tensor) == _lib.KvcacheArgs.qv.offset
assert _KVCACHE.size + 5 * ctypes.sizeof(_lib.Tensor) == _lib.KvcacheArgs.rotary_interleaved.offset
assert struct.calcsize("<" + _TENSOR) == ctypes.sizeof(_lib.Tensor) and _lib.FwdArgs.q.offset == 16
assert (_FWD.size - struct.calcsize("<" + _MASK), _BWD.size - struct.calcsize("<" + _MASK)) == (
    _lib.FwdArgs.window.offset, _lib.BwdArgs.window.offset)
assert (_FWD.size + 4 * ctypes.sizeof(_lib.Tensor), _BWD.size + 4 * ctypes.sizeof(_lib.Tensor)) == (
    _lib.FwdArgs.max_seqlen_q.offset, _lib.BwdArgs.max_seqlen_q.offset)
_NULL = (0,) * 11  # a flash3_tensor with data NULL: "not given"
_PAD = ((), (0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))


def _fields(t):
    """The 11 fields of the flash3_tensor of t (None: _NULL). Raises (AttributeError, KeyError,
    IndexError, ValueError) when t is not a CUDA tensor of a known dtype and rank <= 4; the
    caller then names the argument (_explain)."""
    if t is None:
        return _NULL
    if not t.is_cuda:
        raise ValueError
    rank = t.dim()
    if rank == 4:
        return (t.data_ptr(), _DTYPES[t.dtype], 4, *t.shape, *t.stride())
    if rank > 4:
        raise ValueError
    pad = _PAD[4 - rank]
    return (t.data_ptr(), _DTYPES[t.dtype], rank, *t.shape, *pad, *t.stride(), *pad)


# The dtypes _explain suggests for a tensor argument that has one it cannot pass on.
_WANTED_DTYPES = {"lse": "torch.float32", "q_scale": "torch.float32", "k_scale": "torch.float32",
                  "v_scale": "torch.float32", "scale": "torch.float32", "x": "torch.bfloat16 or torch.float16",
                  "cu_seqlens_q": "torch.int32", "cu_seqlens_k": "torch.int32", "seqused_q": "torch.int32",
                  "seqused_k": "torch.int32", "cache_seqlens": "torch.int32", "cache_batch_idx": "torch.int32",
                  "cache_leftpad": "torch.int32", "page_table": "torch.int32", "rotary_cos": "torch.float32 or q's dtype",
                  "rotary_sin": "torch.float32 or q's dtype",
                  "out": "torch.bfloat16 or torch.float16 (torch.float8_e4m3fn from quantize_fp8)"}


def _explain(named, optional=()):
    """Raises the ValueError naming the first of the (name, tensor) pairs that _fields refused."""
    for name, t in named:
        if t is None:
            if name in optional:
                continue
            raise ValueError(f"{name}: must be a tensor, got None")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_cuda:
            raise ValueError(f"{name}: must be a CUDA tensor, got device {t.device}")
        if t.dtype not in _DTYPES:
            wanted = _WANTED_DTYPES.get(name, "torch.bfloat16 or torch.float16")
            raise ValueError(f"{name}: dtype {t.dtype} is not supported (use {wanted})")
        if t.dim() > 4:
            raise ValueError(f"{name}: rank {t.dim()} is not supported (at most 4), shape {tuple(t.shape)}")


def _scale_arg(softmax_scale):
    """The library's float for softmax_scale (0.0: its default 1/sqrt(head_dim))."""
    if softmax_scale is None:
        return 0.0
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale: must be positive and finite, got {softmax_scale}")
    return scale


_raw_stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_current_device = getattr(torch._C, "_cuda_getDevice", None)


def _stream(index):
    """The handle of torch's current stream on CUDA device `index`."""
    if _raw_stream_of is not None:
        return _raw_stream_of(index) or 0
    return torch.cuda.current_stream(index).cuda_stream or 0


def _on_device(index):
    """The library launches on the current device: make it device `index` for the call."""
    current = _current_device() if _current_device is not None else torch.cuda.current_device()
    return contextlib.nullcontext() if index == current else torch.cuda.device(index)


def _check(rc, buf, what, note=None):
    """Raises the library's error for a return code other than OK: ValueError for an invalid
    argument, RuntimeError otherwise. note(msg) may add to the message."""
    if rc != _lib.OK:
        msg = buf.value.decode(errors="replace") or f"{what} failed with code {rc}"
        if note is not None:
            msg = note(msg)
        raise (ValueError if rc == _lib.INVALID_ARGUMENT else RuntimeError)(msg)


def _int_arg(name, value, lo, hi, bounds):
    """value as an int in [lo, hi); ValueError naming it otherwise (`bounds` says the range)."""
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: must be an int, got {type(value).__name__}") from None
    if not lo <= v < hi:
        raise ValueError(f"{name}: must be {bounds}, got {v}")
    return v


_INT32_MAX = 2**31 - 1
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.401298464324817e-45  # the smallest positive float32 (subnormal)
NO_MASK = (0, -1, -1, 0.0)  # the C fields window, window_left, window_right, softcap: none


def window_arg(name, value):
    """One side of the sliding window (name: window_left or window_right) as an int for the
    library's int32. Its range (>= -1) is the library's to check (its message names the side); a
    bound past int32 is clamped to 2^31 - 1, which excludes nothing as it does (seqlens are below
    2^31), and one below -2^31, which the int32 cannot carry, is refused here."""
    try:
        v = operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: must be an int (>= 0, or -1 for no bound on that side), got "
                         f"{type(value).__name__}") from None
    if v > _INT32_MAX:
        return _INT32_MAX
    if v < -2**31:
        raise ValueError(f"{name}: must be >= 0, or -1 for no bound on that side, got {v}")
    return v


def softcap_arg(softcap):
    """softcap as a float for the library's float32: a real number (not a bool, not a tensor). Its
    range (finite, in [0, 2048]) is the library's to check, except for what float32 cannot
    carry: a magnitude beyond float32's largest (refused here; inf and NaN are passed on) or a
    nonzero one that would round to 0 (no softcap at all) in float32."""
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"softcap: must be a real number (a float; 0.0: none), got {type(softcap).__name__}")
    c = float(softcap)
    if c != 0.0 and math.isfinite(c) and not _FLOAT32_TINY <= abs(c) <= _FLOAT32_MAX:
        raise ValueError(f"softcap: {softcap!r} is not representable as a float32 (it must be finite and in "
                         "[0, 2048]; 0.0: none)")
    return c


def mask_fields(window_left=-1, window_right=-1, softcap=0.0):
    """(window, window_left, window_right, softcap): the C structs' fields (flash3_fwd_args v3,
    flash3_bwd_args v2) for a sliding window (-1: no bound on that side) and a softcap (0.0:
    none); window is 1 when either side is bounded. ValueError naming the argument for a type
    the C fields cannot carry (window_arg, softcap_arg)."""
    if type(window_left) is int and type(window_right) is int and window_left == window_right == -1 and (
            type(softcap) is float and softcap == 0.0):
        return NO_MASK  # the common case, without the checks' cost
    left, right = window_arg("window_left", window_left), window_arg("window_right", window_right)
    return (0 if left == right == -1 else 1, left, right, softcap_arg(softcap))


def block_rows_arg(block_rows):
    """block_rows as a positive int (the library's C ABI reads 0 as its default, so 0 is refused
    here rather than quietly changed)."""
    return _int_arg("block_rows", block_rows, 1, 2**31,
                    ">= 1 and < 2^31 (64 for q, flash3.fp8.block_kv(head_dim) for k and v)")


def seed_arg(seed):
    """seed as an int in [0, 2^63) (the operators carry it as a torch int64)."""
    return _int_arg("seed", seed, 0, 2**63, "in [0, 2^63)")


def check_fp8_qkv(q, k, v):
    """ValueError naming the first of q, k, v that is not a float8_e4m3fn tensor (the FP8
    forward's only input dtype): e5m2, and float8 mixed with 16-bit tensors, are refused here,
    before anything runs."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype is _E4M3:
            continue
        if t.dtype is _E5M2:
            raise ValueError(f"{name}: dtype {t.dtype} is not supported; flash3's FP8 attention takes "
                             "torch.float8_e4m3fn q, k and v (e4m3 only)")
        raise ValueError(f"{name}: dtype {t.dtype} but q is {q.dtype}; FP8 attention needs q, k and v all "
                         "torch.float8_e4m3fn (quantize 16-bit tensors with flash3.quantize_fp8, or pass "
                         "all three in 16 bits)")


def check_scale(name, s, q, shape=None):
    """ValueError naming a dequantization scale s (None: not given) that is not a float32 tensor
    on q's device, or (shape given) not of that shape."""
    if s is None:
        return
    if not isinstance(s, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor (float32), got {type(s).__name__}")
    if s.dtype is not _FLOAT32:
        raise ValueError(f"{name}: dtype {s.dtype} is not supported; scales must be torch.float32")
    if s.device != q.device:
        raise ValueError(f"{name}: on device {s.device} but q is on {q.device}; scales must be on q's device")
    if shape is not None and tuple(s.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(s.shape)}, expected (batch, nheads_kv) = {tuple(shape)}")


def forward_into(q, k, v, out, lse=None, softmax_scale=None, causal=False, q_scale=None, k_scale=None,
                 v_scale=None, window_left=-1, window_right=-1, softcap=0.0):
    """Runs the forward pass into caller-given buffers: out like q (bfloat16 for float8_e4m3 q),
    lse float32 (b, h, sq) or None. FP8 (float8_e4m3fn q, k, v): q_scale, k_scale, v_scale are
    float32 dequantization scales, (batch, nheads_kv) or block scales (flash3.h, FwdArgs), or
    None (1). window_left, window_right: FlashAttention-3's sliding window, query i sees key j
    iff i + seqlen_k - seqlen_q - window_left <= j <= i + seqlen_k - seqlen_q + window_right,
    -1: no bound on that side (causal sets window_right to 0). softcap > 0: the scaled score x
    becomes softcap * tanh(x / softcap) before the softmax (lse is of these logits); 0.0: none;
    16-bit inputs only. Raises ValueError with the library's message on invalid arguments,
    RuntimeError otherwise."""
    scale = _scale_arg(softmax_scale)
    mask = mask_fields(window_left, window_right, softcap)
    try:
        tensors = (*_fields(q), *_fields(k), *_fields(v), *_fields(out), *_fields(lse))
        scales = _NULL * 3 if q_scale is None and k_scale is None and v_scale is None else (
            *_fields(q_scale), *_fields(k_scale), *_fields(v_scale))
        index = q.get_device()
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        _explain((("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("q_scale", q_scale),
                  ("k_scale", k_scale), ("v_scale", v_scale)), optional=("lse", "q_scale", "k_scale", "v_scale"))
        raise
    lib, buf = _lib.lib(), _lib.err_buffer()
    with _on_device(index):  # on torch's current stream of q's device
        args = _FWD.pack(_lib.FWD_ARGS_SIZE_V3, 1 if causal else 0, scale, 0, *tensors, _stream(index), *scales, *mask)
        rc = lib.flash3_fwd(args, buf, _lib.ERR_LEN)
    _check(rc, buf, "flash3_fwd")
    return out, lse


def backward_into(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=None, causal=False,
                  deterministic=False, window_left=-1, window_right=-1, softcap=0.0):
    """Runs the backward pass into caller-given buffers dq (like q), dk, dv (like k, v).

    q, k, v, out and lse are the forward's inputs, output and log-sum-exp (float32 (b, h, sq));
    dout is dLoss/dout, shaped like out. softmax_scale, causal, window_left, window_right and
    softcap must be the forward's (forward_into).
    deterministic: bitwise-identical gradients from call to call (a little slower).
    The library's scratch memory is a uint8 tensor from PyTorch's caching allocator, used on
    torch's current stream of q's device, where the kernels run. Returns (dq, dk, dv).
    Raises ValueError with the library's message on invalid arguments, RuntimeError otherwise.
    """
    scale = _scale_arg(softmax_scale)
    mask = mask_fields(window_left, window_right, softcap)
    try:  # the C order: q, k, v, out, dout, lse, dq, dk, dv
        tensors = (*_fields(q), *_fields(k), *_fields(v), *_fields(out), *_fields(dout), *_fields(lse),
                   *_fields(dq), *_fields(dk), *_fields(dv))
        if lse is None:
            raise ValueError
        index = q.get_device()
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        _explain((("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse), ("dq", dq),
                  ("dk", dk), ("dv", dv)))
        raise
    lib, buf = _lib.lib(), _lib.err_buffer()
    if not _lib.has_bwd():
        raise RuntimeError("this libflash3.so has no backward (flash3_bwd): rebuild the library")
    # NOTES: the workspace size depends on the shapes of q and k and the two flags only
    # (bwd_config.h, BwdWorkspaceLayout), so it is asked once per such key; the window and
    # softcap are in the key as well, since the library's causal flag can come from a window
    # ((-1, 0) is causal). flash3_bwd checks every argument itself (and that the workspace is
    # large enough).
    key = (q.shape, k.shape, index, bool(causal), bool(deterministic), mask)
    _run_bwd(lib, buf, index, q.device, key, _BWD,
             (_lib.BWD_ARGS_SIZE_V2, 1 if causal else 0, 1 if deterministic else 0, scale), tensors, mask)
    return dq, dk, dv


def _run_bwd(lib, buf, index, device, key, packer, head, tensors, tail):
    """flash3_bwd on torch's current stream of CUDA device `index`, with the struct
    packer.pack(*head, *tensors, workspace, workspace_bytes, stream, *tail). The workspace size is
    asked of flash3_bwd_workspace_size once per key (_BWD_WORKSPACE_BYTES); the workspace is a
    uint8 tensor from PyTorch's caching allocator."""
    with _on_device(index):
        size = _BWD_WORKSPACE_BYTES.get(key)
        if size is None:
            nbytes = ctypes.c_uint64(0)
            rc = lib.flash3_bwd_workspace_size(packer.pack(*head, *tensors, 0, 0, 0, *tail), ctypes.byref(nbytes),
                                               buf, _lib.ERR_LEN)
            _check(rc, buf, "flash3_bwd_workspace_size")
            size = nbytes.value
            if len(_BWD_WORKSPACE_BYTES) >= 1024:
                _BWD_WORKSPACE_BYTES.clear()
            _BWD_WORKSPACE_BYTES[key] = size
        workspace, ptr = None, 0
        if size:
            # allocated on the current stream, so the allocator reuses it only after the kernels
            workspace = torch.empty(size + _WORKSPACE_ALIGN, dtype=torch.uint8, device=device)
            ptr = -workspace.data_ptr() % _WORKSPACE_ALIGN + workspace.data_ptr()
        rc = lib.flash3_bwd(packer.pack(*head, *tensors, ptr, size, _stream(index), *tail), buf, _lib.ERR_LEN)
    del workspace
    _check(rc, buf, "flash3_bwd")


_CONTIGUOUS = torch.contiguous_format
_BFLOAT16 = torch.bfloat16


def out_dtype(q):
    """The dtype of the forward's out for q: q's, bfloat16 for float8_e4m3fn q."""
    return _BFLOAT16 if q.dtype is _E4M3 else q.dtype


def fwd(q, k, v, softmax_scale=None, causal=False, want_lse=True, q_scale=None, k_scale=None, v_scale=None,
        window_left=-1, window_right=-1, softcap=0.0):
    """(out, lse) of attention over q, k, v: out contiguous, shaped like q and typed like it
    (bfloat16 for float8_e4m3fn q, which takes the dequantization scales q_scale, k_scale,
    v_scale: forward_into); lse float32 (batch, nheads, seqlen_q), contiguous (None when not
    want_lse). window_left, window_right, softcap: forward_into's. The shapes and layouts are
    those of the fake implementations of flash3::fwd and flash3::fwd_fp8 (_ops.py): keep them in
    step."""
    # NOTES: always contiguous, whatever q's layout: an output whose strides followed q's could
    # differ from what the fake promised to a compiled graph when the compiler lays q out anew;
    # empty_like with an explicit format is also the cheapest allocation call (measured).
    if q.dtype is _E4M3:
        out = torch.empty_like(q, dtype=_BFLOAT16, memory_format=_CONTIGUOUS)
    else:
        out = torch.empty_like(q, memory_format=_CONTIGUOUS)
    lse = None
    if want_lse:
        if q.dim() != 4:
            raise ValueError(f"q: expected (batch, seqlen_q, nheads, headdim), got shape {tuple(q.shape)}")
        b, sq, h, _ = q.shape
        lse = q.new_empty((b, h, sq), dtype=_FLOAT32)
    forward_into(q, k, v, out, lse, softmax_scale, causal, q_scale, k_scale, v_scale, window_left, window_right,
                 softcap)
    return out, lse


def _in_is_x(msg):
    """The library names the quantizer's input `in`; the Python functions call it x."""
    return msg + " (in: the argument x)" if re.search(r"\bin\.|\bin$", msg) else msg


def quantize_fp8_into(x, out, scale, block_rows=128, hadamard=False, seed=0):
    """Quantizes x (batch, seqlen, nheads, head_dim), bfloat16 or float16, into caller-given
    buffers: out float8_e4m3fn shaped like x and scale float32 (batch, nheads, ceil(seqlen /
    block_rows)), with x ~= out * scale per block of block_rows rows of one head (scale = the
    block's max |value| / 448; 1 for an all-zero block). hadamard: each row (head_dim values)
    is first rotated by an orthogonal seeded Hadamard transform (flash3.h, QuantizeArgs); q and
    k quantized with the same seed keep q k^T. seed: an int in [0, 2^63). Returns (out, scale).
    Raises ValueError with the library's message on invalid arguments, RuntimeError otherwise."""
    rows, seed = block_rows_arg(block_rows), seed_arg(seed)
    try:
        tensors = (*_fields(x), *_fields(out), *_fields(scale))
        index = x.get_device()
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        _explain((("x", x), ("out", out), ("scale", scale)))
        raise
    lib, buf = _lib.lib(), _lib.err_buffer()
    if not _lib.has_quantize():
        raise RuntimeError("this libflash3.so has no FP8 quantizer (flash3_quantize_fp8): rebuild the library")
    with _on_device(index):
        args = _QUANTIZE.pack(_lib.QUANTIZE_FP8_ARGS_SIZE, 0, *tensors, rows, 1 if hadamard else 0, seed,
                              _stream(index))
        rc = lib.flash3_quantize_fp8(args, buf, _lib.ERR_LEN)
    _check(rc, buf, "flash3_quantize_fp8", _in_is_x)
    return out, scale


def quantize_shapes(x, block_rows):
    """(out's shape, scale's shape) of quantize_fp8 of x: x's, and (batch, nheads,
    ceil(seqlen / block_rows)); shape arithmetic only (symbolic sizes stay symbolic)."""
    if x.dim() != 4:
        raise ValueError(f"x: expected (batch, seqlen, nheads, head_dim), got shape {tuple(x.shape)}")
    b, s, h, _ = x.shape
    return x.shape, (b, h, (s + block_rows - 1) // block_rows)


def quantize_fp8(x, block_rows=128, hadamard=False, seed=0):
    """(out, scale) of quantize_fp8_into, allocated: out contiguous float8_e4m3fn shaped like x,
    scale contiguous float32 (batch, nheads, ceil(seqlen / block_rows)) (the fake of
    flash3::quantize_fp8, _ops.py: keep them in step)."""
    rows = block_rows_arg(block_rows)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    _, scale_shape = quantize_shapes(x, rows)
    out = torch.empty_like(x, dtype=_E4M3, memory_format=_CONTIGUOUS)
    scale = x.new_empty(scale_shape, dtype=_FLOAT32)
    return quantize_fp8_into(x, out, scale, rows, hadamard, seed)


def kernel_readable(dout):
    """dout as it is when the backward kernels can read it, else a contiguous copy. An incoming
    gradient may be any view (sum() gives a stride-0 expand)."""
    if dout.is_contiguous() or _kernel_layout(dout):
        return dout
    return dout.contiguous()


def bwd(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False, window_left=-1,
        window_right=-1, softcap=0.0):
    """(dq, dk, dv), contiguous, shaped and typed like q, k, v (the fake of flash3::bwd); the
    options as backward_into's."""
    dq = torch.empty_like(q, memory_format=_CONTIGUOUS)
    dk = torch.empty_like(k, memory_format=_CONTIGUOUS)
    dv = torch.empty_like(v, memory_format=_CONTIGUOUS)
    return backward_into(kernel_readable(dout), q, k, v, out, lse, dq, dk, dv, softmax_scale, causal,
                         deterministic, window_left, window_right, softcap)


def _kernel_layout(t):
    """True when flash3 can read t as it is: last dim contiguous, every other stride (of a dim
    longer than 1) positive and a multiple of 16 bytes."""
    if t.stride(-1) != 1:
        return False
    unit = max(1, 16 // t.element_size())
    return all(n <= 1 or (s > 0 and s % unit == 0) for n, s in zip(t.shape[:-1], t.stride()[:-1]))


# ---- variable-length batches (FlashAttention-3's varlen layout) ----------------------------------

_INT32 = torch.int32
_SymInt = getattr(torch, "SymInt", ())


def seqlen_arg(name, value):
    """max_seqlen_q / max_seqlen_k as an int for the library's int32 (a symbolic one under tracing
    as it is). Its range (0 to 2^30, at least every sequence's length, at most the packed length)
    is the library's to check; a value int32 cannot carry is refused here."""
    if isinstance(value, _SymInt):
        return value
    return _int_arg(name, value, -2**31, 2**31, "an int in [0, 2^30], at least every sequence's length")


def _seqlens_tensor(name, t, q, what, entries=None, like=None):
    """ValueError naming an int32 length tensor (cu_seqlens_*, seqused_*) that is not a rank-1
    torch.int32 tensor on q's device, or (entries given) not of that length (like: where the
    length comes from)."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor (torch.int32, {what}), got {type(t).__name__}")
    if t.dtype is not _INT32:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported; {name} must be torch.int32 ({what})")
    if t.device != q.device:
        raise ValueError(f"{name}: on device {t.device} but q is on {q.device}; {name} must be on q's device")
    if t.dim() != 1:
        raise ValueError(f"{name}: expected shape ({what},), got shape {tuple(t.shape)}")
    if entries is not None and t.shape[0] != entries:
        raise ValueError(f"{name}: shape {tuple(t.shape)}, expected ({what},) = ({entries},) ({like})")


def varlen_lse_shape(q, cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None):
    """(nheads, total_q): the shape of lse of the variable-length attention of q (total_q, nheads,
    head_dim); shape arithmetic only (symbolic sizes stay symbolic). Checks what the outputs are
    built and traced from: q 3-dim and not float8 (NotImplementedError: bfloat16 / float16 only);
    cu_seqlens_q and cu_seqlens_k rank-1 torch.int32 tensors on q's device with the same number
    (batch + 1) of entries; seqused_q, seqused_k (None: not given) likewise with batch entries.
    ValueError naming the argument otherwise. The values are the library's to check."""
    if not isinstance(q, torch.Tensor):
        raise ValueError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.dtype in FP8_DTYPES:
        raise NotImplementedError(f"q: dtype {q.dtype} is not supported by flash3's variable-length attention "
                                  "(torch.bfloat16 or torch.float16 q, k, v only)")
    if q.dim() != 3:
        raise ValueError(f"q: expected (total_q, nheads, headdim) (variable-length batches), got shape "
                         f"{tuple(q.shape)}")
    _seqlens_tensor("cu_seqlens_q", cu_seqlens_q, q, "batch + 1")
    n = cu_seqlens_q.shape[0]
    _seqlens_tensor("cu_seqlens_k", cu_seqlens_k, q, "batch + 1", n, "as cu_seqlens_q")
    for name, t in (("seqused_q", seqused_q), ("seqused_k", seqused_k)):
        if t is not None:
            _seqlens_tensor(name, t, q, "batch", n - 1, f"cu_seqlens_q has batch + 1 = {n} entries")
    total_q, h, _ = q.shape
    return h, total_q


def _has_varlen(bwd=False):
    """RuntimeError where the loaded library has no variable-length batches (_lib.has_varlen)."""
    if not _lib.has_varlen(bwd):
        raise RuntimeError("this libflash3.so has no variable-length batches (flash3_fwd_args v4, flash3_bwd_args "
                           "v3: cu_seqlens, seqused): rebuild the library")


def _varlen_fields(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
    """The tensors of the variable-length fields of the C structs (flash3_fwd_args v4,
    flash3_bwd_args v3). Raises as _fields (cu_seqlens_q and cu_seqlens_k must be given)."""
    if cu_seqlens_q is None or cu_seqlens_k is None:
        raise ValueError
    return (*_fields(cu_seqlens_q), *_fields(cu_seqlens_k), *_fields(seqused_q), *_fields(seqused_k))


def _seqlen_fields(max_seqlen_q, max_seqlen_k, check_seqlens):
    """The int32 fields after them: max_seqlen_q, max_seqlen_k, no_seqlens_check, reserved."""
    return (seqlen_arg("max_seqlen_q", max_seqlen_q), seqlen_arg("max_seqlen_k", max_seqlen_k),
            0 if check_seqlens else 1, 0)


# The length tensors whose values the library has checked (check_seqlens), so that a training
# step's many calls with the same cu_seqlens synchronize once: id(the first given length
# tensor) -> (weak references to the four, (their version counters, the maxima, the sides' row
# shapes) at that check). In-place changes bump a tensor's version, so they are checked again;
# inference tensors have no version counter and are checked at every call. (Keyed by id with
# the references compared by `is`: tensors cannot be dict keys, their == is elementwise.)
_CHECKED_SEQLENS = {}
_CHECKED_SEQLENS_MAX = 64


def _checked_once(check_seqlens, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                  q, k):
    """(whether the library must check the length values now, what _remember_checked keeps once
    it did). The tensors already checked, unchanged, cost a dict lookup and these comparisons."""
    if not check_seqlens:
        return False, None
    tensors = (cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    anchor = next((t for t in tensors if t is not None), None)
    if anchor is None:
        return True, None
    try:
        values = (tuple(None if t is None else t._version for t in tensors), max_seqlen_q, max_seqlen_k,
                  tuple(q.shape[:-2]), tuple(k.shape[:-2]))
    except (AttributeError, IndexError, RuntimeError, TypeError):
        return True, None
    old = _CHECKED_SEQLENS.get(id(anchor))
    if old is not None and old[1] == values and all(
            (r is None) == (t is None) and (r is None or r() is t) for r, t in zip(old[0], tensors)):
        return False, None
    return True, (anchor, tensors, values)


def _capturing():
    """Whether torch's current CUDA stream is being captured (the library then skips the check)."""
    try:
        return torch.cuda.is_current_stream_capturing()
    except RuntimeError:  # no usable CUDA: the call fails in the library
        return False


def _remember_checked(entry):
    """Keeps what _checked_once returned once the library has checked it (not while a CUDA graph
    is captured: the library skips the check then)."""
    if entry is None or _capturing():
        return
    anchor, tensors, values = entry
    try:
        refs = tuple(None if t is None else weakref.ref(t) for t in tensors)
    except TypeError:
        return
    if len(_CHECKED_SEQLENS) >= _CHECKED_SEQLENS_MAX:
        for key in [key for key, (old, _) in _CHECKED_SEQLENS.items()
                    if not all(r is None or r() is not None for r in old)]:
            del _CHECKED_SEQLENS[key]
        if len(_CHECKED_SEQLENS) >= _CHECKED_SEQLENS_MAX:
            _CHECKED_SEQLENS.clear()
    _CHECKED_SEQLENS[id(anchor)] = (refs, values)


def _run_fwd_varlen(index, causal, scale, tensors, mask, varlen, seqlens, note=None):
    """flash3_fwd with the flash3_fwd_args v4 struct (the variable-length fields) on torch's
    current stream of CUDA device `index`; raises the library's error (_check, with note)."""
    _has_varlen()
    lib, buf = _lib.lib(), _lib.err_buffer()
    with _on_device(index):
        args = _FWD_VARLEN.pack(_lib.FWD_ARGS_SIZE, 1 if causal else 0, scale, 0, *tensors, _stream(index),
                                *_NULL * 3, *mask, *varlen, *seqlens)
        rc = lib.flash3_fwd(args, buf, _lib.ERR_LEN)
    _check(rc, buf, "flash3_fwd", note)


def forward_varlen_into(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                        seqused_k=None, softmax_scale=None, causal=False, window_left=-1, window_right=-1,
                        softcap=0.0, check_seqlens=True):
    """forward_into for a variable-length batch (FlashAttention-3's varlen layout), into
    caller-given buffers: q and out (total_q, nheads, head_dim), k and v (total_k, nheads_kv,
    head_dim), bfloat16 or float16; sequence b is rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of
    q and out, and rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) of k and v (cu_seqlens_q,
    cu_seqlens_k: int32 (batch + 1) CUDA tensors, starting at 0, never decreasing, ending at
    total_q / total_k). lse float32 (nheads, total_q), or None. max_seqlen_q, max_seqlen_k: at
    least every sequence's length. seqused_q, seqused_k (int32 (batch) or None): only the first
    seqused[b] rows of sequence b take part; out and lse rows past them are not written. The
    mask (causal, window_left, window_right) is aligned bottom-right in each sequence (its
    lengths: the used ones); softmax_scale, softcap: forward_into's. check_seqlens: the library
    checks the values of cu_seqlens and seqused (a device-to-host copy and a stream
    synchronization; skipped while the stream is captured into a CUDA graph), once per set of
    length tensors: a later call with the same tensor objects, unchanged (torch's version
    counters; inference tensors have none and are checked every time), the same maxima and
    packed lengths does not check again. Values written without torch (raw pointers) are not
    seen: pass check_seqlens=True with new tensors then. False skips the check (bad values then
    give undefined results, never an access out of bounds).
    Raises ValueError with the library's message on invalid arguments, RuntimeError otherwise
    (also for a libflash3.so without variable-length batches)."""
    scale = _scale_arg(softmax_scale)
    mask = mask_fields(window_left, window_right, softcap)
    check_now, state = _checked_once(check_seqlens, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                     max_seqlen_k, q, k)
    seqlens = _seqlen_fields(max_seqlen_q, max_seqlen_k, check_now)
    try:
        tensors = (*_fields(q), *_fields(k), *_fields(v), *_fields(out), *_fields(lse))
        varlen = _varlen_fields(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        index = q.get_device()
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        _explain((("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse), ("cu_seqlens_q", cu_seqlens_q),
                  ("cu_seqlens_k", cu_seqlens_k), ("seqused_q", seqused_q), ("seqused_k", seqused_k)),
                 optional=("lse", "seqused_q", "seqused_k"))
        raise
    _run_fwd_varlen(index, causal, scale, tensors, mask, varlen, seqlens)
    if check_now:
        _remember_checked(state)
    return out, lse


def backward_varlen_into(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                         max_seqlen_k, seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                         deterministic=False, window_left=-1, window_right=-1, softcap=0.0, check_seqlens=True):
    """backward_into for a variable-length batch, into caller-given buffers dq (like q), dk, dv
    (like k, v). q, k, v, out, lse (float32 (nheads, total_q)), the lengths and the options are
    the forward's (forward_varlen_into); dout is shaped like out. Gradient rows past seqused are
    written as 0. Returns (dq, dk, dv). Raises as forward_varlen_into."""
    scale = _scale_arg(softmax_scale)
    mask = mask_fields(window_left, window_right, softcap)
    check_now, state = _checked_once(check_seqlens, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q,
                                     max_seqlen_k, q, k)
    seqlens = _seqlen_fields(max_seqlen_q, max_seqlen_k, check_now)
    try:  # the C order: q, k, v, out, dout, lse, dq, dk, dv
        tensors = (*_fields(q), *_fields(k), *_fields(v), *_fields(out), *_fields(dout), *_fields(lse),
                   *_fields(dq), *_fields(dk), *_fields(dv))
        if lse is None:
            raise ValueError
        varlen = _varlen_fields(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        index = q.get_device()
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        _explain((("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse), ("dq", dq),
                  ("dk", dk), ("dv", dv), ("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k),
                  ("seqused_q", seqused_q), ("seqused_k", seqused_k)), optional=("seqused_q", "seqused_k"))
        raise
    if not _lib.has_bwd():
        raise RuntimeError("this libflash3.so has no backward (flash3_bwd): rebuild the library")
    _has_varlen(bwd=True)
    lib, buf = _lib.lib(), _lib.err_buffer()
    # NOTES: the workspace size depends on the shapes and flags (backward_into) and, here, on the
    # batch, the longest sequences and which seqused are given, never on the values of the
    # lengths (it is asked on the host, also while a CUDA graph is captured).
    key = (q.shape, k.shape, index, bool(causal), bool(deterministic), mask, cu_seqlens_q.shape[0], seqlens,
           seqused_q is None, seqused_k is None)
    _run_bwd(lib, buf, index, q.device, key, _BWD_VARLEN,
             (_lib.BWD_ARGS_SIZE, 1 if causal else 0, 1 if deterministic else 0, scale), tensors,
             (*mask, *varlen, *seqlens))
    if check_now:
        _remember_checked(state)
    return dq, dk, dv


def fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
               softmax_scale=None, causal=False, want_lse=True, window_left=-1, window_right=-1, softcap=0.0):
    """(out, lse) of the variable-length attention (forward_varlen_into): out contiguous, shaped
    and typed like q; lse float32 (nheads, total_q), contiguous (None when not want_lse). With
    seqused_q, the rows past it (which the library does not write) are those of a row that sees
    no key: out 0, lse +inf. The shapes and layouts are those of the fake of flash3::fwd_varlen
    (_ops.py): keep them in step."""
    lse_shape = varlen_lse_shape(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    max_seqlen_q, max_seqlen_k = seqlen_arg("max_seqlen_q", max_seqlen_q), seqlen_arg("max_seqlen_k", max_seqlen_k)
    lse = None
    if seqused_q is None:
        out = torch.empty_like(q, memory_format=_CONTIGUOUS)
        if want_lse:
            lse = q.new_empty(lse_shape, dtype=_FLOAT32)
    else:
        out = torch.zeros_like(q, memory_format=_CONTIGUOUS)
        if want_lse:
            lse = q.new_full(lse_shape, math.inf, dtype=_FLOAT32)
    return forward_varlen_into(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                               seqused_k, softmax_scale, causal, window_left, window_right, softcap)


def bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
               seqused_k=None, softmax_scale=None, causal=False, deterministic=False, window_left=-1,
               window_right=-1, softcap=0.0):
    """(dq, dk, dv), contiguous, shaped and typed like q, k, v (the fake of flash3::bwd_varlen);
    the arguments as backward_varlen_into's."""
    varlen_lse_shape(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    max_seqlen_q, max_seqlen_k = seqlen_arg("max_seqlen_q", max_seqlen_q), seqlen_arg("max_seqlen_k", max_seqlen_k)
    dq = torch.empty_like(q, memory_format=_CONTIGUOUS)
    dk = torch.empty_like(k, memory_format=_CONTIGUOUS)
    dv = torch.empty_like(v, memory_format=_CONTIGUOUS)
    return backward_varlen_into(kernel_readable(dout), q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, softmax_scale, causal,
                                deterministic, window_left, window_right, softcap)


# ---- KV cache (decoding) --------------------------------------------------------------------

MAX_KVCACHE_SPLITS = 64  # flash3::kMaxKvcacheSplits (flash3.h)


def num_splits_arg(num_splits):
    """num_splits as an int in [0, MAX_KVCACHE_SPLITS] (0: the library's heuristic); a symbolic one
    under tracing as it is. ValueError naming it otherwise (the library refuses the same range)."""
    if isinstance(num_splits, _SymInt):
        return num_splits
    return _int_arg("num_splits", num_splits, 0, MAX_KVCACHE_SPLITS + 1,
                    f"an int in [0, {MAX_KVCACHE_SPLITS}] (key-range splits; 0: flash3's heuristic)")


def _page_table_tensor(page_table, q, batch):
    """ValueError naming page_table where it is not a torch.int32 (batch, max_pages_per_seq) tensor
    on q's device."""
    what = "(batch, max_pages_per_seq)"
    if not isinstance(page_table, torch.Tensor):
        raise ValueError(f"page_table: expected a torch.Tensor (torch.int32, {what}), got {type(page_table).__name__}")
    if page_table.dtype is not _INT32:
        raise ValueError(f"page_table: dtype {page_table.dtype} is not supported; page_table must be torch.int32 "
                         f"{what}")
    if page_table.device != q.device:
        raise ValueError(f"page_table: on device {page_table.device} but q is on {q.device}; page_table must be on "
                         "q's device")
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(f"page_table: shape {tuple(page_table.shape)}, expected {what} with batch = {batch} (q's)")


def kvcache_shapes(q, k_cache, v_cache, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                   num_splits=0, qv=None):
    """(batch, seqlen_q, nheads, headdim_v): the shape arithmetic of the KV-cache attention of q
    (batch, seqlen_q, nheads, headdim) over k_cache, v_cache, contiguous (batch_cache, seqlen_cache,
    nheads_kv, headdim) or paged (num_pages, page_size, nheads_kv, headdim) with page_table
    (symbolic sizes stay symbolic); headdim_v is out's head dim: q's, or with qv (MLA: q (...,
    64) and qv (batch, seqlen_q, nheads, 512), k_cache (..., 64), v_cache (..., 512)) v_cache's.
    ValueError naming the argument where q, k_cache, v_cache or qv (not None) is not a 4-dim
    tensor; cache_seqlens, cache_batch_idx or cache_leftpad (not None) is not a rank-1 torch.int32
    tensor of batch entries on q's device; page_table (not None) is not a torch.int32 (batch,
    max_pages_per_seq) tensor on q's device; cache_batch_idx comes with page_table; num_splits is
    not an int in [0, MAX_KVCACHE_SPLITS]. float8 q: NotImplementedError. The rest (the head dims
    among them) is the library's to check."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("qv", qv)):
        if t is None and name == "qv":
            continue
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            what = ("(batch, seqlen_q, nheads, headdim)" if name == "q" else
                    "(batch, seqlen_q, nheads, 512) (MLA: the queries' latent part)" if name == "qv" else
                    "(num_pages, page_size, nheads_kv, headdim) (a paged cache: page_table given)"
                    if page_table is not None else "(batch_cache, seqlen_cache, nheads_kv, headdim)")
            raise ValueError(f"{name}: expected {what}, got shape {tuple(t.shape)}")
    if q.dtype in FP8_DTYPES:
        raise NotImplementedError(f"q: dtype {q.dtype} is not supported by flash3's KV-cache attention "
                                  "(torch.bfloat16 or torch.float16 q, k_cache, v_cache only)")
    b, sq, h, d = q.shape
    for name, t in (("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                    ("cache_leftpad", cache_leftpad)):
        if t is not None:
            _seqlens_tensor(name, t, q, "batch", b, f"q has batch = {b}")
    if page_table is not None:
        _page_table_tensor(page_table, q, b)
        if cache_batch_idx is not None:
            raise ValueError("cache_batch_idx: not supported with page_table; a paged cache is addressed through "
                             "page_table alone (cache_batch_idx selects entries of a contiguous cache)")
    num_splits_arg(num_splits)
    return b, sq, h, d if qv is None else v_cache.shape[3]


def check_kvcache_values(k_cache, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                         check_seqlens=True, check_page_table=True):
    """Checks the values of the index tensors of a KV-cache call (shapes as kvcache_shapes
    accepts) with torch operations and one device-to-host copy; nothing while torch's current
    stream is being captured into a CUDA graph. check_seqlens: cache_seqlens[b] in [0,
    seqlen_cache] (k_cache.shape[1], or max_pages_per_seq x page_size when paged), cache_leftpad[b]
    in [0, cache_seqlens[b]] (seqlen_cache without cache_seqlens), cache_batch_idx[b] in [0,
    batch_cache). check_page_table (paged): every page a sequence uses, slots 0 ..
    ceil(cache_seqlens[b] / page_size) - 1 of row b of page_table (its length clamped to the
    cache; every slot without cache_seqlens), in [0, num_pages). Raises ValueError for the first
    bad value (the tensors in this order, then row by row), naming the tensor, the batch entry
    (and slot) and the value."""
    if _capturing():
        return
    paged = page_table is not None
    n_cache = k_cache.shape[1] * (page_table.shape[1] if paged else 1)
    where = (f"page_table.shape[1] x page_size = {page_table.shape[1]} x {k_cache.shape[1]}" if paged else
             "k_cache.shape[1]")
    long = torch.int64
    lens = None if cache_seqlens is None else cache_seqlens.to(long)
    ends = None if lens is None else lens.clamp(0, n_cache)  # each sequence's end, as the library clamps it
    checks = []  # (name, bad, value, extra): bool, int64 tensors of one shape; extra goes into the message
    if check_seqlens:
        if lens is not None:
            checks.append(("cache_seqlens", (lens < 0) | (lens > n_cache), lens, lens))
        if cache_leftpad is not None:
            pad = cache_leftpad.to(long)
            end = torch.full_like(pad, n_cache) if ends is None else ends
            checks.append(("cache_leftpad", (pad < 0) | (pad > end), pad, end))
        if cache_batch_idx is not None and not paged:
            idx = cache_batch_idx.to(long)
            checks.append(("cache_batch_idx", (idx < 0) | (idx >= k_cache.shape[0]), idx, idx))
    page_size, slots = k_cache.shape[1], (page_table.shape[1] if paged else 0)
    if check_page_table and paged:
        pages = page_table.to(long)
        used = (torch.full_like(pages[:, 0], slots) if ends is None else (ends + page_size - 1) // page_size)[:, None]
        in_use = torch.arange(slots, device=pages.device)[None, :] < used
        bad = in_use & ((pages < 0) | (pages >= k_cache.shape[0]))
        checks.append(("page_table", bad, pages, used.expand_as(pages)))
    checks = [c for c in checks if c[1].numel() > 0]
    if not checks:
        return
    rows = []
    for _, bad, value, extra in checks:
        flat = bad.flatten()
        first = flat.to(torch.int32).argmax()  # the first True: argmax gives the first of equal maxima
        rows.append(torch.stack((flat.any().to(long), first, value.flatten()[first], extra.flatten()[first])))
    for (name, _, _, _), (any_bad, first, value, extra) in zip(checks, torch.stack(rows).tolist()):
        if not any_bad:
            continue
        if name == "cache_seqlens":
            raise ValueError(f"cache_seqlens: cache_seqlens[{first}] is {value}; it must be in [0, seqlen_cache] = "
                             f"[0, {n_cache}] ({where})")
        if name == "cache_leftpad":
            bound = f"cache_seqlens[{first}]" if lens is not None else f"seqlen_cache ({where})"
            raise ValueError(f"cache_leftpad: cache_leftpad[{first}] is {value}; it must be in [0, {bound}] = "
                             f"[0, {extra}]")
        if name == "cache_batch_idx":
            raise ValueError(f"cache_batch_idx: cache_batch_idx[{first}] is {value}; it must be in [0, batch_cache) "
                             f"= [0, {k_cache.shape[0]}) (k_cache.shape[0])")
        b, slot = divmod(first, slots)
        why = "" if lens is None else f": ceil(cache_seqlens[{b}] / page_size) = ceil({int(ends[b])} / {page_size})"
        raise ValueError(f"page_table: page_table[{b}, {slot}] is {value}; batch entry {b} reads the pages in slots "
                         f"0 .. {extra - 1} of its row{why}, and each must be in [0, num_pages) = "
                         f"[0, {k_cache.shape[0]}) (k_cache.shape[0])")


def _rotary_tables(cos, sin, dtype):
    """The rotary tables as the library reads them: of one dtype, float32 or q's (dtype), with the
    last dim contiguous. Floating tables that are not are copied to float32 with contiguous rows;
    anything else is passed as it is (the library, or _explain, names it)."""
    def readable(t):
        return not isinstance(t, torch.Tensor) or not t.is_floating_point() or (
            t.dtype in (_FLOAT32, dtype) and t.dim() == 2 and t.stride(-1) == 1)
    same = not (isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor)) or cos.dtype is sin.dtype
    if same and readable(cos) and readable(sin):
        return cos, sin
    def f32(t):
        return t.to(_FLOAT32).contiguous() if isinstance(t, torch.Tensor) and t.is_floating_point() else t
    return f32(cos), f32(sin)


def forward_kvcache_into(q, k_cache, v_cache, out, lse, cache_seqlens=None, softmax_scale=None, causal=False,
                         window_left=-1, window_right=-1, softcap=0.0, cache_batch_idx=None, cache_leftpad=None,
                         page_table=None, num_splits=0, check_page_table=False, check_seqlens=False, k_new=None,
                         v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True, qv=None):
    """Attention of new queries over a KV cache (decoding), into caller-given buffers: q and out
    (batch, seqlen_q, nheads, headdim), bfloat16 or float16; k_cache and v_cache of q's dtype,
    contiguous (batch_cache, seqlen_cache, nheads_kv, headdim) or, with page_table, paged
    (num_pages, page_size, nheads_kv, headdim); lse float32 (batch, nheads, seqlen_q) or None.
    The optional index tensors are torch.int32 on q's device:
      cache_seqlens (batch): sequence b's keys end at cache position cache_seqlens[b] (None: the
        whole cache, seqlen_cache or max_pages_per_seq x page_size);
      cache_leftpad (batch): they start at cache_leftpad[b] (None: 0);
      cache_batch_idx (batch): batch entry b reads entry cache_batch_idx[b] of a contiguous cache
        (None: entry b; then batch_cache = batch); not with page_table;
      page_table (batch, max_pages_per_seq): key position p of sequence b is row p % page_size of
        page page_table[b, p // page_size] (any page size, pages in any order).
    The masks (causal, window_left, window_right) are aligned bottom-right to each sequence's keys:
    query row i is at key position (cache_seqlens[b] - cache_leftpad[b]) - seqlen_q + i of them.
    Rows that see no key: out 0, lse +inf. softmax_scale, softcap: forward_into's. num_splits:
    key-range splits per (sequence, KV head) in [1, MAX_KVCACHE_SPLITS], or 0 for the library's
    heuristic (the results do not depend on it beyond rounding).
    The append, inside the kernel (FlashAttention-3's k, v, rotary_cos, rotary_sin): k_new, v_new
    (batch, seqlen_new, nheads_kv, headdim) of q's dtype, with cache_seqlens (the lengths before
    the append), are written into k_cache and v_cache in place at cache positions cache_seqlens[b]
    .. cache_seqlens[b] + seqlen_new - 1 of each sequence (its entry or its pages; they must fit in
    the cache: positions past it are neither written nor attended to), and attended to: sequence b
    sees [cache_leftpad[b], cache_seqlens[b] + seqlen_new). cache_seqlens itself is not changed.
    rotary_cos, rotary_sin (seqlen_ro, rotary_dim / 2), together and only with k_new, rotary_dim a
    multiple of 16 up to headdim: the first rotary_dim dims of each new key are rotated at its
    cache position and those of q's row i at cache_seqlens[b] + i (causal or a window; a window
    that excludes nothing does not count, as FlashAttention-3) or cache_seqlens[b] (neither),
    pairs (2j, 2j + 1) when rotary_interleaved, else (j, j + rotary_dim / 2); positions past
    seqlen_ro use its last row. The kernel reads tables of one dtype, float32 or q's, with the last
    dim contiguous; other floating tables are copied to float32 first (a copy per call).
    MLA (FlashAttention-3's qv; DeepSeek's multi-head latent attention): qv (batch, seqlen_q,
    nheads, 512) of q's dtype is the queries' latent part and q (..., 64) their rotary part;
    k_cache (..., nheads_kv, 64) holds each key's rotary part and v_cache (..., nheads_kv, 512) its
    latent, which is also the value: the scores are q k^T + qv v^T (head dim 576; softmax_scale
    None: 1/sqrt(576)), out (batch, seqlen_q, nheads, 512). k_new (..., 64) and v_new (..., 512)
    append as above; the rotary embedding (rotary_dim up to 64) applies to q and k_new, not to qv.
    The index values live on the GPU: by default (as FlashAttention-3) the host does not read
    them, and the library clamps them to the cache (bad values give undefined results, never an
    access out of bounds). check_seqlens=True and check_page_table=True check them first
    (check_kvcache_values: one device-to-host copy and so a stream synchronization per call;
    skipped while a CUDA graph is captured) and raise ValueError naming the first bad value.
    Raises ValueError naming the argument for invalid arguments, RuntimeError otherwise (also for
    a libflash3.so without flash3_fwd_kvcache)."""
    scale = _scale_arg(softmax_scale)
    mask = mask_fields(window_left, window_right, softcap)
    splits = num_splits_arg(num_splits)
    append = k_new is not None or v_new is not None or rotary_cos is not None or rotary_sin is not None
    if append:
        rotary_cos, rotary_sin = _rotary_tables(rotary_cos, rotary_sin, getattr(q, "dtype", None))
    try:
        tensors = (*_fields(q), *_fields(k_cache), *_fields(v_cache), *_fields(out), *_fields(lse),
                   *_fields(cache_seqlens), *_fields(cache_batch_idx), *_fields(cache_leftpad), *_fields(page_table))
        # the second version's fields: the append's tensors and qv
        v2 = (*_fields(k_new), *_fields(v_new), *_fields(rotary_cos), *_fields(rotary_sin), *_fields(qv)) if (
            append or qv is not None) else ()
        index = q.get_device()
    except (AttributeError, KeyError, IndexError, TypeError, ValueError):
        _explain((("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out), ("lse", lse),
                  ("cache_seqlens", cache_seqlens), ("cache_batch_idx", cache_batch_idx),
                  ("cache_leftpad", cache_leftpad), ("page_table", page_table), ("k_new", k_new), ("v_new", v_new),
                  ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("qv", qv)),
                 optional=("lse", "cache_seqlens", "cache_batch_idx", "cache_leftpad", "page_table", "k_new", "v_new",
                           "rotary_cos", "rotary_sin", "qv"))
        raise
    if check_seqlens or check_page_table:
        kvcache_shapes(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, page_table, splits, qv)
        check_kvcache_values(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, page_table, check_seqlens,
                             check_page_table)
    lib, buf = _lib.lib(), _lib.err_buffer()
    if not _lib.has_kvcache():
        raise RuntimeError("this libflash3.so has no KV-cache attention (flash3_fwd_kvcache): rebuild the library")
    with _on_device(index):
        if v2:
            args = _KVCACHE_APPEND.pack(_lib.KVCACHE_ARGS_SIZE, 1 if causal else 0, scale, splits, *tensors, *mask,
                                        _stream(index), *v2, 1 if rotary_interleaved else 0, 0)
        else:
            args = _KVCACHE.pack(_lib.KVCACHE_ARGS_SIZE_V1, 1 if causal else 0, scale, splits, *tensors, *mask,
                                 _stream(index))
        rc = lib.flash3_fwd_kvcache(args, buf, _lib.ERR_LEN)
    _check(rc, buf, "flash3_fwd_kvcache")
    return out, lse


def fwd_kvcache(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None, causal=False, want_lse=True,
                window_left=-1, window_right=-1, softcap=0.0, cache_batch_idx=None, cache_leftpad=None,
                page_table=None, num_splits=0, k_new=None, v_new=None, rotary_cos=None, rotary_sin=None,
                rotary_interleaved=True, qv=None):
    """(out, lse) of forward_kvcache_into (with k_new, the cache updated in place): out contiguous,
    of q's dtype, shaped like q, or with qv (MLA) (batch, seqlen_q, nheads, v_cache.shape[3]); lse
    float32 (batch, nheads, seqlen_q), contiguous (None when not want_lse). The shapes and layouts
    are those of the fake of flash3::fwd_kvcache (_ops.py): keep them in step."""
    b, sq, h, dv = kvcache_shapes(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                                  num_splits, qv)
    out = torch.empty_like(q, memory_format=_CONTIGUOUS) if qv is None else q.new_empty((b, sq, h, dv))
    lse = q.new_empty((b, h, sq), dtype=_FLOAT32) if want_lse else None
    return forward_kvcache_into(q, k_cache, v_cache, out, lse, cache_seqlens, softmax_scale, causal, window_left,
                                window_right, softcap, cache_batch_idx, cache_leftpad, page_table, num_splits,
                                k_new=k_new, v_new=v_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                rotary_interleaved=rotary_interleaved, qv=qv)

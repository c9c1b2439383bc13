"""flash3's ctypes path: the flash3_fwd_args / flash3_bwd_args structs packed for one call,
the library called on torch's current stream, and the two allocating kernels the operators
(_ops.py) and the eager autograd path share (fwd, bwd). Loads libflash3.so at the first call.
"""
import contextlib
import ctypes
import math
import struct

import torch

from . import _lib

_DTYPES = {torch.float16: _lib.FLOAT16, torch.bfloat16: _lib.BFLOAT16, torch.float32: _lib.FLOAT32,
           torch.int32: _lib.INT32}
for _name, _code in (("float8_e4m3fn", _lib.FLOAT8_E4M3), ("float8_e5m2", _lib.FLOAT8_E5M2)):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code

_WORKSPACE_ALIGN = 256  # bytes: flash3::BwdArgs::workspace
_BWD_WORKSPACE_BYTES = {}  # (q.shape, k.shape, device, causal, deterministic) -> bytes


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
# q, k, v, out, lse; void* stream; q_scale, k_scale, v_scale (FP8). flash3_bwd_args: uint32 struct_size; int32 causal,
# deterministic; float softmax_scale; then q, k, v, out, dout, lse, dq, dk, dv; void* workspace;
# uint64 workspace_bytes; void* stream. Each struct is packed whole into a bytes object by one
# Struct.pack and passed by address (the library only reads it): the cheapest way to fill it
# from Python (measured: about half the time of packing a ctypes buffer tensor by tensor).
_TENSOR = "Qii4q4q"
_FWD = struct.Struct("<IifI" + _TENSOR * 5 + "Q" + _TENSOR * 3)
_BWD = struct.Struct("<Iiif" + _TENSOR * 9 + "QQQ")
assert (_FWD.size, _BWD.size) == (_lib.FWD_ARGS_SIZE, _lib.BWD_ARGS_SIZE), "flash3 args layout changed"
assert struct.calcsize("<" + _TENSOR) == ctypes.sizeof(_lib.Tensor) and _lib.FwdArgs.q.offset == 16
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
            raise ValueError(f"{name}: dtype {t.dtype} is not supported (use torch.bfloat16 or torch.float16)")
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


def _check(rc, buf, what):
    if rc != _lib.OK:
        msg = buf.value.decode(errors="replace") or f"{what} failed with code {rc}"
        raise (ValueError if rc == _lib.INVALID_ARGUMENT else RuntimeError)(msg)


def forward_into(q, k, v, out, lse=None, softmax_scale=None, causal=False, q_scale=None, k_scale=None,
                 v_scale=None):
    """Runs the forward pass into caller-given buffers: out like q (bfloat16 for float8_e4m3 q),
    lse float32 (b, h, sq) or None. FP8 (float8_e4m3fn q, k, v): q_scale, k_scale, v_scale are
    float32 dequantization scales, (batch, nheads_kv) or block scales (flash3.h, FwdArgs), or
    None (1). Raises ValueError with the library's message on invalid arguments, RuntimeError
    otherwise."""
    scale = _scale_arg(softmax_scale)
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
        args = _FWD.pack(_lib.FWD_ARGS_SIZE, 1 if causal else 0, scale, 0, *tensors, _stream(index), *scales)
        rc = lib.flash3_fwd(args, buf, _lib.ERR_LEN)
    _check(rc, buf, "flash3_fwd")
    return out, lse


def backward_into(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=None, causal=False,
                  deterministic=False):
    """Runs the backward pass into caller-given buffers dq (like q), dk, dv (like k, v).

    q, k, v, out and lse are the forward's inputs, output and log-sum-exp (float32 (b, h, sq));
    dout is dLoss/dout, shaped like out. softmax_scale and causal must be the forward's.
    deterministic: bitwise-identical gradients from call to call (a little slower).
    The library's scratch memory is a uint8 tensor from PyTorch's caching allocator, used on
    torch's current stream of q's device, where the kernels run. Returns (dq, dk, dv).
    Raises ValueError with the library's message on invalid arguments, RuntimeError otherwise.
    """
    scale = _scale_arg(softmax_scale)
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
    head = (_lib.BWD_ARGS_SIZE, 1 if causal else 0, 1 if deterministic else 0, scale)
    with _on_device(index):
        # NOTES: the size depends on the shapes of q and k and the two flags only (bwd_config.h,
        # BwdWorkspaceLayout), so it is asked once per such key; flash3_bwd checks every
        # argument itself (and that the workspace is large enough).
        key = (q.shape, k.shape, index, bool(causal), bool(deterministic))
        size = _BWD_WORKSPACE_BYTES.get(key)
        if size is None:
            nbytes = ctypes.c_uint64(0)
            rc = lib.flash3_bwd_workspace_size(_BWD.pack(*head, *tensors, 0, 0, 0), ctypes.byref(nbytes),
                                               buf, _lib.ERR_LEN)
            _check(rc, buf, "flash3_bwd_workspace_size")
            size = nbytes.value
            if len(_BWD_WORKSPACE_BYTES) >= 1024:
                _BWD_WORKSPACE_BYTES.clear()
            _BWD_WORKSPACE_BYTES[key] = size
        workspace, ptr = None, 0
        if size:
            # allocated on the current stream, so the allocator reuses it only after the kernels
            workspace = torch.empty(size + _WORKSPACE_ALIGN, dtype=torch.uint8, device=q.device)
            ptr = -workspace.data_ptr() % _WORKSPACE_ALIGN + workspace.data_ptr()
        rc = lib.flash3_bwd(_BWD.pack(*head, *tensors, ptr, size, _stream(index)), buf, _lib.ERR_LEN)
    del workspace
    _check(rc, buf, "flash3_bwd")
    return dq, dk, dv


_CONTIGUOUS = torch.contiguous_format
_FLOAT32 = torch.float32


def fwd(q, k, v, softmax_scale=None, causal=False, want_lse=True):
    """(out, lse) of attention over q, k, v: out contiguous, shaped and typed like q; lse float32
    (batch, nheads, seqlen_q), contiguous (None when not want_lse). The shapes and layouts are
    those of the fake implementation of flash3::fwd (_ops.py): keep them in step."""
    # NOTES: always contiguous, whatever q's layout: an output whose strides followed q's could
    # differ from what the fake promised to a compiled graph when the compiler lays q out anew;
    # empty_like with an explicit format is also the cheapest allocation call (measured).
    out = torch.empty_like(q, memory_format=_CONTIGUOUS)
    lse = None
    if want_lse:
        if q.dim() != 4:
            raise ValueError(f"q: expected (batch, seqlen_q, nheads, headdim), got shape {tuple(q.shape)}")
        b, sq, h, _ = q.shape
        lse = q.new_empty((b, h, sq), dtype=_FLOAT32)
    forward_into(q, k, v, out, lse, softmax_scale, causal)
    return out, lse


def kernel_readable(dout):
    """dout as it is when the backward kernels can read it, else a contiguous copy. An incoming
    gradient may be any view (sum() gives a stride-0 expand)."""
    if dout.is_contiguous() or _kernel_layout(dout):
        return dout
    return dout.contiguous()


def bwd(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False):
    """(dq, dk, dv), contiguous, shaped and typed like q, k, v (the fake of flash3::bwd)."""
    dq = torch.empty_like(q, memory_format=_CONTIGUOUS)
    dk = torch.empty_like(k, memory_format=_CONTIGUOUS)
    dv = torch.empty_like(v, memory_format=_CONTIGUOUS)
    return backward_into(kernel_readable(dout), q, k, v, out, lse, dq, dk, dv, softmax_scale, causal,
                         deterministic)


def _kernel_layout(t):
    """True when flash3 can read t as it is: last dim contiguous, every other stride (of a dim
    longer than 1) positive and a multiple of 16 bytes."""
    if t.stride(-1) != 1:
        return False
    unit = max(1, 16 // t.element_size())
    return all(n <= 1 or (s > 0 and s % unit == 0) for n, s in zip(t.shape[:-1], t.stride()[:-1]))

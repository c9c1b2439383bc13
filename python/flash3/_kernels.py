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
_TENSOR = struct.Struct("<Qii4q4q")
assert _TENSOR.size == ctypes.sizeof(_lib.Tensor), "flash3_tensor layout changed"
_PAD = ((), (0,), (0, 0), (0, 0, 0), (0, 0, 0, 0))
# flash3_fwd_args: uint32 struct_size; int32 causal; float softmax_scale; uint32 reserved; then
# q, k, v, out, lse; void* stream. flash3_bwd_args: uint32 struct_size; int32 causal,
# deterministic; float softmax_scale; then q, k, v, out, dout, lse, dq, dk, dv; void* workspace;
# uint64 workspace_bytes; void* stream.
_FWD_HEAD = struct.Struct("<IifI")
_BWD_HEAD = struct.Struct("<Iiif")
_FWD_TAIL = struct.Struct("<Q")  # stream
_BWD_TAIL = struct.Struct("<QQQ")  # workspace, workspace_bytes, stream
assert _FWD_HEAD.size + 5 * _TENSOR.size + _FWD_TAIL.size == _lib.FWD_ARGS_SIZE
assert _BWD_HEAD.size + 9 * _TENSOR.size + _BWD_TAIL.size == _lib.BWD_ARGS_SIZE
assert _lib.FwdArgs.q.offset == _FWD_HEAD.size and _lib.BwdArgs.q.offset == _BWD_HEAD.size


def _pack(buf, offset, t, name):
    """Writes the flash3_tensor of torch tensor t (None: data NULL, 'not given') at buf[offset]."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    code = _DTYPES.get(t.dtype)
    if code is None:
        raise ValueError(f"{name}: dtype {t.dtype} is not supported (use torch.bfloat16 or torch.float16)")
    rank = t.dim()
    if rank > 4:
        raise ValueError(f"{name}: rank {rank} is not supported (at most 4), shape {tuple(t.shape)}")
    pad = _PAD[4 - rank]
    _TENSOR.pack_into(buf, offset, t.data_ptr(), code, rank, *t.shape, *pad, *t.stride(), *pad)


def _scale_arg(softmax_scale):
    """The library's float for softmax_scale (0.0: its default 1/sqrt(head_dim))."""
    if softmax_scale is None:
        return 0.0
    scale = float(softmax_scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"softmax_scale: must be positive and finite, got {softmax_scale}")
    return scale


def _args(head, values, tail, named, optional=()):
    """An args struct (flash3_fwd_args or flash3_bwd_args) packed in a ctypes buffer: head's
    scalars, then the flash3_tensor of each (name, tensor) pair (a CUDA tensor, or None where
    optional: data NULL), then room for tail (zeros; the caller packs it at tail_offset).
    Returns (buffer, tail_offset)."""
    for name, t in named:
        if t is None and name not in optional:
            raise ValueError(f"{name}: must be a tensor, got None")
        if isinstance(t, torch.Tensor) and not t.is_cuda:
            raise ValueError(f"{name}: must be a CUDA tensor, got device {t.device}")
    size = _TENSOR.size
    tail_offset = head.size + size * len(named)
    buf = ctypes.create_string_buffer(tail_offset + tail.size)
    head.pack_into(buf, 0, *values)
    for j, (name, t) in enumerate(named):
        _pack(buf, head.size + j * size, t, name)
    return buf, tail_offset


_raw_stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _stream(dev):
    """The handle of torch's current stream on dev (a CUDA device with an index)."""
    if _raw_stream_of is not None:
        return _raw_stream_of(dev.index if dev.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(dev).cuda_stream


def _on_device(dev):
    """The library launches on the current device: make it dev's for the call."""
    same = dev.index is None or dev.index == torch.cuda.current_device()
    return contextlib.nullcontext() if same else torch.cuda.device(dev)


def _check(rc, buf, what):
    if rc != _lib.OK:
        msg = buf.value.decode(errors="replace") or f"{what} failed with code {rc}"
        raise (ValueError if rc == _lib.INVALID_ARGUMENT else RuntimeError)(msg)


def forward_into(q, k, v, out, lse=None, softmax_scale=None, causal=False):
    """Runs the forward pass into caller-given buffers: out like q, lse float32 (b, h, sq) or None.
    Raises ValueError with the library's message on invalid arguments, RuntimeError otherwise."""
    scale = _scale_arg(softmax_scale)
    args, tail = _args(_FWD_HEAD, (_lib.FWD_ARGS_SIZE, int(bool(causal)), scale, 0), _FWD_TAIL,
                       (("q", q), ("k", k), ("v", v), ("out", out), ("lse", lse)), optional=("lse",))
    lib, buf, dev = _lib.lib(), _lib.err_buffer(), q.device
    with _on_device(dev):  # on torch's current stream of q's device
        _FWD_TAIL.pack_into(args, tail, _stream(dev) or 0)
        rc = lib.flash3_fwd(args, buf, len(buf))
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
    # the C order: q, k, v, out, dout, lse, dq, dk, dv
    args, tail = _args(_BWD_HEAD, (_lib.BWD_ARGS_SIZE, int(bool(causal)), int(bool(deterministic)), scale),
                       _BWD_TAIL, (("q", q), ("k", k), ("v", v), ("out", out), ("dout", dout), ("lse", lse),
                                   ("dq", dq), ("dk", dk), ("dv", dv)))
    lib, buf, dev = _lib.lib(), _lib.err_buffer(), q.device
    if not _lib.has_bwd():
        raise RuntimeError("this libflash3.so has no backward (flash3_bwd): rebuild the library")
    with _on_device(dev):
        # NOTES: the size depends on the shapes of q and k and the two flags only (bwd_config.h,
        # BwdWorkspaceLayout), so it is asked once per such key; flash3_bwd checks every
        # argument itself (and that the workspace is large enough).
        key = (tuple(q.shape), tuple(k.shape), dev.index, bool(causal), bool(deterministic))
        size = _BWD_WORKSPACE_BYTES.get(key)
        if size is None:
            nbytes = ctypes.c_uint64(0)
            rc = lib.flash3_bwd_workspace_size(args, ctypes.byref(nbytes), buf, len(buf))
            _check(rc, buf, "flash3_bwd_workspace_size")
            size = nbytes.value
            if len(_BWD_WORKSPACE_BYTES) >= 1024:
                _BWD_WORKSPACE_BYTES.clear()
            _BWD_WORKSPACE_BYTES[key] = size
        workspace, ptr = None, None
        if size:
            # allocated on the current stream, so the allocator reuses it only after the kernels
            workspace = torch.empty(size + _WORKSPACE_ALIGN, dtype=torch.uint8, device=dev)
            ptr = -workspace.data_ptr() % _WORKSPACE_ALIGN + workspace.data_ptr()
        _BWD_TAIL.pack_into(args, tail, ptr or 0, size, _stream(dev) or 0)
        rc = lib.flash3_bwd(args, buf, len(buf))
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

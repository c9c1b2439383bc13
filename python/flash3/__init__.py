"""flash3: FlashAttention-3 for Hopper, called from PyTorch through ctypes (no extension).

    from flash3 import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)          # q: (batch, seqlen_q, nheads, headdim)
    out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    out.sum().backward()                                  # dq, dk, dv by flash3's backward kernels

The buffer-level entry points are forward_into and backward_into.

Names and argument order follow FlashAttention-3's `flash_attn_interface.flash_attn_func`.
The library is found via $FLASH3_LIB, else ../../build/libflash3.so beside this package, else
the system's library path.
"""
import contextlib
import ctypes
import math
import struct

import torch

from . import _lib

__all__ = ["flash_attn_func", "forward_into", "backward_into", "hopper_available", "version"]

_DTYPES = {torch.float16: _lib.FLOAT16, torch.bfloat16: _lib.BFLOAT16, torch.float32: _lib.FLOAT32,
           torch.int32: _lib.INT32}
for _name, _code in (("float8_e4m3fn", _lib.FLOAT8_E4M3), ("float8_e5m2", _lib.FLOAT8_E5M2)):
    if hasattr(torch, _name):
        _DTYPES[getattr(torch, _name)] = _code

# FlashAttention-3 keyword arguments flash3 cannot honour, with their defaults: a non-default
# value raises NotImplementedError. Performance hints that cannot change the result are ignored.
_UNSUPPORTED = {"qv": None, "q_descale": None, "k_descale": None, "v_descale": None,
                "attention_chunk": 0, "softcap": 0.0}
_IGNORED = ("num_splits", "pack_gqa", "sm_margin")
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


def _forward(q, k, v, softmax_scale, causal, want_lse):
    if not isinstance(q, torch.Tensor) or not q.is_cuda:
        raise ValueError(f"q: must be a CUDA tensor, got {getattr(q, 'device', type(q).__name__)}")
    out = torch.empty_like(q)
    lse = None
    if want_lse and q.dim() == 4:
        b, sq, h, _ = q.shape
        lse = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
    return forward_into(q, k, v, out, lse, softmax_scale, causal)


def _kernel_layout(t):
    """True when flash3 can read t as it is: last dim contiguous, every other stride (of a dim
    longer than 1) positive and a multiple of 16 bytes."""
    if t.stride(-1) != 1:
        return False
    unit = max(1, 16 // t.element_size())
    return all(n <= 1 or (s > 0 and s % unit == 0) for n, s in zip(t.shape[:-1], t.stride()[:-1]))


class _FlashAttnFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic):
        out, lse = _forward(q, k, v, softmax_scale, causal, True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        ctx.mark_non_differentiable(lse)
        # NOTES: lse has no gradient; materialized, autograd would allocate and zero-fill a
        # float32 (batch, nheads, seqlen_q) tensor for it on every backward (one more allocation
        # and kernel launch per call: docs/perf-log.md, H2). Unmaterialized, it arrives as None.
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        if dout is None:  # no gradient reached out (unmaterialized): none for q, k, v either
            return None, None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        # an incoming gradient may be any view (sum() gives a stride-0 expand): copy it only when
        # the kernels cannot read it as it is
        if not _kernel_layout(dout):
            dout = dout.contiguous()
        dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
        backward_into(dout, q, k, v, out, lse, dq, dk, dv, ctx.softmax_scale, ctx.causal,
                      ctx.deterministic)
        return dq, dk, dv, None, None, None


def _window_is_causal(window_size, causal):
    """Maps FlashAttention's window_size onto flash3's masks; raises for real sliding windows."""
    left, right = (-1 if w is None or w < 0 else int(w) for w in window_size)
    if right < 0 and left < 0:
        return causal
    if left < 0 and right == 0:  # FlashAttention's spelling of (bottom-right) causal
        return True
    raise NotImplementedError(f"window_size={tuple(window_size)}: sliding-window attention is not "
                              "supported by flash3")


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, *, window_size=(-1, -1),
                    deterministic=False, return_attn_probs=False, **unsupported):
    """softmax(softmax_scale * q k^T [causal mask]) v.

    q (batch, seqlen_q, nheads, headdim), k/v (batch, seqlen_k, nheads_kv, headdim), bf16 or fp16,
    headdim 64/128/256, nheads a multiple of nheads_kv (GQA/MQA). causal is aligned bottom-right:
    query i sees key j iff j <= i + seqlen_k - seqlen_q. Returns out, or (out, softmax_lse) with
    softmax_lse float32 (batch, nheads, seqlen_q) when return_attn_probs.
    When any of q, k, v requires grad, the backward (loss.backward()) runs flash3's backward
    kernels; deterministic=True makes its gradients bitwise reproducible (the forward always is).
    softmax_lse is not differentiable.
    """
    for name, value in unsupported.items():
        if name in _IGNORED:
            continue
        if name not in _UNSUPPORTED:
            raise TypeError(f"flash_attn_func() got an unexpected keyword argument '{name}'")
        default = _UNSUPPORTED[name]
        if value is not None and (default is None or value != default):
            raise NotImplementedError(f"{name}={value!r} is not supported by flash3")
    causal = _window_is_causal(window_size, bool(causal))
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))
    if needs_grad:
        out, lse = _FlashAttnFunc.apply(q, k, v, softmax_scale, causal, bool(deterministic))
    else:
        out, lse = _forward(q, k, v, softmax_scale, causal, return_attn_probs)
    return (out, lse) if return_attn_probs else out

"""flash3's operators in torch.library (namespace flash3), for torch.compile, torch.export,
CUDA graphs (mode="reduce-overhead") and FakeTensor tracing:

    torch.ops.flash3.fwd(q, k, v, softmax_scale=None, causal=False, deterministic=False,
                         window_left=-1, window_right=-1, softcap=0.0) -> (out, lse)
    torch.ops.flash3.bwd(dout, q, k, v, out, lse, softmax_scale=None, causal=False,
                         deterministic=False, window_left=-1, window_right=-1, softcap=0.0)
                         -> (dq, dk, dv)
    torch.ops.flash3.fwd_fp8(q, k, v, q_scale=None, k_scale=None, v_scale=None, softmax_scale=None,
                             causal=False, window_left=-1, window_right=-1, softcap=0.0) -> (out, lse)
    torch.ops.flash3.quantize_fp8(x, block_rows=128, hadamard=False, seed=0) -> (out, scale)
    torch.ops.flash3.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                                deterministic=False, window_left=-1, window_right=-1, softcap=0.0)
                                -> (out, lse)
    torch.ops.flash3.bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                max_seqlen_k, seqused_q=None, seqused_k=None, softmax_scale=None,
                                causal=False, deterministic=False, window_left=-1, window_right=-1,
                                softcap=0.0) -> (dq, dk, dv)

    torch.ops.flash3.fwd_kvcache(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None,
                                 causal=False, window_left=-1, window_right=-1, softcap=0.0,
                                 cache_batch_idx=None, cache_leftpad=None, page_table=None,
                                 num_splits=0, k_new=None, v_new=None, rotary_cos=None,
                                 rotary_sin=None, rotary_interleaved=True, qv=None) -> (out, lse)

window_left, window_right: FlashAttention-3's sliding window (-1: no bound on that side; the
library refuses < -1), softcap: > 0 caps the scaled scores (0.0: none; 16-bit inputs only), as
_kernels.forward_into; the backward must be given the forward's. (Appended with defaults: calls
written for the earlier schemas work unchanged.)

All but fwd_kvcache are functional (mutates_args=()): they allocate their outputs with torch (the
caching allocator, so inside a CUDA graph the graph's pool) and run the library on
torch.cuda.current_stream() of q's device; the backward's scratch memory is a torch tensor too.
(Functional rather than writing into preallocated outputs: no functionalization wrappers or
copies under torch.compile, inductor plans the buffers, and the eager path, which does not go
through these operators, allocates the same way.)
Outputs are contiguous: out like q, lse float32 (batch, nheads, seqlen_q), dq, dk, dv like q, k,
v. fwd is differentiable in q, k, v through bwd (lse is not differentiable; `deterministic`
is the backward's option, carried by the forward so that autograd can hand it on).
The FP8 operators are inference-only and have no autograd: out of fwd_fp8 is bfloat16 (batch,
seqlen_q, nheads, head_dim) from float8_e4m3fn q, k, v and float32 dequantization scales
(_kernels.forward_into); quantize_fp8 gives out float8_e4m3fn shaped like x and scale float32
(batch, nheads, ceil(seqlen / block_rows)). Backward through either (an input that requires
grad) raises torch's "no autograd formula was registered" RuntimeError naming the operator.
The variable-length operators (FlashAttention-3's varlen layout, _kernels.forward_varlen_into):
q, out, dout, dq (total_q, nheads, head_dim), k, v, dk, dv (total_k, nheads_kv, head_dim),
cu_seqlens_q / cu_seqlens_k int32 (batch + 1), seqused_q / seqused_k int32 (batch) or None, lse
float32 (nheads, total_q); max_seqlen_q / max_seqlen_k are SymInts (the outputs' shapes do not
depend on them, nor on the values of the length tensors). fwd_varlen is differentiable in q, k,
v through bwd_varlen. With seqused_q, out rows past it are 0 and lse rows +inf.
fwd_kvcache (decoding, _kernels.forward_kvcache_into): q (batch, seqlen_q, nheads, head_dim) over
k_cache, v_cache, contiguous (batch_cache, seqlen_cache, nheads_kv, head_dim) or paged (num_pages,
page_size, nheads_kv, head_dim) with page_table int32 (batch, max_pages_per_seq); cache_seqlens,
cache_batch_idx (contiguous cache only), cache_leftpad int32 (batch) or None; num_splits 0..64
(0: the library's heuristic); out like q, lse float32 (batch, nheads, seqlen_q) whatever the cache
layout; inference only, as fwd_fp8. With k_new, v_new (batch, seqlen_new, nheads_kv, head_dim) the
kernel appends them in place into k_cache and v_cache at cache_seqlens (rotated with rotary_cos,
rotary_sin where given, q too; _kernels.forward_kvcache_into). With qv (MLA, FlashAttention-3's
qv: q (..., 64) and qv (batch, seqlen_q, nheads, 512) the queries' rotary and latent parts,
k_cache (..., 64) and v_cache (..., 512) the keys' (v_cache also the values)), out is (batch,
seqlen_q, nheads, v_cache.shape[3]). It is the one operator that mutates its inputs: k_cache
and v_cache are declared written (mutates_args; Tensor(a1!), Tensor(a2!) in
the schema) whether or not k_new is given. Under torch.compile it is functionalized like any
mutating operator (a graph that writes its inputs: mode="reduce-overhead" replays it from a CUDA
graph only where the cache is a static input, a module's buffer say); its fake writes nothing
(the outputs' shapes do not depend on the append).

Adding an operator (a KV cache, say): a kernel in _kernels.py, then here one annotated
function that calls it, its fake (shape arithmetic and new_empty / empty_like on the fake
inputs only, so symbolic shapes work), optionally setup_context and backward, and one
_define(...) call. The eager entry points (flash_attn_interface.py) skip the dispatcher where
nothing traces (see direct()), calling the same kernels.
"""
from typing import Optional

import torch

from . import _kernels

Tensor = torch.Tensor
NAMESPACE = "flash3"
OPS = {}  # name -> torch.library CustomOpDef, in definition order

# torch.library.custom_op, register_fake and register_autograd came with PyTorch 2.4; without
# them flash3 runs eagerly only (flash_attn_func works, torch.compile breaks the graph there).
available = all(hasattr(torch.library, name) for name in ("custom_op", "register_fake"))

_is_compiling = torch.compiler.is_compiling if hasattr(torch, "compiler") else (lambda: False)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", lambda: 0)
_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", lambda: False)
_grad_enabled = torch.is_grad_enabled


def direct(*tensors):
    """True when a call on these tensors may skip the dispatcher and run the kernels directly
    (the eager fast path: the operators' dispatch to their Python kernels and autograd cost, on
    the host, about 10 us per forward without grad, 27 us with grad and 47 us per
    forward+backward more (PyTorch 2.11)): nothing traces or transforms it (no
    torch.compile / dynamo, no TorchDispatchMode such as FakeTensorMode or make_fx's proxy
    mode, no functorch transform) and every tensor is a plain torch.Tensor (no subclass)."""
    # NOTES: is_compiling first: dynamo folds it to True and never looks at the rest (calls into
    # torch._C it could not trace). Each check costs about 0.1 us.
    if not available:
        return True
    if _is_compiling() or _dispatch_modes() or _functorch_active():
        return False
    for t in tensors:
        if type(t) is not Tensor:
            return False
    return True


def _define(name, kernel, fake, setup_context=None, backward=None, mutates_args=()):
    """Registers flash3::<name>: kernel (annotated: the schema is inferred from it, with the
    arguments named in mutates_args marked as written) for every device (the kernel itself
    rejects what is not CUDA, naming the argument), its fake, and its autograd formula where
    given. Returns the OpOverload, torch.ops.flash3.<name>.default."""
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", kernel, mutates_args=mutates_args)
    op.register_fake(fake)
    if backward is not None:
        op.register_autograd(backward, setup_context=setup_context)
    OPS[name] = op
    return getattr(getattr(torch.ops, NAMESPACE), name).default


# ---- flash3::fwd ---------------------------------------------------------------------------

def _check_mask(window_left, window_right, softcap):
    """The fakes' type checks of the window and softcap, as the kernels make them (the values
    are the library's to check, at run time); symbolic values pass."""
    for name, side in (("window_left", window_left), ("window_right", window_right)):
        if not isinstance(side, torch.SymInt):
            _kernels.window_arg(name, side)
    if not isinstance(softcap, torch.SymFloat):
        _kernels.softcap_arg(softcap)


def _fwd(q: Tensor, k: Tensor, v: Tensor, softmax_scale: Optional[float] = None, causal: bool = False,
         deterministic: bool = False, window_left: int = -1, window_right: int = -1,
         softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    return _kernels.fwd(q, k, v, softmax_scale, causal, True, None, None, None, window_left, window_right, softcap)


def _fwd_fake(q, k, v, softmax_scale=None, causal=False, deterministic=False, window_left=-1, window_right=-1,
              softcap=0.0):
    _check_mask(window_left, window_right, softcap)
    if q.dim() != 4:
        raise ValueError(f"q: expected (batch, seqlen_q, nheads, headdim), got shape {tuple(q.shape)}")
    b, sq, h, _ = q.shape
    out = torch.empty_like(q, dtype=_kernels.out_dtype(q), memory_format=torch.contiguous_format)
    return out, q.new_empty((b, h, sq), dtype=torch.float32)


def fwd_setup_context(ctx, inputs, output):
    """Shared by flash3::fwd's autograd and the eager autograd.Function (flash_attn_interface)."""
    q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window_left, ctx.window_right, ctx.softcap = window_left, window_right, softcap
    ctx.mark_non_differentiable(lse)
    # NOTES: lse has no gradient; materialized, autograd would allocate and zero-fill a float32
    # (batch, nheads, seqlen_q) tensor for it on every backward (docs/perf-log.md, H2).
    # Unmaterialized, it arrives as None, and so does dout when out got no gradient.
    ctx.set_materialize_grads(False)


def fwd_backward(ctx, dout, dlse):
    """d(q, k, v) from dout through flash3::bwd; None for the non-tensor inputs. The kernel is
    called directly where nothing traces and no higher-order gradient is being built, else the
    operator (which has no autograd: asking for a second derivative raises)."""
    if dout is None:  # no gradient reached out: none for q, k, v either
        return (None,) * 9
    q, k, v, out, lse = ctx.saved_tensors
    run = _kernels.bwd if not _grad_enabled() and direct(dout, q) else bwd
    dq, dk, dv = run(dout, q, k, v, out, lse, ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.window_left,
                     ctx.window_right, ctx.softcap)
    return dq, dk, dv, None, None, None, None, None, None


# ---- flash3::bwd ---------------------------------------------------------------------------

def _bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
         softmax_scale: Optional[float] = None, causal: bool = False,
         deterministic: bool = False, window_left: int = -1, window_right: int = -1,
         softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    return _kernels.bwd(dout, q, k, v, out, lse, softmax_scale, causal, deterministic, window_left, window_right,
                        softcap)


def _bwd_fake(dout, q, k, v, out, lse, softmax_scale=None, causal=False, deterministic=False, window_left=-1,
              window_right=-1, softcap=0.0):
    _check_mask(window_left, window_right, softcap)
    cf = torch.contiguous_format
    return (torch.empty_like(q, memory_format=cf), torch.empty_like(k, memory_format=cf),
            torch.empty_like(v, memory_format=cf))


# ---- flash3::fwd_fp8 -----------------------------------------------------------------------

def _fwd_fp8(q: Tensor, k: Tensor, v: Tensor, q_scale: Optional[Tensor] = None, k_scale: Optional[Tensor] = None,
             v_scale: Optional[Tensor] = None, softmax_scale: Optional[float] = None,
             causal: bool = False, window_left: int = -1, window_right: int = -1,
             softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    return _kernels.fwd(q, k, v, softmax_scale, causal, True, q_scale, k_scale, v_scale, window_left, window_right,
                        softcap)


def _fwd_fp8_fake(q, k, v, q_scale=None, k_scale=None, v_scale=None, softmax_scale=None, causal=False,
                  window_left=-1, window_right=-1, softcap=0.0):
    _check_mask(window_left, window_right, softcap)  # softcap > 0 is the library's to refuse (16-bit only)
    _kernels.check_fp8_qkv(q, k, v)
    for name, s in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
        _kernels.check_scale(name, s, q)  # their shapes are the kernel's to check
    if q.dim() != 4:
        raise ValueError(f"q: expected (batch, seqlen_q, nheads, headdim), got shape {tuple(q.shape)}")
    b, sq, h, _ = q.shape
    out = torch.empty_like(q, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
    return out, q.new_empty((b, h, sq), dtype=torch.float32)


# ---- flash3::quantize_fp8 ------------------------------------------------------------------

def _quantize_fp8(x: Tensor, block_rows: int = 128, hadamard: bool = False, seed: int = 0) -> tuple[Tensor, Tensor]:
    return _kernels.quantize_fp8(x, block_rows, hadamard, seed)


def _quantize_fp8_fake(x, block_rows=128, hadamard=False, seed=0):
    if isinstance(block_rows, int):  # a symbolic block_rows is checked by the kernel
        _kernels.block_rows_arg(block_rows)
    _, scale_shape = _kernels.quantize_shapes(x, block_rows)
    out = torch.empty_like(x, dtype=torch.float8_e4m3fn, memory_format=torch.contiguous_format)
    return out, x.new_empty(scale_shape, dtype=torch.float32)


# ---- flash3::fwd_varlen --------------------------------------------------------------------

def _check_varlen(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, window_left,
                  window_right, softcap):
    """The fakes' checks of the variable-length arguments, as the kernels make them (symbolic
    values pass); returns lse's shape (nheads, total_q)."""
    _check_mask(window_left, window_right, softcap)
    for name, n in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        _kernels.seqlen_arg(name, n)
    return _kernels.varlen_lse_shape(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)


def _fwd_varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                max_seqlen_k: int, seqused_q: Optional[Tensor] = None, seqused_k: Optional[Tensor] = None,
                softmax_scale: Optional[float] = None, causal: bool = False, deterministic: bool = False,
                window_left: int = -1, window_right: int = -1, softcap: float = 0.0) -> tuple[Tensor, Tensor]:
    return _kernels.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                               softmax_scale, causal, True, window_left, window_right, softcap)


def _fwd_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
                     softmax_scale=None, causal=False, deterministic=False, window_left=-1, window_right=-1,
                     softcap=0.0):
    lse_shape = _check_varlen(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k,
                              window_left, window_right, softcap)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty(lse_shape, dtype=torch.float32)


def fwd_varlen_setup_context(ctx, inputs, output):
    """Shared by flash3::fwd_varlen's autograd and the eager autograd.Function
    (flash_attn_interface), as fwd_setup_context."""
    (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k, softmax_scale, causal,
     deterministic, window_left, window_right, softcap) = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
    ctx.max_seqlen_q, ctx.max_seqlen_k = max_seqlen_q, max_seqlen_k
    ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
    ctx.window_left, ctx.window_right, ctx.softcap = window_left, window_right, softcap
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)  # as fwd_setup_context


def fwd_varlen_backward(ctx, dout, dlse):
    """d(q, k, v) from dout through flash3::bwd_varlen (the kernel directly where fwd_backward
    calls it directly); None for the other inputs."""
    if dout is None:
        return (None,) * 15
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k = ctx.saved_tensors
    run = _kernels.bwd_varlen if not _grad_enabled() and direct(dout, q) else bwd_varlen
    dq, dk, dv = run(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, ctx.max_seqlen_q, ctx.max_seqlen_k,
                     seqused_q, seqused_k, ctx.softmax_scale, ctx.causal, ctx.deterministic, ctx.window_left,
                     ctx.window_right, ctx.softcap)
    return (dq, dk, dv) + (None,) * 12


# ---- flash3::bwd_varlen --------------------------------------------------------------------

def _bwd_varlen(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_seqlens_q: Tensor,
                cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, seqused_q: Optional[Tensor] = None,
                seqused_k: Optional[Tensor] = None, softmax_scale: Optional[float] = None, causal: bool = False,
                deterministic: bool = False, window_left: int = -1, window_right: int = -1,
                softcap: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    return _kernels.bwd_varlen(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               seqused_q, seqused_k, softmax_scale, causal, deterministic, window_left, window_right,
                               softcap)


def _bwd_varlen_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None,
                     seqused_k=None, softmax_scale=None, causal=False, deterministic=False, window_left=-1,
                     window_right=-1, softcap=0.0):
    _check_varlen(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, max_seqlen_q, max_seqlen_k, window_left,
                  window_right, softcap)
    cf = torch.contiguous_format
    return (torch.empty_like(q, memory_format=cf), torch.empty_like(k, memory_format=cf),
            torch.empty_like(v, memory_format=cf))


# ---- flash3::fwd_kvcache -------------------------------------------------------------------

def _fwd_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Optional[Tensor] = None,
                 softmax_scale: Optional[float] = None, causal: bool = False, window_left: int = -1,
                 window_right: int = -1, softcap: float = 0.0, cache_batch_idx: Optional[Tensor] = None,
                 cache_leftpad: Optional[Tensor] = None, page_table: Optional[Tensor] = None,
                 num_splits: int = 0, k_new: Optional[Tensor] = None, v_new: Optional[Tensor] = None,
                 rotary_cos: Optional[Tensor] = None, rotary_sin: Optional[Tensor] = None,
                 rotary_interleaved: bool = True, qv: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    return _kernels.fwd_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, True, window_left,
                                window_right, softcap, cache_batch_idx, cache_leftpad, page_table, num_splits, k_new,
                                v_new, rotary_cos, rotary_sin, rotary_interleaved, qv)


def _fwd_kvcache_fake(q, k_cache, v_cache, cache_seqlens=None, softmax_scale=None, causal=False, window_left=-1,
                      window_right=-1, softcap=0.0, cache_batch_idx=None, cache_leftpad=None, page_table=None,
                      num_splits=0, k_new=None, v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True,
                      qv=None):
    # the append writes k_cache and v_cache, which the outputs do not depend on: nothing to do here.
    # out as _kernels.fwd_kvcache allocates it: like q, or with qv (MLA) of v_cache's head dim
    _check_mask(window_left, window_right, softcap)
    b, sq, h, dv = _kernels.kvcache_shapes(q, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad,
                                           page_table, num_splits, qv)
    out = torch.empty_like(q, memory_format=torch.contiguous_format) if qv is None else q.new_empty((b, sq, h, dv))
    return out, q.new_empty((b, h, sq), dtype=torch.float32)


if available:
    fwd = _define("fwd", _fwd, _fwd_fake, fwd_setup_context, fwd_backward)
    bwd = _define("bwd", _bwd, _bwd_fake)
    fwd_fp8 = _define("fwd_fp8", _fwd_fp8, _fwd_fp8_fake)
    quantize_fp8 = _define("quantize_fp8", _quantize_fp8, _quantize_fp8_fake)
    fwd_varlen = _define("fwd_varlen", _fwd_varlen, _fwd_varlen_fake, fwd_varlen_setup_context, fwd_varlen_backward)
    bwd_varlen = _define("bwd_varlen", _bwd_varlen, _bwd_varlen_fake)
    fwd_kvcache = _define("fwd_kvcache", _fwd_kvcache, _fwd_kvcache_fake, mutates_args=("k_cache", "v_cache"))
else:  # pragma: no cover (PyTorch < 2.4)
    fwd, bwd, fwd_fp8, quantize_fp8 = _fwd, _bwd, _fwd_fp8, _quantize_fp8
    fwd_varlen, bwd_varlen, fwd_kvcache = _fwd_varlen, _bwd_varlen, _fwd_kvcache

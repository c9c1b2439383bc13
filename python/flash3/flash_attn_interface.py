"""Drop-in for FlashAttention-3's `flash_attn_interface` (hopper/flash_attn_interface.py):
the same function names, argument names, order, defaults and return values, so that

    import flash3.flash_attn_interface as flash_attn_interface     # was: import flash_attn_interface
    from flash3.flash_attn_interface import flash_attn_func         # or: from flash3 import ...

is the only change code written for FlashAttention-3 needs.

FP8, as FlashAttention-3: q, k, v torch.float8_e4m3fn with the float32 dequantization scales
q_descale, k_descale, v_descale ((batch, nheads_kv) each, optional: None is 1) give a bfloat16
out (and lse); inference only (no autograd; a backward through it raises). The descales with
16-bit q, k, v, float8_e5m2, and float8 mixed with 16-bit tensors raise ValueError naming the
argument. (flash3.flash_attn_fp8_func quantizes 16-bit inputs itself, with block scales.)

Sliding window and softcap, as FlashAttention-3 (forward and backward; float16 and bfloat16 only:
with float8 inputs the library refuses both, but causal): window_size = (left, right) lets query i see key j iff
i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right; a negative side is
unbounded ((-1, -1): no window), and causal=True makes right 0 ((-1, 0) is causal). softcap > 0
replaces each scaled score x by softcap * tanh(x / softcap) before the softmax (softmax_lse is
of these logits); 0.0: none; finite, at most 2048, float16 / bfloat16 only. A window_size that is
not a pair of ints, or a softcap that is not a real number, raises ValueError naming it; a
softcap out of range (negative, too large, NaN, or with float8 inputs) raises the library's
ValueError naming it. The backward gets the forward's window and softcap.

Variable-length batches, as FlashAttention-3's flash_attn_varlen_func: q (total_q, nheads,
headdim), k and v (total_k, nheads_kv, headdim) hold the batch's sequences one after the other,
sequence b being rows cu_seqlens_q[b]:cu_seqlens_q[b + 1] of q and cu_seqlens_k[b]:cu_seqlens_k[b
+ 1] of k and v (cu_seqlens_q, cu_seqlens_k: int32 (batch + 1) on q's device); the masks are
aligned bottom-right in each sequence; softmax_lse is float32 (nheads, total_q). seqused_q /
seqused_k (int32 (batch)) keep only the first seqused[b] rows of sequence b: out rows past
seqused_q are 0 (softmax_lse +inf) and gradient rows past seqused are 0. bfloat16 and float16 only.

Arguments flash3 does not support yet raise NotImplementedError naming the argument when given
a value other than their default: qv (not None; flash_attn_with_kvcache takes it, below),
attention_chunk (not 0); for flash_attn_varlen_func also q_descale, k_descale, v_descale (not
None), and float8 q names q.
(Under torch.compile with fullgraph=True, dynamo reports the NotImplementedError, with its
message, as an unsupported exception; without fullgraph it reaches the caller as it is.)
Accepted and ignored (by flash_attn_varlen_func too), because they tune speed only and cannot
change flash3's results:
num_splits (FlashAttention-3 splits the keys across blocks; flash3 picks its own schedule, and
its output is the same for every value; flash_attn_with_kvcache passes it on, below), pack_gqa (a
GQA layout choice) and sm_margin (SMs left free for other kernels).

Decoding, as FlashAttention-3's flash_attn_with_kvcache: q (batch, seqlen_q, nheads, headdim)
attends to k_cache, v_cache, a contiguous cache (batch_cache, seqlen_cache, nheads_kv, headdim),
optionally through cache_batch_idx, or a paged one (num_pages, page_size, nheads_kv, headdim)
through page_table; sequence b to its cache positions [cache_leftpad[b], cache_seqlens[b])
(cache_seqlens an int, an int32 (batch) tensor, or None: the whole cache), masks aligned
bottom-right to them; num_splits splits the key range (0: flash3's heuristic); inference only.
New keys and values k, v are appended in place at cache_seqlens, rotated with rotary_cos,
rotary_sin (the queries too), inside the decoding kernel as FlashAttention-3 does
(torch.ops.flash3.fwd_kvcache with k_new, v_new; flash3.kvcache checks the arguments first and
holds the torch reference). MLA (DeepSeek's multi-head latent attention), as FlashAttention-3's
qv: q (..., 64) and qv (batch, seqlen_q, nheads, 512) are the queries' rotary and latent parts,
k_cache (..., nheads_kv, 64) and v_cache (..., nheads_kv, 512) the keys' (the latent is also the
value); out is (batch, seqlen_q, nheads, 512). Not yet (NotImplementedError naming the argument):
cu_seqlens_q, cu_seqlens_k_new, max_seqlen_q, rotary_seqlens, the descales. flash3 always
packs the query heads of a KV head into one tile, so pack_gqa is accepted and ignored, as is
sm_margin. scheduler_metadata (get_scheduler_metadata's) is accepted and not read: flash3's plan
(the splits) comes from the shapes on the host at each call and its launch reads nothing from
the device, so a decode step captures into a CUDA graph without it.

In eager mode the calls run the library directly (the lowest host time); under torch.compile,
torch.export or any FakeTensor / dispatch-mode tracing they call the torch.library operators
torch.ops.flash3.fwd / bwd and fwd_varlen / bwd_varlen (_ops.py), which trace without a graph
break.
"""
import operator

import torch

from . import _kernels, _ops, kvcache

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "get_scheduler_metadata"]

# FlashAttention-3 arguments flash3 accepts and ignores (speed only; see above).
_IGNORED = ("num_splits", "pack_gqa", "sm_margin")

_direct = _ops.direct
_is_compiling = _ops._is_compiling
_FP8 = _kernels.FP8_DTYPES
_grad_enabled = torch.is_grad_enabled


class _FlashAttnFunc(torch.autograd.Function):
    """flash3::fwd's autograd (the same setup_context and backward), without the dispatcher."""

    # NOTES: forward takes ctx and calls setup_context itself: with a separate setup_context,
    # Function.apply binds the arguments through inspect.signature on every call (about 50 us).
    @staticmethod
    def forward(ctx, q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap):
        out, lse = _kernels.fwd(q, k, v, softmax_scale, causal, True, None, None, None, window_left, window_right,
                                softcap)
        _ops.fwd_setup_context(ctx, (q, k, v, softmax_scale, causal, deterministic, window_left, window_right,
                                     softcap), (out, lse))
        return out, lse

    backward = staticmethod(_ops.fwd_backward)


def _unsupported(name, value):
    shown = f"<tensor of shape {tuple(value.shape)}>" if isinstance(value, torch.Tensor) else repr(value)
    raise NotImplementedError(f"{name}={shown} is not supported by flash3 (FlashAttention-3 argument "
                              f"{name}: leave it at its default)")


_INT32_MAX = 2**31 - 1
_SymInt = getattr(torch, "SymInt", ())
_SymFloat = getattr(torch, "SymFloat", ())


def _window_side(value, window_size):
    """One side of window_size as an int, -1 for any negative one (unbounded) and at most
    2^31 - 1 (the library's int32; a bound that large excludes nothing); a symbolic one under
    tracing as it is. ValueError naming window_size for what is not an int."""
    if isinstance(value, _SymInt):
        return value
    try:
        side = operator.index(value)
    except TypeError:
        raise ValueError(f"window_size: expected a pair (left, right) of ints (-1: no bound on that side), "
                         f"got {window_size!r}") from None
    return -1 if side < 0 else min(side, _INT32_MAX)


def _window(window_size, causal):
    """(causal, window_left, window_right) for flash3 from FlashAttention-3's (window_size,
    causal): a negative side is unbounded (-1 for the library), causal makes the right side 0,
    and a right side of 0 is causal (flash3's causal flag, the right side then -1: the library
    sets it to 0). The sides are not compared with the sequence lengths (the library drops a
    bound that excludes nothing), so the answer never depends on the shapes."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size: expected a pair (left, right) of ints (-1: no bound on that side), "
                         f"got {window_size!r}") from None
    left, right = _window_side(left, window_size), _window_side(right, window_size)
    if left < 0:
        left = -1
    if right < 0:
        right = -1
    causal = bool(causal) or right == 0
    return causal, left, -1 if causal else right


def _softcap(softcap):
    """softcap as a float (a symbolic one under tracing as it is); ValueError naming it when it
    is not a real number. Its range is the library's to check."""
    if type(softcap) is float or isinstance(softcap, _SymFloat):
        return softcap
    return _kernels.softcap_arg(softcap)


def _mask_args(window_size, causal, softcap):
    """(causal, window_left, window_right, softcap) for the library from FlashAttention-3's
    window_size, causal and softcap (_window, _softcap); the common case, no window and softcap
    0.0, costs two comparisons."""
    left = right = -1
    if window_size != (-1, -1):
        causal, left, right = _window(window_size, causal)
    if type(softcap) is not float or softcap != 0.0:
        softcap = _softcap(softcap)
    return causal, left, right, softcap


def _attention(q, k, v, softmax_scale, causal, deterministic, return_attn_probs, window_left=-1, window_right=-1,
               softcap=0.0):
    if _direct(q, k, v):
        if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            out, lse = _FlashAttnFunc.apply(q, k, v, softmax_scale, causal, deterministic, window_left, window_right,
                                            softcap)
        else:
            out, lse = _kernels.fwd(q, k, v, softmax_scale, causal, return_attn_probs, None, None, None, window_left,
                                    window_right, softcap)
    else:
        out, lse = _ops.fwd(q, k, v, softmax_scale, causal, deterministic, window_left, window_right, softcap)
    return (out, lse) if return_attn_probs else out


def _fp8_attention(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, return_attn_probs,
                   window_left=-1, window_right=-1, softcap=0.0):
    """FlashAttention-3's FP8 forward: float8_e4m3fn q, k, v, descales float32 (batch,
    nheads_kv) or None; out bfloat16. Also where descales come with 16-bit inputs, to refuse them
    naming the argument."""
    descales = (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale))
    if q.dtype not in _kernels.FP8_DTYPES:
        for name, s in descales:
            if s is not None:
                shown = f"<tensor of shape {tuple(s.shape)}>" if isinstance(s, torch.Tensor) else repr(s)
                raise ValueError(f"{name}: given ({shown}) but q is {q.dtype}; q_descale, k_descale and "
                                 "v_descale apply to torch.float8_e4m3fn q, k, v only (leave them None)")
    _kernels.check_fp8_qkv(q, k, v)
    shape = (k.shape[0], k.shape[2]) if k.dim() == 4 else None  # else the kernel names k's rank
    for name, s in descales:
        _kernels.check_scale(name, s, q, shape)
    scales = [s for _, s in descales if s is not None]
    grad = _grad_enabled() and any(t.requires_grad for t in (q, k, v, *scales))
    if _direct(q, k, v, *scales) and not grad:
        out, lse = _kernels.fwd(q, k, v, softmax_scale, causal, return_attn_probs, q_descale, k_descale, v_descale,
                                window_left, window_right, softcap)
    else:  # also where an input requires grad: the operator has no autograd, its backward raises
        out, lse = _ops.fwd_fp8(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, window_left,
                                window_right, softcap)
    return (out, lse) if return_attn_probs else out


def flash_attn_func(
    q,
    k,
    v,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """softmax(softmax_scale * q k^T [softcap] [causal / window mask]) v, as FlashAttention-3's
    flash_attn_func.

    q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_kv, headdim): CUDA
    tensors, bf16 or fp16, headdim 64, 128 or 256, nheads a multiple of nheads_kv (GQA/MQA);
    or float8_e4m3fn with q_descale, k_descale, v_descale float32 (batch, nheads_kv) (each
    optional: None is 1; the true q is q * q_descale per (batch, kv head)), out then bfloat16.
    softmax_scale: default 1 / sqrt(headdim). causal: the mask aligned bottom-right: query i
    sees key j iff j <= i + seqlen_k - seqlen_q; a row that sees no key gives 0 (lse +inf).
    window_size (left, right): query i sees key j iff i + seqlen_k - seqlen_q - left <= j <=
    i + seqlen_k - seqlen_q + right (a negative side: unbounded; causal: right = 0).
    softcap > 0: scores x = softmax_scale * q.k become softcap * tanh(x / softcap) (0.0: none;
    16-bit only). deterministic: bitwise-reproducible gradients (the forward always is).
    Returns out (batch, seqlen_q, nheads, headdim), or (out, softmax_lse) when
    return_attn_probs, softmax_lse float32 (batch, nheads, seqlen_q) and not differentiable.
    The unsupported and ignored arguments: see the module's docstring.
    """
    if qv is not None:
        _unsupported("qv", qv)
    if attention_chunk:
        _unsupported("attention_chunk", attention_chunk)
    causal, left, right, softcap = _mask_args(window_size, causal, softcap)
    if q_descale is not None or k_descale is not None or v_descale is not None or q.dtype in _FP8:
        return _fp8_attention(q, k, v, q_descale, k_descale, v_descale, softmax_scale, bool(causal),
                              return_attn_probs, left, right, softcap)
    return _attention(q, k, v, softmax_scale, bool(causal), bool(deterministic), return_attn_probs, left, right,
                      softcap)


def _split_qkv(qkv, num_heads_q):
    """q, k, v as views of FlashAttention-3's packed qkv: (batch, seqlen, 3, nheads, headdim), or
    (batch, seqlen, num_heads_q + 2 * nheads_kv, headdim) with num_heads_q given."""
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"qkv: expected (batch, seqlen, 3, nheads, headdim), got shape {tuple(qkv.shape)}")
        return qkv.unbind(2)
    if qkv.dim() == 4:
        if num_heads_q is None:
            raise ValueError("num_heads_q: needed when qkv is (batch, seqlen, nheads_q + 2 * nheads_kv, "
                             f"headdim), got qkv of shape {tuple(qkv.shape)}")
        num_heads_k = (qkv.shape[2] - num_heads_q) // 2
        if num_heads_q <= 0 or num_heads_k <= 0 or num_heads_q + 2 * num_heads_k != qkv.shape[2]:
            raise ValueError(f"num_heads_q: {num_heads_q} does not split qkv's {qkv.shape[2]} heads into "
                             "num_heads_q + 2 * nheads_kv")
        return qkv.split([num_heads_q, num_heads_k, num_heads_k], dim=2)
    raise ValueError(f"qkv: expected 5 dims (batch, seqlen, 3, nheads, headdim) or 4 with num_heads_q, "
                     f"got shape {tuple(qkv.shape)}")


class _FlashAttnQKVPackedFunc(torch.autograd.Function):
    """Eager autograd of the packed form: the gradient is one packed dqkv, the kernels writing dq,
    dk and dv straight into its parts (no concatenation)."""

    @staticmethod
    def forward(ctx, qkv, softmax_scale, causal, deterministic, num_heads_q, window_left, window_right, softcap):
        q, k, v = _split_qkv(qkv, num_heads_q)
        out, lse = _kernels.fwd(q, k, v, softmax_scale, causal, True, None, None, None, window_left, window_right,
                                softcap)
        ctx.save_for_backward(qkv, out, lse)
        ctx.softmax_scale, ctx.causal, ctx.deterministic = softmax_scale, causal, deterministic
        ctx.num_heads_q = num_heads_q
        ctx.window_left, ctx.window_right, ctx.softcap = window_left, window_right, softcap
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout, dlse):
        if dout is None:
            return (None,) * 8
        qkv, out, lse = ctx.saved_tensors
        dqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
        _kernels.backward_into(_kernels.kernel_readable(dout), *_split_qkv(qkv, ctx.num_heads_q), out, lse,
                               *_split_qkv(dqkv, ctx.num_heads_q), ctx.softmax_scale, ctx.causal,
                               ctx.deterministic, ctx.window_left, ctx.window_right, ctx.softcap)
        return dqkv, None, None, None, None, None, None, None


def flash_attn_qkvpacked_func(
    qkv,
    softmax_scale=None,
    causal=False,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    deterministic=False,
    num_heads_q=None,
    sm_margin=0,
    return_attn_probs=False,
):
    """flash_attn_func over one packed tensor, as FlashAttention-3's flash_attn_qkvpacked_func.

    qkv: (batch, seqlen, 3, nheads, headdim), or (batch, seqlen, num_heads_q + 2 * nheads_kv,
    headdim) with num_heads_q given (GQA/MQA). The gradient, when qkv requires grad, is one
    tensor shaped like qkv. Returns out, or (out, softmax_lse) when return_attn_probs.
    window_size, softcap: as flash_attn_func's.
    FP8 (float8_e4m3fn qkv, descales (batch, nheads_kv)): as flash_attn_func, no gradient.
    """
    if attention_chunk:
        _unsupported("attention_chunk", attention_chunk)
    causal, deterministic = bool(causal), bool(deterministic)
    causal, left, right, softcap = _mask_args(window_size, causal, softcap)
    if q_descale is not None or k_descale is not None or v_descale is not None or qkv.dtype in _FP8:
        q, k, v = _split_qkv(qkv, num_heads_q)
        return _fp8_attention(q, k, v, q_descale, k_descale, v_descale, softmax_scale, causal, return_attn_probs,
                              left, right, softcap)
    if _direct(qkv) and _grad_enabled() and qkv.requires_grad:
        out, lse = _FlashAttnQKVPackedFunc.apply(qkv, softmax_scale, causal, deterministic, num_heads_q, left, right,
                                                 softcap)
        return (out, lse) if return_attn_probs else out
    q, k, v = _split_qkv(qkv, num_heads_q)
    return _attention(q, k, v, softmax_scale, causal, deterministic, return_attn_probs, left, right, softcap)


class _FlashAttnVarlenFunc(torch.autograd.Function):
    """flash3::fwd_varlen's autograd (the same setup_context and backward), without the
    dispatcher (as _FlashAttnFunc)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q, seqused_k,
                softmax_scale, causal, deterministic, window_left, window_right, softcap):
        out, lse = _kernels.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                       seqused_k, softmax_scale, causal, True, window_left, window_right, softcap)
        _ops.fwd_varlen_setup_context(ctx, (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                            seqused_q, seqused_k, softmax_scale, causal, deterministic, window_left,
                                            window_right, softcap), (out, lse))
        return out, lse

    backward = staticmethod(_ops.fwd_varlen_backward)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    seqused_q=None,
    seqused_k=None,
    softmax_scale=None,
    causal=False,
    qv=None,
    q_descale=None, k_descale=None, v_descale=None,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    num_splits=1,
    pack_gqa=None,
    deterministic=False,
    sm_margin=0,
    return_attn_probs=False,
):
    """flash_attn_func over a batch of sequences of different lengths packed one after the
    other, as FlashAttention-3's flash_attn_varlen_func.

    q (total_q, nheads, headdim), k and v (total_k, nheads_kv, headdim): CUDA tensors, bf16 or
    fp16, headdim 64, 128 or 256, nheads a multiple of nheads_kv. cu_seqlens_q, cu_seqlens_k:
    int32 (batch + 1) on q's device, the sequences' offsets (0 first, total_q / total_k last,
    never decreasing): sequence b is q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]] and
    k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]] (v likewise). max_seqlen_q, max_seqlen_k: ints, at
    least every sequence's length. seqused_q, seqused_k: int32 (batch) or None; only the first
    seqused[b] rows of sequence b take part (its lengths for the masks); out rows past
    seqused_q are 0 (softmax_lse +inf), gradient rows past seqused 0. softmax_scale, causal,
    window_size, softcap, deterministic: as flash_attn_func's, the masks aligned bottom-right
    in each sequence. The library checks the values of cu_seqlens and seqused (a device-to-host
    copy; not while a CUDA graph is captured).
    Returns out (total_q, nheads, headdim), or (out, softmax_lse) when return_attn_probs,
    softmax_lse float32 (nheads, total_q) and not differentiable.
    The unsupported and ignored arguments: see the module's docstring.
    """
    if qv is not None:
        _unsupported("qv", qv)
    if attention_chunk:
        _unsupported("attention_chunk", attention_chunk)
    for name, s in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if s is not None:
            _unsupported(name, s)
    causal, left, right, softcap = _mask_args(window_size, causal, softcap)
    causal, deterministic = bool(causal), bool(deterministic)
    if seqused_q is None and seqused_k is None:
        plain = _direct(q, k, v, cu_seqlens_q, cu_seqlens_k)
    else:
        plain = _direct(q, k, v, cu_seqlens_q, cu_seqlens_k, *(t for t in (seqused_q, seqused_k) if t is not None))
    if plain:
        if _grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
            out, lse = _FlashAttnVarlenFunc.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                                  seqused_q, seqused_k, softmax_scale, causal, deterministic, left,
                                                  right, softcap)
        else:
            out, lse = _kernels.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                           seqused_q, seqused_k, softmax_scale, causal, return_attn_probs, left,
                                           right, softcap)
    else:
        # the checks the operator's schema would make with a less helpful message (a length tensor
        # that is None or not a tensor), and those of the fake
        _kernels.varlen_lse_shape(q, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k)
        if not _is_compiling():  # dynamo would specialize the compiled code on the lengths' values
            _kernels.seqlen_arg("max_seqlen_q", max_seqlen_q)
            _kernels.seqlen_arg("max_seqlen_k", max_seqlen_k)
        out, lse = _ops.fwd_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q,
                                   seqused_k, softmax_scale, causal, deterministic, left, right, softcap)
    return (out, lse) if return_attn_probs else out


def _cache_seqlens(cache_seqlens, q):
    """cache_seqlens as an int32 (batch) tensor on q's device (None stays None): an int is every
    entry's length; ValueError naming it for what is neither (a tensor is checked by the kernel)."""
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        return cache_seqlens
    if isinstance(cache_seqlens, _SymInt):
        n = cache_seqlens
    else:
        try:
            n = operator.index(cache_seqlens)
        except TypeError:
            raise ValueError(f"cache_seqlens: expected an int, a torch.int32 tensor (batch,) or None, got "
                             f"{type(cache_seqlens).__name__}") from None
        if not 0 <= n <= _INT32_MAX:
            raise ValueError(f"cache_seqlens: {n} is out of range; it must be in [0, seqlen_cache]")
    return torch.full((q.shape[0],), n, dtype=torch.int32, device=q.device)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    qv=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    page_table=None,
    cu_seqlens_q=None,
    cu_seqlens_k_new=None,
    max_seqlen_q=None,
    rotary_seqlens=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=0,
    pack_gqa=None,
    sm_margin=0,
    return_softmax_lse=False,
):
    """Attention of new queries over a KV cache (decoding), as FlashAttention-3's
    flash_attn_with_kvcache.

    q (batch, seqlen_q, nheads, headdim); k_cache, v_cache: CUDA tensors of q's dtype (bf16 or
    fp16), headdim 64, 128 or 256, nheads a multiple of nheads_kv, either contiguous
    (batch_cache, seqlen_cache, nheads_kv, headdim) (batch_cache = batch without
    cache_batch_idx), or paged (num_pages, page_size, nheads_kv, headdim) with page_table, int32
    (batch, max_pages_per_seq) on q's device: key position p of sequence b is row p % page_size of
    page page_table[b, p // page_size] (any page size; pages in any order). cache_seqlens: int,
    int32 (batch) on q's device, or None (the whole cache: seqlen_cache, or max_pages_per_seq x
    page_size): sequence b's keys end at cache position cache_seqlens[b]. cache_leftpad (int32
    (batch)): they start at cache_leftpad[b] (None: 0). cache_batch_idx (int32 (batch), contiguous
    cache only): batch entry b uses cache entry cache_batch_idx[b] (None: b).
    k, v (batch, seqlen_new, nheads_kv, headdim), with cache_seqlens: written into k_cache,
    v_cache in place at positions cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of each
    sequence (its entry or its pages; they must fit in the cache), and attended to; with
    rotary_cos, rotary_sin ((seqlen_ro, rotary_dim / 2), covering those positions; rotary_dim a
    multiple of 16 up to headdim; any floating dtype, used in float32) the new keys are rotated at
    those positions and q at positions cache_seqlens + i (causal or a window that excludes
    something) or cache_seqlens (otherwise), interleaved pairs or GPT-NeoX halves
    (rotary_interleaved); as FlashAttention-3, these are cache positions, also with cache_leftpad.
    The append and the rotation happen inside the attention kernel, in one launch.
    The index values are not read by the host (as FlashAttention-3): the library clamps them to
    the cache (flash3.forward_kvcache_into(..., check_seqlens=True, check_page_table=True) checks
    them, with a synchronization). causal, window_size, softcap, softmax_scale: as
    flash_attn_func's, aligned bottom-right to each sequence's keys: query row i is at key
    position (cache_seqlens[b] - cache_leftpad[b]) - seqlen_q + i of them. A row that sees no key
    gives out 0 (softmax_lse +inf). num_splits: the key-range splits per (sequence, KV head), 1 to
    64, or 0 for flash3's heuristic (the results do not depend on it beyond rounding).
    qv (MLA, DeepSeek's multi-head latent attention): (batch, seqlen_q, nheads, 512) of q's dtype,
    the queries' latent part, with q (..., 64) their rotary part; k_cache (..., nheads_kv, 64)
    holds each key's rotary part and v_cache (..., nheads_kv, 512) its latent, which is also the
    value: the scores are q k^T + qv v^T (head dim 576; softmax_scale None: 1/sqrt(576)), out
    (batch, seqlen_q, nheads, 512). k (..., 64) and v (..., 512) append as above, rotary_cos and
    rotary_sin (rotary_dim up to 64) rotate q and k (not qv). Only these head dims with qv.
    Returns out (batch, seqlen_q, nheads, headdim; 512 with qv), or (out, softmax_lse) when
    return_softmax_lse, softmax_lse float32 (batch, nheads, seqlen_q). Inference only.
    The unsupported and ignored arguments: see the module's docstring.
    """
    for name, value in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k_new", cu_seqlens_k_new),
                        ("max_seqlen_q", max_seqlen_q), ("rotary_seqlens", rotary_seqlens), ("q_descale", q_descale),
                        ("k_descale", k_descale), ("v_descale", v_descale)):
        if value is not None:
            _unsupported(name, value)
    _check_scheduler_metadata(scheduler_metadata)
    if attention_chunk:
        _unsupported("attention_chunk", attention_chunk)
    causal, left, right, softcap = _mask_args(window_size, causal, softcap)
    causal = bool(causal)
    if isinstance(q, torch.Tensor) and q.dim() == 4:
        cache_seqlens = _cache_seqlens(cache_seqlens, q)
    index = (cache_seqlens, cache_batch_idx, cache_leftpad, page_table)
    given = [t for t in index if t is not None]
    new = ()  # the append's arguments, where any is given
    if k is not None or v is not None or rotary_cos is not None or rotary_sin is not None:
        _kernels.kvcache_shapes(q, k_cache, v_cache, *index, num_splits, qv)
        kvcache.check_append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, page_table)
        new = (k, v, rotary_cos, rotary_sin, bool(rotary_interleaved))
        given += [t for t in new[:4] if t is not None]
    mla = {}  # qv where given
    if qv is not None:
        mla["qv"] = qv
        given.append(qv)
    if _direct(q, k_cache, v_cache, *given) and not (
            _grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad or
                                 getattr(qv, "requires_grad", False))):
        out, lse = _kernels.fwd_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal,
                                        return_softmax_lse, left, right, softcap, *index[1:], num_splits, *new, **mla)
    else:
        # inputs that require grad: the operator, whose backward raises (inference only)
        _kernels.kvcache_shapes(q, k_cache, v_cache, *index, num_splits, qv)
        out, lse = _ops.fwd_kvcache(q, k_cache, v_cache, cache_seqlens, softmax_scale, causal, left, right, softcap,
                                    *index[1:], num_splits, *new, **mla)
    return (out, lse) if return_softmax_lse else out


def _check_scheduler_metadata(metadata):
    """scheduler_metadata: None or get_scheduler_metadata's int32 tensor (its contents are not read)."""
    if metadata is not None and not (isinstance(metadata, torch.Tensor) and metadata.dtype == torch.int32):
        shown = f"{metadata.dtype} tensor" if isinstance(metadata, torch.Tensor) else type(metadata).__name__
        raise ValueError(f"scheduler_metadata: expected None or get_scheduler_metadata's int32 tensor, got {shown}")


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, num_heads_q, num_heads_kv, headdim,
                           cache_seqlens, qkv_dtype=torch.bfloat16, headdim_v=None, cu_seqlens_q=None,
                           cu_seqlens_k_new=None, cache_leftpad=None, page_size=None, max_seqlen_k_new=0,
                           causal=False, window_size=(-1, -1), attention_chunk=0, has_softcap=False, num_splits=0,
                           pack_gqa=None, sm_margin=0):
    """FlashAttention-3's get_scheduler_metadata, for callers written against it: the metadata a
    decode step passes to flash_attn_with_kvcache(scheduler_metadata=) so that it needs no host
    work under a CUDA graph. flash3 needs none: its split count comes from the shapes on the host
    (flash3::kvcache_num_splits) and its launch reads nothing from the device. Returns an empty
    int32 tensor on cache_seqlens' device, which flash_attn_with_kvcache accepts and does not read.
    The arguments are FlashAttention-3's; only cache_seqlens (a tensor) is used, for its device."""
    if not isinstance(cache_seqlens, torch.Tensor):
        raise ValueError(f"cache_seqlens: expected a torch.Tensor (int32 (batch)), got {type(cache_seqlens).__name__}")
    return torch.empty(0, dtype=torch.int32, device=cache_seqlens.device)

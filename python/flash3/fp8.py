"""flash3's FP8 (e4m3) attention for 16-bit inputs: quantize_fp8 (block scales, optional Hadamard
rotation) and flash_attn_fp8_func, which quantizes q, k, v and runs the FP8 forward.

    out = flash3.flash_attn_fp8_func(q, k, v, causal=True)      # q, k, v bfloat16 or float16
    qf, q_scale = flash3.quantize_fp8(q, block_rows=64, hadamard=True, seed=0)

Inference only: nothing here has a gradient (an input that requires grad takes the operators,
whose backward raises torch's "no autograd formula was registered" error). In eager mode the
calls run the library directly; under torch.compile (fullgraph), torch.export or any
FakeTensor / dispatch-mode tracing they call the operators torch.ops.flash3.quantize_fp8 and
torch.ops.flash3.fwd_fp8 (_ops.py).
"""
import torch

from . import _kernels, _ops

__all__ = ["flash_attn_fp8_func", "quantize_fp8", "block_kv"]

_direct = _ops.direct
_grad_enabled = torch.is_grad_enabled
_INPUT_DTYPES = (torch.bfloat16, torch.float16)
# The head dims of the quantizer and of the FP8 forward kernels (flash3.h); powers of two, as the
# Hadamard transform needs.
_HEAD_DIMS = (64, 128, 256)
BLOCK_Q = 64  # rows per scale block of q (flash3::kFp8BlockQ)


def block_kv(head_dim):
    """Rows per scale block of k and v at this head dim (flash3::fp8_block_kv): the FP8 kernel's
    key tile at head dim 128 (192 keys), 128 keys at 64 and 256."""
    return 192 if head_dim == 128 else 128


def _runs_directly(*tensors):
    """The eager bypass (_ops.direct), except where an input requires grad under grad mode: the
    operators then record the call, so that a backward through it raises instead of finding no
    graph."""
    return _direct(*tensors) and not (_grad_enabled() and any(t.requires_grad for t in tensors))


def quantize_fp8(x, block_rows=None, hadamard=False, seed=0):
    """(out, scale): x (batch, seqlen, nheads, head_dim) bfloat16 or float16 on a CUDA device ->
    out float8_e4m3fn (same shape, contiguous) and scale float32 (batch, nheads, ceil(seqlen /
    block_rows)) with x ~= out * scale per block of block_rows rows of one head; with hadamard
    each row is first rotated by the orthogonal Hadamard transform with random signs from seed
    (an int in [0, 2^63)): quantize q and k with the same seed and q k^T is kept. Use
    block_rows=64 for q and the default (None: block_kv(head_dim)) for k and v, the FP8
    forward's block scales."""
    seed = _kernels.seed_arg(seed)
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if block_rows is None:  # a tensor of the wrong rank gets the shape error below
        block_rows = block_kv(x.shape[-1] if x.dim() else 0)
    if _runs_directly(x):
        return _kernels.quantize_fp8(x, block_rows, hadamard, seed)
    return _ops.quantize_fp8(x, _kernels.block_rows_arg(block_rows), bool(hadamard), seed)


def _check_inputs(q, k, v, hadamard):
    """ValueError naming the first of q, k, v that flash_attn_fp8_func cannot quantize: not a
    4-dim bfloat16 / float16 tensor of q's dtype, or a head dim other than 64, 128, 256."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in _INPUT_DTYPES:
            raise ValueError(f"{name}: dtype {t.dtype} is not supported; flash_attn_fp8_func quantizes "
                             "torch.bfloat16 or torch.float16 q, k, v (for float8_e4m3fn inputs use "
                             "flash_attn_func with q_descale, k_descale, v_descale)")
        if t.dtype is not q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} but q is {q.dtype}; q, k and v must have the same dtype")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected (batch, seqlen, nheads, headdim), got shape {tuple(t.shape)}")
        if t.shape[3] not in _HEAD_DIMS:
            why = " (hadamard=True rotates by a Hadamard matrix: a power of two)" if hadamard else ""
            raise ValueError(f"{name}: head dim {t.shape[3]} is not supported; flash_attn_fp8_func takes head "
                             f"dims 64, 128, 256{why}")


def flash_attn_fp8_func(q, k, v, softmax_scale=None, causal=False, hadamard=True, seed=0, return_attn_probs=False):
    """softmax(softmax_scale * q k^T [causal mask]) v computed in FP8: q is quantized to e4m3 with
    one scale per 64 rows of a head, k and v with one per block_kv(headdim) rows, then the FP8
    forward runs with those block scales.

    q (batch, seqlen_q, nheads, headdim), k and v (batch, seqlen_k, nheads_kv, headdim): CUDA
    tensors, bfloat16 or float16 (one dtype), headdim 64, 128 or 256, nheads a multiple of
    nheads_kv. softmax_scale: default 1 / sqrt(headdim). causal: as flash_attn_func's.
    hadamard: rotate q and k by the same random orthogonal Hadamard transform (seed) before
    quantizing (incoherent processing: outliers spread over a row, a smaller quantization
    error; q k^T, so the output, is unchanged by the rotation); v is never rotated.
    Returns out bfloat16 (batch, seqlen_q, nheads, headdim), or (out, softmax_lse) when
    return_attn_probs (float32 (batch, nheads, seqlen_q)). No gradient.
    """
    _check_inputs(q, k, v, hadamard)
    seed, hadamard = _kernels.seed_arg(seed), bool(hadamard)
    d = q.shape[3]
    if _runs_directly(q, k, v):
        qf, qs = _kernels.quantize_fp8(q, BLOCK_Q, hadamard, seed)
        kf, ks = _kernels.quantize_fp8(k, block_kv(d), hadamard, seed)
        vf, vs = _kernels.quantize_fp8(v, block_kv(d), False, 0)
        out, lse = _kernels.fwd(qf, kf, vf, softmax_scale, bool(causal), return_attn_probs, qs, ks, vs)
    else:
        qf, qs = _ops.quantize_fp8(q, BLOCK_Q, hadamard, seed)
        kf, ks = _ops.quantize_fp8(k, block_kv(d), hadamard, seed)
        vf, vs = _ops.quantize_fp8(v, block_kv(d), False, 0)
        out, lse = _ops.fwd_fp8(qf, kf, vf, qs, ks, vs, softmax_scale, bool(causal))
    return (out, lse) if return_attn_probs else out

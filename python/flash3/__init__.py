"""flash3: FlashAttention-3 for Hopper, called from PyTorch through ctypes (no extension).

    from flash3 import flash_attn_func
    out = flash_attn_func(q, k, v, causal=True)          # q: (batch, seqlen_q, nheads, headdim)
    out, lse = flash_attn_func(q, k, v, return_attn_probs=True)
    out.sum().backward()                                  # dq, dk, dv by flash3's backward kernels

    out = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
                                                          # q: (total_q, nheads, headdim), packed
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens)  # decoding, append

flash_attn_func, flash_attn_qkvpacked_func and flash_attn_varlen_func follow FlashAttention-3's
`flash_attn_interface` (names, argument order, defaults, return values); so does the module
flash3.flash_attn_interface (`import flash3.flash_attn_interface as flash_attn_interface`),
sliding windows (window_size) and softcap included, forward and backward; flash_attn_varlen_func
takes variable-length batches (cu_seqlens, seqused), forward and backward, bfloat16 / float16.
They trace under torch.compile (fullgraph, dynamic shapes, CUDA graphs) through the
torch.library operators torch.ops.flash3.fwd and torch.ops.flash3.bwd (varlen: fwd_varlen and
bwd_varlen; flash3._ops). flash_attn_with_kvcache attends over a KV cache, contiguous or paged
(page_table), up to cache_seqlens (inference; torch.ops.flash3.fwd_kvcache).
FP8 (inference): flash_attn_func takes float8_e4m3fn q, k, v with q_descale, k_descale,
v_descale as FlashAttention-3 does; flash_attn_fp8_func quantizes bfloat16 / float16 inputs
itself (block scales, Hadamard rotation) and quantize_fp8 is its quantizer (flash3.fp8; the
operators torch.ops.flash3.fwd_fp8 and torch.ops.flash3.quantize_fp8).
The buffer-level entry points are forward_into, backward_into, forward_varlen_into,
backward_varlen_into, forward_kvcache_into and quantize_fp8_into.

The library is loaded at the first call, not at import (see _lib.py for where it is looked for).
"""
from . import _kernels, _lib, _ops, flash_attn_interface, fp8
from ._kernels import (_kernel_layout, backward_into, backward_varlen_into, forward_into, forward_kvcache_into,
                       forward_varlen_into, hopper_available, quantize_fp8_into, version)
from .flash_attn_interface import (_IGNORED, flash_attn_func, flash_attn_qkvpacked_func, flash_attn_varlen_func,
                                   flash_attn_with_kvcache, get_scheduler_metadata)
from .fp8 import flash_attn_fp8_func, quantize_fp8

__all__ = ["flash_attn_func", "flash_attn_qkvpacked_func", "flash_attn_varlen_func", "flash_attn_with_kvcache",
           "get_scheduler_metadata", "flash_attn_interface", "flash_attn_fp8_func", "quantize_fp8", "forward_into", "backward_into",
           "forward_varlen_into", "backward_varlen_into", "forward_kvcache_into", "quantize_fp8_into",
           "hopper_available", "version"]

"""The KV cache's append with rotary embedding (flash_attn_with_kvcache's k, v, rotary_cos,
rotary_sin): the checks of its arguments flash_attn_with_kvcache makes before the kernel
(check_append), and the append in torch operations (append, rotary, rotates_q_by_token) as a
reference: new keys and values written into the cache (contiguous, through cache_batch_idx, or
paged through page_table) in place at each sequence's length, the rotary embedding
(FlashAttention-3's meaning) applied to the new keys and to the queries first.

flash3 itself appends inside the decoding kernel (flash3::fwd_kvcache with k_new, v_new,
rotary_cos, rotary_sin; _kernels.forward_kvcache_into), as FlashAttention-3 does. The torch
version here is what the tests hold the kernel to (the same cache contents: v as given, k within
one rounding) and what the CPU stand-in of the kernel runs (tests/stand_in.py).
"""
import torch

_INT64 = torch.int64


def rotary(x, cos, sin, positions, interleaved):
    """x (batch, seqlen, nheads, headdim) with its first rotary_dim = 2 x cos.shape[1] dims
    rotated by the angles of rows `positions` (batch, seqlen) of cos and sin (seqlen_ro,
    rotary_dim / 2): pairs (2i, 2i + 1) when interleaved, else (i, i + rotary_dim / 2) (GPT-NeoX);
    out_a = a cos - b sin, out_b = a sin + b cos, in float32, rounded to x's dtype. Positions
    past the table are clamped to its last row (the caller's precondition: seqlen_ro covers
    them)."""
    half = cos.shape[1]
    rot = 2 * half
    pos = positions.clamp(0, cos.shape[0] - 1)
    c = cos[pos].float()[:, :, None, :]  # (batch, seqlen, 1, half)
    s = sin[pos].float()[:, :, None, :]
    xr = x[..., :rot].float()
    if interleaved:
        a, b = xr[..., 0::2], xr[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xr[..., :half], xr[..., half:]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((out.to(x.dtype), x[..., rot:]), dim=-1)


def rotates_q_by_token(causal, window_left, window_right, seqlen_q, seqlen_cache):
    """Whether q's row i is rotated at cache_seqlens + i (True) or every row at cache_seqlens:
    FlashAttention-3's rule, causal or local, on the mask as the library normalizes it (and
    FlashAttention-3 does): causal makes window_right 0, a bound that excludes nothing (window_left
    >= seqlen_cache - 1, window_right >= seqlen_q - 1; seqlen_cache the longest key range, as
    the cache's shape gives it) is no bound, and a window (-1, 0) is causal."""
    right = 0 if causal else window_right
    left = -1 if window_left >= seqlen_cache - 1 else window_left
    right = -1 if right >= seqlen_q - 1 else right
    return bool(causal) or left >= 0 or right >= 0


def check_append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, page_table=None):
    """ValueError naming the argument where the append's arguments do not fit: k and v given
    together, (batch, seqlen_new, nheads_kv, headdim) with q's batch and the cache's heads and
    head dim, seqlen_new at most a sequence's capacity (seqlen_cache, or max_pages_per_seq x
    page_size with page_table), on its device and of its dtype; rotary_cos and rotary_sin
    together, only with k and v, (seqlen_ro, rotary_dim / 2) with rotary_dim a multiple of 16 up
    to headdim, floating, on q's device; cache_seqlens given. (cache_seqlens + seqlen_new within
    the capacity is the caller's precondition: the values are on the GPU.) The library checks the
    same again (flash3::validate_kvcache), by its own names (k_new, v_new); these come first so that
    the messages name flash_attn_with_kvcache's arguments, also where the library is not called."""
    if (k is None) != (v is None):
        raise ValueError(f"k and v: give both or neither (k is {'None' if k is None else 'given'}, v is "
                         f"{'None' if v is None else 'given'})")
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError("rotary_cos and rotary_sin: give both or neither")
    if k is None:
        if rotary_cos is not None:
            raise ValueError("rotary_cos: applies with k and v only (the new keys and the queries are rotated)")
        return
    if cache_seqlens is None:
        raise ValueError("cache_seqlens: required with k and v (where the new keys go)")
    for name, t, cache in (("k", k, k_cache), ("v", v, v_cache)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        want = (q.shape[0], None, *cache.shape[2:])
        if t.dim() != 4 or t.shape[0] != want[0] or tuple(t.shape[2:]) != tuple(want[2:]):
            raise ValueError(f"{name}: shape {tuple(t.shape)}, expected (batch, seqlen_new, nheads_kv, headdim) = "
                             f"({want[0]}, seqlen_new, {want[2]}, {want[3]}) (q's batch, {name}_cache's heads and "
                             "head dim)")
        if t.dtype != cache.dtype or t.device != cache.device:
            raise ValueError(f"{name}: {t.dtype} on {t.device}, expected {name}_cache's {cache.dtype} on "
                             f"{cache.device}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"v: seqlen_new {v.shape[1]} differs from k's {k.shape[1]}")
    capacity = k_cache.shape[1] * (page_table.shape[1] if isinstance(page_table, torch.Tensor) and
                                   page_table.dim() == 2 else 1)
    if k.shape[1] > capacity:
        where = "max_pages_per_seq x page_size" if page_table is not None else "seqlen_cache"
        raise ValueError(f"k: seqlen_new {k.shape[1]} overruns the cache: a sequence holds {capacity} keys ({where})")
    if rotary_cos is not None:
        for name, t in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or not t.is_floating_point():
                raise ValueError(f"{name}: expected a floating tensor (seqlen_ro, rotary_dim / 2)")
            if t.device != q.device:
                raise ValueError(f"{name}: on device {t.device} but q is on {q.device}")
        if rotary_sin.shape != rotary_cos.shape:
            raise ValueError(f"rotary_sin: shape {tuple(rotary_sin.shape)} differs from rotary_cos's "
                             f"{tuple(rotary_cos.shape)}")
        rotary_dim = 2 * rotary_cos.shape[1]
        if not 0 < rotary_dim <= q.shape[-1] or rotary_dim % 16 != 0 or rotary_cos.shape[0] == 0:
            raise ValueError(f"rotary_cos: shape {tuple(rotary_cos.shape)}; rotary_dim = 2 x its dim 1 must be a "
                             f"multiple of 16 in [16, headdim = {q.shape[-1]}] and seqlen_ro at least 1")


def append(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, rotary_interleaved, causal_or_local,
           cache_batch_idx=None, page_table=None):
    """Writes k and v (rotated, with rotary_cos) into k_cache, v_cache at the cache positions
    cache_seqlens[b] .. cache_seqlens[b] + seqlen_new - 1 of each batch entry b, and returns (q,
    rotated where rotary is given, and the lengths after the append, int32). Position p of entry
    b is row p of cache entry b (cache_batch_idx[b] where given) of a contiguous cache, or row
    p % page_size of page page_table[b, p // page_size] of a paged one. A cache_leftpad does not
    move them: the new keys follow the sequence's last key, cache_seqlens[b] - 1.
    The rotary angles are those of the same positions (FlashAttention-3's: the cache position,
    not counted from cache_leftpad): key i at cache_seqlens[b] + i, q's row i at cache_seqlens[b]
    + i where causal_or_local (rotates_q_by_token), else all at cache_seqlens[b]. The rows must fit
    in the cache (cache_seqlens + seqlen_new <= seqlen_cache, or max_pages_per_seq x page_size);
    the values are on the GPU and not checked: positions past the cache are clamped to its last,
    as are cache entries and pages to those that exist, so that nothing is written out of bounds
    (the kernel instead neither writes nor attends to them: the two agree where the rows fit)."""
    b, s_new = k.shape[0], k.shape[1]
    start = cache_seqlens.to(_INT64)[:, None]
    pos_k = start + torch.arange(s_new, device=k.device, dtype=_INT64)[None, :]  # (batch, seqlen_new)
    if rotary_cos is not None:
        k = rotary(k, rotary_cos, rotary_sin, pos_k, rotary_interleaved)
        sq = q.shape[1]
        pos_q = start + torch.arange(sq, device=q.device, dtype=_INT64)[None, :] if causal_or_local else \
            start.expand(b, sq)
        q = rotary(q, rotary_cos, rotary_sin, pos_q, rotary_interleaved)
    if page_table is None:
        rows = pos_k.clamp(0, k_cache.shape[1] - 1)
        if cache_batch_idx is None:
            entries = torch.arange(b, device=k.device, dtype=_INT64)[:, None]
        else:
            entries = cache_batch_idx.to(_INT64).clamp(0, k_cache.shape[0] - 1)[:, None]
    else:
        page_size = k_cache.shape[1]
        pos = pos_k.clamp(0, page_table.shape[1] * page_size - 1)
        entries = page_table.to(_INT64).gather(1, pos // page_size).clamp(0, k_cache.shape[0] - 1)
        rows = pos % page_size
    entries = entries.expand_as(rows)
    k_cache[entries, rows] = k
    v_cache[entries, rows] = v
    return q, (cache_seqlens + s_new).to(torch.int32)

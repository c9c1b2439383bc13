"""CPU stand-ins for flash3's library calls (forward_into, backward_into, forward_varlen_into,
backward_varlen_into, forward_kvcache_into, quantize_fp8_into), for the tests that run without a
GPU: the attention math in float64, written into the caller's buffers as the library would (rows
that see no key: out 0, lse +inf; dq 0; FP8 inputs dequantized by their scales first;
variable-length batches one sequence at a time, out and lse rows past seqused_q untouched,
gradient rows past seqused 0; a KV cache one batch entry at a time over its keys, cache
positions [cache_leftpad[b], cache_seqlens[b]) gathered from its cache entry or its pages, after
the append of k_new, v_new with rotary as the kernel makes it, by the torch reference
flash3.kvcache.append; with qv (MLA) the attention of [q, qv] over [k, v] with v as the values,
head dim 576), and
the FP8 block quantization (with the Hadamard rotation of src/quant/hadamard.h) computed as the
kernel does, in float32 where it rounds. Everything above them (the operators, their fakes and
autograd, the eager paths, the allocation of outputs and the handling of dout, the host-side
checks of forward_kvcache_into's index values, which the stand-in calls as the real one does) is
flash3's own code.

    calls = stand_in.install(monkeypatch)   # each call appends (name, dict of its arguments)
"""
import math

import flash3
import torch


def _scale(q, softmax_scale):
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _scores(q, k, scale, causal, window, softcap):
    """S (b, h, sq, sk) in float64, capped (softcap > 0: softcap * tanh(S / softcap)) and masked
    (-inf), and tanh(S / softcap) (None without softcap); q (b, sq, h, d), k with q's heads.
    Mask: bottom-right causal, and FlashAttention-3's window (left, right): query i sees key j
    iff i + sk - sq - left <= j <= i + sk - sq + right, -1 unbounded; causal makes right 0."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    sq, sk = q.shape[1], k.shape[1]
    i = torch.arange(sq, device=q.device)[:, None]
    j = torch.arange(sk, device=q.device)[None, :]
    left, right = window
    right = 0 if causal else right
    hidden = torch.zeros(sq, sk, dtype=torch.bool, device=q.device)
    if right >= 0:
        hidden |= j > i + sk - sq + right
    if left >= 0:
        hidden |= j < i + sk - sq - left
    return s.masked_fill(hidden, float("-inf")), t


def _probs(s):
    """P and lse (b, h, sq) in float64 of masked scores s; rows that see no key: P 0, lse +inf."""
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)  # a row that sees no key
    p = torch.exp(s - lse.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
    return p, lse.masked_fill(empty, float("inf"))


def _wide(q, k, v):
    rep = q.shape[2] // k.shape[2]
    return q.double(), k.double().repeat_interleave(rep, dim=2), v.double().repeat_interleave(rep, dim=2)


def attention(q, k, v, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0):
    """(out, lse) in float64."""
    q64, k64, v64 = _wide(q, k, v)
    p, lse = _probs(_scores(q64, k64, _scale(q, softmax_scale), causal, window, softcap)[0])
    return torch.einsum("bhqk,bkhd->bqhd", p, v64), lse


def attention_grads(dout, q, k, v, softmax_scale=None, causal=False, window=(-1, -1), softcap=0.0):
    """(dq, dk, dv) in float64, dk and dv summed over the query heads that share a kv head."""
    scale = _scale(q, softmax_scale)
    q64, k64, v64 = _wide(q, k, v)
    do = dout.double()
    s, t = _scores(q64, k64, scale, causal, window, softcap)
    p, _ = _probs(s)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, v64)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    if t is not None:
        ds = ds * (1 - t * t)  # the derivative of softcap * tanh(S / softcap)
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k64) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q64) * scale
    b, sk, hk, d = k.shape
    rep = q.shape[2] // hk
    return dq, dk.reshape(b, sk, hk, rep, d).sum(3), dv.reshape(b, sk, hk, rep, d).sum(3)


def _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None):
    """The rows (slices of the packed tensors) of q and of k of each sequence, cut to the first
    seqused[b] rows where seqused is given (clamped to the sequence, as the library does)."""
    cq, ck = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    uq = None if seqused_q is None else [int(x) for x in seqused_q]
    uk = None if seqused_k is None else [int(x) for x in seqused_k]

    def rows(cu, used, b):
        n = cu[b + 1] - cu[b] if used is None else min(max(used[b], 0), cu[b + 1] - cu[b])
        return slice(cu[b], cu[b] + n)

    return [(rows(cq, uq, b), rows(ck, uk, b)) for b in range(len(cq) - 1)]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None, **kwargs):
    """attention over a packed batch (FlashAttention-3's varlen layout), one sequence at a time:
    q (total_q, h, d), k and v (total_k, hk, d) split by the int32 offsets cu_seqlens_q/k (batch
    + 1 each), cut to seqused_q/k (batch each, optional); out (total_q, h, d) and lse (h,
    total_q) in float64, rows past seqused_q as a row that sees no key (out 0, lse +inf)."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float64, device=q.device)
    for sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        o, l = attention(q[sq][None], k[sk][None], v[sk][None], **kwargs)
        out[sq], lse[:, sq] = o[0], l[0]
    return out, lse


def attention_grads_varlen(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q=None, seqused_k=None, **kwargs):
    """attention_grads over a packed batch, as attention_varlen: (dq, dk, dv) in float64, 0 in the
    rows past seqused."""
    grads = [torch.zeros(t.shape, dtype=torch.float64, device=t.device) for t in (q, k, v)]
    for sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):
        dq, dk, dv = attention_grads(dout[sq][None], q[sq][None], k[sk][None], v[sk][None], **kwargs)
        grads[0][sq], grads[1][sk], grads[2][sk] = dq[0], dk[0], dv[0]
    return tuple(grads)


def kvcache_sequence(k_cache, v_cache, b, cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                     page_table=None):
    """(k, v), each (1, n, nheads_kv, headdim): the keys and values of batch entry b of a KV cache
    in key order, its cache positions [cache_leftpad[b], cache_seqlens[b]) clamped to the cache
    as the library clamps them (the end to [0, seqlen_cache], the start to [0, end]). Position p
    is row p of cache entry cache_batch_idx[b] (b without it), or row p % page_size of page
    page_table[b, p // page_size] of a paged cache (page and entry indices clamped to the cache)."""
    paged = page_table is not None
    n_cache = k_cache.shape[1] * (page_table.shape[1] if paged else 1)
    end = n_cache if cache_seqlens is None else min(max(int(cache_seqlens[b]), 0), n_cache)
    start = 0 if cache_leftpad is None else min(max(int(cache_leftpad[b]), 0), end)
    if not paged:
        e = b if cache_batch_idx is None else min(max(int(cache_batch_idx[b]), 0), k_cache.shape[0] - 1)
        return k_cache[e:e + 1, start:end], v_cache[e:e + 1, start:end]
    pos = torch.arange(start, end, device=k_cache.device)
    page_size = k_cache.shape[1]
    pages = page_table[b].to(k_cache.device).long()[pos // page_size].clamp(0, k_cache.shape[0] - 1)
    return k_cache[pages, pos % page_size][None], v_cache[pages, pos % page_size][None]


# ---- FP8 -----------------------------------------------------------------------------------------

def _sign(seed, i):
    """s_i of src/quant/hadamard.h: -1 when the top bit of splitmix64 of seed + (i + 1) * the
    golden-ratio increment is set, else +1."""
    mask = 2**64 - 1
    z = (seed + (i + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return -1.0 if (z ^ (z >> 31)) >> 63 else 1.0


def hadamard_matrix(d, seed, normalized=True):
    """M = diag(s) H (/ sqrt(d) when normalized), float64 (d, d): a row x rotates to x @ M.
    H_ij = (-1)^popcount(i & j), the Sylvester Hadamard matrix."""
    i = torch.arange(d)
    bits = i[:, None] & i[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    h = 1.0 - 2.0 * parity.double()
    s = torch.tensor([_sign(seed, j) for j in range(d)], dtype=torch.float64)
    m = s[:, None] * h
    return m / math.sqrt(d) if normalized else m


def quantize(x, block_rows, hadamard=False, seed=0):
    """(out float8_e4m3fn, scale float32 (b, h, ceil(s / block_rows))) as the kernel computes
    them: y = x (rotated by the unnormalized diag(s) H with hadamard) in float32, amax per block,
    scale = amax / 448 (/ sqrt(d) with hadamard) rounded once to float32 (1 for a zero block),
    out = y * float32(448 / amax) rounded to e4m3."""
    b, s, h, d = x.shape
    y = x.double()
    if hadamard:
        y = y @ hadamard_matrix(d, seed, normalized=False).to(x.device)
    y = y.float()
    nb = (s + block_rows - 1) // block_rows
    pad = torch.zeros(b, nb * block_rows, h, d, dtype=torch.float32, device=x.device)
    pad[:, :s] = y.abs()
    amax = pad.reshape(b, nb, block_rows, h, d).amax(dim=(2, 4)).transpose(1, 2)  # (b, h, nb)
    factor = (1.0 / math.sqrt(d) if hadamard else 1.0) / 448.0
    scale = torch.where(amax > 0, (amax.double() * factor).float(), torch.ones_like(amax))
    inv = torch.where(amax > 0, torch.tensor(448.0) / amax, torch.zeros_like(amax))  # float32
    rows = torch.arange(s, device=x.device) // block_rows
    out = (y * inv[:, :, rows].transpose(1, 2)[..., None]).to(torch.float8_e4m3fn)
    return out, scale


def dequantize(t, scale, block, heads_kv):
    """t (b, s, h, d) in float64 times its scale: None (1), (b, heads_kv) (query head i uses kv
    head i // (h // heads_kv)) or block scales (b, h, ceil(s / block))."""
    x = t.double()
    if scale is None:
        return x
    b, s, h, d = t.shape
    sc = scale.double()
    if sc.dim() == 2:
        return x * sc.repeat_interleave(h // heads_kv, dim=1)[:, None, :, None]
    rows = torch.arange(s, device=t.device) // block
    return x * sc[:, :, rows].transpose(1, 2)[..., None]


def install(monkeypatch):
    """Puts the stand-ins in place of flash3._kernels.forward_into / backward_into /
    forward_varlen_into / backward_varlen_into / forward_kvcache_into / quantize_fp8_into (what flash3's kernels,
    operators and autograd call); returns the list the calls are logged in."""
    calls = []

    def forward_into(q, k, v, out, lse=None, softmax_scale=None, causal=False, q_scale=None, k_scale=None,
                     v_scale=None, window_left=-1, window_right=-1, softcap=0.0):
        calls.append(("fwd", dict(q=q, k=k, v=v, out=out, lse=lse, softmax_scale=softmax_scale, causal=causal,
                                  q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, window_left=window_left,
                                  window_right=window_right, softcap=softcap)))
        if q.dtype == torch.float8_e4m3fn:
            hk, blk = k.shape[2], flash3.fp8.block_kv(k.shape[3])
            q, k, v = dequantize(q, q_scale, 64, hk), dequantize(k, k_scale, blk, hk), dequantize(v, v_scale, blk, hk)
        o, l = attention(q, k, v, softmax_scale, causal, (window_left, window_right), softcap)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)
        return out, lse

    def backward_into(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=None, causal=False,
                      deterministic=False, window_left=-1, window_right=-1, softcap=0.0):
        calls.append(("bwd", dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv,
                                  softmax_scale=softmax_scale, causal=causal, deterministic=deterministic,
                                  window_left=window_left, window_right=window_right, softcap=softcap)))
        window = (window_left, window_right)
        for buf, g in zip((dq, dk, dv), attention_grads(dout, q, k, v, softmax_scale, causal, window, softcap)):
            buf.copy_(g)
        return dq, dk, dv

    def quantize_fp8_into(x, out, scale, block_rows=128, hadamard=False, seed=0):
        calls.append(("quantize", dict(x=x, out=out, scale=scale, block_rows=block_rows, hadamard=hadamard,
                                       seed=seed)))
        o, s = quantize(x, block_rows, hadamard, seed)
        out.copy_(o)
        scale.copy_(s)
        return out, scale

    def forward_varlen_into(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                            seqused_q=None, seqused_k=None, softmax_scale=None, causal=False, window_left=-1,
                            window_right=-1, softcap=0.0, check_seqlens=True):
        calls.append(("fwd_varlen", dict(q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q,
                                         cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                         max_seqlen_k=max_seqlen_k, seqused_q=seqused_q, seqused_k=seqused_k,
                                         softmax_scale=softmax_scale, causal=causal, window_left=window_left,
                                         window_right=window_right, softcap=softcap, check_seqlens=check_seqlens)))
        kw = dict(softmax_scale=softmax_scale, causal=causal, window=(window_left, window_right), softcap=softcap)
        for sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k):  # rows past seqused: untouched
            o, l = attention(q[sq][None], k[sk][None], v[sk][None], **kw)
            out[sq] = o[0]
            if lse is not None:
                lse[:, sq] = l[0]
        return out, lse

    def backward_varlen_into(dout, q, k, v, out, lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                             max_seqlen_k, seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                             deterministic=False, window_left=-1, window_right=-1, softcap=0.0, check_seqlens=True):
        calls.append(("bwd_varlen", dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv,
                                         cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, seqused_q=seqused_q,
                                         seqused_k=seqused_k, softmax_scale=softmax_scale, causal=causal,
                                         deterministic=deterministic, window_left=window_left,
                                         window_right=window_right, softcap=softcap, check_seqlens=check_seqlens)))
        kw = dict(softmax_scale=softmax_scale, causal=causal, window=(window_left, window_right), softcap=softcap)
        grads = attention_grads_varlen(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, **kw)
        for buf, g in zip((dq, dk, dv), grads):  # rows past seqused: 0
            buf.copy_(g)
        return dq, dk, dv

    def forward_kvcache_into(q, k_cache, v_cache, out, lse, cache_seqlens=None, softmax_scale=None, causal=False,
                             window_left=-1, window_right=-1, softcap=0.0, cache_batch_idx=None, cache_leftpad=None,
                             page_table=None, num_splits=0, check_page_table=False, check_seqlens=False, k_new=None,
                             v_new=None, rotary_cos=None, rotary_sin=None, rotary_interleaved=True, qv=None):
        calls.append(("fwd_kvcache", dict(q=q, k_cache=k_cache, v_cache=v_cache, out=out, lse=lse, qv=qv,
                                          cache_seqlens=cache_seqlens, softmax_scale=softmax_scale, causal=causal,
                                          window_left=window_left, window_right=window_right, softcap=softcap,
                                          cache_batch_idx=cache_batch_idx, cache_leftpad=cache_leftpad,
                                          page_table=page_table, num_splits=num_splits,
                                          check_page_table=check_page_table, check_seqlens=check_seqlens,
                                          k_new=k_new, v_new=v_new, rotary_cos=rotary_cos, rotary_sin=rotary_sin,
                                          rotary_interleaved=rotary_interleaved)))
        if check_seqlens or check_page_table:  # flash3's host-side check, as the real forward_kvcache_into makes it
            flash3._kernels.check_kvcache_values(k_cache, cache_seqlens, cache_batch_idx, cache_leftpad, page_table,
                                                 check_seqlens, check_page_table)
        if k_new is not None:  # the kernel's append: the new rows written (rotated), then attended to with q rotated
            n_cache = k_cache.shape[1] * (page_table.shape[1] if page_table is not None else 1)
            by_token = flash3.kvcache.rotates_q_by_token(causal, window_left, window_right, q.shape[1], n_cache)
            q, cache_seqlens = flash3.kvcache.append(q, k_cache, v_cache, k_new, v_new, rotary_cos, rotary_sin,
                                                     cache_seqlens, rotary_interleaved, by_token, cache_batch_idx,
                                                     page_table)
        kw = dict(softmax_scale=softmax_scale, causal=causal, window=(window_left, window_right), softcap=softcap)
        for b in range(q.shape[0]):  # entry b over its keys, the masks aligned bottom-right to them
            k, v = kvcache_sequence(k_cache, v_cache, b, cache_seqlens, cache_batch_idx, cache_leftpad, page_table)
            qb = q[b:b + 1]
            if qv is not None:  # MLA: scores q k^T + qv v^T, one product of head dim 576 (its default scale too)
                qb, k = torch.cat((qb, qv[b:b + 1]), dim=-1), torch.cat((k, v), dim=-1)
            o, l = attention(qb, k, v, **kw)
            out[b] = o[0]
            if lse is not None:
                lse[b] = l[0]
        return out, lse

    monkeypatch.setattr(flash3._kernels, "forward_into", forward_into)
    monkeypatch.setattr(flash3._kernels, "backward_into", backward_into)
    monkeypatch.setattr(flash3._kernels, "quantize_fp8_into", quantize_fp8_into)
    monkeypatch.setattr(flash3._kernels, "forward_varlen_into", forward_varlen_into)
    monkeypatch.setattr(flash3._kernels, "backward_varlen_into", backward_varlen_into)
    monkeypatch.setattr(flash3._kernels, "forward_kvcache_into", forward_kvcache_into)
    return calls

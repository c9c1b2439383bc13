"""CPU stand-ins for flash3's library calls (forward_into, backward_into, quantize_fp8_into), for
the tests that run without a GPU: the attention math in float64, written into the caller's
buffers as the library would (rows that see no key: out 0, lse +inf; dq 0; FP8 inputs
dequantized by their scales first), and the FP8 block quantization (with the Hadamard rotation
of src/quant/hadamard.h) computed as the kernel does, in float32 where it rounds. Everything
above them (the operators, their fakes and autograd, the eager paths, the allocation of
outputs and the handling of dout) is flash3's own code.

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


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cq, ck = [int(x) for x in cu_seqlens_q], [int(x) for x in cu_seqlens_k]
    return [(slice(cq[i], cq[i + 1]), slice(ck[i], ck[i + 1])) for i in range(len(cq) - 1)]


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """attention over a packed batch (FlashAttention-3's varlen layout), one sequence at a time:
    q (total_q, h, d), k and v (total_k, hk, d) split by the int32 offsets cu_seqlens_q/k (batch
    + 1 each); out (total_q, h, d) and lse (h, total_q) in float64."""
    outs, lses = [], []
    for sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k):
        o, lse = attention(q[sq][None], k[sk][None], v[sk][None], **kwargs)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, dim=1)


def attention_grads_varlen(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, **kwargs):
    """attention_grads over a packed batch, as attention_varlen: (dq, dk, dv) in float64."""
    grads = [attention_grads(dout[sq][None], q[sq][None], k[sk][None], v[sk][None], **kwargs)
             for sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k)]
    return tuple(torch.cat([g[n][0] for g in grads]) for n in range(3))


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
    quantize_fp8_into (what flash3's kernels, operators and autograd call); returns the list the
    calls are logged in."""
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

    monkeypatch.setattr(flash3._kernels, "forward_into", forward_into)
    monkeypatch.setattr(flash3._kernels, "backward_into", backward_into)
    monkeypatch.setattr(flash3._kernels, "quantize_fp8_into", quantize_fp8_into)
    return calls

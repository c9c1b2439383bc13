"""CPU stand-ins for flash3's two library calls (forward_into, backward_into), for the tests that
run without a GPU: the attention math in float64, written into the caller's buffers as the
library would (rows that see no key: out 0, lse +inf; dq 0). Everything above them (the
operators, their fakes and autograd, the eager autograd path, the allocation of outputs and
the handling of dout) is flash3's own code.

    calls = stand_in.install(monkeypatch)   # each call appends (name, dict of its arguments)
"""
import math

import flash3
import torch


def _scale(q, softmax_scale):
    return 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)


def _probs(q, k, scale, causal):
    """P (b, h, sq, sk) and lse (b, h, sq) in float64; q (b, sq, h, d), k with q's heads."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    empty = torch.isneginf(lse)  # a row that sees no key
    p = torch.exp(s - lse.masked_fill(empty, 0.0)[..., None]).masked_fill(empty[..., None], 0.0)
    return p, lse.masked_fill(empty, float("inf"))


def _wide(q, k, v):
    rep = q.shape[2] // k.shape[2]
    return q.double(), k.double().repeat_interleave(rep, dim=2), v.double().repeat_interleave(rep, dim=2)


def attention(q, k, v, softmax_scale=None, causal=False):
    """(out, lse) in float64."""
    q64, k64, v64 = _wide(q, k, v)
    p, lse = _probs(q64, k64, _scale(q, softmax_scale), causal)
    return torch.einsum("bhqk,bkhd->bqhd", p, v64), lse


def attention_grads(dout, q, k, v, softmax_scale=None, causal=False):
    """(dq, dk, dv) in float64, dk and dv summed over the query heads that share a kv head."""
    scale = _scale(q, softmax_scale)
    q64, k64, v64 = _wide(q, k, v)
    do = dout.double()
    p, _ = _probs(q64, k64, scale, causal)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, do)
    dp = torch.einsum("bqhd,bkhd->bhqk", do, v64)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k64) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q64) * scale
    b, sk, hk, d = k.shape
    rep = q.shape[2] // hk
    return dq, dk.reshape(b, sk, hk, rep, d).sum(3), dv.reshape(b, sk, hk, rep, d).sum(3)


def install(monkeypatch):
    """Puts the stand-ins in place of flash3._kernels.forward_into / backward_into (what
    flash3's kernels, operators and autograd call); returns the list the calls are logged in."""
    calls = []

    def forward_into(q, k, v, out, lse=None, softmax_scale=None, causal=False):
        calls.append(("fwd", dict(q=q, k=k, v=v, out=out, lse=lse, softmax_scale=softmax_scale, causal=causal)))
        o, l = attention(q, k, v, softmax_scale, causal)
        out.copy_(o)
        if lse is not None:
            lse.copy_(l)
        return out, lse

    def backward_into(dout, q, k, v, out, lse, dq, dk, dv, softmax_scale=None, causal=False,
                      deterministic=False):
        calls.append(("bwd", dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, dq=dq, dk=dk, dv=dv,
                                  softmax_scale=softmax_scale, causal=causal, deterministic=deterministic)))
        for buf, g in zip((dq, dk, dv), attention_grads(dout, q, k, v, softmax_scale, causal)):
            buf.copy_(g)
        return dq, dk, dv

    monkeypatch.setattr(flash3._kernels, "forward_into", forward_into)
    monkeypatch.setattr(flash3._kernels, "backward_into", backward_into)
    return calls

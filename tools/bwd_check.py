#!/usr/bin/env python3
"""Debugging aid: flash3's backward against float64 autograd on a few shapes, printing the max
error of dq, dk, dv beside that of the same computation in bf16 (the tests' yardstick).
Calls the C ABI directly (no dependence on the Python package's autograd).

    FLASH3_LIB=build/libflash3.so python3 tools/bwd_check.py
"""
import ctypes
import math
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
from flash3 import _lib  # noqa: E402  (the C structs and dtype codes, not the autograd)

lib = ctypes.CDLL(os.environ.get("FLASH3_LIB", os.path.join(ROOT, "build", "libflash3.so")))
CODES = {torch.float16: _lib.FLOAT16, torch.bfloat16: _lib.BFLOAT16, torch.float32: _lib.FLOAT32}


def ref(t):
    r = _lib.Tensor()
    r.data, r.dtype, r.rank = t.data_ptr(), CODES[t.dtype], t.dim()
    for i, (n, s) in enumerate(zip(t.shape, t.stride())):
        r.shape[i], r.stride[i] = n, s
    return r


def args(cls, size, **fields):
    """A flash3_fwd_args / flash3_bwd_args with struct_size set and the given fields."""
    a = cls(struct_size=size)
    for name, value in fields.items():
        setattr(a, name, value)
    return ctypes.byref(a)


def attn(q, k, v, causal, scale):
    g = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(g, dim=2)
    v = v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + sk - sq, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p.to(v.dtype), v)


def run(b, sq, sk, h, hk, d, causal, dtype=torch.bfloat16, deterministic=False):
    torch.manual_seed(0)
    dev = "cuda"
    q = torch.randn(b, sq, h, d, device=dev, dtype=dtype)
    k = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
    v = torch.randn(b, sk, hk, d, device=dev, dtype=dtype)
    do = torch.randn(b, sq, h, d, device=dev, dtype=dtype)
    scale = 1 / math.sqrt(d)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, sq, device=dev, dtype=torch.float32)
    err = ctypes.create_string_buffer(1024)
    rc = lib.flash3_fwd(args(_lib.FwdArgs, _lib.FWD_ARGS_SIZE, q=ref(q), k=ref(k), v=ref(v), out=ref(out),
                             lse=ref(lse), causal=int(causal)), err, 1024)
    assert rc == 0, err.value
    dq, dk, dv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    rc = lib.flash3_bwd(args(_lib.BwdArgs, _lib.BWD_ARGS_SIZE, q=ref(q), k=ref(k), v=ref(v), out=ref(out),
                             dout=ref(do), lse=ref(lse), dq=ref(dq), dk=ref(dk), dv=ref(dv), causal=int(causal),
                             deterministic=int(deterministic)), err, 1024)
    assert rc == 0, err.value
    torch.cuda.synchronize()
    grads = {}
    for prec in (torch.float64, dtype):
        qq, kk, vv = (t.detach().to(prec).requires_grad_() for t in (q, k, v))
        o = attn(qq, kk, vv, causal, scale)
        o.backward(do.to(prec))
        grads[prec] = (qq.grad, kk.grad, vv.grad)
    line = f"b{b} sq{sq} sk{sk} h{h}/{hk} d{d} causal={int(causal)} {str(dtype)[6:]} det={int(deterministic)}:"
    ok = True
    for name, mine, r64, rlo in zip(("dq", "dk", "dv"), (dq, dk, dv), grads[torch.float64], grads[dtype]):
        e = (mine.double() - r64).abs().max().item()
        el = (rlo.double() - r64).abs().max().item()
        nan = torch.isnan(mine).any().item()
        good = (not nan) and e <= 2 * el + 1e-4
        ok &= good
        line += f" {name} {e:.2e} (lowp {el:.2e}){'' if good else ' BAD'}{' NaN' if nan else ''}"
    print(line, flush=True)
    return ok


if __name__ == "__main__":
    lib.flash3_fwd.restype = ctypes.c_int
    lib.flash3_bwd.restype = ctypes.c_int
    cases = []
    for d in (64, 128, 256):
        for causal in (False, True):
            cases += [(1, 128, 128, 2, 2, d, causal), (2, 113, 300, 4, 1, d, causal),
                      (1, 1000, 1000, 2, 2, d, causal), (1, 300, 113, 4, 2, d, causal)]
    bad = 0
    for c in cases:
        try:
            bad += not run(*c)
        except Exception as e:  # keep going: report every case
            print("case", c, "raised", e, flush=True)
            bad += 1
    bad += not run(1, 1000, 1000, 4, 2, 128, True, torch.float16)
    bad += not run(2, 1000, 1000, 4, 2, 128, True, torch.bfloat16, True)
    print("bwd_check:", "all ok" if bad == 0 else f"{bad} BAD", flush=True)
    sys.exit(1 if bad else 0)

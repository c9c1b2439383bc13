#!/usr/bin/env python3
"""Host time per call of flash3's PyTorch entry points beside SDPA's cuDNN backend.

A tiny problem (the GPU's share of each call is a few microseconds) is called --calls times
without synchronizing, so the wall time per call is the host's: Python, the binding, argument
checks, launches. Where the GPU work of a call is shorter than this, the GPU idles between calls
(small batches, decoding, short sequences); where it is longer, the host time is hidden.

    FLASH3_LIB=build/libflash3.so PYTHONPATH=python python3 bench/host_overhead.py [--profile]

--profile adds a cProfile of flash3's forward and backward calls (the top functions by own time).
"""
import argparse
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash3


def per_call_us(fn, calls):
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--profile", action="store_true")
    a = p.parse_args()
    b, s, h, d = 1, a.seqlen, 2, a.hdim
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True).transpose(1, 2)

    def f3(q, k, v):
        return flash3.flash_attn_func(q, k, v, causal=True)

    out_f3 = f3(qg, kg, vg)
    out_cu = cudnn(qg, kg, vg)
    out, lse = flash3.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    cases = {
        "forward, flash3 (flash_attn_func)": lambda: f3(q, k, v),
        "forward, cuDNN (SDPA)": lambda: cudnn(q, k, v),
        "backward, flash3 (autograd.grad)": lambda: torch.autograd.grad(out_f3, (qg, kg, vg), dout, retain_graph=True),
        "backward, cuDNN (autograd.grad)": lambda: torch.autograd.grad(out_cu, (qg, kg, vg), dout, retain_graph=True),
        "backward, flash3 (backward_into)": lambda: flash3.backward_into(dout, q, k, v, out, lse, dq, dk, dv,
                                                                         causal=True),
    }
    print(f"host time per call, batch {b}, seqlen {s}, {h} heads, hdim {d}, causal, bf16; {a.calls} calls")
    for name, fn in cases.items():
        print(f"  {name:36s} {per_call_us(fn, a.calls):7.1f} us")
    if a.profile:
        for name in ("forward, flash3 (flash_attn_func)", "backward, flash3 (autograd.grad)"):
            prof = cProfile.Profile()
            fn = cases[name]
            prof.enable()
            for _ in range(a.calls):
                fn()
            prof.disable()
            torch.cuda.synchronize()
            print(f"\n== cProfile: {name}, {a.calls} calls (tottime = own time)")
            pstats.Stats(prof).sort_stats("tottime").print_stats(14)


if __name__ == "__main__":
    main()

"""Runs one attention call of flash3 and of cuDNN (PyTorch SDPA) inside a CUDA profiler range,
for Nsight Compute: `ncu --profile-from-start off ... python3 tools/prof.py --pass bwd ...` profiles
exactly the kernels of one flash3 call and one cuDNN call on the same inputs (warm-ups outside).
With --fa3, FlashAttention-3's call (the prebuilt comparator) on the same inputs too.
--pass fp8: flash3's FP8 forward and FlashAttention-3's instead, e4m3 inputs with per-(batch,
kv head) descales, and flash3's with block scales.

usage: FLASH3_LIB=build/libflash3.so PYTHONPATH=python python3 tools/prof.py
           [--pass fwd|bwd|fp8] [--hdim 128] [--seqlen 2048] [--causal 0|1]
           [--only flash3|cudnn|fa3] [--fa3 /tmp/fa3_anchor.so] [--batch B --heads H:HKV]
           [--window LEFT] [--softcap CAP]
Shapes follow the paper's sweep (batch = 16384 / seqlen, heads = 2048 / hdim) unless --batch and
--heads are given (GQA when HKV < H). --window LEFT: the sliding window (LEFT, 0) for flash3 and
FlashAttention-3 (cuDNN's SDPA has no window: left out); --softcap CAP likewise (its tanh cap).
"""
import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flash3


def paper_problem(d, s, causal, batch=0, heads="", fa3_path=None, window=-1, softcap=0.0):
    """The paper's sweep shape at head dim d, seqlen s (batch 16384 / s, heads 2048 / d; or the
    given batch and "H:HKV" heads), bf16, seed 0: (q, k, v, dout) with q, k, v requiring grad,
    and {name: attention(q, k, v)} for flash3, cuDNN (PyTorch SDPA's cuDNN backend) and, with
    fa3_path, FlashAttention-3 (its forward; its backward through fa3_bwd), all in flash3's
    (b, s, h, d) layout."""
    b = batch or max(1, 16384 // s)
    h, hkv = (int(x) for x in heads.split(":")) if heads else (max(1, 2048 // d),) * 2
    torch.manual_seed(0)
    q, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_()

    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal, enable_gqa=hkv != h).transpose(1, 2)

    win = (window, 0 if causal else -1)
    impls = {"flash3": lambda q, k, v: flash3.flash_attn_func(q, k, v, causal=causal, window_size=win,
                                                              softcap=softcap)}
    if window < 0 and softcap == 0:
        impls["cudnn"] = cudnn
    if fa3_path:
        torch.ops.load_library(fa3_path)
        impls["fa3"] = lambda q, k, v: torch.ops.flash_attn_3.fwd(q, k, v, is_causal=causal, softcap=softcap,
                                                                  **fa3_window(window, causal))
    return (q, k, v, dout), impls


def fa3_window(window, causal):
    """FlashAttention-3's window arguments for the window (window, 0 if causal else -1)."""
    return {} if window < 0 else {"window_size_left": window, "window_size_right": 0 if causal else -1}


def fa3_bwd(q, k, v, dout, causal, window=-1, softcap=0.0):
    """FlashAttention-3's backward call on the forward's outputs (it has no autograd here)."""
    w = dict(fa3_window(window, causal), softcap=softcap)
    out, lse = torch.ops.flash_attn_3.fwd(q, k, v, is_causal=causal, **w)[:2]
    grads = [torch.empty_like(t) for t in (q, k, v)]
    return lambda: torch.ops.flash_attn_3.bwd(dout, q, k, v, out, lse, *grads, is_causal=causal, **w)


def fp8_impls(q, k, v, causal, fa3_path):
    """flash3's and FlashAttention-3's FP8 forward on e4m3 copies of q, k, v (unit descales), and
    flash3's with block scales (flash3_blk: random in [0.5, 1.5), so that O is rescaled wherever
    the v scale changes)."""
    q8, k8, v8 = (t.detach().to(torch.float8_e4m3fn) for t in (q, k, v))
    b, s, h, dim = q.shape
    d = torch.ones(b, k.shape[2], device="cuda", dtype=torch.float32)
    bkv = flash3.fp8.block_kv(dim)
    qs, ks, vs = (torch.rand(b, heads, -(-s // blk), device="cuda") + 0.5
                  for heads, blk in ((h, flash3.fp8.BLOCK_Q), (k.shape[2], bkv), (k.shape[2], bkv)))
    out = torch.empty(b, s, h, dim, device="cuda", dtype=torch.bfloat16)
    torch.ops.load_library(fa3_path)
    fa3 = torch.ops.flash_attn_3
    return {
        "flash3": lambda: flash3.flash_attn_func(q8, k8, v8, causal=causal, q_descale=d, k_descale=d, v_descale=d),
        "flash3_blk": lambda: flash3.forward_into(q8, k8, v8, out, None, causal=causal, q_scale=qs, k_scale=ks,
                                                  v_scale=vs),
        "fa3": lambda: fa3.fwd(q8, k8, v8, q_descale=d, k_descale=d, v_descale=d, is_causal=causal),
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--pass", dest="pss", choices=("fwd", "bwd", "fp8"), default="fwd")
    p.add_argument("--hdim", type=int, default=128)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--causal", type=int, default=0)
    p.add_argument("--only", choices=("flash3", "flash3_blk", "cudnn", "fa3"), default=None)
    p.add_argument("--fa3", default=None, help="FlashAttention-3's fa3_anchor.so (--pass fp8: default /tmp/fa3_anchor.so)")
    p.add_argument("--batch", type=int, default=0)
    p.add_argument("--heads", default="", help="H:HKV query and kv heads")
    p.add_argument("--window", type=int, default=-1, help="left window (LEFT, 0); -1: none")
    p.add_argument("--softcap", type=float, default=0.0, help="tanh softcap; 0: none")
    a = p.parse_args()
    s, d = a.seqlen, a.hdim
    causal = bool(a.causal)
    (q, k, v, dout), impls = paper_problem(d, s, causal, a.batch, a.heads, a.fa3 if a.pss != "fp8" else None,
                                           a.window, a.softcap)
    b, h = q.shape[0], q.shape[2]
    if a.pss == "fp8":
        impls = fp8_impls(q, k, v, causal, a.fa3 or "/tmp/fa3_anchor.so")
    if a.only:
        impls = {a.only: impls[a.only]}
    calls = {}
    for name, fn in impls.items():
        if a.pss == "fp8":
            calls[name] = fn
        elif a.pss == "fwd":
            calls[name] = lambda fn=fn: fn(q, k, v)
        elif name == "fa3":
            calls[name] = fa3_bwd(q.detach(), k.detach(), v.detach(), dout, causal, a.window, a.softcap)
        else:
            out = fn(q, k, v)
            calls[name] = lambda out=out: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    for call in calls.values():
        for _ in range(3):
            call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, call in calls.items():
        torch.cuda.nvtx.range_push(name)
        call()
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print(f"profiled {list(calls)}: {a.pss} hdim {d} seqlen {s} causal {causal} batch {b} heads {h} window {a.window} softcap {a.softcap}")


if __name__ == "__main__":
    main()

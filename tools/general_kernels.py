#!/usr/bin/env python3
"""Where the general kernels (variable lengths, windows, softcap) lose time against the default
ones, on 8 sequences x 2k bf16 tokens, hidden 2048 (docs/perf-log.md V4).

    python3 tools/general_kernels.py times --hdims 64,128,256
        per-kernel CUDA time (torch.profiler, 10 calls) of the fixed-length call, of the general
        kernel with fixed lengths (window left = seqlen - 2, as below) and of the same tokens
        packed (flash3.forward_varlen_into / flash_attn_varlen_func), forward and backward,
        causal and not;
    ncu --profile-from-start off -k regex:bwd_kernel --section SourceCounters -o rep \\
        python3 tools/general_kernels.py ncu --hdim 64 --pass bwd
        one call each, inside the profiled region, of: the default kernel, the general kernel with
        fixed lengths (window left = seqlen - 2, which masks one block pair), the general kernel
        with variable lengths; non-causal. (`ncu -i rep.ncu-rep --page source --csv
        --print-source cuda,sass` then gives each line's executed instructions and stall samples.)
"""
import argparse
import collections
import sys

BATCH, SEQLEN, HIDDEN = 8, 2048, 2048


def problem(torch, d):
    h, total = HIDDEN // d, BATCH * SEQLEN
    q, k, v, dout = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    cu = torch.arange(0, total + 1, SEQLEN, device="cuda", dtype=torch.int32)
    return q, k, v, dout, cu


def times(torch, flash3, hdims):
    from torch.profiler import ProfilerActivity, profile
    for d in hdims:
        for causal in (False, True):
            q, k, v, dout, cu = problem(torch, d)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            o = flash3.flash_attn_varlen_func(qg, kg, vg, cu, cu, SEQLEN, SEQLEN, causal=causal)
            qb, kb, vb = (t.view(BATCH, SEQLEN, *t.shape[1:]).clone().requires_grad_() for t in (q, k, v))
            ob = flash3.flash_attn_func(qb, kb, vb, causal=causal)
            ow = flash3.flash_attn_func(qb, kb, vb, causal=causal, window_size=(SEQLEN - 2, -1))
            out_b, lse_b = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], device="cuda")
            calls = {
                "fwd fixed": lambda: flash3.flash_attn_func(qb, kb, vb, causal=causal),
                "fwd general": lambda: flash3.flash_attn_func(qb, kb, vb, causal=causal,
                                                              window_size=(SEQLEN - 2, -1)),
                "fwd varlen": lambda: flash3.forward_varlen_into(q, k, v, out_b, lse_b, cu, cu, SEQLEN, SEQLEN,
                                                                 causal=causal, check_seqlens=False),
                "bwd fixed": lambda: torch.autograd.grad(ob, (qb, kb, vb), dout.view_as(ob), retain_graph=True),
                "bwd general": lambda: torch.autograd.grad(ow, (qb, kb, vb), dout.view_as(ow), retain_graph=True),
                "bwd varlen": lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True),
            }
            for name, call in calls.items():
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        call()
                    torch.cuda.synchronize()
                per_kernel = collections.Counter()
                for e in prof.events():
                    if e.device_type == torch.autograd.DeviceType.CUDA:
                        per_kernel[e.name[:80]] += e.device_time_total / 10
                print(f"hdim {d} causal {int(causal)} {name}: {sum(per_kernel.values()):.1f} us per call")
                for kernel, us in per_kernel.most_common():
                    print(f"    {us:9.1f} us  {kernel}")


def ncu_calls(torch, flash3, d, pss):
    q, k, v, dout, cu = problem(torch, d)
    qb, kb, vb = (t.view(BATCH, SEQLEN, *t.shape[1:]) for t in (q, k, v))
    window = dict(window_size=(SEQLEN - 2, -1))
    if pss == "fwd":
        calls = [lambda: flash3.flash_attn_func(qb, kb, vb), lambda: flash3.flash_attn_func(qb, kb, vb, **window),
                 lambda: flash3.flash_attn_varlen_func(q, k, v, cu, cu, SEQLEN, SEQLEN)]
    else:
        out, lse = flash3.flash_attn_func(qb, kb, vb, return_attn_probs=True)
        outv, lsev = flash3.flash_attn_varlen_func(q, k, v, cu, cu, SEQLEN, SEQLEN, return_attn_probs=True)
        bufs, bufv = [torch.empty_like(t) for t in (qb, kb, vb)], [torch.empty_like(t) for t in (q, k, v)]
        calls = [lambda: flash3.backward_into(dout.view_as(qb), qb, kb, vb, out, lse, *bufs),
                 lambda: flash3.backward_into(dout.view_as(qb), qb, kb, vb, out, lse, *bufs, window_left=SEQLEN - 2),
                 lambda: flash3.backward_varlen_into(dout, q, k, v, outv, lsev, *bufv, cu, cu, SEQLEN, SEQLEN)]
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for call in calls:
        call()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    t = sub.add_parser("times")
    t.add_argument("--hdims", default="64,128,256")
    n = sub.add_parser("ncu")
    n.add_argument("--hdim", type=int, default=64)
    n.add_argument("--pass", dest="pss", choices=("fwd", "bwd"), default="bwd")
    a = p.parse_args(argv)
    import torch
    import flash3
    if not torch.cuda.is_available():
        print("general_kernels: no GPU")
        return 0
    if a.mode == "times":
        times(torch, flash3, [int(x) for x in a.hdims.split(",")])
    else:
        ncu_calls(torch, flash3, a.hdim, a.pss)
    return 0


if __name__ == "__main__":
    sys.exit(main())

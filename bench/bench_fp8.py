#!/usr/bin/env python3
"""The FP8 (e4m3) forward beside FlashAttention-3's FP8 forward in one process, round robin, plus
the paper's Table 3 (accuracy on outlier inputs), the quantizer's bandwidth and the end-to-end
time (quantize + attention) against flash3's BF16 forward.

    python3 bench/bench_fp8.py --fa3 /tmp/fa3_anchor.so [--hdims 64,128,256] [--seqlens 512,...]
        [--causal 0|1|both] [--reps 10] [--runs 3] [--warmup 3] [--json out.json]
        [--skip speed,accuracy,quant]

Speed (the paper's sweep, timing.py: 16k tokens, hidden 2048, FLOPs 4 b h s^2 d, halved for
causal): q, k, v drawn N(0, 1) in bf16, quantized per (batch, kv head) (scale = amax / 448), the
same e4m3 tensors and descales for both libraries:
    flash3      forward_into(q8, k8, v8, out, q_scale=, k_scale=, v_scale=)   (batch, nheads_kv)
    flash3_blk  the same with block scales (q per 64 rows, k and v per block_kv(head dim))
    fa3         torch.ops.flash_attn_3.fwd(q8, k8, v8, q_descale=, k_descale=, v_descale=)
Each call between CUDA events after a spin kernel; per run and point, --reps repetitions that time
each implementation once in rotated order; --runs runs in one process; reported: the median over
runs of each run's median, and ratios to FA3 (median [min..max] over runs). cuDNN is not timed:
PyTorch's SDPA has no FP8 path.
Table 3: batch 4, seqlen 2048, 16 heads, head dim 128, q, k, v ~ N(0, 1) + N(0, 100) x
Bernoulli(0.001) in float32; RMSE of the output against float64 attention of the same float32
inputs, for: per-tensor scales (flash3 and FA3), block scales (quantize_fp8), incoherent
processing with per-tensor scales (the rotation M of quantize_fp8's seed, applied in float32),
and both (quantize_fp8 with hadamard and block scales).
Quantizer: (4, 8192, 16, 128) bf16 -> e4m3 with block scales, with and without the rotation,
against a device-to-device copy of the input (bandwidth = bytes read + written per second).
End to end: quantize q, k, v (rotation on q and k) + the FP8 forward with block scales, against
flash3's BF16 forward on the same bf16 inputs.
"""
import argparse
import json
import math
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import (DEFAULT_HDIMS, DEFAULT_SEQLENS, SPIN_CYCLES, fmt, geomean, ints, log,  # noqa: E402
                    rel_diff, sweep_points, tflops, time_call_ms)

E4M3_MAX = 448.0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fa3", default="/tmp/fa3_anchor.so")
    ap.add_argument("--hdims", type=ints, default=DEFAULT_HDIMS)
    ap.add_argument("--seqlens", type=ints, default=DEFAULT_SEQLENS)
    ap.add_argument("--causal", default="both", choices=["0", "1", "both"])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip", default="", help="comma list of speed, accuracy, quant")
    return ap.parse_args(argv)


def load_fa3(torch, path):
    if path.endswith(".xz"):
        import lzma
        import shutil
        out = os.path.join(tempfile.mkdtemp(), "fa3_anchor.so")
        shutil.copyfileobj(lzma.open(path), open(out, "wb"))
        path = out
    torch.ops.load_library(path)
    return torch.ops.flash_attn_3


def per_head_quant(torch, x, nheads_kv):
    """x (b, s, h, d) -> e4m3 and descales (b, nheads_kv): amax / 448 over each kv head's group."""
    b, s, h, d = x.shape
    g = x.float().abs().view(b, s, nheads_kv, h // nheads_kv, d).amax(dim=(1, 3, 4))
    scale = torch.where(g > 0, g / E4M3_MAX, torch.ones_like(g))
    rep = scale.repeat_interleave(h // nheads_kv, dim=1)[:, None, :, None]
    return (x.float() / rep).to(torch.float8_e4m3fn), scale.contiguous()


def block_quant(torch, x, block):
    """x (b, s, h, d) -> e4m3 and block scales (b, h, ceil(s / block)), in torch (timing inputs)."""
    b, s, h, d = x.shape
    nb = -(-s // block)
    pad = torch.zeros(b, nb * block, h, d, device=x.device, dtype=torch.float32)
    pad[:, :s] = x.float()
    amax = pad.abs().view(b, nb, block, h, d).amax(dim=(2, 4)).transpose(1, 2)  # (b, h, nb)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    rep = scale.transpose(1, 2).repeat_interleave(block, dim=1)[:, :s, :, None]
    return (x.float() / rep).to(torch.float8_e4m3fn), scale.contiguous()


def speed(torch, flash3, fa3, a):
    dev = torch.device("cuda")
    causals = [0, 1] if a.causal == "both" else [int(a.causal)]
    rows = []
    for d, causal, s, b, h, flops in sweep_points(a.hdims, causals, a.seqlens):
        gen = torch.Generator(device=dev).manual_seed(1000 * d + s + causal)
        q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(3))
        (q8, qd), (k8, kd), (v8, vd) = (per_head_quant(torch, x, h) for x in (q, k, v))
        bkv = flash3.fp8.block_kv(d)
        (q8b, qs), (k8b, ks), (v8b, vs) = (block_quant(torch, x, blk) for x, blk in ((q, 64), (k, bkv), (v, bkv)))
        out = torch.empty(b, s, h, d, device=dev, dtype=torch.bfloat16)
        outb = torch.empty_like(out)
        calls = {
            "flash3": lambda: flash3.forward_into(q8, k8, v8, out, None, causal=bool(causal), q_scale=qd,
                                                  k_scale=kd, v_scale=vd),
            "flash3_blk": lambda: flash3.forward_into(q8b, k8b, v8b, outb, None, causal=bool(causal), q_scale=qs,
                                                      k_scale=ks, v_scale=vs),
        }
        if fa3 is not None:
            calls["fa3"] = lambda: fa3.fwd(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                           is_causal=bool(causal))[0]
        check = {}
        ref = calls["fa3"]() if fa3 is not None else None
        for name in ("flash3", "flash3_blk"):
            calls[name]()
            got = out if name == "flash3" else outb
            check[name] = rel_diff(got, ref) if ref is not None else None
        names = list(calls)
        per_run = {n: [] for n in names}
        for _ in range(a.runs):
            for n in names:
                for _ in range(a.warmup):
                    calls[n]()
            times = {n: [] for n in names}
            for rep in range(a.reps):
                order = names[rep % len(names):] + names[:rep % len(names)]
                for n in order:
                    times[n].append(time_call_ms(torch, calls[n], SPIN_CYCLES["fwd"]))
            for n in names:
                per_run[n].append(tflops(flops, statistics.median(times[n])))
        row = {"hdim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h, "check_vs_fa3": check}
        for n in names:
            row[n + "_tflops"] = statistics.median(per_run[n])
            row[n + "_runs"] = per_run[n]
        if fa3 is not None:
            for n in ("flash3", "flash3_blk"):
                r = [x / y for x, y in zip(per_run[n], per_run["fa3"])]
                row[n + "_over_fa3"] = [statistics.median(r), min(r), max(r)]
        r = [x / y for x, y in zip(per_run["flash3_blk"], per_run["flash3"])]
        row["blk_over_flash3"] = [statistics.median(r), min(r), max(r)]
        rows.append(row)
        log(f"d={d} causal={causal} s={s}: flash3 {row['flash3_tflops']:.0f} blk {row['flash3_blk_tflops']:.0f} "
            + (f"fa3 {row['fa3_tflops']:.0f} ratio {row['flash3_over_fa3'][0]:.3f}" if fa3 is not None else "")
            + f" check {check}")
    return rows


def outlier_inputs(torch, shape, gen):
    dev = torch.device("cuda")
    x = torch.randn(*shape, device=dev, dtype=torch.float32, generator=gen)
    rare = torch.rand(*shape, device=dev, generator=gen) < 0.001
    return x + rare * torch.randn(*shape, device=dev, dtype=torch.float32, generator=gen) * 10.0


def rotation(torch, kernels, d, seed):
    """quantize_fp8's rotation M (d x d, float64) for `seed`, read back from the quantizer: row i
    of the identity becomes row i of M = diag(s) H / sqrt(d), all of whose entries are +-1/sqrt(d)
    (exact in e4m3 once scaled to +-448)."""
    eye = torch.eye(d, device="cuda", dtype=torch.bfloat16).view(1, d, 1, d)
    out, scale = kernels.quantize_fp8(eye, block_rows=1, hadamard=True, seed=seed)
    return out.double().view(d, d) * scale.double().view(d, 1)


def accuracy(torch, flash3, kernels, fa3):
    gen = torch.Generator(device="cuda").manual_seed(3)
    b, s, h, d = 4, 2048, 16, 128
    q, k, v = (outlier_inputs(torch, (b, s, h, d), gen) for _ in range(3))
    qt, kt, vt = (x.double().transpose(1, 2) for x in (q, k, v))
    ref = torch.softmax(qt @ kt.transpose(-1, -2) / math.sqrt(d), dim=-1) @ vt
    ref = ref.transpose(1, 2)
    del qt, kt, vt
    out = torch.empty(b, s, h, d, device="cuda", dtype=torch.bfloat16)

    def rmse(x):
        return ((x.double() - ref) ** 2).mean().sqrt().item()

    def per_tensor(x):
        sc = x.abs().amax() / E4M3_MAX
        return (x / sc).to(torch.float8_e4m3fn), sc.expand(b, h).contiguous().float()

    res = {}
    (q8, qs), (k8, ks), (v8, vs) = (per_tensor(x) for x in (q, k, v))
    flash3.forward_into(q8, k8, v8, out, None, q_scale=qs, k_scale=ks, v_scale=vs)
    res["per_tensor_flash3"] = rmse(out)
    if fa3 is not None:
        res["per_tensor_fa3"] = rmse(fa3.fwd(q8, k8, v8, q_descale=qs, k_descale=ks, v_descale=vs)[0])
    qb, kb, vb = (x.to(torch.bfloat16) for x in (q, k, v))
    bkv = flash3.fp8.block_kv(d)
    (q8, qs), (k8, ks), (v8, vs) = (kernels.quantize_fp8(x, block_rows=blk, hadamard=False)
                                    for x, blk in ((qb, 64), (kb, bkv), (vb, bkv)))
    flash3.forward_into(q8, k8, v8, out, None, q_scale=qs, k_scale=ks, v_scale=vs)
    res["block"] = rmse(out)
    m = rotation(torch, kernels, d, seed=0).float()
    (q8, qs), (k8, ks), (v8, vs) = (per_tensor(x) for x in (q @ m, k @ m, v))
    flash3.forward_into(q8, k8, v8, out, None, q_scale=qs, k_scale=ks, v_scale=vs)
    res["incoherent_per_tensor"] = rmse(out)
    (q8, qs), (k8, ks) = (kernels.quantize_fp8(x, block_rows=blk, hadamard=True, seed=0)
                          for x, blk in ((qb, 64), (kb, bkv)))
    v8, vs = kernels.quantize_fp8(vb, block_rows=bkv, hadamard=False)
    flash3.forward_into(q8, k8, v8, out, None, q_scale=qs, k_scale=ks, v_scale=vs)
    res["block_and_incoherent"] = rmse(out)
    flash3.forward_into(qb, kb, vb, out, None)
    res["bf16_flash3"] = rmse(out)
    for kk, vv in res.items():
        log(f"Table 3: {kk:24s} RMSE {vv:.3e}")
    return res


def timed(torch, fn, reps=20):
    for _ in range(3):
        fn()
    return statistics.median(time_call_ms(torch, fn, SPIN_CYCLES["fwd"]) for _ in range(reps))


def quant_and_e2e(torch, flash3, kernels):
    dev = torch.device("cuda")
    b, s, h, d = 4, 8192, 16, 128
    x = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16)
    nbytes_in = x.numel() * 2
    res = {}
    copy_ms = timed(torch, lambda: x.clone())
    res["copy_gbs"] = 2 * nbytes_in / (copy_ms * 1e-3) / 1e9
    for hadamard in (False, True):
        ms = timed(torch, lambda: kernels.quantize_fp8(x, block_rows=128, hadamard=hadamard, seed=0))
        moved = nbytes_in + x.numel() + 4 * b * h * (s // 128)
        res[f"quantize_gbs{'_hadamard' if hadamard else ''}"] = moved / (ms * 1e-3) / 1e9
    log(f"quantizer: copy {res['copy_gbs']:.0f} GB/s, quantize {res['quantize_gbs']:.0f} GB/s, "
        f"with rotation {res['quantize_gbs_hadamard']:.0f} GB/s")
    e2e = []
    for d, causal, s, b, h, flops in sweep_points([64, 128, 256], [0, 1], [2048, 8192]):
        q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        out = torch.empty_like(q)

        bkv = flash3.fp8.block_kv(d)

        def fp8():
            (q8, qs), (k8, ks) = (kernels.quantize_fp8(t, block_rows=blk, hadamard=True, seed=0)
                                  for t, blk in ((q, 64), (k, bkv)))
            v8, vs = kernels.quantize_fp8(v, block_rows=bkv, hadamard=False)
            flash3.forward_into(q8, k8, v8, out, None, causal=bool(causal), q_scale=qs, k_scale=ks, v_scale=vs)

        bf16 = timed(torch, lambda: flash3.forward_into(q, k, v, out, None, causal=bool(causal)))
        f8 = timed(torch, fp8)
        e2e.append({"hdim": d, "causal": causal, "seqlen": s, "bf16_ms": bf16, "fp8_e2e_ms": f8,
                    "speedup": bf16 / f8})
        log(f"end to end d={d} causal={causal} s={s}: bf16 {bf16:.3f} ms, quantize + fp8 {f8:.3f} ms "
            f"({bf16 / f8:.2f}x)")
    res["end_to_end"] = e2e
    return res


def table(rows, fa3):
    lines = ["| hdim | causal | seqlen | flash3 | flash3 block scales | FA3 | flash3/FA3 | block/per-head |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ra = r.get("flash3_over_fa3")
        lines.append(f"| {r['hdim']} | {'y' if r['causal'] else 'n'} | {r['seqlen']} | {r['flash3_tflops']:.0f} | "
                     f"{r['flash3_blk_tflops']:.0f} | {fmt(r.get('fa3_tflops'), '.0f')} | "
                     + (f"{ra[0]:.2f} [{ra[1]:.2f}-{ra[2]:.2f}]" if ra else "-")
                     + f" | {r['blk_over_flash3'][0]:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    a = parse_args(argv)
    import torch
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "python"))
    import flash3
    from flash3 import _kernels as kernels
    fa3 = load_fa3(torch, a.fa3) if a.fa3 and a.fa3 != "none" else None
    skip = set(filter(None, a.skip.split(",")))
    data = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "options": vars(a)}
    if "speed" not in skip:
        rows = speed(torch, flash3, fa3, a)
        data["speed"] = rows
        print(table(rows, fa3))
        long = [r for r in rows if r["seqlen"] >= 1024 and "flash3_over_fa3" in r]
        if long:
            data["summary"] = {
                "geomean_flash3_over_fa3": geomean([r["flash3_over_fa3"][0] for r in rows if "flash3_over_fa3" in r]),
                "points_seqlen_ge_1k_below_fa3": sum(r["flash3_over_fa3"][0] < 1 for r in long),
                "points_seqlen_ge_1k": len(long),
                "geomean_block_over_per_head": geomean([r["blk_over_flash3"][0] for r in rows]),
            }
            log(json.dumps(data["summary"]))
    if "accuracy" not in skip:
        data["table3"] = accuracy(torch, flash3, kernels, fa3)
    if "quant" not in skip:
        data["quantizer"] = quant_and_e2e(torch, flash3, kernels)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()

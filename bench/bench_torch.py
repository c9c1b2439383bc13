#!/usr/bin/env python3
"""flash3 vs cuDNN (SDPA) vs FlashAttention-2 (SDPA), forward or backward, bf16, on the paper's sweep, in one process.

Every point uses the same random-normal inputs for all backends; flash3's result is checked against
cuDNN's before timing. Timing: CUDA events around one call, after the GPU has been given a short
spin kernel so host launch overhead is hidden (all backends alike); 3 warm-ups, median of --reps.
FLOPs = 4 * batch * nheads * seqlen_q * seqlen_k * hdim, halved for causal (the paper's §4.1);
the backward counts 2.5x that (5 matmuls against the forward's 2).
The implied flash3/FA3 = (flash3/cuDNN, this run) / (FA3/cuDNN, shared/fa3_vs_cudnn_h200.json).

--pass bwd (or --bwd) times the backward only: one forward per backend outside the timed region,
then torch.autograd.grad(out, (q, k, v), dout, retain_graph=True) for flash3 (default and
deterministic=True), cuDNN and FA2 alike, so each is timed with its gradients' allocation and
whatever its autograd node launches. The dq, dk, dv of flash3 are checked against cuDNN's first.
The anchors' backward ratios were timed without the spin, host launch overhead included (cuDNN's
backward reads 25-45% slower at seqlen 512-1k that way, the same at 16k; checked on the H200), so
for the backward cuDNN and flash3 are also timed that way (the *_nospin columns) and FA3 is
implied as (FA3/cuDNN anchor) x cuDNN-without-spin. flash3_over_fa3_implied compares flash3's
kernel time with that; flash3_over_fa3_implied_same_method compares flash3 without spin with it.

    python3 bench/bench_torch.py [--pass fwd|bwd] [--quick] [--hdims 64,128,256] [--seqlens 512,...]
                                 [--causal both] [--reps 10] [--json out.json]
"""
import argparse
import datetime
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

from timing import (BWD_FLOPS_FACTOR, MISMATCH, SPIN_CYCLES, first_line, fmt, gemm_tflops,  # noqa: E402
                    geomean, ints, log, median_time_ms, ratio, sdpa, spin_kernel, sweep_points)

GRADS = ("dq", "dk", "dv")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pass", dest="pss", choices=["fwd", "bwd"], default="fwd",
                   help="forward (default) or backward only")
    p.add_argument("--bwd", dest="pss", action="store_const", const="bwd", help="same as --pass bwd")
    p.add_argument("--hdims", type=ints, default=[64, 128, 256])
    p.add_argument("--seqlens", type=ints, default=[512, 1024, 2048, 4096, 8192, 16384])
    p.add_argument("--causal", choices=["0", "1", "both"], default="both")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--spin", type=int, default=None, metavar="CYCLES",
                   help="spin kernel before each timed call (default 200k fwd, 1M bwd)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--quick", action="store_true", help="hdims 64,128,256 x seqlens 1k,4k only")
    a = p.parse_args()
    if a.quick:
        a.seqlens = [1024, 4096]
    if a.spin is None:
        a.spin = SPIN_CYCLES[a.pss]
    return a


def load_anchors(pss="fwd"):
    """(path, {(hdim, causal, seqlen): FA3/cuDNN ratio of this pass}) from the anchors JSON."""
    cands = [os.environ.get("FLASH3_ANCHORS", "")]
    cands += [os.path.join(ROOT, "..", "shared"), os.path.join(ROOT, "shared"),
              os.path.join(ROOT, "bench", "anchors")]
    for c in cands:
        path = os.path.join(c, "fa3_vs_cudnn_h200.json") if c and os.path.isdir(c) else c
        if path and os.path.isfile(path):
            with open(path) as f:
                d = json.load(f)
            key = f"fa3_over_cudnn_{pss}"
            table = {(r["hd"], bool(r["causal"]), r["seqlen"]): r.get(key) for r in d["rows"]}
            return os.path.abspath(path), table
    return None, {}


def geomeans(rows, keys):
    return {k: geomean(r.get(k) for r in rows) for k in keys}


def main():
    a = parse_args()
    try:
        import torch
    except ImportError:
        log("bench_torch: torch is not installed")
        return 2
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        log(f"bench_torch: no Hopper GPU (cuda available: {torch.cuda.is_available()}, capability: {cap})")
        return 2
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    try:
        import flash3
        ok, why = flash3.hopper_available()
        f3_version = flash3.version() if ok else None
    except Exception as e:  # noqa: BLE001 - a missing library still lets the baselines run
        ok, why, f3_version = False, f"{type(e).__name__}: {e}", None
    if not ok:
        log(f"bench_torch: flash3 unavailable, its columns will be empty: {why}")
    anchors_path, anchors = load_anchors(a.pss)
    dev = torch.device("cuda")
    spin = spin_kernel(torch)  # spin kernel: keeps the GPU busy while the host launches

    def time_ms(fn, spin_cycles=None):
        cycles = a.spin if spin_cycles is None else spin_cycles
        return median_time_ms(torch, fn, a.warmup, a.reps, cycles)

    # ---- the ceiling: bf16 GEMM 8192^3 ------------------------------------------------------
    gemm = gemm_tflops(torch, dev, a.warmup, a.reps, a.spin)
    log(f"device: {torch.cuda.get_device_name(dev)}; torch {torch.__version__}, cuDNN "
        f"{torch.backends.cudnn.version()}, CUDA {torch.version.cuda}; flash3 {f3_version}")
    log(f"bf16 GEMM 8192^3: {gemm:.1f} TFLOP/s")
    log(f"anchors: {anchors_path or 'not found (FA3 columns empty)'}")

    def sdpa_backend(backend):
        return sdpa(F, sdpa_kernel, backend)

    causals = {"0": [False], "1": [True], "both": [False, True]}[a.causal]
    env = dict(torch=torch, dev=dev, flash3=flash3 if ok else None, sdpa=sdpa_backend, SDPBackend=SDPBackend,
               anchors=anchors, causals=causals, time_ms=time_ms)
    if a.pss == "bwd":
        rows, summary, what, method = sweep_bwd(a, env)
    else:
        rows, summary, what, method = sweep_fwd(a, env)
    log("geomean: " + ", ".join(f"{k} {fmt(v, '.3f')}" for k, v in summary.items()))
    if a.json:
        result = {
            "pass": a.pss,
            "what": what,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "device": torch.cuda.get_device_name(dev), "capability": list(torch.cuda.get_device_capability(dev)),
            "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "cuda": torch.version.cuda,
            "flash3_version": f3_version, "flash3_unavailable": None if ok else why,
            "gemm_bf16_tflops": gemm, "anchors": anchors_path,
            "flops": "4 * batch * nheads * seqlen^2 * hdim, halved for causal"
                     + (f", times {BWD_FLOPS_FACTOR} for the backward" if a.pss == "bwd" else ""),
            "timing": {"warmup": a.warmup, "reps": a.reps, "stat": "median", "spin_before_each": spin is not None,
                       "spin_cycles": a.spin, "method": method},
            "geomean": summary, "rows": rows,
        }
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
        log(f"wrote {a.json}")
    return 0


def sweep_fwd(a, env):
    torch, dev, flash3, time_ms = env["torch"], env["dev"], env["flash3"], env["time_ms"]
    sdpa, SDPBackend, anchors = env["sdpa"], env["SDPBackend"], env["anchors"]
    impls = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "fa2": sdpa(SDPBackend.FLASH_ATTENTION)}
    if flash3 is not None:
        impls = {"flash3": lambda q, k, v, causal: flash3.flash_attn_func(q, k, v, causal=causal), **impls}

    hdr = (f"{'hdim':>4} {'causal':>6} {'seqlen':>6} | {'flash3':>7} {'cudnn':>7} {'fa2':>7} | "
           f"{'f3/cudnn':>8} {'f3/fa2':>7} {'fa3/cudnn':>9} {'f3/fa3':>7} | {'maxdiff':>8} {'relerr':>8}")
    log(hdr)
    log("-" * len(hdr))
    rows = []
    torch.manual_seed(0)
    for d, causal, s, b, h, flops in sweep_points(a.hdims, env["causals"], a.seqlens, 1):
        row = {"hdim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h, "flops": flops}
        errors = {}
        try:
            q, k, v = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        except torch.cuda.OutOfMemoryError as e:
            log(f"{d:>4} {causal!s:>6} {s:>6} | out of memory: {e}")
            continue
        outs = {}
        for name, fn in impls.items():  # correctness, once, before timing
            try:
                outs[name] = fn(q, k, v, causal).float()
            except Exception as e:  # noqa: BLE001 - a failed backend is recorded, not fatal
                errors[name] = first_line(e)
        ref_name = "cudnn" if "cudnn" in outs else ("fa2" if "fa2" in outs else None)
        if "flash3" in outs and ref_name:
            o, r = outs["flash3"], outs[ref_name]
            row["check_against"] = ref_name
            row["max_abs_diff"] = (o - r).abs().max().item()
            row["rel_err"] = ((o - r).norm() / r.norm()).item()
            row["flash3_nan"] = bool(torch.isnan(o).any().item())
        if "fa2" in outs and "cudnn" in outs:
            row["fa2_vs_cudnn_rel_err"] = ((outs["fa2"] - outs["cudnn"]).norm() / outs["cudnn"].norm()).item()
        del outs
        tf = {}
        for name, fn in impls.items():
            if name in errors:
                tf[name] = None
                continue
            try:
                ms = time_ms(lambda: fn(q, k, v, causal))
                tf[name] = flops / (ms * 1e-3) / 1e12
                row[f"{name}_ms"] = ms
            except Exception as e:  # noqa: BLE001
                errors[name], tf[name] = f"{type(e).__name__}: {e}", None
        for name in ("flash3", "cudnn", "fa2"):
            row[f"{name}_tflops"] = tf.get(name)

        row["flash3_over_cudnn"] = ratio(tf.get("flash3"), tf.get("cudnn"))
        row["flash3_over_fa2"] = ratio(tf.get("flash3"), tf.get("fa2"))
        row["fa3_over_cudnn"] = anchors.get((d, causal, s))
        row["flash3_over_fa3_implied"] = ratio(row["flash3_over_cudnn"], row["fa3_over_cudnn"])
        if errors:
            row["errors"] = errors
        rows.append(row)
        del q, k, v
        log(f"{d:>4} {causal!s:>6} {s:>6} | {fmt(tf.get('flash3'), '7.1f')} {fmt(tf.get('cudnn'), '7.1f')} "
            f"{fmt(tf.get('fa2'), '7.1f')} | {fmt(row['flash3_over_cudnn'], '8.3f')} "
            f"{fmt(row['flash3_over_fa2'], '7.3f')} {fmt(row['fa3_over_cudnn'], '9.3f')} "
            f"{fmt(row['flash3_over_fa3_implied'], '7.3f')} | {fmt(row.get('max_abs_diff'), '8.2e')} "
            f"{fmt(row.get('rel_err'), '8.2e')}" + ("  MISMATCH" if (row.get("rel_err") or 0) > MISMATCH
                                                    or row.get("flash3_nan") else ""))
        for name, msg in errors.items():
            log(f"      {name} failed: {msg[:200]}")
    summary = geomeans(rows, ("flash3_over_cudnn", "flash3_over_fa2", "flash3_over_fa3_implied"))
    what = "flash3 vs cuDNN vs FA2 (torch SDPA) forward, bf16, TFLOP/s by the paper's formula"
    return rows, summary, what, "one forward call"


def grad_diffs(torch, got, ref):
    """Per-gradient relative (norm) and max-abs differences of got against ref, and whether got has NaN."""
    rel, mad = {}, {}
    for name, g, r in zip(GRADS, got, ref):
        g, r = g.float(), r.float()
        rel[name] = ((g - r).norm() / r.norm()).item() if r.norm().item() else (g - r).norm().item()
        mad[name] = (g - r).abs().max().item()
    nan = any(bool(torch.isnan(g).any().item()) for g in got)
    return rel, mad, nan


def sweep_bwd(a, env):
    torch, dev, flash3, time_ms = env["torch"], env["dev"], env["flash3"], env["time_ms"]
    sdpa, SDPBackend, anchors = env["sdpa"], env["SDPBackend"], env["anchors"]
    impls = {"cudnn": sdpa(SDPBackend.CUDNN_ATTENTION), "fa2": sdpa(SDPBackend.FLASH_ATTENTION)}
    if flash3 is not None:
        impls = {"flash3": lambda q, k, v, causal: flash3.flash_attn_func(q, k, v, causal=causal),
                 "flash3_det": lambda q, k, v, causal: flash3.flash_attn_func(q, k, v, causal=causal,
                                                                              deterministic=True),
                 **impls}
    names = ("flash3", "flash3_det", "cudnn", "fa2")  # a tuple: names + (...) below

    hdr = (f"{'hdim':>4} {'causal':>6} {'seqlen':>6} | {'flash3':>7} {'f3det':>7} {'cudnn':>7} {'fa2':>7} | "
           f"{'f3/cudnn':>8} {'det/cud':>7} {'det/f3':>6} {'f3/fa2':>7} {'fa3/cudnn':>9} {'f3/fa3':>7} "
           f"{'same':>5} | {'relerr':>8} {'det':>8}")
    log("backward only: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True); "
        f"FLOPs = {BWD_FLOPS_FACTOR} x forward")
    log(hdr)
    log("-" * len(hdr))
    rows = []
    torch.manual_seed(0)
    for d, causal, s, b, h, flops in sweep_points(a.hdims, env["causals"], a.seqlens, BWD_FLOPS_FACTOR):
        row = {"pass": "bwd", "hdim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h,
               "flops": flops}
        errors = {}
        try:
            q, k, v, dout = (torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
        except torch.cuda.OutOfMemoryError as e:
            log(f"{d:>4} {causal!s:>6} {s:>6} | out of memory: {e}")
            continue
        # one forward each, outside any timing; its graph is kept for the timed backwards
        outs, grads = {}, {}
        for name, fn in impls.items():
            try:
                outs[name] = fn(q, k, v, causal)
                grads[name] = torch.autograd.grad(outs[name], (q, k, v), dout, retain_graph=True)
            except Exception as e:  # noqa: BLE001 - a failed backend is recorded, not fatal
                errors[name] = first_line(e)
                outs.pop(name, None)
        ref_name = "cudnn" if "cudnn" in grads else ("fa2" if "fa2" in grads else None)
        if ref_name:
            row["check_against"] = ref_name
            for name in ("flash3", "flash3_det", "fa2"):
                if name in grads and name != ref_name:
                    rel, mad, nan = grad_diffs(torch, grads[name], grads[ref_name])
                    key = {"flash3": "", "flash3_det": "det_", "fa2": "fa2_"}[name]
                    row[f"{key}grad_rel_err"], row[f"{key}grad_max_abs_diff"] = rel, mad
                    row[f"{key}rel_err"], row[f"{key}max_abs_diff"] = max(rel.values()), max(mad.values())
                    if name.startswith("flash3"):
                        row[f"{key}nan"] = nan
        if "flash3" in grads and "flash3_det" in grads:
            _, mad, _ = grad_diffs(torch, grads["flash3_det"], grads["flash3"])
            row["det_vs_default_max_abs_diff"] = max(mad.values())
        del grads
        tf, out = {}, None
        # kernel time (spin first), then for cuDNN and flash3 also the anchors' way (no spin)
        plan = [(name, "", None) for name in names] + [(n, "_nospin", 0) for n in ("cudnn", "flash3")]
        for name, suffix, cycles in plan:
            if name not in outs or name in errors:
                continue
            out = outs[name]
            try:
                ms = time_ms(lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True), cycles)
                tf[name + suffix] = flops / (ms * 1e-3) / 1e12
                row[f"{name}{suffix}_ms"] = ms
            except Exception as e:  # noqa: BLE001
                errors[name] = first_line(e)
        for name in names + ("cudnn_nospin", "flash3_nospin"):
            row[f"{name}_tflops"] = tf.get(name)
        row["flash3_over_cudnn"] = ratio(tf.get("flash3"), tf.get("cudnn"))
        row["flash3_det_over_cudnn"] = ratio(tf.get("flash3_det"), tf.get("cudnn"))
        row["flash3_det_over_flash3"] = ratio(tf.get("flash3_det"), tf.get("flash3"))
        row["flash3_over_fa2"] = ratio(tf.get("flash3"), tf.get("fa2"))
        row["fa3_over_cudnn"] = anchors.get((d, causal, s))
        fa3 = None
        if row["fa3_over_cudnn"] and tf.get("cudnn_nospin"):
            fa3 = row["fa3_over_cudnn"] * tf["cudnn_nospin"]
        row["fa3_implied_tflops"] = fa3
        row["flash3_over_fa3_implied"] = ratio(tf.get("flash3"), fa3)
        row["flash3_over_fa3_implied_same_method"] = ratio(tf.get("flash3_nospin"), fa3)
        if errors:
            row["errors"] = errors
        rows.append(row)
        del outs, out, q, k, v, dout
        bad = ((row.get("rel_err") or 0) > MISMATCH or (row.get("det_rel_err") or 0) > MISMATCH
               or row.get("nan") or row.get("det_nan"))
        log(f"{d:>4} {causal!s:>6} {s:>6} | {fmt(tf.get('flash3'), '7.1f')} "
            f"{fmt(tf.get('flash3_det'), '7.1f')} {fmt(tf.get('cudnn'), '7.1f')} {fmt(tf.get('fa2'), '7.1f')} | "
            f"{fmt(row['flash3_over_cudnn'], '8.3f')} {fmt(row['flash3_det_over_cudnn'], '7.3f')} "
            f"{fmt(row['flash3_det_over_flash3'], '6.3f')} {fmt(row['flash3_over_fa2'], '7.3f')} "
            f"{fmt(row['fa3_over_cudnn'], '9.3f')} {fmt(row['flash3_over_fa3_implied'], '7.3f')} "
            f"{fmt(row['flash3_over_fa3_implied_same_method'], '5.2f')} | "
            f"{fmt(row.get('rel_err'), '8.2e')} {fmt(row.get('det_rel_err'), '8.2e')}"
            + ("  MISMATCH" if bad else ""))
        for name, msg in errors.items():
            log(f"      {name} failed: {msg[:200]}")
        torch.cuda.empty_cache()
    summary = geomeans(rows, ("flash3_over_cudnn", "flash3_det_over_cudnn", "flash3_det_over_flash3",
                              "flash3_over_fa2", "flash3_over_fa3_implied", "flash3_over_fa3_implied_same_method"))
    what = ("flash3 (default and deterministic) vs cuDNN vs FA2 (torch SDPA) backward, bf16, TFLOP/s by the "
            f"paper's formula ({BWD_FLOPS_FACTOR} x forward FLOPs)")
    method = ("backward only: one forward outside timing, then torch.autograd.grad(out, (q, k, v), dout, "
              "retain_graph=True) per timed call; *_nospin: the same without the spin kernel (the anchors' "
              "method); FA3 implied = fa3_over_cudnn x cudnn_nospin_tflops")
    return rows, summary, what, method


if __name__ == "__main__":
    sys.exit(main())

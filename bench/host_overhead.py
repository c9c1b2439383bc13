#!/usr/bin/env python3
"""Host time per attention call: flash3's public Python API beside FlashAttention-3's raw ops and
PyTorch SDPA (cuDNN backend), in one process, at shapes where the host's work dominates.

    FLASH3_LIB=build/libflash3.so PYTHONPATH=python python3 bench/host_overhead.py \\
        [--fa3 /tmp/fa3_anchor.so] [--hdims 64,128] [--causal 0,1] [--seqlen 128] [--batch 1] \\
        [--calls 200] [--reps 7] [--json host_overhead.json] [--profile]
    python3 bench/host_overhead.py --report host_overhead.json   # the table again, no GPU

What is timed. One attention layer's call, batch 1, seqlen 128, bf16, hidden 2048 (nheads =
2048 / head dim), head dims 64 and 128, causal and not: the GPU's share of a call is a few
microseconds, so a stream of calls is limited by the host (Python, argument checks, autograd,
allocations, kernel launches).
  fwd      flash3.flash_attn_func(q, k, v, causal=...)      (inputs without requires_grad)
           FA3    torch.ops.flash_attn_3.fwd(q, k, v, is_causal=...)
           SDPA   F.scaled_dot_product_attention, cuDNN backend, on (b, h, s, d) views
  fwd+bwd  flash3 out = flash_attn_func(q, k, v, causal=...); torch.autograd.grad(out, (q, k, v), dout)
           FA3    fa3.fwd(...), then fa3.bwd(dout, q, k, v, out, lse, dq, dk, dv, is_causal=...)
                  into dq, dk, dv allocated once: no autograd graph, no gradient allocation
           FA3+ag the same two raw ops inside a minimal torch.autograd.Function of this script
                  (a stand-in for a Python wrapper: FA3's build here has none)
           SDPA   through autograd, like flash3
FlashAttention-3 (../shared/anchors/fa3/fa3_anchor.so.xz) is a prebuilt torch op library with NO
Python wrapper (no flash_attn_interface): its rows are the bare torch.ops calls, which is the
least host work any FA3 user can have. The fwd+bwd comparison is asymmetric: flash3 and SDPA pay
for autograd (graph, saved tensors, gradient allocation), raw FA3 does not; FA3+ag shows what a
wrapper adds.

How. Per implementation: --warmup calls; then --reps repetitions, each of which runs every
implementation once in an order rotated by one per repetition (round robin), and per
implementation and repetition:
  host  --calls back-to-back calls timed by time.perf_counter, torch.cuda.synchronize() only
        before the first and after the last: wall time / calls. Where the GPU's share of a call
        is shorter than the host's, this is the host time per call (the "bound" column says
        host when host >= 1.5 x GPU).
  GPU   --gpu-calls back-to-back calls between two CUDA events, issued while a spin kernel
        (torch.cuda._sleep, bench/timing.py) keeps the GPU busy, so the events see the kernels
        only: GPU time / calls, for reference.
The table gives medians over the repetitions; the /FA3 column is host(X) / host(FA3 raw) of the
same pass and point, the spread column (max - min) / median of X's repetitions. Target (issue
41): flash3's host time at most FA3's at every point ("met"); where it is not, the summary says
whether each excess is within the larger of the two implementations' spreads at that point.
Before timing, each implementation's output (fwd) or dq, dk, dv (fwd+bwd) is compared with FA3's
(relative norm difference, bench/timing.py's rel_diff; above 1e-2 the row is flagged MISMATCH).

Only flash3.flash_attn_func and autograd are used, so the script follows the API as it evolves
(a tuple result is read as (out, ...)). --profile adds a cProfile of flash3's calls (top
functions by own time). JSON (--json): options, device, versions, FA3's library, every row with
its per-repetition times, and per pass the flash3/FA3 ratios and the target's verdict.
"""
import argparse
import contextlib
import cProfile
import datetime
import json
import os
import pstats
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import (HIDDEN, MISMATCH, SPIN_CYCLES, first_line, fmt, geomean, ints, log, rel_diff,  # noqa: E402
                    time_call_ms, load_fa3)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PASSES = ("fwd", "fwd_bwd")
PASS_TITLE = {"fwd": "forward", "fwd_bwd": "forward + backward"}
# implementation key -> label in the table
LABELS = {
    "flash3": "flash3 flash_attn_func",
    "flash3_raw": "flash3 forward_into/backward_into",
    "fa3": "FA3 raw torch.ops (no wrapper)",
    "fa3_autograd": "FA3 raw ops + autograd.Function*",
    "sdpa_cudnn": "SDPA cuDNN",
}
DEVICE = "cuda"  # (a CPU test of the script's logic sets "cpu")
HOST_BOUND = 1.5  # host >= this x GPU: the host is the limit
CYCLES_PER_US = 2000  # spin-kernel cycles per microsecond (about 1.98 GHz; more cycles is harmless)
FA3_CANDIDATES = ("/tmp/fa3_anchor.so", os.path.join(ROOT, ".anchors", "fa3_anchor.so.xz"),
                  os.path.join(ROOT, "..", "shared", "anchors", "fa3", "fa3_anchor.so.xz"))
NOTES = [
    "FA3 = FlashAttention-3's prebuilt op library (fa3_anchor.so): torch.ops.flash_attn_3.fwd/.bwd "
    "called directly; it has no Python wrapper (no flash_attn_interface).",
    "fwd+bwd is asymmetric: flash3 and SDPA go through autograd (graph, saved tensors, gradient "
    "allocation); FA3 raw fwd + bwd writes into dq, dk, dv allocated once and skips autograd.",
    "* FA3 raw ops + autograd.Function: this script's minimal wrapper, a stand-in for what a Python "
    "wrapper of FA3 adds.",
]


def first(r):
    return r[0] if isinstance(r, (tuple, list)) else r


def flash3_version(mod):
    """flash3's version(), or why there is none (the library did not load: the calls then fail
    with the reason, in their rows)."""
    try:
        return mod.version() if hasattr(mod, "version") else None
    except Exception as e:  # noqa: BLE001
        return f"? ({first_line(e)})"


# ---- timing --------------------------------------------------------------------------------------

def host_us(torch, fn, calls):
    """Microseconds per call of `calls` back-to-back calls of fn, CPU wall clock, the GPU
    synchronized only before the first call and after the last."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def gpu_us(torch, fn, calls, host_us_per_call):
    """Microseconds per call of the GPU's work of `calls` back-to-back calls between two CUDA
    events, issued while a spin kernel keeps the GPU busy (long enough to cover the host's time)."""
    spin = max(SPIN_CYCLES["fwd"], int(1.5 * host_us_per_call * calls * CYCLES_PER_US))

    def run():
        for _ in range(calls):
            fn()
    return time_call_ms(torch, run, spin) * 1e3 / calls


# ---- implementations -----------------------------------------------------------------------------

def fa3_autograd_fn(torch, fa3):
    class FA3Func(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, causal):
            out, lse = fa3.fwd(q, k, v, is_causal=causal)[:2]
            ctx.save_for_backward(q, k, v, out, lse)
            ctx.causal = causal
            return out

        @staticmethod
        @torch.autograd.function.once_differentiable
        def backward(ctx, dout):
            q, k, v, out, lse = ctx.saved_tensors
            dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
            fa3.bwd(dout, q, k, v, out, lse, dq, dk, dv, is_causal=ctx.causal)
            return dq, dk, dv, None
    return FA3Func.apply


class Case:
    """One implementation at one point: call() runs one timed call; result() returns the tensors
    compared with FA3's (out, or (dq, dk, dv)); ctx() is entered around every timed block."""

    def __init__(self, impl, call, result, ctx=contextlib.nullcontext):
        self.impl, self.call, self.result, self.ctx = impl, call, result, ctx


def make_cases(torch, F, pss, q, k, v, dout, causal, flash3, fa3, cudnn_ctx):
    """The cases of pass pss ("fwd" or "fwd_bwd") on the same inputs (b, s, h, d)."""
    cases = []
    # SDPA gets (b, h, s, d) views made once, as a model holding them would call it
    qt, kt, vt, doutt = (t.transpose(1, 2) for t in (q, k, v, dout))
    if pss == "fwd":
        if flash3 is not None:
            def f3():
                return first(flash3.flash_attn_func(q, k, v, causal=causal))
            cases.append(Case("flash3", f3, f3))
            out3, lse3 = torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)

            def f3raw():
                flash3.forward_into(q, k, v, out3, lse3, causal=causal)
                return out3
            cases.append(Case("flash3_raw", f3raw, f3raw))
        if fa3 is not None:
            def fa():
                return fa3.fwd(q, k, v, is_causal=causal)[0]
            cases.append(Case("fa3", fa, fa))

        def sd():
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
        cases.append(Case("sdpa_cudnn", lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal),
                          sd, cudnn_ctx))
        return cases

    def leaves(*ts):
        return [t.detach().clone().requires_grad_() for t in ts]

    def grads(fwd, ins, d):
        return lambda: torch.autograd.grad(fwd(*ins), ins, d)

    if flash3 is not None:
        ins = leaves(q, k, v)
        call = grads(lambda a, b, c: first(flash3.flash_attn_func(a, b, c, causal=causal)), ins, dout)
        cases.append(Case("flash3", call, call))
        qr, kr, vr = (t.detach() for t in (q, k, v))
        o3, l3 = torch.empty_like(qr), qr.new_empty((qr.shape[0], qr.shape[2], qr.shape[1]), dtype=torch.float32)
        g3 = [torch.empty_like(t) for t in (qr, kr, vr)]

        def raw3():
            flash3.forward_into(qr, kr, vr, o3, l3, causal=causal)
            flash3.backward_into(dout, qr, kr, vr, o3, l3, *g3, causal=causal)
            return tuple(g3)
        cases.append(Case("flash3_raw", raw3, raw3))
    if fa3 is not None:
        qd, kd, vd = (t.detach() for t in (q, k, v))
        dq, dk, dv = (torch.empty_like(t) for t in (qd, kd, vd))

        def raw():
            out, lse = fa3.fwd(qd, kd, vd, is_causal=causal)[:2]
            fa3.bwd(dout, qd, kd, vd, out, lse, dq, dk, dv, is_causal=causal)
            return dq, dk, dv
        cases.append(Case("fa3", raw, raw))
        apply = fa3_autograd_fn(torch, fa3)
        ins = leaves(q, k, v)
        call = grads(lambda a, b, c: apply(a, b, c, causal), ins, dout)
        cases.append(Case("fa3_autograd", call, call))
    # (b, h, s, d) leaves that are transposed views of (b, s, h, d) memory, like a model's q, k, v
    ins = [t.transpose(1, 2) for t in leaves(q, k, v)]
    ins = [t.detach().requires_grad_() for t in ins]
    call = grads(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=causal), ins, doutt)

    def sd_result():
        return tuple(g.transpose(1, 2) for g in call())
    cases.append(Case("sdpa_cudnn", call, sd_result, cudnn_ctx))
    return cases


def check(cases, torch):
    """{impl: (rel_diff vs FA3 or None, error or None)}: each case run once, compared with FA3's."""
    results, errors = {}, {}
    for c in cases:
        try:
            with c.ctx():
                r = c.result()
            torch.cuda.synchronize()
            results[c.impl] = r if isinstance(r, (tuple, list)) else (r,)
        except Exception as e:  # noqa: BLE001 - one failing implementation must not stop the rest
            errors[c.impl] = first_line(e)
    ref = results.get("fa3")
    out = {}
    for c in cases:
        if c.impl in errors:
            out[c.impl] = (None, errors[c.impl])
            continue
        if ref is None or c.impl == "fa3":
            out[c.impl] = (None, None)
            continue
        d = max(rel_diff(x, y) for x, y in zip(results[c.impl], ref))
        out[c.impl] = (d, None)
    return out


def run_point(torch, F, a, pss, hdim, causal, flash3, fa3, cudnn_ctx):
    """The rows of one (pass, hdim, causal) point."""
    b, s, h = a.batch, a.seqlen, max(1, a.hidden // hdim)
    dev = torch.device(DEVICE)
    gen = torch.Generator(device=dev).manual_seed(1000 * hdim + causal)
    q, k, v, dout = (torch.randn(b, s, h, hdim, device=dev, dtype=torch.bfloat16, generator=gen)
                     for _ in range(4))
    cases = make_cases(torch, F, pss, q, k, v, dout, bool(causal), flash3, fa3, cudnn_ctx)
    checks = check(cases, torch)
    live = [c for c in cases if checks[c.impl][1] is None]
    for c in live:
        with c.ctx():
            for _ in range(a.warmup):
                c.call()
    torch.cuda.synchronize()
    host = {c.impl: [] for c in live}
    gpu = {c.impl: [] for c in live}
    for rep in range(a.reps):
        order = live[rep % len(live):] + live[:rep % len(live)] if live else []
        for c in order:
            with c.ctx():
                t = host_us(torch, c.call, a.calls)
                host[c.impl].append(t)
                gpu[c.impl].append(gpu_us(torch, c.call, a.gpu_calls, t))
    rows = []
    fa3_host = statistics.median(host["fa3"]) if host.get("fa3") else None
    for c in cases:
        diff, err = checks[c.impl]
        hm = statistics.median(host[c.impl]) if host.get(c.impl) else None
        gm = statistics.median(gpu[c.impl]) if gpu.get(c.impl) else None
        rows.append({
            "pass": pss, "hdim": hdim, "causal": int(causal), "batch": b, "seqlen": s, "nheads": h,
            "impl": c.impl, "label": LABELS[c.impl],
            "host_us": hm, "gpu_us": gm,
            "bound": None if hm is None or gm is None else ("host" if hm >= HOST_BOUND * gm else "gpu"),
            "host_over_fa3": hm / fa3_host if hm and fa3_host else None,
            "host_spread": (max(host[c.impl]) - min(host[c.impl])) / hm if hm else None,
            "host_us_reps": host.get(c.impl, []), "gpu_us_reps": gpu.get(c.impl, []),
            "rel_diff_vs_fa3": diff, "mismatch": bool(diff is not None and not diff <= MISMATCH),
            "error": err,
        })
    return rows, cases


def profile_flash3(cases, calls, title):
    for c in cases:
        if c.impl != "flash3":
            continue
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            c.call()
        prof.disable()
        log(f"\n== cProfile: {title}, {calls} calls (tottime = own time)")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(14)


# ---- report --------------------------------------------------------------------------------------

def summarize(rows):
    """Per pass: flash3 / FA3 raw host-time ratios (geomean, max) and whether the target holds."""
    out = {}
    for pss in PASSES:
        r = [x["host_over_fa3"] for x in rows if x["pass"] == pss and x["impl"] == "flash3"]
        r = [x for x in r if x]
        ag = [x["host_over_fa3"] for x in rows if x["pass"] == pss and x["impl"] == "fa3_autograd"]
        ag = [x for x in ag if x]
        f3 = {(x["hdim"], x["causal"]): x["host_us"] for x in rows
              if x["pass"] == pss and x["impl"] == "flash3" and x["host_us"]}
        fag = {(x["hdim"], x["causal"]): x["host_us"] for x in rows
               if x["pass"] == pss and x["impl"] == "fa3_autograd" and x["host_us"]}
        vs_ag = [f3[k] / fag[k] for k in f3 if k in fag]
        raw = [x["host_over_fa3"] for x in rows if x["pass"] == pss and x["impl"] == "flash3_raw"]
        raw = [x for x in raw if x]
        # the repetitions' spread ((max - min) / median) of flash3's and FA3's host times per point
        spread = {}
        for x in rows:
            if x["pass"] == pss and x["impl"] in ("flash3", "fa3") and x["host_spread"] is not None:
                key = (x["hdim"], x["causal"])
                spread[key] = max(spread.get(key, 0.0), x["host_spread"])
        within = [x["host_over_fa3"] <= 1.0 + spread.get((x["hdim"], x["causal"]), 0.0) for x in rows
                  if x["pass"] == pss and x["impl"] == "flash3" and x["host_over_fa3"]]
        out[pss] = {
            "points": len(r),
            "flash3_over_fa3_geomean": geomean(r), "flash3_over_fa3_max": max(r) if r else None,
            "fa3_autograd_over_fa3_geomean": geomean(ag),
            "flash3_raw_over_fa3_geomean": geomean(raw), "flash3_raw_over_fa3_max": max(raw) if raw else None,
            "flash3_over_fa3_autograd_geomean": geomean(vs_ag),
            "target_met": (max(r) <= 1.0) if r else None,
            "target_met_within_spread": all(within) if within else None,
            "mismatches": sum(1 for x in rows if x["pass"] == pss and x["mismatch"]),
            "errors": sum(1 for x in rows if x["pass"] == pss and x["error"]),
        }
    return out


def table_lines(data):
    o = data["options"]
    lines = [f"host time per call: batch {o['batch']}, seqlen {o['seqlen']}, hidden {o['hidden']} "
             f"(nheads = hidden / hdim), bf16, one attention layer; {o['calls']} back-to-back calls "
             f"(perf_counter, synchronize at the ends), GPU time from CUDA events over {o['gpu_calls']} "
             f"calls behind a spin kernel; median of {o['reps']} round-robin repetitions"]
    lines += [f"  note: {n}" for n in data.get("notes", [])]
    hdr = f"{'pass':8s} {'hdim':>4s} {'causal':>6s}  {'implementation':34s} {'host us':>8s} {'spread':>6s} " \
          f"{'GPU us':>7s} {'bound':>5s} {'/FA3':>6s}  check"
    for pss in PASSES:
        rows = [r for r in data["rows"] if r["pass"] == pss]
        if not rows:
            continue
        lines += ["", f"-- {PASS_TITLE[pss]}", hdr]
        for r in rows:
            chk = r["error"] or ("MISMATCH " if r["mismatch"] else "") + (
                f"rel diff {r['rel_diff_vs_fa3']:.1e}" if r["rel_diff_vs_fa3"] is not None else "")
            sp = r.get("host_spread")
            lines.append(f"{pss:8s} {r['hdim']:4d} {r['causal']:6d}  {r['label']:34s} {fmt(r['host_us'], '8.1f')} "
                         f"{fmt(None if sp is None else 100 * sp, '5.1f')}% {fmt(r['gpu_us'], '7.1f')} "
                         f"{r['bound'] or '-':>5s} {fmt(r['host_over_fa3'], '6.2f')}  {chk}")
    s = data.get("summary", {})
    lines.append("")
    for pss in PASSES:
        x = s.get(pss)
        if not x or not x["points"]:
            continue
        verdict = {True: "met", False: "NOT met", None: "-"}[x["target_met"]]
        if x["target_met"] is False and x.get("target_met_within_spread"):
            verdict = "NOT met strictly, met within the repetitions' spread"
        lines.append(f"{PASS_TITLE[pss]}: flash3 / FA3 raw host time: geomean {fmt(x['flash3_over_fa3_geomean'], '.2f')}, "
                     f"max {fmt(x['flash3_over_fa3_max'], '.2f')} over {x['points']} points; target (<= 1.00 "
                     f"at every point): {verdict}"
                     + ("" if x["fa3_autograd_over_fa3_geomean"] is None else
                        f"; flash3 / (FA3 raw + autograd.Function*) geomean "
                        f"{fmt(x['flash3_over_fa3_autograd_geomean'], '.2f')}")
                     + ("" if x.get("flash3_raw_over_fa3_geomean") is None else
                        f"; flash3 raw (forward_into/backward_into) / FA3 raw geomean "
                        f"{fmt(x['flash3_raw_over_fa3_geomean'], '.2f')}, max {fmt(x['flash3_raw_over_fa3_max'], '.2f')}")
                     + (f"; {x['mismatches']} MISMATCH" if x["mismatches"] else "")
                     + (f"; {x['errors']} errors" if x["errors"] else ""))
    return lines


def write_json(path, data):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hdims", type=ints, default=[64, 128], help="head dims (default 64,128)")
    p.add_argument("--causal", type=ints, default=[0, 1], help="0,1 (default both)")
    p.add_argument("--pass", dest="passes", choices=("fwd", "fwd_bwd", "both"), default="both")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=128)
    p.add_argument("--hidden", type=int, default=HIDDEN, help=f"nheads = hidden / hdim (default {HIDDEN})")
    p.add_argument("--calls", type=int, default=200, help="back-to-back calls per host timing")
    p.add_argument("--gpu-calls", type=int, default=32, help="back-to-back calls per GPU (event) timing")
    p.add_argument("--reps", type=int, default=7, help="round-robin repetitions (median)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--fa3", metavar="PATH", help="fa3_anchor.so or .so.xz (default: the first of "
                   + ", ".join(FA3_CANDIDATES) + " that exists); 'none' to skip")
    p.add_argument("--no-flash3", action="store_true", help="without flash3 (FA3 and SDPA only)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--profile", action="store_true", help="cProfile of flash3's calls")
    p.add_argument("--report", metavar="JSON", help="print the table of a saved run and exit (no GPU)")
    a = p.parse_args(argv)
    for name in ("calls", "gpu_calls", "reps", "batch", "seqlen"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if any(c not in (0, 1) for c in a.causal):
        p.error("--causal takes 0 and/or 1")
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.report:
        with open(a.report) as f:
            data = json.load(f)
        for line in table_lines(data):
            print(line)
        return 0

    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if not torch.cuda.is_available():
        log("host_overhead: no CUDA device")
        return 2

    data = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "argv": sys.argv[1:],
            "options": {k: v for k, v in vars(a).items() if k not in ("report",)},
            "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cudnn": torch.backends.cudnn.version(), "python": sys.version.split()[0],
            "notes": list(NOTES), "rows": []}
    flash3 = None
    if not a.no_flash3:
        import flash3
        data["flash3"] = {"module": os.path.abspath(flash3.__file__), "version": flash3_version(flash3),
                          "FLASH3_LIB": os.environ.get("FLASH3_LIB")}
    fa3, tmp = None, tempfile.mkdtemp(prefix="host_overhead_")
    fa3_path = a.fa3 or next((p for p in FA3_CANDIDATES if os.path.exists(p)), None)
    if fa3_path and fa3_path != "none":
        try:
            fa3, data["fa3"] = load_fa3(torch, fa3_path, tmp)
        except Exception as e:  # noqa: BLE001
            log(f"FA3: could not load {fa3_path}: {first_line(e)}; its rows are left out")
            data["fa3_error"] = first_line(e)
    else:
        log("FA3: no fa3_anchor.so found (--fa3 PATH); its rows are left out")
    shutil.rmtree(tmp, ignore_errors=True)

    def cudnn_ctx():
        return sdpa_kernel(SDPBackend.CUDNN_ATTENTION)

    log(f"device {data['device']}, torch {torch.__version__}, cuDNN {data['cudnn']}"
        + (f", flash3 {data['flash3']['version']}" if flash3 is not None else "")
        + (f", FA3 {data['fa3']['path']}" if fa3 is not None else ""))
    passes = PASSES if a.passes == "both" else (a.passes,)
    t0 = time.time()
    for pss in passes:
        for hdim in a.hdims:
            for causal in a.causal:
                rows, cases = run_point(torch, F, a, pss, hdim, causal, flash3, fa3, cudnn_ctx)
                data["rows"] += rows
                brief = ", ".join(f"{r['impl']} {fmt(r['host_us'], '.1f')}" for r in rows)
                log(f"  {pss} hdim {hdim} causal {causal}: host us/call {brief}")
                if a.profile and hdim == a.hdims[-1] and causal == a.causal[-1]:
                    profile_flash3(cases, a.calls, f"flash3 {PASS_TITLE[pss]}, hdim {hdim}, causal {causal}")
                del cases
                data["summary"] = summarize(data["rows"])
                if a.json:
                    write_json(a.json, data)
    data["seconds"] = round(time.time() - t0, 1)
    if a.json:
        write_json(a.json, data)
    log("")
    for line in table_lines(data):
        log(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Sliding-window and softcap speed: flash3 beside FlashAttention-3 in one process, round robin (issue 43).

    python3 bench/bench_mask.py --fa3 /tmp/fa3_anchor.so [--hdims 64,128,256] [--runs 3] [--reps 10]
        [--warmup 3] [--window 4096] [--seqlen 16384] [--softcap 30] [--softcap-seqlens 1024,4096,16384]
        [--skip window,softcap,check] [--json out.json]
    python3 bench/bench_mask.py --report out.json      # the tables and summary again, no GPU

All bf16, q, k, v (batch, seqlen, nheads, head_dim) drawn N(0, 1) (one seed per point, the same in
every run), hidden 2048 (nheads = 2048 / head_dim), softmax_scale 1/sqrt(head_dim).
  flash3  flash3.flash_attn_func(q, k, v, causal=, window_size=(left, right), softcap=)
          (backward: its autograd, torch.autograd.grad(out, (q, k, v), dout, retain_graph=True))
  fa3     torch.ops.flash_attn_3.fwd(q, k, v, is_causal=, window_size_left=, window_size_right=,
          softcap=)[0]; backward fa3.bwd(dout, q, k, v, out, lse, dq, dk, dv, <same mask args>)
          into preallocated dq, dk, dv. --fa3 PATH (or its .so.xz); missing or "none": flash3 alone.

1. window: batch 1, seqlen_q = seqlen_k = --seqlen (16384), head dims --hdims; forward and
   backward (the forward once outside the timed region); four implementations round robin:
   flash3 and FA3, each with the causal mask (window (-1, 0)) and with the sliding window
   (--window, 0) (causal with a left window: query i sees keys i - window .. i).
   Per point: win/causal = t_window / t_causal (flash3, FA3); area = visible (i, j) pairs of
   the window mask / of the causal mask (counted row by row); flash3 win/causal / area
   (target <= 1.10); FA3/flash3 = t_fa3 / t_flash3 on the window mask (target >= 1.0).
2. softcap: forward only, head dims --hdims, seqlens --softcap-seqlens with batch = 16384 /
   seqlen, causal and not; flash3 and FA3 with and without softcap --softcap (30), round robin,
   on N(0, 1) inputs (scores of std ~1: flash3's online softmax rescales as rarely with the cap
   as without, so the cost is that of the cap). Per point: cost = t_softcap / t_plain (flash3;
   target <= 1.03 at head dim 128; FA3 for reference), FA3/flash3 = t_fa3 / t_flash3 with softcap.
3. check (first run, before timing): each flash3 result against FA3's on the same mask, relative
   norm difference |a - b| / |b| (forward: out; backward: dq, dk, dv, the largest reported); above
   1e-2 or any NaN: MISMATCH. softcap: the check has its own inputs, q multiplied by 10 (scores
   of std ~10 reach the cap of 30), and also reports |out_softcap - out_plain| / |out_plain| of
   flash3 ("cap effect": that the cap changed something).

Timing (bench/timing.py): each call between two CUDA events after a spin kernel (200k cycles
forward, 1M backward); at each point of a run --warmup untimed calls of each implementation, then
--reps repetitions, each timing every implementation once, the order rotated by one per
repetition; a run's value is the median of its reps. The whole thing (both parts) runs --runs
times in one process; reported: the median over runs of each time and, for each ratio, the
per-run ratios' median [min-max].
JSON (--json, rewritten after every run): device, torch, flash3's library (path, sha256,
version), FA3's library and schemas, options, and per part the rows with every rep's time
(times_ms[impl][run]), the per-run medians, the ratios, checks, errors and verdicts.
"""
import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import (BWD_FLOPS_FACTOR, HIDDEN, MISMATCH, SPIN_CYCLES, TOKENS, first_line, fmt,  # noqa: E402
                    hopper_torch, ints, load_fa3, log, median_or_none, rel_diff, rng, round_robin, sha256)

SKIPPABLE = ("window", "softcap", "check")
AREA_TARGET = 1.10     # flash3 (t_window / t_causal) / area ratio at most this
FA3_TARGET = 1.0       # t_fa3 / t_flash3 on the window mask at least this
SOFTCAP_TARGET = 1.03  # flash3 t_softcap / t_plain at most this at head dim SOFTCAP_HDIM
SOFTCAP_HDIM = 128
SOFTCAP_QSCALE = 10.0
WIN_IMPLS = ("flash3_causal", "flash3_window", "fa3_causal", "fa3_window")
SC_IMPLS = ("flash3", "flash3_softcap", "fa3", "fa3_softcap")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring for what is measured and the targets.")
    p.add_argument("--fa3", default="/tmp/fa3_anchor.so", metavar="PATH",
                   help="FlashAttention-3's fa3_anchor.so (or .so.xz); missing or 'none': flash3 alone")
    p.add_argument("--hdims", type=ints, default=[64, 128, 256])
    p.add_argument("--runs", type=int, default=3, help="runs of the whole thing in this process (default 3)")
    p.add_argument("--reps", type=int, default=10, help="round-robin repetitions per point per run (default 10)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--window", type=int, default=4096, help="left window of the window mask (default 4096)")
    p.add_argument("--seqlen", type=int, default=16384, help="seqlen of the window part (default 16384)")
    p.add_argument("--softcap", type=float, default=30.0)
    p.add_argument("--softcap-seqlens", type=ints, default=[1024, 4096, 16384])
    p.add_argument("--skip", default="", help="comma list of " + ", ".join(SKIPPABLE))
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--report", metavar="JSON", help="print the tables and summary of a written JSON and exit")
    a = p.parse_args(argv)
    a.skip = set(filter(None, a.skip.split(",")))
    bad = a.skip - set(SKIPPABLE)
    if bad:
        p.error(f"--skip: unknown {sorted(bad)}; expected a comma list of {', '.join(SKIPPABLE)}")
    if not a.report and (a.runs < 1 or a.reps < 1 or a.warmup < 0):
        p.error("--runs and --reps must be at least 1, --warmup at least 0")
    return a


# ---- pure Python: masks, statistics, report ----------------------------------------------------

def visible_pairs(sq, sk, left, right):
    """The number of (i, j) with query i seeing key j under FlashAttention-3's window
    (i + sk - sq - left <= j <= i + sk - sq + right, a negative side unbounded), counted row by row."""
    n = 0
    for i in range(sq):
        c = i + sk - sq
        lo = max(0, c - left) if left >= 0 else 0
        hi = min(sk - 1, c + right) if right >= 0 else sk - 1
        n += max(0, hi - lo + 1)
    return n


def ratio_stats(num, den):
    """Per-run ratios num_r / den_r (runs where both exist): {runs, median, min, max}."""
    rs = [x / y if x is not None and y else None for x, y in zip(num, den)]
    xs = [r for r in rs if r is not None]
    if not xs:
        return {"runs": rs, "median": None, "min": None, "max": None}
    return {"runs": rs, "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def scaled(st, f):
    """A ratio's statistics divided by the constant f."""
    return {k: (v / f if v is not None else None) if k != "runs" else [x / f if x is not None else None for x in v]
            for k, v in st.items()}


def col(x, spec, w):
    """x formatted by spec ('-' where None), right-aligned in w characters."""
    return f"{fmt(x, spec):>{w}}"


def flags(r):
    out = []
    if r.get("mismatch"):
        out.append(f"MISMATCH({','.join(r['mismatch'])})")
    if r.get("errors"):
        out.append(f"ERROR({','.join(sorted(r['errors']))})")
    return out


def verdict(ok, word="ok", bad="MISS"):
    return "n/a" if ok is None else (word if ok else bad)


def window_rows_finish(r):
    """The ratios and verdicts of one window row from its per-run medians (ms_runs)."""
    m = r["ms_runs"]
    none = [None] * max((len(v) for v in m.values()), default=0)
    g = lambda n: m.get(n, none)  # noqa: E731
    r["ms"] = {n: median_or_none(v) for n, v in m.items()}
    f3 = ratio_stats(g("flash3_window"), g("flash3_causal"))
    r["ratios"] = {
        "flash3_win_over_causal": f3,
        "fa3_win_over_causal": ratio_stats(g("fa3_window"), g("fa3_causal")),
        "flash3_win_over_causal_over_area": scaled(f3, r["area_ratio"]),
        "fa3_over_flash3_window": ratio_stats(g("fa3_window"), g("flash3_window")),
        "fa3_over_flash3_causal": ratio_stats(g("fa3_causal"), g("flash3_causal")),
    }
    factor = BWD_FLOPS_FACTOR if r["pass"] == "bwd" else 1
    per_pair = factor * 4 * r["batch"] * r["nheads"] * r["hdim"]
    r["tflops_visible"] = {n: (per_pair * r["visible_pairs"]["window" if n.endswith("window") else "causal"]
                               / (ms * 1e-3) / 1e12 if ms else None) for n, ms in r["ms"].items()}
    a = r["ratios"]["flash3_win_over_causal_over_area"]["median"]
    s = r["ratios"]["fa3_over_flash3_window"]["median"]
    r["verdict"] = {"area": None if a is None else a <= AREA_TARGET,
                    "vs_fa3": None if s is None else s >= FA3_TARGET}
    return r


def softcap_rows_finish(r):
    m = r["ms_runs"]
    none = [None] * max((len(v) for v in m.values()), default=0)
    g = lambda n: m.get(n, none)  # noqa: E731
    r["ms"] = {n: median_or_none(v) for n, v in m.items()}
    r["ratios"] = {
        "flash3_softcap_cost": ratio_stats(g("flash3_softcap"), g("flash3")),
        "fa3_softcap_cost": ratio_stats(g("fa3_softcap"), g("fa3")),
        "fa3_over_flash3_softcap": ratio_stats(g("fa3_softcap"), g("flash3_softcap")),
        "fa3_over_flash3_plain": ratio_stats(g("fa3"), g("flash3")),
    }
    c = r["ratios"]["flash3_softcap_cost"]["median"]
    r["verdict"] = {"cost": None if c is None else c <= SOFTCAP_TARGET,
                    "cost_is_target": r["hdim"] == SOFTCAP_HDIM}
    return r


def window_table(rows):
    W = 19
    hdr = (f"{'pass':4} {'hdim':>4} | {'f3 causal':>9} {'f3 win':>8} {'fa3 causal':>10} {'fa3 win':>8} ms | "
           f"{'f3 win/causal':>{W}} {'fa3 win/causal':>14} {'area':>6} {'f3 (win/causal)/area':>{W + 1}} | "
           f"{'FA3/f3 window':>{W}} {'FA3/f3 causal':>13} | verdict")
    out = ["window: t_window / t_causal against the visible-area ratio; FA3/f3 = t_fa3 / t_flash3 "
           f"(targets: f3 (win/causal)/area <= {AREA_TARGET:.2f}, FA3/f3 window >= {FA3_TARGET:.2f})",
           hdr, "-" * len(hdr)]
    for r in rows:
        ms, ra = r["ms"], r["ratios"]
        v = r["verdict"]
        out.append(
            f"{r['pass']:4} {r['hdim']:>4} | {col(ms.get('flash3_causal'), '.3f', 9)} "
            f"{col(ms.get('flash3_window'), '.3f', 8)} "
            f"{col(ms.get('fa3_causal'), '.3f', 10)} {col(ms.get('fa3_window'), '.3f', 8)}    | "
            f"{rng(ra['flash3_win_over_causal']):>{W}} {col(ra['fa3_win_over_causal']['median'], '.3f', 14)} "
            f"{r['area_ratio']:6.4f} {rng(ra['flash3_win_over_causal_over_area']):>{W + 1}} | "
            f"{rng(ra['fa3_over_flash3_window']):>{W}} {col(ra['fa3_over_flash3_causal']['median'], '.3f', 13)} | "
            + " ".join([f"area:{verdict(v['area'])}", f"vs_fa3:{verdict(v['vs_fa3'])}"] + flags(r)))
    return out


def softcap_table(rows, softcap):
    W = 19
    hdr = (f"{'hdim':>4} {'causal':>6} {'seqlen':>6} {'batch':>5} | {'f3':>7} {'f3 cap':>7} {'fa3':>7} "
           f"{'fa3 cap':>7} ms | {'f3 cap/plain':>{W}} {'fa3 cap/plain':>{W}} | {'FA3/f3 softcap':>{W}} "
           f"{'FA3/f3 plain':>12} | verdict")
    out = [f"softcap {softcap:g}, forward: cost = t_softcap / t_plain (target: flash3 <= {SOFTCAP_TARGET} at "
           f"head dim {SOFTCAP_HDIM}); FA3/f3 = t_fa3 / t_flash3", hdr, "-" * len(hdr)]
    for r in rows:
        ms, ra, v = r["ms"], r["ratios"], r["verdict"]
        vv = f"cost:{verdict(v['cost'])}" if v["cost_is_target"] else f"(cost {verdict(v['cost'], 'ok', 'over')})"
        out.append(
            f"{r['hdim']:>4} {int(r['causal']):>6} {r['seqlen']:>6} {r['batch']:>5} | "
            f"{col(ms.get('flash3'), '.3f', 7)} {col(ms.get('flash3_softcap'), '.3f', 7)} {col(ms.get('fa3'), '.3f', 7)} "
            f"{col(ms.get('fa3_softcap'), '.3f', 7)}    | {rng(ra['flash3_softcap_cost']):>{W}} "
            f"{rng(ra['fa3_softcap_cost']):>{W}} | {rng(ra['fa3_over_flash3_softcap']):>{W}} "
            f"{col(ra['fa3_over_flash3_plain']['median'], '.3f', 12)} | " + " ".join([vv] + flags(r)))
    return out


def check_lines(data):
    out = []
    for part in ("window", "softcap"):
        for r in (data.get(part) or {}).get("rows", []):
            if not r.get("check"):
                continue
            cells = []
            for name, c in r["check"].items():
                s = f"{name} {fmt(c.get('rel_err'), '.2e')}"
                if c.get("grad_rel_err"):
                    s += " (" + " ".join(f"{g} {fmt(x, '.1e')}" for g, x in c["grad_rel_err"].items()) + ")"
                if c.get("cap_effect") is not None:
                    s += f" cap effect {c['cap_effect']:.2e}"
                if c.get("nan"):
                    s += " NaN"
                cells.append(s)
            out.append(f"check {point_label(part, r)}: " + "; ".join(cells))
    return out


def point_label(part, r):
    if part == "window":
        return f"window {r['pass']} d{r['hdim']}"
    return f"softcap d{r['hdim']} {'causal' if r['causal'] else 'noncausal'} s{r['seqlen']}"


def summarize(data):
    """{window: {...}, softcap: {...}, line: one-line summary}."""
    s, parts = {}, []
    wrows = (data.get("window") or {}).get("rows", [])
    if wrows:
        area = [r["ratios"]["flash3_win_over_causal_over_area"]["median"] for r in wrows]
        speed = [r["ratios"]["fa3_over_flash3_window"]["median"] for r in wrows]
        area_k, speed_k = [x for x in area if x is not None], [x for x in speed if x is not None]
        s["window"] = {
            "points": len(wrows),
            "area_fail": [point_label("window", r) for r in wrows if r["verdict"]["area"] is False],
            "vs_fa3_fail": [point_label("window", r) for r in wrows if r["verdict"]["vs_fa3"] is False],
            "worst_area": max(area_k) if area_k else None,
            "worst_fa3_over_flash3": min(speed_k) if speed_k else None,
        }
        w = s["window"]
        parts.append(f"window: (win/causal)/area worst {fmt(w['worst_area'], '.3f')} "
                     f"({w['points'] - len(w['area_fail'])}/{w['points']} <= {AREA_TARGET:.2f})"
                     + (f", FA3/f3 worst {fmt(w['worst_fa3_over_flash3'], '.3f')} "
                        f"({w['points'] - len(w['vs_fa3_fail'])}/{w['points']} >= {FA3_TARGET:.2f})"
                        if speed_k else ", no FA3"))
    srows = (data.get("softcap") or {}).get("rows", [])
    if srows:
        tgt = [r for r in srows if r["verdict"]["cost_is_target"]]
        costs = [r["ratios"]["flash3_softcap_cost"]["median"] for r in tgt]
        costs = [c for c in costs if c is not None]
        s["softcap"] = {
            "points": len(srows), "target_points": len(tgt),
            "cost_fail": [point_label("softcap", r) for r in tgt if r["verdict"]["cost"] is False],
            "worst_cost_target_hdim": max(costs) if costs else None,
            "worst_cost_all": max((r["ratios"]["flash3_softcap_cost"]["median"] for r in srows
                                   if r["ratios"]["flash3_softcap_cost"]["median"] is not None), default=None),
        }
        c = s["softcap"]
        parts.append(f"softcap d{SOFTCAP_HDIM}: cost worst {fmt(c['worst_cost_target_hdim'], '.3f')} "
                     f"({c['target_points'] - len(c['cost_fail'])}/{c['target_points']} <= {SOFTCAP_TARGET:.2f}), "
                     f"all hdims worst {fmt(c['worst_cost_all'], '.3f')}")
    mism = [point_label(p, r) + ":" + ",".join(r["mismatch"]) for p in ("window", "softcap")
            for r in (data.get(p) or {}).get("rows", []) if r.get("mismatch")]
    errs = [point_label(p, r) + ":" + ",".join(sorted(r["errors"])) for p in ("window", "softcap")
            for r in (data.get(p) or {}).get("rows", []) if r.get("errors")]
    s["mismatch_points"], s["error_points"] = mism, errs
    parts.append(f"mismatches {len(mism)}, errors {len(errs)}")
    s["line"] = "summary: " + "; ".join(parts)
    return s


def report(data):
    """Prints the tables, checks and summary of the JSON's data."""
    fa3 = data.get("fa3")
    log(f"device: {data.get('device')}; flash3 {(data.get('flash3') or {}).get('lib')}; "
        f"FA3 {fa3['path'] if fa3 else 'none (flash3 alone)'}; runs {data['options']['runs']}, "
        f"reps {data['options']['reps']}, warmup {data['options']['warmup']}")
    if (data.get("window") or {}).get("rows"):
        log("")
        for line in window_table(data["window"]["rows"]):
            log(line)
    if (data.get("softcap") or {}).get("rows"):
        log("")
        for line in softcap_table(data["softcap"]["rows"], data["options"]["softcap"]):
            log(line)
    lines = check_lines(data)
    if lines:
        log("")
        for line in lines:
            log(line)
    s = summarize(data)
    log("")
    for k in ("mismatch_points", "error_points"):
        if s[k]:
            log(f"{k.replace('_', ' ')}: " + "; ".join(s[k]))
    log(s["line"])
    return s


# ---- GPU -------------------------------------------------------------------------------------

def load_fa3_or_none(torch, path, tmp):
    """timing.load_fa3, or (None, None) where path is 'none' or missing."""
    if not path or path == "none" or not os.path.isfile(path):
        return None, None
    return load_fa3(torch, path, tmp)


def flash3_info(flash3):
    """Path, sha256 and version of the libflash3.so this process loaded."""
    ok, why = flash3.hopper_available()  # loads the library
    path = getattr(flash3._lib.lib(), "_name", None)
    try:
        with open("/proc/self/maps") as f:
            mapped = {ln.split(None, 5)[5].strip() for ln in f if len(ln.split(None, 5)) == 6}
        hits = sorted(m for m in mapped if "libflash3" in os.path.basename(m))
        if hits:
            path = hits[0]
    except OSError:
        pass
    return {"lib": os.path.abspath(path) if path else None, "sha256": sha256(path) if path and os.path.isfile(path)
            else None, "version": flash3.version(), "FLASH3_LIB": os.environ.get("FLASH3_LIB"),
            "hopper_available": ok, "why": why}


def first(r):
    return r[0] if isinstance(r, (tuple, list)) else r


def make_calls(torch, flash3, fa3, pss, tensors, masks):
    """{impl: call} (each run once here) and {impl: its first result}, errors; masks: {impl:
    (lib, causal, (left, right), softcap)}. fwd: result out; bwd: (dq, dk, dv), the forward done
    once here, outside the timed call."""
    calls, results, errors = {}, {}, {}
    for name, (lib, causal, (left, right), softcap) in masks.items():
        try:
            if lib == "fa3" and fa3 is None:
                continue
            if pss == "fwd":
                q, k, v = tensors
                if lib == "flash3":
                    call = (lambda c=causal, w=(left, right), s=softcap:
                            first(flash3.flash_attn_func(q, k, v, causal=c, window_size=w, softcap=s)))
                else:
                    call = (lambda c=causal, lf=left, rt=right, s=softcap:
                            fa3.fwd(q, k, v, is_causal=c, window_size_left=lf, window_size_right=rt, softcap=s)[0])
            else:
                q, k, v, dout = tensors
                if lib == "flash3":
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                    out = first(flash3.flash_attn_func(qg, kg, vg, causal=causal, window_size=(left, right),
                                                       softcap=softcap))
                    call = (lambda o=out, x=(qg, kg, vg):
                            torch.autograd.grad(o, x, dout, retain_graph=True))
                else:
                    out, lse = fa3.fwd(q, k, v, is_causal=causal, window_size_left=left, window_size_right=right,
                                       softcap=softcap)[:2]
                    grads = tuple(torch.empty_like(t) for t in (q, k, v))

                    def call(o=out, lse=lse, g=grads, c=causal, lf=left, rt=right, s=softcap):
                        fa3.bwd(dout, q, k, v, o, lse, *g, is_causal=c, window_size_left=lf,
                                window_size_right=rt, softcap=s)
                        return g
            r = call()
            calls[name] = call
            results[name] = r
        except Exception as e:  # noqa: BLE001
            errors[name] = first_line(e)
    torch.cuda.synchronize()
    return calls, results, errors


def check(torch, pss, results, pairs, cap_pairs=()):
    """{name: {vs, rel_err[, grad_rel_err], nan[, cap_effect]}} and the mismatching names; pairs:
    (flash3 impl, its FA3 reference); cap_pairs: (flash3 softcap impl, flash3 plain impl)."""
    def has_nan(x):
        return any(bool(torch.isnan(t).any().item()) for t in ((x,) if pss == "fwd" else x))

    out, mism = {}, []
    for name, ref in pairs:
        if name not in results:
            continue
        c = {"nan": has_nan(results[name])}
        if ref in results:
            c["vs"] = ref
            if pss == "fwd":
                c["rel_err"] = rel_diff(results[name], results[ref])
            else:
                c["grad_rel_err"] = {g: rel_diff(x, y) for g, x, y in zip(("dq", "dk", "dv"), results[name],
                                                                          results[ref])}
                c["rel_err"] = max(c["grad_rel_err"].values())
        out[name] = c
        if c["nan"] or (c.get("rel_err") or 0) > MISMATCH:
            mism.append(name)
    for cap, plain in cap_pairs:
        if cap in results and plain in results and cap in out:
            out[cap]["cap_effect"] = rel_diff(results[cap], results[plain])
    return out, mism


def run_point(torch, flash3, fa3, a, rec, run, pss, seed, shape, masks, pairs, cap_pairs=(), check_qscale=1.0):
    """Sets up, checks (first run) and times one point for one run into rec. check_qscale != 1:
    the check runs on its own inputs, q multiplied by it (the timed inputs stay N(0, 1))."""
    dev = torch.device("cuda")
    errors = {}
    times = {}
    try:
        g = torch.Generator(device=dev)
        g.manual_seed(seed)
        n = 3 if pss == "fwd" else 4
        ts = [torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(n)]
        want_check = run == 0 and "check" not in a.skip
        if want_check and check_qscale != 1.0:
            _, results, _ = make_calls(torch, flash3, fa3, pss, [ts[0] * check_qscale] + ts[1:], masks)
            rec["check"], rec["mismatch"] = check(torch, pss, results, pairs, cap_pairs)
            rec["check_q_scale"] = check_qscale
            del results
        calls, results, errors = make_calls(torch, flash3, fa3, pss, ts, masks)
        if want_check and check_qscale == 1.0:
            rec["check"], rec["mismatch"] = check(torch, pss, results, pairs, cap_pairs)
        del results
        times = round_robin(torch, calls, a.warmup, a.reps, SPIN_CYCLES[pss], errors)
        del calls, ts
    except torch.cuda.OutOfMemoryError as e:
        errors["all"] = first_line(e)
    for n, t in times.items():
        rec["times_ms"].setdefault(n, [None] * a.runs)[run] = t
        rec["ms_runs"].setdefault(n, [None] * a.runs)[run] = statistics.median(t) if t else None
    for n, msg in errors.items():
        rec["errors"].setdefault(n, msg)
    torch.cuda.empty_cache()


def new_rec(meta, impls, runs):
    rec = dict(meta)
    rec.update({"times_ms": {n: [None] * runs for n in impls}, "ms_runs": {n: [None] * runs for n in impls},
                "errors": {}, "check": None, "mismatch": []})
    return rec


def window_part(torch, flash3, fa3, a, run, recs, t0):
    s, W = a.seqlen, a.window
    causal_pairs = visible_pairs(s, s, -1, 0)
    window_pairs = visible_pairs(s, s, W, 0)
    masks = {"flash3_causal": ("flash3", True, (-1, -1), 0.0), "flash3_window": ("flash3", True, (W, 0), 0.0),
             "fa3_causal": ("fa3", True, (-1, -1), 0.0), "fa3_window": ("fa3", True, (W, 0), 0.0)}
    impls = [n for n in WIN_IMPLS if fa3 is not None or not n.startswith("fa3")]
    pairs = [("flash3_causal", "fa3_causal"), ("flash3_window", "fa3_window")]
    for pss in ("fwd", "bwd"):
        for d in a.hdims:
            b, h = 1, max(1, HIDDEN // d)
            key = f"{pss}/{d}"
            rec = recs.setdefault(key, new_rec(
                {"pass": pss, "hdim": d, "seqlen": s, "batch": b, "nheads": h, "window": W,
                 "visible_pairs": {"causal": causal_pairs, "window": window_pairs},
                 "area_ratio": window_pairs / causal_pairs}, impls, a.runs))
            run_point(torch, flash3, fa3, a, rec, run, pss, 7919 * d + (pss == "bwd"), (b, s, h, d),
                      {n: masks[n] for n in impls}, pairs)
            window_rows_finish(rec)
            ms = " ".join(f"{n} {fmt(rec['ms_runs'][n][run], '.3f')}" for n in impls)
            log(f"[run {run + 1}/{a.runs} {time.time() - t0:5.0f}s] window {pss} d{d}: {ms} ms; "
                f"f3 (win/causal)/area {fmt(rec['ratios']['flash3_win_over_causal_over_area']['runs'][run], '.3f')}, "
                f"FA3/f3 window {fmt(rec['ratios']['fa3_over_flash3_window']['runs'][run], '.3f')}"
                + (f"  {' '.join(flags(rec))}" if flags(rec) else "")
                + "".join(f"\n      {n} failed: {m[:200]}" for n, m in rec["errors"].items()))


def softcap_part(torch, flash3, fa3, a, run, recs, t0):
    cap = a.softcap
    impls = [n for n in SC_IMPLS if fa3 is not None or not n.startswith("fa3")]
    pairs = [("flash3", "fa3"), ("flash3_softcap", "fa3_softcap")]
    for d in a.hdims:
        for causal in (False, True):
            masks = {"flash3": ("flash3", causal, (-1, -1), 0.0), "flash3_softcap": ("flash3", causal, (-1, -1), cap),
                     "fa3": ("fa3", causal, (-1, -1), 0.0), "fa3_softcap": ("fa3", causal, (-1, -1), cap)}
            for s in a.softcap_seqlens:
                b, h = max(1, TOKENS // s), max(1, HIDDEN // d)
                key = f"{d}/{int(causal)}/{s}"
                rec = recs.setdefault(key, new_rec(
                    {"hdim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h, "softcap": cap},
                    impls, a.runs))
                run_point(torch, flash3, fa3, a, rec, run, "fwd", 1_000_003 * d + 1009 * s + int(causal),
                          (b, s, h, d), {n: masks[n] for n in impls}, pairs,
                          cap_pairs=[("flash3_softcap", "flash3")], check_qscale=SOFTCAP_QSCALE)
                softcap_rows_finish(rec)
                ms = " ".join(f"{n} {fmt(rec['ms_runs'][n][run], '.3f')}" for n in impls)
                log(f"[run {run + 1}/{a.runs} {time.time() - t0:5.0f}s] softcap d{d} causal {int(causal)} s{s}: "
                    f"{ms} ms; f3 cost {fmt(rec['ratios']['flash3_softcap_cost']['runs'][run], '.3f')}"
                    + (f"  {' '.join(flags(rec))}" if flags(rec) else "")
                    + "".join(f"\n      {n} failed: {m[:200]}" for n, m in rec["errors"].items()))


def main(argv=None):
    a = parse_args(argv)
    if a.report:
        with open(a.report) as f:
            report(json.load(f))
        return 0
    torch = hopper_torch("bench_mask")
    if torch is None:
        return 2
    sys.path.insert(0, os.path.join(HERE, "..", "python"))
    import flash3
    tmp = tempfile.mkdtemp(prefix="bench_mask_")
    try:
        fa3, fa3_info = load_fa3_or_none(torch, a.fa3, tmp)
    finally:
        shutil.rmtree(tmp, True)  # a loaded library stays mapped once unlinked
    f3 = flash3_info(flash3)
    log(f"device: {torch.cuda.get_device_name()}; torch {torch.__version__}; flash3 {f3['version']} "
        f"from {f3['lib']} (sha256 {str(f3['sha256'])[:12]})")
    if fa3 is None:
        log(f"FA3: not loaded ({a.fa3!r} missing or 'none'): flash3 alone, no FA3 ratios and no checks")
    else:
        log(f"FA3: {fa3_info['path']} (sha256 {fa3_info['sha256'][:12]})")
        log(f"FA3 fwd schema: {fa3_info['fwd_schema']}")
        log(f"FA3 bwd schema: {fa3_info['bwd_schema']}")
    opts = {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(a).items()}
    data = {
        "what": "flash3 beside FlashAttention-3, sliding window and softcap, bf16, one process, round robin",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "flash3": f3, "fa3": fa3_info, "options": opts,
        "targets": {"window_over_causal_over_area_max": AREA_TARGET, "fa3_over_flash3_window_min": FA3_TARGET,
                    "softcap_cost_max": SOFTCAP_TARGET, "softcap_cost_hdim": SOFTCAP_HDIM},
        "definitions": {
            "ms_runs": "per run, the median of the reps' CUDA-event times (ms)",
            "ms": "median over runs of ms_runs",
            "ratios": "per-run ratios of ms_runs: runs, median, min, max",
            "area_ratio": "visible (i, j) pairs of the window mask / of the causal mask",
            "tflops_visible": "4 b h d x visible pairs (x2.5 backward) / median time",
            "check": f"relative norm difference to FA3's result (bwd: max of dq, dk, dv); mismatch above {MISMATCH} "
                     "or on NaN; cap_effect: flash3 softcap vs plain output",
        },
        "spin_cycles": SPIN_CYCLES,
    }
    win, sc = {}, {}

    def save():
        if "window" not in a.skip:
            data["window"] = {"rows": list(win.values())}
        if "softcap" not in a.skip:
            data["softcap"] = {"rows": list(sc.values())}
        data["summary"] = {k: v for k, v in summarize(data).items()}
        if a.json:
            os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
            with open(a.json + ".tmp", "w") as f:
                json.dump(data, f, indent=1)
            os.replace(a.json + ".tmp", a.json)

    t0 = time.time()
    for run in range(a.runs):
        t_run = time.time()
        if "window" not in a.skip:
            window_part(torch, flash3, fa3, a, run, win, t0)
        if "softcap" not in a.skip:
            softcap_part(torch, flash3, fa3, a, run, sc, t0)
        save()
        dt = time.time() - t_run
        log(f"[run {run + 1}/{a.runs} took {dt:.0f}s; about {dt * (a.runs - run - 1):.0f}s more]")
    log("")
    report(data)
    if a.json:
        log(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

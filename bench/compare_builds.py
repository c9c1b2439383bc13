#!/usr/bin/env python3
"""Several flash3 builds, FlashAttention-3 and (optionally) cuDNN timed in one process, round robin, on the paper's sweep.

    python3 bench/compare_builds.py --build old=.old/python:.old/libflash3.so \\
        --build new=python:build/libflash3.so [--fa3 /tmp/fa3_anchor.so] [--cudnn] \\
        [--pass fwd|bwd|both] [--hdims 64,128,256] [--seqlens 512,...] [--causal 0|1|both] \\
        [--reps 10] [--runs 3] [--warmup 3] [--quick] [--fp8] [--gqa [--heads 32:4,64:8]
        [--batches 8,4,1]] [--window LEFT] [--softcap C] [--varlen [--docs]] [--json out.json]
    python3 bench/compare_builds.py --report out.json      # the table and summary again, no GPU

Builds: each --build NAME=PKG_DIR:LIB gives a folder holding the `flash3` package (or the package
folder itself) and its libflash3.so (a .so.xz is unpacked first). Each library is copied to its
own file in a temporary folder (two libraries from distinct files are two independent libraries),
and each package is imported under its own module name (flash3_build_NAME) with $FLASH3_LIB
naming that copy until the package has loaded it (flash3's _lib reads $FLASH3_LIB at the first
call that needs the library, so the script makes that call, hopper_available(), right then); the
script then checks in /proc/self/maps that the copy is mapped. Only the public API that every
build has is called: flash_attn_func(q, k, v, causal=...) (its autograd for the backward),
hopper_available(), version(). The first build is the baseline ("old") of the rule below.
FA3: --fa3 PATH (the unpacked fa3_anchor.so, or its .xz) loads with torch.ops.load_library;
forward fa3.fwd(q, k, v, is_causal=...), backward fa3.bwd(dout, q, k, v, out, lse, dq, dk, dv,
is_causal=...) into preallocated dq, dk, dv. --cudnn: torch SDPA's cuDNN backend, autograd.

Sweep (bench/timing.py): bf16, head dims 64/128/256, causal and not, seqlens 512..16k, batch x
seqlen = 16k tokens, hidden 2048 (nheads = 2048 / hdim). FLOPs = 4 b h s^2 d, halved for causal;
the backward counts 2.5x that.
--gqa: the shapes users run most instead: GQA 8:1 (--heads Q:KV pairs, default 32:4 and 64:8),
head dim 128 (--hdims), seqlens 2k, 8k, 32k (--seqlens), batch min(8, 32k / seqlen) (or each of
--batches); h in the FLOPs is the query heads. cuDNN runs with SDPA's enable_gqa. Every implementation gets the same inputs (one seed per point, the
same in every run).
--window LEFT, --softcap C: every call with the sliding window (LEFT, 0) (causal; non-causal (LEFT,
-1)) and / or softcap C (flash_attn_func's window_size, softcap; FA3's window_size_left/right,
softcap); the FLOPs stay the unwindowed formula's, so the ratios are what compare.
--varlen: every call as a variable-length call on the same tokens: the batch's b sequences of
seqlen tokens packed (total, h, d) with cu_seqlens of equal steps (flash_attn_varlen_func; FA3's
fwd / bwd with cu_seqlens_q/k, max_seqlen_q/k), so that builds compare on the varlen kernels.
--docs (with --varlen): the b x seqlen tokens as documents of log-uniform lengths in [64, 8192]
(bench_varlen.py's packed batch, timing.doc_lengths) instead of b equal sequences; the FLOPs stay
the b equal sequences' formula, so the ratios are what compare.
  Forward: one forward call is timed (inputs without requires_grad).
  Backward: the backward only, as bench_torch.py --pass bwd: one forward per implementation
  outside the timed region, then torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
  per timed call (FA3: one fa3.bwd call).
Correctness, before timing, in the first run: each output (forward) or dq, dk, dv (backward, the
largest of the three) against FA3's (else the baseline build's): relative norm difference
|x - ref| / |ref|; above 1e-2 (5e-2 with --fp8: two e4m3 kernels differ by about 1% at
non-causal points, where the output is an average over many keys), or any NaN, the point is flagged MISMATCH. Each build is also
compared with the baseline build (JSON).

Timing: each call between two CUDA events after a spin kernel (timing.py). At each point of a
run: --warmup untimed calls of each implementation, then --reps repetitions, each of which times
every implementation once, in an order rotated by one at each repetition (round robin: clock or
temperature drifts reach every implementation alike). The whole sweep is run --runs times in the
same process (forward runs first, then backward runs).

Definitions (per point, per implementation X):
  run value        X_r = TFLOP/s of the median time of X's --reps calls in run r
  median, range    median over runs of X_r; min..max over runs
  spread(X)        (max_r X_r - min_r X_r) / median_r X_r, the run-to-run relative spread
  X/Y              the per-run ratios X_r / Y_r: their median over runs [min..max]
Rule (issue 40, "What must not change"), for each build B against the baseline A at each point:
  spread = max(spread(A), spread(B)),  ok  iff  median_r(B_r / A_r) >= 1 - max(0.01, spread)
i.e. no point slower by more than 1% or by that point's own run-to-run spread, whichever is larger.
Summary per pass: points failing the rule, geomean of B/A (of the per-point medians), geomean of
each build / FA3 (and / cuDNN).

JSON (--json; written after every run, so a cut-off run still leaves its data): the builds (package,
library, sha256, version), FA3's library, device and versions, options, the definitions above,
and per pass {"rows": [...], "summary": {...}, "geomean": {...}}; a row holds the raw times
(times_ms[impl][run] = the --reps times), the per-run medians, the statistics, ratios, the rule's
verdict per build, the checks and errors, and flat "<impl>_tflops" keys (medians) with the
top-level "series" so that bench/plot.py draws it (--pass fwd|bwd).
"""
import argparse
import atexit
import datetime
import importlib.util
import itertools
import json
import lzma
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

from timing import (sha256, BWD_FLOPS_FACTOR, DEFAULT_HDIMS, DEFAULT_SEQLENS, MISMATCH, SPIN_CYCLES,
                    doc_lengths, first_line, fmt, gemm_tflops, geomean, ints, log, rel_diff, sdpa, spin_kernel,
                    sweep_points, tflops, load_fa3, round_robin, hopper_torch, rng)

PASSES = ("fwd", "bwd")
FLOOR = 0.01  # the rule's smallest allowed slowdown
FA3, CUDNN = "fa3", "cudnn"
RESERVED = {FA3, CUDNN}


# ---- arguments ---------------------------------------------------------------------------------

def parse_build(spec):
    """NAME=PKG_DIR:LIB -> (name, pkg_dir, lib)."""
    name, eq, rest = spec.partition("=")
    pkg, colon, lib = rest.rpartition(":")
    if not (eq and colon and name and pkg and lib):
        raise argparse.ArgumentTypeError(f"--build {spec!r}: expected NAME=PYTHON_PKG_DIR:LIB_PATH")
    if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name) or name in RESERVED:
        raise argparse.ArgumentTypeError(f"--build {spec!r}: NAME must be an identifier other than "
                                         f"{sorted(RESERVED)}")
    return name, pkg, lib


GQA_HDIMS, GQA_SEQLENS, GQA_TOKENS = (128,), (2048, 8192, 32768), 32768


def parse_heads(spec):
    """'32:4,64:8' -> [(32, 4), (64, 8)]: query heads a multiple of the kv heads."""
    out = []
    for item in spec.split(","):
        h, colon, hkv = item.partition(":")
        if not colon or not h.isdigit() or not hkv.isdigit() or int(hkv) < 1 or int(h) % int(hkv):
            raise ValueError(f"expected Q:KV pairs with Q a multiple of KV >= 1, got {item!r}")
        out.append((int(h), int(hkv)))
    return out


def gqa_points(hdims, causals, seqlens, heads, batches, factor=1):
    """(hdim, causal, seqlen, batch, nheads, nheads_kv, FLOPs) of each GQA point: every head pair,
    batch min(8, GQA_TOKENS / seqlen) or each of batches; FLOPs = factor x 4 b h s^2 d (h the
    query heads), halved for causal."""
    for d in hdims:
        for causal in causals:
            for s in seqlens:
                for b in batches or [max(1, min(8, GQA_TOKENS // s))]:
                    for h, hkv in heads:
                        yield d, causal, s, b, h, hkv, factor * 4 * b * h * s * s * d / (2 if causal else 1)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring for the definitions and the rule.")
    p.add_argument("--build", type=parse_build, action="append", default=[], metavar="NAME=PKG_DIR:LIB",
                   help="a flash3 build (repeat; the first is the baseline)")
    p.add_argument("--fa3", metavar="PATH", help="FlashAttention-3's fa3_anchor.so (or .so.xz)")
    p.add_argument("--cudnn", action="store_true", help="also time cuDNN (torch SDPA)")
    p.add_argument("--pass", dest="pss", choices=["fwd", "bwd", "both"], default="both")
    p.add_argument("--hdims", type=ints, default=None, help="default 64,128,256 (--gqa: 128)")
    p.add_argument("--seqlens", type=ints, default=None, help="default 512..16k (--gqa: 2k,8k,32k)")
    p.add_argument("--causal", choices=["0", "1", "both"], default="both")
    p.add_argument("--reps", type=int, default=10, help="timed repetitions per point per run (default 10)")
    p.add_argument("--bwd-reps", type=int, default=None, help="the same for the backward (default --reps)")
    p.add_argument("--runs", type=int, default=3, help="sweeps in this process (default 3)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--spin", type=int, default=None, metavar="CYCLES",
                   help="spin kernel before each timed call (default 200k fwd, 1M bwd)")
    p.add_argument("--quick", action="store_true", help="seqlens 1k,4k only")
    p.add_argument("--gqa", action="store_true", help="GQA shapes (see the docstring) instead of the paper's sweep")
    p.add_argument("--heads", default="32:4,64:8", help="--gqa: query:kv head pairs")
    p.add_argument("--batches", type=ints, default=None, help="--gqa: batch sizes (default min(8, 32k / seqlen))")
    p.add_argument("--fp8", action="store_true",
                   help="forward in e4m3 (inputs cast from the bf16 ones) with unit (batch, kv head) descales")
    p.add_argument("--window", type=int, default=-1, metavar="LEFT", help="sliding window (LEFT, 0); -1: none")
    p.add_argument("--softcap", type=float, default=0.0, metavar="C", help="softcap C (0: none)")
    p.add_argument("--varlen", action="store_true", help="variable-length calls on the same tokens (equal lengths)")
    p.add_argument("--docs", action="store_true", help="--varlen: log-uniform document lengths instead of equal ones")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--report", metavar="JSON", help="print the table and summary of a written JSON and exit")
    a = p.parse_args(argv)
    if a.hdims is None:
        a.hdims = list(GQA_HDIMS if a.gqa else DEFAULT_HDIMS)
    if a.seqlens is None:
        a.seqlens = list(GQA_SEQLENS if a.gqa else DEFAULT_SEQLENS)
    if a.quick:
        a.seqlens = [1024, 4096]
    try:
        a.heads = parse_heads(a.heads)
    except ValueError as e:
        p.error(f"--heads {a.heads!r}: {e}")
    if a.bwd_reps is None:
        a.bwd_reps = a.reps
    if not a.report:
        if not a.build:
            p.error("at least one --build is needed")
        names = [b[0] for b in a.build]
        if len(set(names)) != len(names):
            p.error(f"--build names must differ: {names}")
        if a.runs < 1 or a.reps < 1 or a.bwd_reps < 1:
            p.error("--runs, --reps and --bwd-reps must be at least 1")
        if a.fp8 and a.pss != "fwd":
            p.error("--fp8 times the forward only: add --pass fwd")
        if a.fp8 and (a.window >= 0 or a.softcap or a.varlen):
            p.error("--window, --softcap and --varlen are for bf16 (not --fp8)")
        if a.docs and not a.varlen:
            p.error("--docs is for --varlen calls")
    return a


# ---- statistics (no torch) ---------------------------------------------------------------------

def present(xs):
    return [x for x in xs if x is not None]


def value_stats(runs):
    """{runs, median, min, max, spread} of per-run values (None: that run has none)."""
    xs = present(runs)
    if not xs:
        return {"runs": list(runs), "median": None, "min": None, "max": None, "spread": None}
    med = statistics.median(xs)
    return {"runs": list(runs), "median": med, "min": min(xs), "max": max(xs),
            "spread": (max(xs) - min(xs)) / med if med else None}


def ratio_stats(xs, ys):
    """Per-run ratios x_r / y_r (runs where both exist): {runs, median, min, max, of_medians}."""
    rs = [x / y if x is not None and y else None for x, y in zip(xs, ys)]
    st = value_stats(rs)
    mx, my = value_stats(xs)["median"], value_stats(ys)["median"]
    return {"runs": rs, "median": st["median"], "min": st["min"], "max": st["max"],
            "of_medians": mx / my if mx is not None and my else None}


def rule_verdict(ratio, spread_base, spread_build, floor=FLOOR):
    """The rule: ok iff ratio >= 1 - max(floor, max(spread_base, spread_build))."""
    spreads = present([spread_base, spread_build])
    spread = max(spreads) if spreads else None
    allowed = max(floor, spread or 0.0)
    return {"ratio": ratio, "spread": spread, "allowed_slowdown": allowed, "threshold": 1 - allowed,
            "ok": None if ratio is None else ratio >= 1 - allowed}


def ratio_keys(builds, have_fa3, have_cudnn):
    """(key, numerator, denominator) of every ratio reported: each build over the baseline, each
    build over FA3 and over cuDNN, FA3 over cuDNN."""
    base = builds[0]
    keys = [(f"{b}/{base}", b, base) for b in builds[1:]]
    if have_fa3:
        keys += [(f"{b}/{FA3}", b, FA3) for b in builds]
    if have_cudnn:
        keys += [(f"{b}/{CUDNN}", b, CUDNN) for b in builds]
        if have_fa3:
            keys.append((f"{FA3}/{CUDNN}", FA3, CUDNN))
    return keys


def point_row(meta, ms_runs, builds, have_fa3, have_cudnn):
    """The statistics of one point from its per-run median times: ms_runs[impl] = [ms or None per
    run]. meta holds pass, hdim, causal, seqlen, batch, nheads, flops (and is copied)."""
    row = dict(meta)
    flops = meta["flops"]
    tf_runs = {n: [tflops(flops, ms) if ms else None for ms in runs] for n, runs in ms_runs.items()}
    row["ms_runs"] = {n: list(r) for n, r in ms_runs.items()}
    row["tflops"] = {n: value_stats(r) for n, r in tf_runs.items()}
    for n, st in row["tflops"].items():
        row[f"{n}_tflops"] = st["median"]  # flat, for bench/plot.py
    empty = [None] * max((len(r) for r in tf_runs.values()), default=0)
    row["ratios"] = {key: ratio_stats(tf_runs.get(x, empty), tf_runs.get(y, empty))
                     for key, x, y in ratio_keys(builds, have_fa3, have_cudnn)}
    base = builds[0]
    row["rule"] = {b: rule_verdict(row["ratios"][f"{b}/{base}"]["median"],
                                   row["tflops"].get(base, {}).get("spread"),
                                   row["tflops"].get(b, {}).get("spread"))
                   for b in builds[1:]}
    return row


def pass_summary(rows, builds, have_fa3, have_cudnn):
    """Per pass: points failing the rule (and without a verdict), geomeans of the median ratios,
    mismatches and errors."""
    base = builds[0]
    s = {"points": len(rows), "rule": {}, "geomean": {}, "mismatch_points": [], "error_points": []}
    for b in builds[1:]:
        fails = [point_label(r) for r in rows if r["rule"][b]["ok"] is False]
        unknown = [point_label(r) for r in rows if r["rule"][b]["ok"] is None]
        worst = min((r for r in rows if r["ratios"][f"{b}/{base}"]["median"] is not None),
                    key=lambda r: r["ratios"][f"{b}/{base}"]["median"], default=None)
        s["rule"][b] = {"failing": len(fails), "failing_points": fails, "no_verdict": unknown,
                        "worst": None if worst is None else
                        {"point": point_label(worst), "ratio": worst["ratios"][f"{b}/{base}"]["median"]}}
    for key, _, _ in ratio_keys(builds, have_fa3, have_cudnn):
        s["geomean"][key] = geomean(r["ratios"][key]["median"] for r in rows)
    s["mismatch_points"] = [point_label(r) + ": " + ",".join(r["mismatch"]) for r in rows if r.get("mismatch")]
    s["error_points"] = [point_label(r) + ": " + ",".join(sorted(r["errors"])) for r in rows if r.get("errors")]
    return s


def point_label(r):
    gqa = f" b{r['batch']} h{r['nheads']}:{r['nheads_kv']}" if r.get("nheads_kv", r["nheads"]) != r["nheads"] else ""
    return f"{r['pass']} d{r['hdim']} {'causal' if r['causal'] else 'noncausal'} s{r['seqlen']}{gqa}"


# ---- report (no torch) -------------------------------------------------------------------------

def table_lines(rows, builds, have_fa3, have_cudnn):
    """The compact table: pass, hdim, causal, seqlen | TFLOP/s medians | B/base [range] | build/FA3
    (range for the non-baseline builds) | spread | verdict and flags."""
    base = builds[0]
    impls = list(builds) + ([FA3] if have_fa3 else []) + ([CUDNN] if have_cudnn else [])
    W = 19  # 'm.mmm [l.lll-h.hhh]'
    cols = [(f"{b}/{base}", W) for b in builds[1:]]
    if have_fa3:
        cols += [(f"{b}/{FA3}", W if b != base or len(builds) == 1 else 7) for b in builds[1:] + [base]]
    if have_cudnn:
        cols += [(f"{b}/{CUDNN}", 7) for b in builds]
    gqa = any(r.get("nheads_kv", r["nheads"]) != r["nheads"] for r in rows)
    shape = (lambda r: f" {r['batch']:>5} {str(r['nheads']) + ':' + str(r['nheads_kv']):>5}") if gqa else (lambda r: "")
    hdr = (f"{'pass':4} {'hdim':>4} {'causal':>6} {'seqlen':>6}" + (f" {'batch':>5} {'heads':>5}" if gqa else "")
           + " | " + " ".join(f"{n:>7}" for n in impls)
           + " | " + " ".join(f"{k:>{w}}" for k, w in cols) + f" | {'spread':>6} | verdict")
    out = [hdr, "-" * len(hdr)]
    for r in rows:
        cells = []
        for k, w in cols:
            st = r["ratios"].get(k)
            cells.append(f"{rng(st) if w == W else fmt(st and st.get('median'), '7.3f'):>{w}}")
        verdicts = []
        for b in builds[1:]:
            ok = r["rule"][b]["ok"]
            v = "ok" if ok else ("SLOWER" if ok is False else "n/a")
            verdicts.append(v if len(builds) == 2 else f"{b}:{v}")
        spreads = present([r["rule"][b]["spread"] for b in builds[1:]])
        if len(builds) == 1 and have_fa3:  # one build: the run-to-run spread of its ratio to FA3
            spreads = present([value_stats((r["ratios"].get(f"{base}/{FA3}") or {}).get("runs", []))["spread"]])
        flags = [f"MISMATCH({','.join(r['mismatch'])})"] if r.get("mismatch") else []
        flags += [f"ERROR({','.join(sorted(r['errors']))})"] if r.get("errors") else []
        out.append(f"{r['pass']:4} {r['hdim']:>4} {int(bool(r['causal'])):>6} {r['seqlen']:>6}{shape(r)} | "
                   + " ".join(fmt(r["tflops"].get(n, {}).get("median"), "7.1f") for n in impls) + " | "
                   + " ".join(cells) + f" | {fmt(max(spreads) if spreads else None, '6.3f')} | "
                   + " ".join(verdicts + flags))
    return out


def summary_lines(pss, s, builds):
    base = builds[0]
    out = [f"summary {pss}: {s['points']} points"]
    for b in builds[1:]:
        r = s["rule"][b]
        worst = r["worst"]
        out.append(f"  {b}/{base}: {r['failing']} point(s) failing the rule"
                   + (f" ({'; '.join(r['failing_points'])})" if r["failing_points"] else "")
                   + (f", {len(r['no_verdict'])} without a verdict" if r["no_verdict"] else "")
                   + f"; geomean {fmt(s['geomean'].get(f'{b}/{base}'), '.4f')}"
                   + (f"; worst {worst['ratio']:.4f} at {worst['point']}" if worst else ""))
    others = [f"{k} {fmt(v, '.4f')}" for k, v in s["geomean"].items() if not k.endswith(f"/{base}")
              or k.startswith(f"{base}/")]
    if others:
        out.append("  geomean " + ", ".join(others))
    if s["mismatch_points"]:
        out.append(f"  MISMATCH at {len(s['mismatch_points'])} point(s): " + "; ".join(s["mismatch_points"]))
    if s["error_points"]:
        out.append(f"  errors at {len(s['error_points'])} point(s): " + "; ".join(s["error_points"]))
    return out


def report(data):
    """Prints each pass's table and summary from the JSON's data."""
    builds = [b["name"] for b in data["builds"]]
    have_fa3, have_cudnn = bool(data.get("fa3")), bool(data.get("cudnn"))
    for pss in PASSES:
        sec = data.get(pss)
        if not sec or not sec.get("rows"):
            continue
        log("")
        for line in table_lines(sec["rows"], builds, have_fa3, have_cudnn):
            log(line)
    for pss in PASSES:
        sec = data.get(pss)
        if sec and sec.get("rows"):
            for line in summary_lines(pss, sec["summary"], builds):
                log(line)


def plot_series(builds, have_fa3, have_cudnn):
    """[label, row key] of each bar series, for bench/plot.py."""
    out = [[b, f"{b}_tflops"] for b in builds]
    if have_fa3:
        out.append(["FlashAttention-3", f"{FA3}_tflops"])
    if have_cudnn:
        out.append(["cuDNN", f"{CUDNN}_tflops"])
    return out


# ---- loading -----------------------------------------------------------------------------------

def copy_or_unpack(src, dst):
    """Copies src to dst, unpacking it first when it ends in .xz."""
    if src.endswith(".xz"):
        with lzma.open(src) as f, open(dst, "wb") as g:
            shutil.copyfileobj(f, g)
    else:
        shutil.copyfile(src, dst)
    return dst


def mapped_files():
    """The files mapped into this process (/proc/self/maps), real paths."""
    try:
        with open("/proc/self/maps") as f:
            return {line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6}
    except OSError:
        return set()


def load_build(name, pkg_dir, lib, tmp):
    """Imports PKG_DIR's flash3 package as flash3_build_NAME with its own copy of lib; returns
    (module, info). Raises RuntimeError when the build does not load or loads another library."""
    pkg = pkg_dir if os.path.isfile(os.path.join(pkg_dir, "__init__.py")) else os.path.join(pkg_dir, "flash3")
    init = os.path.join(pkg, "__init__.py")
    if not os.path.isfile(init):
        raise RuntimeError(f"build {name}: no flash3 package at {pkg_dir}")
    if not os.path.isfile(lib):
        raise RuntimeError(f"build {name}: no library at {lib}")
    copy = os.path.realpath(copy_or_unpack(lib, os.path.join(tmp, f"libflash3_{name}.so")))
    modname = f"flash3_build_{name}"
    spec = importlib.util.spec_from_file_location(modname, init, submodule_search_locations=[pkg])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod  # the package's relative imports (from . import _lib) find it here
    saved = os.environ.get("FLASH3_LIB")
    os.environ["FLASH3_LIB"] = copy
    try:
        spec.loader.exec_module(mod)
        # the library is loaded at the first call that needs it: make that call now, while
        # $FLASH3_LIB names this build's copy
        probe = getattr(mod, "hopper_available", None)
        if probe is not None:
            ok, why = probe()
        else:
            mod._lib.lib()
            ok, why = True, ""
    finally:
        if saved is None:
            os.environ.pop("FLASH3_LIB", None)
        else:
            os.environ["FLASH3_LIB"] = saved
    if not ok:
        raise RuntimeError(f"build {name}: not usable: {why}")
    if copy not in mapped_files():
        raise RuntimeError(f"build {name}: {copy} is not mapped after loading: the package loaded "
                           "another library")
    version = mod.version() if hasattr(mod, "version") else None
    info = {"name": name, "package": os.path.abspath(pkg), "lib": os.path.abspath(lib),
            "lib_sha256": sha256(copy), "lib_copy": copy, "module": modname, "version": version}
    return mod, info


# ---- implementations ---------------------------------------------------------------------------

def first(r):
    return r[0] if isinstance(r, (tuple, list)) else r


class Impl:
    """fwd(q, k, v, causal) -> out; bwd(q, k, v, dout, causal) -> call, which runs one backward
    and returns (dq, dk, dv) (the forward done once, outside)."""

    def __init__(self, name, fwd, bwd):
        self.name, self.fwd, self.bwd = name, fwd, bwd


def autograd_impl(torch, name, fwd):
    def bwd(q, k, v, dout, causal):
        out = fwd(q, k, v, causal)
        return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
    return Impl(name, fwd, bwd)


_DESCALES = {}


def unit_descale(torch, q, k):
    """Unit (batch, kv head) descales, made once per shape (no fill kernel in a timed call)."""
    key = (q.shape[0], k.shape[2])
    if key not in _DESCALES:
        _DESCALES[key] = torch.ones(*key, device=q.device, dtype=torch.float32)
    return _DESCALES[key]


def mask_kwargs(window, softcap, causal, fa3):
    """The keyword arguments of --window and --softcap for flash3's flash_attn_func or FA3's fwd/bwd."""
    kw = {}
    if window >= 0:
        right = 0 if causal else -1
        kw.update({"window_size_left": window, "window_size_right": right} if fa3 else {"window_size": (window, right)})
    if softcap:
        kw["softcap"] = softcap
    return kw


_CU_SEQLENS = {}


def packed(torch, q, k, v, docs=False):
    """--varlen: q, k, v (b, s, h, d) as packed (b s, h, d) views and the keyword arguments of the
    varlen call (equal lengths s, or with docs timing.doc_lengths(b s); cu_seqlens made once per
    shape)."""
    b, s = q.shape[:2]
    key = (b, s, q.device, docs)
    if key not in _CU_SEQLENS:
        lens = doc_lengths(b * s) if docs else [s] * b
        cu = torch.tensor([0] + list(itertools.accumulate(lens)), device=q.device, dtype=torch.int32)
        _CU_SEQLENS[key] = (cu, max(lens))
    cu, m = _CU_SEQLENS[key]
    names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
    kw = dict(zip(names, (cu, cu, m, m)))
    return [t.reshape(b * s, *t.shape[2:]) for t in (q, k, v)], kw


def flash3_impl(torch, name, mod, fp8=False, window=-1, softcap=0.0, varlen=False, docs=False):
    if fp8:
        def fwd8(q, k, v, causal):
            d = unit_descale(torch, q, k)
            return first(mod.flash_attn_func(q, k, v, causal=causal, q_descale=d, k_descale=d, v_descale=d))
        return Impl(name, fwd8, None)

    def fwd(q, k, v, causal):
        mask = mask_kwargs(window, softcap, causal, False)
        if not varlen:
            return first(mod.flash_attn_func(q, k, v, causal=causal, **mask))
        qkv, kw = packed(torch, q, k, v, docs)
        return first(mod.flash_attn_varlen_func(*qkv, **kw, causal=causal, **mask)).view(q.shape)
    return autograd_impl(torch, name, fwd)


def fa3_impl(torch, fa3, fp8=False, window=-1, softcap=0.0, varlen=False, docs=False):
    def args(q, k, v, causal):
        """The q, k, v and keyword arguments of FA3's fwd / bwd."""
        kw = mask_kwargs(window, softcap, causal, True)
        if not varlen:
            return (q, k, v), kw
        qkv, vkw = packed(torch, q, k, v, docs)
        return qkv, {**kw, **vkw}

    def fwd(q, k, v, causal):
        if fp8:
            d = unit_descale(torch, q, k)
            return fa3.fwd(q, k, v, q_descale=d, k_descale=d, v_descale=d, is_causal=causal)[0]
        qkv, kw = args(q, k, v, causal)
        return fa3.fwd(*qkv, is_causal=causal, **kw)[0].view(q.shape)

    def bwd(q, k, v, dout, causal):
        shapes = [t.shape for t in (q, k, v)]
        (q, k, v), kw = args(q.detach(), k.detach(), v.detach(), causal)
        dout = dout.reshape(q.shape)
        out, lse = fa3.fwd(q, k, v, is_causal=causal, **kw)[:2]
        dq, dk, dv = (t.new_empty(t.shape) for t in (q, k, v))
        grads = tuple(g.view(shape) for g, shape in zip((dq, dk, dv), shapes))  # the callers' shapes

        def call():
            fa3.bwd(dout, q, k, v, out, lse, dq, dk, dv, is_causal=causal, **kw)
            return grads
        return call
    return Impl(FA3, fwd, bwd)


# ---- the sweep ---------------------------------------------------------------------------------

def point_seed(hdim, causal, seqlen, batch=0, nheads=0):
    return 1_000_003 * hdim + 1009 * seqlen + int(causal) + 7919 * batch + 104_729 * nheads


MISMATCH_FP8 = 5e-2


def check_point(torch, pss, results, builds, ref, limit=MISMATCH):
    """{impl: {vs, rel_err[, grads], nan}} for each result against ref's, and each build against
    the baseline's; results[impl] = out (fwd) or (dq, dk, dv) (bwd)."""
    def diff(got, want):
        if pss == "fwd":
            return rel_diff(got, want), None
        g = {n: rel_diff(x, y) for n, x, y in zip(("dq", "dk", "dv"), got, want)}
        return max(g.values()), g

    def has_nan(x):
        xs = [x] if pss == "fwd" else list(x)
        return any(bool(torch.isnan(t).any().item()) for t in xs)

    if ref not in results:  # FA3 failed here: the baseline build is the reference
        ref = builds[0]
    check, mismatch = {}, []
    for name, x in results.items():
        c = {"nan": has_nan(x)}
        if ref in results and name != ref:
            c["vs"] = ref
            c["rel_err"], grads = diff(x, results[ref])
            if grads:
                c["grad_rel_err"] = grads
        if name in builds[1:] and builds[0] in results and ref != builds[0]:
            c["vs_baseline_rel_err"], _ = diff(x, results[builds[0]])
        if c["nan"] or (c.get("rel_err") or 0) > limit:
            mismatch.append(name)
        check[name] = c
    return check, mismatch


def setup_point(torch, dev, pss, impls, d, causal, s, b, h, hkv, want_results, fp8=False):
    """Inputs of one point (k, v with hkv heads), a call per implementation (already run once)
    and, when want_results, each one's result of that call (out, or dq, dk, dv). fp8: q, k, v
    cast to e4m3."""
    g = torch.Generator(device=dev)
    g.manual_seed(point_seed(d, causal, s) if hkv == h else point_seed(d, causal, s, b, h))
    n = 3 if pss == "fwd" else 4
    ts = [torch.randn(b, s, hkv if i in (1, 2) else h, d, device=dev, dtype=torch.bfloat16, generator=g)
          for i in range(n)]
    calls, results, errors = {}, {}, {}
    if pss == "fwd":
        q, k, v = (t.to(torch.float8_e4m3fn) for t in ts) if fp8 else ts

        def make(impl):
            return lambda: impl.fwd(q, k, v, causal)
    else:
        q, k, v, dout = ts
        for t in (q, k, v):
            t.requires_grad_()

        def make(impl):
            return impl.bwd(q, k, v, dout, causal)
    for name, impl in impls.items():
        try:
            call = make(impl)
            r = call()
            calls[name] = call
            if want_results:
                results[name] = r
        except Exception as e:  # noqa: BLE001
            errors[name] = first_line(e)
    torch.cuda.synchronize()
    return calls, results, errors


def run_sweep(a, torch, dev, impls, builds, have_fa3, have_cudnn, data, save):
    causals = {"0": [False], "1": [True], "both": [False, True]}[a.causal]
    passes = PASSES if a.pss == "both" else (a.pss,)
    ref = FA3 if have_fa3 else builds[0]
    t_start = time.time()
    for pss in passes:
        factor = 1 if pss == "fwd" else BWD_FLOPS_FACTOR
        reps = a.reps if pss == "fwd" else a.bwd_reps
        spin = a.spin if a.spin is not None else SPIN_CYCLES[pss]
        if a.gqa:
            points = list(gqa_points(a.hdims, causals, a.seqlens, a.heads, a.batches, factor))
        else:
            points = [(d, c, s, b, h, h, f) for d, c, s, b, h, f in sweep_points(a.hdims, causals, a.seqlens, factor)]
        raw = {}
        log(f"\n== {pss}: {len(points)} points x {a.runs} runs x {len(impls)} implementations "
            f"({', '.join(impls)}), {a.warmup} warm-ups + {reps} round-robin reps each, spin {spin} cycles")
        for run in range(a.runs):
            t_run = time.time()
            for i, (d, causal, s, b, h, hkv, flops) in enumerate(points):
                key = (d, causal, s, b, h, hkv)
                rec = raw.setdefault(key, {
                    "meta": {"pass": pss, "hdim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h,
                             "nheads_kv": hkv, "flops": flops},
                    "ms_runs": {n: [None] * a.runs for n in impls},
                    "times_ms": {n: [None] * a.runs for n in impls},
                    "errors": {}, "check": None, "mismatch": []})
                errors = {}
                try:
                    calls, results, errors = setup_point(torch, dev, pss, impls, d, causal, s, b, h, hkv, run == 0, a.fp8)
                    if run == 0:
                        rec["check"], rec["mismatch"] = check_point(torch, pss, results, builds, ref,
                                                                     MISMATCH_FP8 if a.fp8 else MISMATCH)
                    del results
                    times = round_robin(torch, calls, a.warmup, reps, spin, errors)
                except torch.cuda.OutOfMemoryError as e:
                    errors["all"], times = first_line(e), {}
                calls = None
                for n, t in times.items():
                    rec["times_ms"][n][run] = t
                    rec["ms_runs"][n][run] = statistics.median(t) if t else None
                for n, msg in errors.items():
                    rec["errors"].setdefault(n, msg)
                torch.cuda.empty_cache()
                tf = " ".join(f"{n} {fmt(tflops(flops, rec['ms_runs'][n][run]) if rec['ms_runs'][n][run] else None, '.1f')}"
                              for n in impls)
                log(f"[{pss} run {run + 1}/{a.runs} {i + 1:>2}/{len(points)} {time.time() - t_start:5.0f}s] "
                    f"hdim {d:>3} causal {int(causal)} seqlen {s:>5}"
                    + (f" batch {b} heads {h}:{hkv}" if hkv != h else "") + f": {tf}"
                    + (f"  MISMATCH({','.join(rec['mismatch'])})" if run == 0 and rec["mismatch"] else "")
                    + "".join(f"\n      {n} failed: {m[:200]}" for n, m in errors.items()))
            dt = time.time() - t_run
            log(f"[{pss} run {run + 1}/{a.runs} took {dt:.0f}s; about {dt * (a.runs - run - 1):.0f}s more for this pass]")
            data[pss] = pass_data(raw, builds, have_fa3, have_cudnn)
            save()
        for line in table_lines(data[pss]["rows"], builds, have_fa3, have_cudnn):
            log(line)


def pass_data(raw, builds, have_fa3, have_cudnn):
    rows = []
    for rec in raw.values():
        row = point_row(rec["meta"], rec["ms_runs"], builds, have_fa3, have_cudnn)
        row["times_ms"] = rec["times_ms"]
        row["check"], row["mismatch"] = rec["check"], rec["mismatch"]
        if rec["errors"]:
            row["errors"] = rec["errors"]
        rows.append(row)
    summary = pass_summary(rows, builds, have_fa3, have_cudnn)
    return {"rows": rows, "summary": summary, "geomean": summary["geomean"]}


def main(argv=None):
    a = parse_args(argv)
    if a.report:
        with open(a.report) as f:
            report(json.load(f))
        return 0
    torch = hopper_torch("compare_builds")
    if torch is None:
        return 2
    dev = torch.device("cuda")
    tmp = tempfile.mkdtemp(prefix="compare_builds_")
    atexit.register(shutil.rmtree, tmp, True)  # the mapped copies stay usable once unlinked

    impls, infos = {}, []
    for name, pkg, lib in a.build:
        mod, info = load_build(name, pkg, lib, tmp)
        impls[name] = flash3_impl(torch, name, mod, a.fp8, a.window, a.softcap, a.varlen, a.docs)
        infos.append(info)
        log(f"build {name}: version {info['version']}, {info['package']}, {info['lib']} "
            f"(sha256 {info['lib_sha256'][:12]}), loaded from {info['lib_copy']}")
    builds = [b["name"] for b in infos]
    fa3_info = None
    if a.fa3:
        fa3, fa3_info = load_fa3(torch, a.fa3, tmp)
        impls[FA3] = fa3_impl(torch, fa3, a.fp8, a.window, a.softcap, a.varlen, a.docs)
        log(f"FA3: {fa3_info['path']} (sha256 {fa3_info['sha256'][:12]})")
    if a.cudnn and not a.fp8 and a.window < 0 and not a.softcap and not a.varlen:
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
        impls[CUDNN] = autograd_impl(torch, CUDNN, sdpa(F, sdpa_kernel, SDPBackend.CUDNN_ATTENTION))
    have_fa3, have_cudnn = FA3 in impls, CUDNN in impls

    gemm = gemm_tflops(torch, dev)
    data = {
        "what": "flash3 builds side by side in one process (round robin), with FlashAttention-3"
                + (" and cuDNN" if have_cudnn else "") + (", e4m3" if a.fp8 else ", bf16") + ", TFLOP/s by the paper's formula",
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(dev), "capability": list(torch.cuda.get_device_capability(dev)),
        "torch": torch.__version__, "cuda": torch.version.cuda, "cudnn_version": torch.backends.cudnn.version(),
        "gemm_bf16_tflops": gemm,
        "builds": infos, "baseline": builds[0], "fa3": fa3_info, "cudnn": have_cudnn,
        "options": {"hdims": a.hdims, "seqlens": a.seqlens, "causal": a.causal, "reps": a.reps,
                    "window": a.window, "softcap": a.softcap, "varlen": a.varlen, "docs": a.docs, "gqa": a.gqa, "heads": a.heads if a.gqa else None, "batches": a.batches,
                    "bwd_reps": a.bwd_reps, "runs": a.runs, "warmup": a.warmup,
                    "spin_cycles": a.spin if a.spin is not None else SPIN_CYCLES,
                    "spin_available": spin_kernel(torch) is not None},
        "flops": f"4 * batch * nheads * seqlen^2 * hdim, halved for causal, times {BWD_FLOPS_FACTOR} for the backward",
        "definitions": {
            "run value": "TFLOP/s of the median of the reps' CUDA-event times in that run",
            "median, min, max": "over runs of the run values",
            "spread": "(max - min) / median of the run values",
            "ratio X/Y": "per-run ratios X_r / Y_r: median over runs, min, max (of_medians: median X / median Y)",
            "rule": f"B/base median >= 1 - max({FLOOR}, max(spread(base), spread(B)))",
            "check": f"relative norm difference to {FA3 if have_fa3 else builds[0]}'s output (forward) or the "
                     f"largest of dq, dk, dv's (backward); mismatch above "
                     f"{MISMATCH_FP8 if a.fp8 else MISMATCH} or on NaN",
        },
        "series": plot_series(builds, have_fa3, have_cudnn),
        "geomean_labels": [[k, k] for k, _, _ in ratio_keys(builds, have_fa3, have_cudnn)],
    }
    log(f"device: {data['device']}; torch {torch.__version__}, CUDA {torch.version.cuda}; "
        f"bf16 GEMM 8192^3: {gemm:.1f} TFLOP/s")

    def save():
        if a.json:
            os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
            with open(a.json + ".tmp", "w") as f:
                json.dump(data, f, indent=1)
            os.replace(a.json + ".tmp", a.json)

    run_sweep(a, torch, dev, impls, builds, have_fa3, have_cudnn, data, save)
    log("")
    for pss in PASSES:
        if pss in data:
            for line in summary_lines(pss, data[pss]["summary"], builds):
                log(line)
    save()
    if a.json:
        log(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

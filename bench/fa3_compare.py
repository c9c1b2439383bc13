#!/usr/bin/env python3
"""flash3 against FlashAttention-3, two ways, from bench_torch.py JSONs and the anchors JSON.

  python3 bench/fa3_compare.py RUN.json [RUN2.json ...] [--anchors PATH] [--min-seqlen N]

1. The issues' test: flash3's ratio to cuDNN (same run) over FA3's ratio to cuDNN in the anchors'
   run (bench_torch.py's flash3_over_fa3_implied; for the backward, FA3 is implied from cuDNN
   timed without the spin kernel, the anchors' method).
2. Absolute rates, each over the bf16 GEMM rate of its own run: (flash3 / GEMM of this run) /
   (FA3 / GEMM of the anchors' run). This one does not carry the anchors' cuDNN reading, which
   moved by up to 10% between two runs of the same day on the anchors' machine (ANCHORS.md: hdim
   128 non-causal 4k read 653 and 588), but it compares two machines: an H100 run against the
   H200 anchors favours FA3 where the kernel is memory-bound (the H200's HBM is 1.4x faster).
Prints one table per measure (rows: head dim x causal, columns: seqlen) and how many points of
seqlen >= --min-seqlen (default: 1k forward, 2k backward, the issues' thresholds) reach 1.00.

With several runs (of the same code), each cell is the median over the runs and its range, and
each measure also counts the points at >= 1.00 in every run and in at least one: how much of a
verdict is the run rather than the code.
"""
import argparse
import json
import math
import os
import statistics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ratio_test(run, r, fa3, gemm_anchor):
    return r.get("flash3_over_fa3_implied")


def normalized(run, r, fa3, gemm_anchor):
    gemm_run = run.get("gemm_bf16_tflops")
    f = fa3.get((r["hdim"], bool(r["causal"]), r["seqlen"]))
    if not (f and gemm_run and gemm_anchor and r.get("flash3_tflops")):
        return None
    return (r["flash3_tflops"] / gemm_run) / (f / gemm_anchor)


MEASURES = (("flash3/cuDNN over FA3/cuDNN (the issues' test)", ratio_test),
            ("flash3/GEMM over FA3/GEMM (absolute rates, each over its run's GEMM)", normalized))


def point_values(runs, fa3, gemm_anchor, fn):
    """{(hdim, causal, seqlen): [value in run 0, run 1, ...]} over the points every run has."""
    per_run = []
    for run in runs:
        per_run.append({(r["hdim"], bool(r["causal"]), r["seqlen"]): fn(run, r, fa3, gemm_anchor)
                        for r in run["rows"]})
    keys = set(per_run[0])
    for d in per_run[1:]:
        keys &= set(d)
    return {k: [d[k] for d in per_run] for k in keys if all(d[k] is not None for d in per_run)}


def summarize(values, min_seqlen):
    """The counts line of one measure: values as point_values returns them."""
    counted = {k: v for k, v in values.items() if k[2] >= min_seqlen}
    if not counted:
        return None
    n = len(next(iter(counted.values())))
    med = [statistics.median(v) for v in counted.values()]
    g = math.exp(sum(map(math.log, med)) / len(med))
    line = (f"seqlen >= {min_seqlen}: {sum(m >= 1.0 for m in med)}/{len(med)} points at >= 1.00"
            f"{' by the median over the runs' if n > 1 else ''}, geomean {g:.3f}, lowest {min(med):.2f}")
    if n > 1:
        line += (f"; at >= 1.00 in all {n} runs: {sum(min(v) >= 1.0 for v in counted.values())}, "
                 f"in at least one: {sum(max(v) >= 1.0 for v in counted.values())}; per run: "
                 + " / ".join(str(sum(v[i] >= 1.0 for v in counted.values())) for i in range(n)))
    return line


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench_json", nargs="+")
    p.add_argument("--anchors", default=os.path.join(ROOT, "bench", "anchors", "fa3_vs_cudnn_h200.json"))
    p.add_argument("--min-seqlen", type=int, default=None)
    a = p.parse_args()
    runs = []
    for path in a.bench_json:
        with open(path) as f:
            runs.append(json.load(f))
    with open(a.anchors) as f:
        anchors = json.load(f)
    pss = runs[0].get("pass", "fwd")
    if any(r.get("pass", "fwd") != pss for r in runs):
        p.error("bench_json: the runs mix forward and backward JSONs; give runs of one pass")
    min_seqlen = a.min_seqlen if a.min_seqlen is not None else (1024 if pss == "fwd" else 2048)
    fa3 = {(r["hd"], bool(r["causal"]), r["seqlen"]): r.get(f"fa3_{pss}") for r in anchors["rows"]}
    gemm_anchor = anchors.get("gemm_bf16_tflops")
    for run in runs:
        print(f"{run.get('device', '?')}, {pss}, {run.get('date', '')}: GEMM {run.get('gemm_bf16_tflops', 0):.0f} "
              f"TFLOP/s here, {gemm_anchor:.0f} in the anchors' run ({anchors.get('what', '')[:60]}...)")
    for title, fn in MEASURES:
        values = point_values(runs, fa3, gemm_anchor, fn)
        seqlens = sorted({k[2] for k in values})
        groups = sorted({k[:2] for k in values})
        print(f"\n{title}" + (f", median over {len(runs)} runs [lowest-highest]" if len(runs) > 1 else ""))
        print("| hdim | causal | " + " | ".join(f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens) + " |")
        print("|---|---|" + "---|" * len(seqlens))
        for hd, causal in groups:
            cells = []
            for s in seqlens:
                v = values.get((hd, causal, s))
                if v is None:
                    cells.append("-")
                elif len(v) == 1:
                    cells.append(f"{v[0]:.2f}")
                else:
                    cells.append(f"{statistics.median(v):.2f} [{min(v):.2f}-{max(v):.2f}]")
            print(f"| {hd} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
        line = summarize(values, min_seqlen)
        if line:
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

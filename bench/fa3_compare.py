#!/usr/bin/env python3
"""flash3 against FlashAttention-3, two ways, from a bench_torch.py JSON and the anchors JSON.

  python3 bench/fa3_compare.py docs/results/bench_torch.json [--anchors PATH] [--min-seqlen N]

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
"""
import argparse
import json
import math
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("bench_json")
    p.add_argument("--anchors", default=os.path.join(ROOT, "bench", "anchors", "fa3_vs_cudnn_h200.json"))
    p.add_argument("--min-seqlen", type=int, default=None)
    a = p.parse_args()
    with open(a.bench_json) as f:
        run = json.load(f)
    with open(a.anchors) as f:
        anchors = json.load(f)
    pss = run.get("pass", "fwd")
    min_seqlen = a.min_seqlen if a.min_seqlen is not None else (1024 if pss == "fwd" else 2048)
    gemm_run, gemm_anchor = run.get("gemm_bf16_tflops"), anchors.get("gemm_bf16_tflops")
    fa3 = {(r["hd"], bool(r["causal"]), r["seqlen"]): r.get(f"fa3_{pss}") for r in anchors["rows"]}
    rows = {(r["hdim"], bool(r["causal"]), r["seqlen"]): r for r in run["rows"]}
    seqlens = sorted({k[2] for k in rows})
    groups = sorted({k[:2] for k in rows})

    def ratio_test(r, key):
        return r.get("flash3_over_fa3_implied")

    def normalized(r, key):
        f = fa3.get(key)
        if not (f and gemm_run and gemm_anchor and r.get("flash3_tflops")):
            return None
        return (r["flash3_tflops"] / gemm_run) / (f / gemm_anchor)

    print(f"{run.get('device', '?')}, {pss}, {run.get('date', '')}: GEMM {gemm_run:.0f} TFLOP/s here, "
          f"{gemm_anchor:.0f} in the anchors' run ({anchors.get('what', '')[:60]}...)")
    for title, fn in (("flash3/cuDNN over FA3/cuDNN (the issues' test)", ratio_test),
                      ("flash3/GEMM over FA3/GEMM (absolute rates, each over its run's GEMM)", normalized)):
        print(f"\n{title}")
        print("| hdim | causal | " + " | ".join(f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens) + " |")
        print("|---|---|" + "---|" * len(seqlens))
        counted = []
        for hd, causal in groups:
            cells = []
            for s in seqlens:
                r = rows.get((hd, causal, s))
                v = fn(r, (hd, causal, s)) if r else None
                cells.append("-" if v is None else f"{v:.2f}")
                if v is not None and s >= min_seqlen:
                    counted.append(v)
            print(f"| {hd} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")
        if counted:
            g = math.exp(sum(map(math.log, counted)) / len(counted))
            print(f"seqlen >= {min_seqlen}: {sum(v >= 1.0 for v in counted)}/{len(counted)} points at >= 1.00, "
                  f"geomean {g:.3f}, lowest {min(counted):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

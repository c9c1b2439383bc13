#!/usr/bin/env python3
"""Prints the README's speed table (flash3 TFLOP/s and ratio to cuDNN) from bench_torch.py's JSON.

For a backward run (the JSON's "pass" is "bwd", or --pass bwd) a second table follows with
flash3 deterministic=True (ratio to cuDNN, then to flash3's default), and a line of geomeans.
usage: python3 bench/table.py bench/baselines/fwd.json [--pass fwd|bwd]"""
import argparse
import json
import math


def label(s):
    return f"{s // 1024}k" if s >= 1024 else str(s)


def rows_of(data, pss):
    """The rows of pass pss: the top-level rows when the file is of that pass, else its section."""
    if (data.get("pass") or "fwd") == pss:
        return data["rows"]
    sec = data.get(pss)
    return sec.get("rows", []) if isinstance(sec, dict) else (sec or [])


def table(rows, cell):
    seqlens = sorted({r["seqlen"] for r in rows})
    by_key = {(r["hdim"], bool(r["causal"]), r["seqlen"]): r for r in rows}
    print("| hdim | causal | " + " | ".join(label(s) for s in seqlens) + " |")
    print("|---|---|" + "---|" * len(seqlens))
    for hdim in sorted({r["hdim"] for r in rows}):
        for causal in (False, True):
            cells = [cell(by_key.get((hdim, causal, s))) for s in seqlens]
            print(f"| {hdim} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")


def tf_and_ratio(tf_key, ratio_key, second_key=None):
    def cell(r):
        if not (r and r.get(tf_key) and r.get(ratio_key)):
            return "-"
        text = f"{round(r[tf_key]):d} ({r[ratio_key]:.2f}x"
        if second_key and r.get(second_key):
            text += f", {r[second_key]:.2f}"
        return text + ")"
    return cell


def geomean(rows, key):
    xs = [r[key] for r in rows if r.get(key)]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json")
    p.add_argument("--pass", dest="pss", choices=["fwd", "bwd"], default=None,
                   help="default: the JSON's own pass")
    a = p.parse_args()
    with open(a.json) as f:
        data = json.load(f)
    pss = a.pss or data.get("pass") or "fwd"
    rows = rows_of(data, pss)
    if not rows:
        raise SystemExit(f"table: no '{pss}' rows in {a.json}")
    table(rows, tf_and_ratio("flash3_tflops", "flash3_over_cudnn"))
    if pss != "bwd":
        return
    print()
    print("Deterministic backward (deterministic=True): TFLOP/s (ratio to cuDNN, ratio to the default)")
    print()
    table(rows, tf_and_ratio("flash3_det_tflops", "flash3_det_over_cudnn", "flash3_det_over_flash3"))
    print()
    names = (("flash3_over_cudnn", "cuDNN"), ("flash3_over_fa2", "FlashAttention-2"),
             ("flash3_over_fa3_implied", "FA3 (implied)"),
             ("flash3_over_fa3_implied_same_method", "FA3 (implied, both without spin)"),
             ("flash3_det_over_cudnn", "deterministic/cuDNN"),
             ("flash3_det_over_flash3", "deterministic/default"))
    parts = [f"{geomean(rows, k):.2f}x {lab}" for k, lab in names if geomean(rows, k)]
    print("geomean: " + (", ".join(parts) if parts else "-"))


if __name__ == "__main__":
    main()

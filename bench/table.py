#!/usr/bin/env python3
"""Prints the README's speed table (flash3 TFLOP/s and ratio to cuDNN) from bench_torch.py's JSON.
usage: python3 bench/table.py docs/results/bench_torch.json"""
import json
import sys

rows = json.load(open(sys.argv[1]))["rows"]
seqlens = sorted({r["seqlen"] for r in rows})
label = lambda s: f"{s // 1024}k" if s >= 1024 else str(s)
print("| hdim | causal | " + " | ".join(label(s) for s in seqlens) + " |")
print("|---|---|" + "---|" * len(seqlens))
for hdim in sorted({r["hdim"] for r in rows}):
    for causal in (False, True):
        cells = []
        for s in seqlens:
            r = next((r for r in rows if r["hdim"] == hdim and r["causal"] == causal and r["seqlen"] == s), None)
            ok = r and r.get("flash3_tflops") and r.get("flash3_over_cudnn")
            cells.append(f"{round(r['flash3_tflops']):d} ({r['flash3_over_cudnn']:.2f}x)" if ok else "-")
        print(f"| {hdim} | {'yes' if causal else 'no'} | " + " | ".join(cells) + " |")

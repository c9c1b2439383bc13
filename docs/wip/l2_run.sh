#!/usr/bin/env bash
# Scratch (session 25, call 8): the backward's causal L2 section budget, l2_bytes / d for d = 2 (main),
# 1, 4, and no sections (0), head dims 64 and 128 causal, 3 rounds alternated; pytest with d = 0.
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" source exp/exp_build.sh
FLASH3_EXP_L2DIV=0 PYTHONPATH=python timeout 60 python3 -m pytest -q -x tests/test_torch.py -k "backward or bwd or grad" 2>&1 | tail -1
for r in 1 2 3; do for d in 2 1 4 0; do
  FLASH3_EXP_L2DIV=$d HDIMS=64,128 CAUSAL=1 timeout 100 python3 exp/ab_time.py "d$d" >> "$OUT/ab.txt" 2>&1
done; echo "round $r $(( $(date +%s) - t0 )) s"; done
python3 - "$OUT/ab.txt" <<'PY'
import json, sys, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    tag, js = line.split(" ", 1); runs[tag].append(json.loads(js))
med = lambda xs: sorted(xs)[len(xs) // 2]
keys = list(runs["d2"][0])
print(f"{'point':>14} | " + " | ".join(f"{t:>14}" for t in runs))
for k in keys:
    base = med([r[k] for r in runs["d2"]])
    print(f"{k:>14} | " + " | ".join(f"{med([r[k] for r in runs[t]]):7.0f} {med([r[k] for r in runs[t]])/base:5.3f}" for t in runs))
PY
echo "elapsed $(( $(date +%s) - t0 )) s"

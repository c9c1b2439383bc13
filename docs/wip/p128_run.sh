#!/usr/bin/env bash
# Scratch (session 24): the persistent kernel at head dim 128 (bwd_persistent_hdim128_at_90223fd.patch): build with both kernels, check, gtest Bwd*, pytest, A/B.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
t0=$(date +%s)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DCMAKE_CUDA_FLAGS="-DFLASH3_EXP_PERSIST_AB -DFLASH3_EXP_PERSIST128" > "$OUT/cfg.log" 2>&1
cmake --build build -j16 > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
FLASH3_LIB=$PWD/build/libflash3.so timeout 120 python3 exp/persist_check.py 2>&1 | tee "$OUT/check.log"
grep -q "persist_check PASSED" "$OUT/check.log" || { echo "check failed: no timing"; exit 1; }
timeout 200 ./build/flash3_tests --gtest_filter='Bwd*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1; echo "gtest Bwd* rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
grep -E "FAILED|Failure" "$OUT/gtest.log" | head -10
FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=python timeout 120 python3 -m pytest -q -x tests/test_torch.py 2>&1 | tail -1
for r in 1 2; do
  for v in 0 1; do
    FLASH3_EXP_PERSIST=$v HDIMS=128 CAUSAL=1 FLASH3_LIB=$PWD/build/libflash3.so timeout 100 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
  done
done
python3 - "$OUT/ab.txt" <<'PY'
import json, sys, math, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    tag, js = line.split(" ", 1); runs[tag[:2]].append(json.loads(js))
keys = list(runs["v0"][0]); med = lambda xs: sorted(xs)[len(xs) // 2]; g = []
print(f"{'point':>14} | {'one item per block':>18} | {'persistent':>14} | ratio")
for k in keys:
    a = sorted(r[k] for r in runs["v0"]); b = sorted(r[k] for r in runs["v1"]); g.append(med(b) / med(a))
    print(f"{k:>14} | {' '.join(f'{x:.0f}' for x in a):>18} | {' '.join(f'{x:.0f}' for x in b):>14} | {med(b)/med(a):.3f}")
print("geomean persistent / one item per block", round(math.exp(sum(map(math.log, g)) / len(g)), 4))
PY

#!/usr/bin/env bash
# Scratch (session 23): one build with experiment macros, variants chosen by an environment variable.
#   FLAGS="-DX" ENVVAR=NAME VALUES="0 132 264" HDIMS=64,128 SEQS=... ROUNDS="1 2"
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
cmake -S . -B build_env -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_TESTS=OFF -DFLASH3_BUILD_BENCH=OFF \
  -DCMAKE_CUDA_FLAGS="$FLAGS" > "$OUT/cfg.log" 2>&1
t0=$(date +%s); cmake --build build_env -j16 --target flash3 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
for v in $VALUES; do
  [ "$v" = 0 ] && continue
  echo "pytest $ENVVAR=$v: $(env $ENVVAR=$v FLASH3_LIB=$PWD/build_env/libflash3.so PYTHONPATH=python timeout 200 python3 -m pytest -q -x tests/test_torch.py 2>&1 | tail -1)"
done
for r in ${ROUNDS:-1 2}; do
  for v in $VALUES; do
    env $ENVVAR=$v FLASH3_LIB=$PWD/build_env/libflash3.so timeout 150 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
  done
done
python3 - "$OUT/ab.txt" $(for v in $VALUES; do echo v$v; done) <<'PY'
import json, sys, math, collections
runs = collections.defaultdict(list)
names = sys.argv[2:]
for line in open(sys.argv[1]):
    tag, js = line.split(" ", 1)
    for n in names:
        if tag.startswith(n) and tag[len(n):].isdigit(): runs[n].append(json.loads(js))
keys = list(runs[names[0]][0])
med = lambda xs: sorted(xs)[len(xs) // 2]
print(f"{'point':>14} | " + " | ".join(f"{n:>16}" for n in names) + " | " + " ".join(f"{n}/{names[0]}" for n in names[1:]))
g = collections.defaultdict(list)
for k in keys:
    mb = med([r[k] for r in runs[names[0]]])
    cols, rat = [], []
    for n in names:
        xs = sorted(r[k] for r in runs[n]); cols.append(" ".join(f"{x:.0f}" for x in xs))
        if n != names[0]: rat.append(med(xs) / mb); g[n].append(med(xs) / mb)
    print(f"{k:>14} | " + " | ".join(f"{c:>16}" for c in cols) + " | " + " ".join(f"{x:.3f}" for x in rat))
for n in names[1:]:
    print("geomean", n, "/", names[0], round(math.exp(sum(map(math.log, g[n])) / len(g[n])), 4))
PY

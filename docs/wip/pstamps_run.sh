#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
t0=$(date +%s)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DFLASH3_BUILD_TESTS=OFF -DCMAKE_CUDA_FLAGS="-DFLASH3_EXP_PERSIST_AB -DFLASH3_EXP_STAMPS" > "$OUT/cfg.log" 2>&1
cmake --build build -j16 --target flash3 > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
export FLASH3_LIB=$PWD/build/libflash3.so
timeout 100 python3 exp/persist_check.py 2>&1 | tee "$OUT/check.log"
grep -q "persist_check PASSED" "$OUT/check.log" || { echo "check failed"; exit 1; }
timeout 120 python3 exp/pstamps.py 2>&1 | tee "$OUT/pstamps.txt"
for r in 1 2; do for v in 0 1; do
  FLASH3_EXP_PERSIST=$v CAUSAL=1 timeout 100 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
done; done
python3 exp/ab_summary.py "$OUT/ab.txt"

#!/usr/bin/env bash
EXP_TESTS=OFF EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" source exp/exp_build.sh
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_PERSIST=$v HDIMS=64 CAUSAL=1 timeout 100 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
done; done
python3 exp/ab_summary.py "$OUT/ab.txt"

#!/usr/bin/env bash
EXP_TESTS=OFF EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB -DFLASH3_EXP_STAMPS" source exp/exp_build.sh
timeout 100 python3 exp/persist_check.py 2>&1 | tee "$OUT/check.log"
grep -q "persist_check PASSED" "$OUT/check.log" || { echo "check failed"; exit 1; }
timeout 120 python3 exp/pstamps.py 2>&1 | tee "$OUT/pstamps.txt"
for r in 1 2; do for v in 0 1; do
  FLASH3_EXP_PERSIST=$v CAUSAL=1 timeout 100 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
done; done
python3 exp/ab_summary.py "$OUT/ab.txt"

#!/usr/bin/env bash
# Scratch (session 24): head dim 64 non-causal backward, persistent against one block per item.
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB -DFLASH3_EXP_PERSIST_NONCAUSAL" source exp/exp_build.sh
CAUSAL=0 ONLY64=1 timeout 60 python3 exp/persist_check.py 2>&1 | tee "$OUT/check.log"
grep -q "persist_check PASSED" "$OUT/check.log" || { echo "check failed: no timing"; exit 1; }
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_PERSIST=$v HDIMS=64 CAUSAL=0 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
done; done
python3 exp/ab_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"
timeout 100 ./build/flash3_tests --gtest_filter='BwdGpuPersistent*:BwdGpuDeterministic*:BwdGpuSmall*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1; echo "gtest rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
grep -E "FAILED|Failure" "$OUT/gtest.log" | head -10
PYTHONPATH=python timeout 40 python3 -m pytest -q -x tests/test_torch.py 2>&1 | tail -1
echo "elapsed $(( $(date +%s) - t0 )) s"

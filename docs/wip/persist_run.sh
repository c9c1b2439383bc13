#!/usr/bin/env bash
# Scratch (sessions 23-24): build with both backward kernels, check, test, A/B.
# CUDA_FLAGS (default -DFLASH3_EXP_PERSIST_AB) and AB_HDIMS (default 64,128) choose the build and
# the A/B points: the head dim 128 patch runs with
#   CUDA_FLAGS="-DFLASH3_EXP_PERSIST_AB -DFLASH3_EXP_PERSIST128" AB_HDIMS=128 bash exp/persist_run.sh
EXP_FLAGS="${CUDA_FLAGS:--DFLASH3_EXP_PERSIST_AB}" source exp/exp_build.sh
FLASH3_LIB=$PWD/build/libflash3.so timeout 120 python3 exp/persist_check.py 2>&1 | tee "$OUT/check.log"
grep -q "persist_check PASSED" "$OUT/check.log" || { echo "check failed: no timing"; exit 1; }
timeout 200 ./build/flash3_tests --gtest_filter='Bwd*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1; echo "gtest Bwd* rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
grep -E "FAILED|Failure" "$OUT/gtest.log" | head -10
FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=python timeout 120 python3 -m pytest -q -x tests/test_torch.py 2>&1 | tail -1
for r in 1 2; do
  for v in 0 1; do
    FLASH3_EXP_PERSIST=$v HDIMS=${AB_HDIMS:-64,128} CAUSAL=1 FLASH3_LIB=$PWD/build/libflash3.so timeout 100 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
  done
done
python3 exp/ab_summary.py "$OUT/ab.txt"

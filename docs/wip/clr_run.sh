#!/usr/bin/env bash
# Scratch (session 33, B91): the in-kernel dQ clear. After `bash scripts/device_run.sh build`
# (tests on) and `rm -rf exp; cp -r docs/wip exp`: gtest Bwd*:CausalOrder* (with the ClearInKernel
# cases), pytest backward, memcheck BwdGpuSmall.* (exp_tests.sh); then an A/B in the same build,
# FLASH3_BWD_CLEAR_LEAD=1073741824 (every pair cleared by the preprocess, as before; v0) against
# the library's lead (v1), ROUNDS rounds over HDIMS x CAUSAL x SEQS; then kbreak at 8k with each.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; t0=$(date +%s)
TEST_BUILD=build GTEST_TIMEOUT=300 source exp/exp_tests.sh
export HDIMS=${HDIMS:-64,128,256} CAUSAL=${CAUSAL:-0,1} SEQS=${SEQS:-4096,8192,16384}
export FLASH3_LIB=$PWD/build/libflash3.so
for r in $(seq 1 "${ROUNDS:-3}"); do
  FLASH3_BWD_CLEAR_LEAD=1073741824 timeout 120 python3 exp/ab_time.py "v0$r" >> "$OUT/ab.txt" 2>&1
  timeout 120 python3 exp/ab_time.py "v1$r" >> "$OUT/ab.txt" 2>&1
done
python3 exp/abn_summary.py "$OUT/ab.txt" | tee "$OUT/ab_summary.txt"
for v in 1073741824 ""; do
  echo "== kbreak FLASH3_BWD_CLEAR_LEAD=$v" | tee -a "$OUT/kbreak.txt"
  FLASH3_BWD_CLEAR_LEAD=$v HDIMS=64,128,256 SEQS=8192 timeout 120 python3 exp/kbreak.py 2>&1 | grep -v -i warn | tee -a "$OUT/kbreak.txt"
done
echo "elapsed $(( $(date +%s) - t0 )) s"

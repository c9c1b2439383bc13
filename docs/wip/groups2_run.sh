#!/usr/bin/env bash
# Scratch (session 31, B80): main with four dQ copies at head dim 256 causal from 128 key blocks and
# two from 32 (bwd_dq_groups): the deterministic gtests (20 runs bitwise, accuracy against FP64,
# a 4-copy case at 8200 keys), BwdGpuSmall, the CPU workspace tests, pytest -k backward, and det /
# default at head dim 256 causal 1k-16k, two rounds. `bash exp/groups2_run.sh`.
source exp/exp_builds.sh
b build "" ON
t1=$(date +%s)
timeout 240 ./build/flash3_tests --gtest_filter='BwdGpuDeterministic.*:BwdGpuSmall.*:BwdWorkspace.*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1
echo "gtest rc=$? in $(( $(date +%s) - t1 )) s: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
grep -E "FAILED|Failure" "$OUT/gtest.log" | head
FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=python timeout 100 python3 -m pytest -q -x tests/test_torch.py -k "backward" > "$OUT/pytest_bwd.log" 2>&1
echo "pytest backward rc=$?: $(tail -1 "$OUT/pytest_bwd.log")"
for r in 1 2; do
  FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=1 SEQS=1024,2048,4096,8192,16384 timeout 60 python3 exp/ab_time.py "def$r" >> "$OUT/ab.txt" 2>&1
  DET=1 FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=1 SEQS=1024,2048,4096,8192,16384 timeout 60 python3 exp/ab_time.py "det$r" >> "$OUT/ab.txt" 2>&1
done
cat "$OUT/ab.txt"; nvidia-smi --query-gpu=name --format=csv,noheader
echo "elapsed $(( $(date +%s) - t0 )) s"

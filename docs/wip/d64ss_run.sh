#!/usr/bin/env bash
# Scratch (session 32, B81): head dim 64 with FlashAttention-3's layout, 128 x 128 not swapped,
# every GEMM from shared memory (-DFLASH3_EXP_D64_SS=<dQ stages>, bwd_config.h; the one-block
# kernel, no persistence) against main (build2). cp -r docs/wip exp; `bash exp/d64ss_run.sh`.
source exp/exp_builds.sh
b build_ss "-DFLASH3_EXP_D64_SS=${DQ_STAGES:-2}" ON
TEST_BUILD=build_ss GTEST_TIMEOUT=200 source exp/exp_tests.sh
b build2 ""
for r in 1 2; do
  for v in 0 1; do
    lib=$([ $v = 0 ] && echo build2 || echo build_ss)
    FLASH3_LIB=$PWD/$lib/libflash3.so HDIMS=64 CAUSAL=0,1 SEQS=1024,2048,4096,8192,16384 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
  done
done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# Scratch (session 32, B82): head dim 64 with a third Q/dO stage (-DFLASH3_EXP_D64_STAGES=3,
# bwd_config.h; 226.5 KB of shared memory with the persistent kernel's buffers) against main
# (build2): gtest Bwd*, pytest backward, memcheck with it, then A/B three rounds.
# cp -r docs/wip exp; `bash exp/d64stages_run.sh`.
source exp/exp_builds.sh
b build_st "-DFLASH3_EXP_D64_STAGES=3" ON
TEST_BUILD=build_st GTEST_TIMEOUT=200 source exp/exp_tests.sh
b build2 ""
for r in 1 2 3; do
  for v in 0 1; do
    lib=$([ $v = 0 ] && echo build2 || echo build_st)
    FLASH3_LIB=$PWD/$lib/libflash3.so HDIMS=64 CAUSAL=0,1 SEQS=1024,2048,4096,8192,16384 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
  done
done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

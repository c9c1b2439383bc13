#!/usr/bin/env bash
# Scratch (session 30, B74): every 4th exponential of the swapped loop's P^T on the FMA pipe
# (exp2_fma, -DFLASH3_EXP_POLY=4; build, tested) against MUFU only (build2). `bash exp/poly_run.sh`.
source exp/exp_builds.sh
P=${POLY:-4}
b build "-DFLASH3_EXP_POLY=$P" ON
cuobjdump --dump-sass build/CMakeFiles/flash3.dir/src/bwd/bwd_bf16_hdim64.cu.o | grep -c "MUFU.EX2" | sed 's/^/MUFU.EX2 in hdim64 TU: /'
TEST_BUILD=build GTEST_TIMEOUT=200 source exp/exp_tests.sh
b build2 "-DFLASH3_EXP_POLY=0" OFF
cuobjdump --dump-sass build2/CMakeFiles/flash3.dir/src/bwd/bwd_bf16_hdim64.cu.o | grep -c "MUFU.EX2" | sed 's/^/MUFU.EX2 in hdim64 TU (main): /'
for r in 1 2 3; do
  FLASH3_LIB=$PWD/build2/libflash3.so HDIMS=64,128 CAUSAL=0,1 SEQS=2048,4096,8192,16384 timeout 90 python3 exp/ab_time.py "v0$r" >> "$OUT/ab.txt" 2>&1
  FLASH3_LIB=$PWD/build/libflash3.so HDIMS=64,128 CAUSAL=0,1 SEQS=2048,4096,8192,16384 timeout 90 python3 exp/ab_time.py "v1$r" >> "$OUT/ab.txt" 2>&1
done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

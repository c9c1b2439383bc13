#!/usr/bin/env bash
# Scratch (session 34, B95): the persistent causal head dim 64 kernel visiting first to last where
# no dq_sem (-DFLASH3_EXP_F2L) against main: both builds' gradients on long causal problems
# (f2l_check.py), gtest Bwd* + pytest backward + memcheck on the variant, then the A/B.
source exp/exp_builds.sh
source exp/exp_variants.sh
export HDIMS=64 CAUSAL=1 SEQS=4096,8192,16384 ROUNDS=${ROUNDS:-3}
b build_f "-DFLASH3_EXP_F2L" ON
TEST_BUILD=build_f GTEST_TIMEOUT=200 source exp/exp_tests.sh
b build2 ""
for d in build2 build_f; do FLASH3_LIB=$PWD/$d/libflash3.so timeout 120 python3 exp/f2l_check.py $d; done
abt "$ROUNDS" build2 build_f
echo "elapsed $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# Scratch (session 32, B86): head dim 128 with a third Q/dO stage in the room of one dQ stage
# (v1: FLASH3_EXP_D128_STAGES=3, FLASH3_EXP_D128_DQ=1; v2: 2 and 1, the dQ stage's cost alone)
# against main (v0: 2 and 2). Needs the two macros in BwdTileConfig<128> (bwd_config.h; not on
# main). cp -r docs/wip exp; `bash exp/d128stages_run.sh`.
source exp/exp_builds.sh
b build_v1 "-DFLASH3_EXP_D128_STAGES=3 -DFLASH3_EXP_D128_DQ=1" ON
TEST_BUILD=build_v1 GTEST_TIMEOUT=200 source exp/exp_tests.sh
b build_v2 "-DFLASH3_EXP_D128_STAGES=2 -DFLASH3_EXP_D128_DQ=1"
b build_v0 ""
export HDIMS=128 CAUSAL=0,1 SEQS=1024,2048,4096,8192,16384
abt 2 build_v0 build_v1 build_v2
echo "elapsed $(( $(date +%s) - t0 )) s"

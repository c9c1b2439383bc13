#!/usr/bin/env bash
# Scratch (session 32): one variant against main. build_x with FLAGS (tests on): gtest Bwd*,
# pytest backward, memcheck (exp_tests.sh); build2 = main; then ROUNDS (default 2) rounds of
# ab_time.py over the points in HDIMS, CAUSAL, SEQS (exported by the caller). d64ss_run.sh and
# d64stages_run.sh call it.
source exp/exp_builds.sh
b build_x "$FLAGS" ON
TEST_BUILD=build_x GTEST_TIMEOUT=200 source exp/exp_tests.sh
b build2 ""
abt "${ROUNDS:-2}" build2 build_x
echo "elapsed $(( $(date +%s) - t0 )) s"

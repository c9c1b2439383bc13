#!/usr/bin/env bash
# Scratch (session 28, B68): dQ added from the consumers' registers at head dim 256 (default mode)
# with two Q/dO stages, against the writers' path (FLASH3_EXP_DQ_RED=0 under -DFLASH3_EXP_PERSIST_AB,
# bwd_config.h's bwd_dq_red). Copy docs/wip to exp/ first (cp -r docs/wip exp), then
# `bash exp/red_run.sh` from the repository root. RED_TESTS=0 skips the tests.
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" EXP_TESTS=ON source exp/exp_build.sh
if [ "${RED_TESTS:-1}" = 1 ]; then
GTEST_TIMEOUT=200 source exp/exp_tests.sh
fi
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_DQ_RED=$v HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab_red.txt" 2>&1
done; done
echo "v0 writers (one stage), v1 dQ from registers (two stages), head dim 256"; python3 exp/ab_summary.py "$OUT/ab_red.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

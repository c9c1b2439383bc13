#!/usr/bin/env bash
# Scratch (session 29, B72): head dim 256 default mode with FlashAttention-3's 64 x 80 tile (dK^T,
# dV^T accumulators, dQ added from registers in two parts), against main's 64 x 64 writers' kernel
# (FLASH3_EXP_DQ_RED=0 under -DFLASH3_EXP_PERSIST_AB). Copy docs/wip to exp/ first, then
# `bash exp/n80_run.sh` from the repository root. N80_TESTS=0 skips the tests.
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" EXP_TESTS=ON source exp/exp_build.sh
if [ "${N80_TESTS:-1}" = 1 ]; then
source exp/exp_tests.sh
fi
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_DQ_RED=$v HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab_n80.txt" 2>&1
done; done
echo "v0 main (64 x 64, writers), v1 64 x 80 (dQ from registers), head dim 256"; python3 exp/ab_summary.py "$OUT/ab_n80.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

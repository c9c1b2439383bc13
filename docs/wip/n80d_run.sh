#!/usr/bin/env bash
# Scratch (session 29, B72): the 64 x 80 head dim 256 kernel, dQ from registers, dK, dV issued
# first, 40 / 232 registers, with two Q stages and one dO stage (-DFLASH3_EXP_N80_Q2, FlashAttention-3's
# counts), tested, against main's 64 x 64 kernel (FLASH3_EXP_DQ_RED=0). `bash exp/n80d_run.sh`
# after cp -r docs/wip exp.
F="-DFLASH3_EXP_PERSIST_AB -DFLASH3_EXP_N80_REGS40 -DFLASH3_EXP_N80_ORDER -DFLASH3_EXP_N80_Q2"
EXP_FLAGS="$F" EXP_TESTS=ON source exp/exp_build.sh
source exp/exp_tests.sh
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_DQ_RED=$v HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
done; done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

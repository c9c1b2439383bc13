#!/usr/bin/env bash
# Scratch (session 29, B72): the 64 x 80 head dim 256 kernel with dK, dV issued first and 40 / 232
# registers (call 2's best), dQ from registers (build) or through one 32 KB buffer in two parts and
# the writers' bulk adds (build2, -DFLASH3_EXP_N80_WRITERS, tested), against main's 64 x 64 kernel
# (FLASH3_EXP_DQ_RED=0). `bash exp/n80c_run.sh` after cp -r docs/wip exp.
source exp/exp_builds.sh
F="-DFLASH3_EXP_PERSIST_AB -DFLASH3_EXP_N80_REGS40 -DFLASH3_EXP_N80_ORDER"  # (the old inline b() added PERSIST_AB)
b build2 "$F -DFLASH3_EXP_N80_WRITERS" ON
TEST_BUILD=build2 source exp/exp_tests.sh
b build "$F" OFF
for r in 1 2 3; do
  FLASH3_LIB=$PWD/build/libflash3.so FLASH3_EXP_DQ_RED=0 HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v0$r" >> "$OUT/ab.txt" 2>&1
  FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v1$r" >> "$OUT/ab.txt" 2>&1
  FLASH3_LIB=$PWD/build2/libflash3.so HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v2$r" >> "$OUT/ab.txt" 2>&1
done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

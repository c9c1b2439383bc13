#!/usr/bin/env bash
# Scratch (session 29, B72): the 64 x 80 head dim 256 kernel with dK, dV issued first and 40 / 232
# registers (call 2's best), dQ from registers (build) or through one 32 KB buffer in two parts and
# the writers' bulk adds (build2, -DFLASH3_EXP_N80_WRITERS, tested), against main's 64 x 64 kernel
# (FLASH3_EXP_DQ_RED=0). `bash exp/n80c_run.sh` after cp -r docs/wip exp.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; t0=$(date +%s)
F="-DFLASH3_EXP_N80_REGS40 -DFLASH3_EXP_N80_ORDER"
b() {  # build dir, flags, tests
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DFLASH3_BUILD_TESTS=$3 \
    -DCMAKE_CUDA_FLAGS="-DFLASH3_EXP_PERSIST_AB $2" -DCMAKE_CXX_FLAGS="-DFLASH3_EXP_PERSIST_AB $2" > "$OUT/cfg_$1.log" 2>&1
  cmake --build "$1" -j16 > "$OUT/build_$1.log" 2>&1 || { tail -30 "$OUT/build_$1.log"; exit 1; }
  echo "$1 built at $(( $(date +%s) - t0 )) s"
}
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

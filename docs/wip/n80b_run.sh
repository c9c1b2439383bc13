#!/usr/bin/env bash
# Scratch (session 29, B72): three builds of the 64 x 80 head dim 256 kernel, timed against main's
# 64 x 64 one (FLASH3_EXP_DQ_RED=0): v1 producer 24 / consumers 240 registers, dQ part 0 first;
# v2 40 / 232 (-DFLASH3_EXP_N80_REGS40: the producer's loop unrolled); v3 40 / 232 with dK, dV
# issued before the dQ parts (-DFLASH3_EXP_N80_ORDER). `bash exp/n80b_run.sh` after cp -r docs/wip exp.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; t0=$(date +%s)
b() {  # build dir, flags
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DFLASH3_BUILD_TESTS=OFF \
    -DCMAKE_CUDA_FLAGS="-DFLASH3_EXP_PERSIST_AB $2" -DCMAKE_CXX_FLAGS="-DFLASH3_EXP_PERSIST_AB $2" > "$OUT/cfg_$1.log" 2>&1
  cmake --build "$1" -j16 --target flash3 > "$OUT/build_$1.log" 2>&1 || { tail -30 "$OUT/build_$1.log"; exit 1; }
  echo "$1 built at $(( $(date +%s) - t0 )) s"
}
b build ""; b build2 "-DFLASH3_EXP_N80_REGS40"; b build3 "-DFLASH3_EXP_N80_REGS40 -DFLASH3_EXP_N80_ORDER"
for r in 1 2 3; do
  FLASH3_LIB=$PWD/build/libflash3.so FLASH3_EXP_DQ_RED=0 HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v0$r" >> "$OUT/ab.txt" 2>&1
  FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v1$r" >> "$OUT/ab.txt" 2>&1
  FLASH3_LIB=$PWD/build2/libflash3.so HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v2$r" >> "$OUT/ab.txt" 2>&1
  FLASH3_LIB=$PWD/build3/libflash3.so HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v3$r" >> "$OUT/ab.txt" 2>&1
done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# Scratch (session 30): per-phase clocks of the swapped loop (head dims 64, 128), -DFLASH3_EXP_PHASES.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; t0=$(date +%s)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DFLASH3_BUILD_TESTS=OFF \
  -DCMAKE_CUDA_FLAGS="-DFLASH3_EXP_PHASES" -DCMAKE_CXX_FLAGS="-DFLASH3_EXP_PHASES" > "$OUT/cfg.log" 2>&1
cmake --build build -j16 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "built at $(( $(date +%s) - t0 )) s"
FLASH3_LIB=$PWD/build/libflash3.so POINTS=128:1:2048,128:0:2048,128:1:16384,64:1:8192,64:0:8192,64:1:2048 timeout 200 python3 exp/phases.py 2>&1 | tee "$OUT/phases2.txt" | grep -v "^$" | head -80
echo "elapsed $(( $(date +%s) - t0 )) s"

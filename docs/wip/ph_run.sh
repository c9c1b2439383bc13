#!/usr/bin/env bash
# Scratch (session 30): per-phase clocks of the head dim 256 loop (kSdPByGemm, -DFLASH3_EXP_PHASES).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; t0=$(date +%s)
b() {  # build dir, flags, tests
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DFLASH3_BUILD_TESTS=$3 \
    -DCMAKE_CUDA_FLAGS="$2" -DCMAKE_CXX_FLAGS="$2" > "$OUT/cfg_$1.log" 2>&1
  cmake --build "$1" -j16 > "$OUT/build_$1.log" 2>&1 || { tail -30 "$OUT/build_$1.log"; exit 1; }
  echo "$1 built at $(( $(date +%s) - t0 )) s"
}
b build "-DFLASH3_EXP_PHASES" OFF
FLASH3_LIB=$PWD/build/libflash3.so timeout 120 python3 exp/phases.py 2>&1 | tee "$OUT/phases.txt" | grep -v "^$" | head -60
FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=0,1 SEQS=2048,4096,16384 timeout 90 python3 exp/ab_time.py ph 2>&1 | tail -3
echo "elapsed $(( $(date +%s) - t0 )) s"

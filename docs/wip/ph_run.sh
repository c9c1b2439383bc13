#!/usr/bin/env bash
# Scratch (session 30): per-phase clocks of the head dim 256 loop (kSdPByGemm, -DFLASH3_EXP_PHASES).
source exp/exp_builds.sh
b build "-DFLASH3_EXP_PHASES" OFF
FLASH3_LIB=$PWD/build/libflash3.so timeout 120 python3 exp/phases.py 2>&1 | tee "$OUT/phases.txt" | grep -v "^$" | head -60
FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=0,1 SEQS=2048,4096,16384 timeout 90 python3 exp/ab_time.py ph 2>&1 | tail -3
echo "elapsed $(( $(date +%s) - t0 )) s"

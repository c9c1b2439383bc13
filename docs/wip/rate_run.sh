#!/usr/bin/env bash
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DCUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED -I third_party/cutlass/include --expt-relaxed-constexpr exp/wgmma_rate.cu -o /tmp/wgmma_rate || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv
for i in 1 2; do /tmp/wgmma_rate | tee -a "$OUT/rate.txt"; done

#!/usr/bin/env bash
# Scratch (session 29, B72's last call): Nsight Compute on the 64 x 80 head dim 256 kernel (dQ in two
# parts through the writers, dK, dV first, 40 / 232 registers) against main's 64 x 64 kernel
# (FLASH3_EXP_DQ_RED=0), flash3's main kernel only, non-causal 2k: speed of light, warp states,
# the L2's reduction sectors. On branch bwd256-n80 (docs/wip/bwd_n80_hdim256_at_9f3cab9.patch).
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; t0=$(date +%s)
F="-DFLASH3_EXP_PERSIST_AB -DFLASH3_EXP_N80_REGS40 -DFLASH3_EXP_N80_ORDER -DFLASH3_EXP_N80_WRITERS"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DFLASH3_BUILD_TESTS=OFF \
  -DCMAKE_CUDA_FLAGS="$F" -DCMAKE_CXX_FLAGS="$F" > /dev/null 2>&1
cmake --build build -j16 --target flash3 > "$OUT/build.log" 2>&1 || { tail -5 "$OUT/build.log"; exit 1; }
echo "build $(( $(date +%s) - t0 )) s"
export FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=python
M=lts__t_sectors_op_red.sum,lts__t_sectors_op_red.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.avg.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
S="--section SpeedOfLight --section WarpStateStats --metrics $M"
for v in 1 0; do
  FLASH3_EXP_DQ_RED=$v timeout 150 ncu --profile-from-start off --clock-control none -k regex:bwd_kernel $S \
    python3 tools/prof.py --pass bwd --hdim 256 --seqlen 2048 --causal 0 --only flash3 > "$OUT/ncu_red$v.txt" 2>&1
  echo "== FLASH3_EXP_DQ_RED=$v rc=$?"
  grep -E "Duration|lts__t_sectors_op_red|lts__t_sectors.avg|hmma|Compute \(SM\) Throughput|Memory Throughput|L2 Cache Throughput|Stall|Warp Cycles Per Issued" "$OUT/ncu_red$v.txt" | cut -c1-120 | head -30
done
echo "elapsed $(( $(date +%s) - t0 )) s"

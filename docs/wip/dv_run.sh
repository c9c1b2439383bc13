#!/usr/bin/env bash
# Scratch (session 30, B76): head dim 256, P stored and dV issued before dS is computed
# (-DFLASH3_EXP_DV_EARLY; build, pytest) against main (build2). `bash exp/dv_run.sh`.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; t0=$(date +%s)
b() {  # build dir, flags
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DFLASH3_BUILD_TESTS=OFF \
    -DCMAKE_CUDA_FLAGS="$2" -DCMAKE_CXX_FLAGS="$2" > "$OUT/cfg_$1.log" 2>&1
  cmake --build "$1" -j16 > "$OUT/build_$1.log" 2>&1 || { tail -30 "$OUT/build_$1.log"; exit 1; }
  echo "$1 built at $(( $(date +%s) - t0 )) s"
}
b build "-DFLASH3_EXP_DV_EARLY"
FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=python timeout 100 python3 -m pytest -q -x tests/test_torch.py -k "backward" > "$OUT/pytest_bwd.log" 2>&1
echo "pytest backward rc=$?: $(tail -1 "$OUT/pytest_bwd.log")"
b build2 ""
for r in 1 2; do
  FLASH3_LIB=$PWD/build2/libflash3.so HDIMS=256 CAUSAL=0,1 SEQS=2048,4096,8192,16384 timeout 60 python3 exp/ab_time.py "v0$r" >> "$OUT/ab.txt" 2>&1
  FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=0,1 SEQS=2048,4096,8192,16384 timeout 60 python3 exp/ab_time.py "v1$r" >> "$OUT/ab.txt" 2>&1
done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

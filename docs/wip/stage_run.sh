#!/usr/bin/env bash
# Scratch (session 28, call 3, docs/perf-log.md B69): what a second Q/dO stage is worth at head dim
# 256, measured on B68's dQ-from-registers kernels (the only ones with room for it). Needs
# bwd_dq_red_hdim256_at_07e6742.patch applied plus two experiment switches that are not in it:
#   bwd_config.h, BwdTileConfig<256>: kRedStages = FLASH3_EXP_RED_STAGES where defined (else 2);
#   bwd_kernel.h, bwd_mainloop_ss: under -DFLASH3_EXP_RED_LAST the kDQRed branch (order dQ, dK, dV)
#   is skipped, and after the dQ wait of the common path kDQRed calls bwd_red_dq instead of
#   bwd_store_dq (order dK, dV, dQ, the reds after the dQ wait: call 1's order).
# One build with one stage, one with two, and the writers' path (FLASH3_EXP_DQ_RED=0) as the reference.
# Copy ab_time.py and ab_summary.py to exp/, then `bash exp/stage_run.sh` from the repository root.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; t0=$(date +%s)
for st in 1 2; do
  f="-DFLASH3_EXP_PERSIST_AB -DFLASH3_EXP_RED_LAST -DFLASH3_EXP_RED_STAGES=$st"
  cmake -S . -B build_s$st -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DFLASH3_BUILD_TESTS=OFF -DCMAKE_CUDA_FLAGS="$f" -DCMAKE_CXX_FLAGS="$f" > "$OUT/cfg$st.log" 2>&1
  cmake --build build_s$st -j16 --target flash3 > "$OUT/build$st.log" 2>&1 || { tail -30 "$OUT/build$st.log"; exit 1; }
  grep -c "C75" "$OUT/build$st.log"
done
echo "builds: $(( $(date +%s) - t0 )) s"
for r in 1 2 3; do
  FLASH3_LIB=$PWD/build_s1/libflash3.so HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v0$r" >> "$OUT/ab_stage.txt" 2>&1
  FLASH3_LIB=$PWD/build_s2/libflash3.so HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v1$r" | tee -a "$OUT/ab_stage.txt" >> "$OUT/ab_ref.txt" 2>&1
  FLASH3_EXP_DQ_RED=0 FLASH3_LIB=$PWD/build_s2/libflash3.so HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v0$r" >> "$OUT/ab_ref.txt" 2>&1
done
echo "v0 reds after dQ, one stage; v1 the same with two stages"; python3 exp/ab_summary.py "$OUT/ab_stage.txt"
echo "v0 writers (main's kernel); v1 reds after dQ with two stages"; python3 exp/ab_summary.py "$OUT/ab_ref.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

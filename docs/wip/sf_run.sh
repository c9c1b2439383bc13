#!/usr/bin/env bash
# Scratch (session 27, B66): store-first (no dQ clear) beyond 32 key blocks (FLASH3_EXP_SF_MAX) and at
# non-causal head dim 256 (FLASH3_EXP_SF_256NC=1), against main's rule. Needs a switch that is not on main:
# in bwd_dq_store_first (src/bwd/bwd_config.h, at 18e9ad0's signature), under -DFLASH3_EXP_PERSIST_AB,
# max_blocks = atoi(FLASH3_EXP_SF_MAX) (default 32) and non-causal 256 allowed where FLASH3_EXP_SF_256NC=1.
# That function runs in host C++ (bwd_api.cpp), so exp_build.sh passes EXP_FLAGS as CMAKE_CXX_FLAGS too
# (session 27 call 3 ran without it: both variants the same code). ovl_check.py's workspace is sized
# before the switch flips, so its check fails with a workspace-size error for this switch (call 4).
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" EXP_TESTS=OFF source exp/exp_build.sh
CHECK_VAR=FLASH3_EXP_SF_MAX CHECK_VALS=32,1000 HDIMS=64,128 timeout 150 python3 exp/ovl_check.py > "$OUT/check.txt" 2>&1; echo "check rc=$?: $(tail -1 "$OUT/check.txt")"
CHECK_VAR=FLASH3_EXP_SF_256NC HDIMS=256 timeout 100 python3 exp/ovl_check.py > "$OUT/check256.txt" 2>&1; echo "check256 rc=$?: $(tail -1 "$OUT/check256.txt")"
FLASH3_EXP_SF_MAX=128 FLASH3_EXP_SF_256NC=1 HDIMS=64,128,256 SEQS=8192,16384 timeout 100 python3 exp/kbreak.py > "$OUT/kbreak.txt" 2>&1; echo "kbreak rc=$?"
for r in 1 2 3; do for v in 0 1; do
  if [ $v = 1 ]; then export FLASH3_EXP_SF_MAX=64; else unset FLASH3_EXP_SF_MAX; fi
  HDIMS=64,128 CAUSAL=0,1 SEQS=8192 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab_sf64.txt" 2>&1
  if [ $v = 1 ]; then export FLASH3_EXP_SF_MAX=128; fi
  HDIMS=64,128 CAUSAL=0,1 SEQS=16384 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab_sf128.txt" 2>&1
  unset FLASH3_EXP_SF_MAX
  FLASH3_EXP_SF_256NC=$v HDIMS=256 CAUSAL=0 SEQS=512,1024,2048,4096 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab_sf256.txt" 2>&1
done; done
echo "v0 main, v1 store-first up to 64 key blocks (8k)"; python3 exp/ab_summary.py "$OUT/ab_sf64.txt"
echo "v0 main, v1 store-first up to 128 key blocks (16k)"; python3 exp/ab_summary.py "$OUT/ab_sf128.txt"
echo "v0 main, v1 store-first at non-causal head dim 256 (up to 32 key blocks)"; python3 exp/ab_summary.py "$OUT/ab_sf256.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# Scratch (session 32, B83): the backward preprocess with heads fastest in its block order
# (-DFLASH3_EXP_PRE_HEADS, bwd_kernel.h), so that the blocks running together read whole rows of
# O and dO (every head's 128-256 bytes of a row, contiguous) instead of one head's rows 2-8 KB
# apart. pytest backward with it; kbreak (per-kernel times) of both builds; A/B two rounds.
# cp -r docs/wip exp; `bash exp/pre_run.sh`.
source exp/exp_builds.sh
b build_pre "-DFLASH3_EXP_PRE_HEADS"
pyt build_pre
b build2 ""
for v in 0 1; do
  lib=$([ $v = 0 ] && echo build2 || echo build_pre)
  echo "== kbreak $lib" >> "$OUT/kbreak.txt"
  FLASH3_LIB=$PWD/$lib/libflash3.so HDIMS=64,128,256 SEQS=1024,2048,4096,8192 timeout 100 python3 exp/kbreak.py 2>/dev/null >> "$OUT/kbreak.txt"
done
grep -E "^ *(64|128|256) |==" "$OUT/kbreak.txt" | cut -c1-60
export HDIMS=64,128,256 CAUSAL=0,1 SEQS=1024,2048,4096
AB_TIMEOUT=80 abt 2 build2 build_pre
echo "elapsed $(( $(date +%s) - t0 )) s"

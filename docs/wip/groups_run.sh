#!/usr/bin/env bash
# Scratch (session 31): the deterministic mode's dQ copies (bwd_dq_groups) at head dim 256 causal,
# where det/default read 0.82-0.86 on an H200 (session 31 call 7). One build with
# -DFLASH3_EXP_PERSIST_AB; FLASH3_EXP_DQ_GROUPS=G forces G copies (the edit to bwd_config.h that reads
# it is not on main: docs/wip/bwd_dq_groups_env_at_d6d8157.patch, git apply first). `bash exp/groups_run.sh`.
source exp/exp_builds.sh
b build "-DFLASH3_EXP_PERSIST_AB"
for r in 1 2; do
  FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=1 SEQS=2048,4096,8192,16384 timeout 60 python3 exp/ab_time.py "def$r" >> "$OUT/ab.txt" 2>&1
  for g in 1 2 4; do
    FLASH3_EXP_DQ_GROUPS=$g DET=1 FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=1 SEQS=2048,4096,8192,16384 timeout 60 python3 exp/ab_time.py "g$g$r" >> "$OUT/ab.txt" 2>&1
  done
done
cat "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

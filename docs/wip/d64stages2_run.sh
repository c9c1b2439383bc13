#!/usr/bin/env bash
# Scratch (session 32, B84): head dim 64's Q/dO and dQ stages, after B82 (3 and 4): v1 four Q/dO
# stages and two dQ stages, v2 three and two, against main (v0). Needs the two macros
# FLASH3_EXP_D64_STAGES / FLASH3_EXP_D64_DQ in BwdTileConfig<64> (bwd_config.h; not on main).
# cp -r docs/wip exp; `bash exp/d64stages2_run.sh`.
source exp/exp_builds.sh
b build_v1 "-DFLASH3_EXP_D64_STAGES=4 -DFLASH3_EXP_D64_DQ=2"
FLASH3_LIB=$PWD/build_v1/libflash3.so PYTHONPATH=python timeout 100 python3 -m pytest -q -x tests/test_torch.py -k "backward" > "$OUT/pytest_bwd.log" 2>&1
echo "pytest backward (v1) rc=$?: $(tail -1 "$OUT/pytest_bwd.log")"
b build_v2 "-DFLASH3_EXP_D64_STAGES=3 -DFLASH3_EXP_D64_DQ=2"
b build_v0 ""
for r in 1 2; do
  for v in 0 1 2; do
    FLASH3_LIB=$PWD/build_v$v/libflash3.so HDIMS=64 CAUSAL=0,1 SEQS=1024,2048,4096,8192,16384 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
  done
done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

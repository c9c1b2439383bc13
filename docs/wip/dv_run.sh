#!/usr/bin/env bash
# Scratch (session 30, B75): head dim 256, P stored and dV issued before dS is computed
# (-DFLASH3_EXP_DV_EARLY; build, pytest) against main (build2). `bash exp/dv_run.sh`.
# FLAGS (build's flags), AB_HDIMS and AB_TIMEOUT change the defaults (dofirst_run.sh sets them).
source exp/exp_builds.sh
b build "${FLAGS:--DFLASH3_EXP_DV_EARLY}"
FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=python timeout 100 python3 -m pytest -q -x tests/test_torch.py -k "backward" > "$OUT/pytest_bwd.log" 2>&1
echo "pytest backward rc=$?: $(tail -1 "$OUT/pytest_bwd.log")"
b build2 ""
for r in 1 2; do
  FLASH3_LIB=$PWD/build2/libflash3.so HDIMS=${AB_HDIMS:-256} CAUSAL=0,1 SEQS=2048,4096,8192,16384 timeout ${AB_TIMEOUT:-60} python3 exp/ab_time.py "v0$r" >> "$OUT/ab.txt" 2>&1
  FLASH3_LIB=$PWD/build/libflash3.so HDIMS=${AB_HDIMS:-256} CAUSAL=0,1 SEQS=2048,4096,8192,16384 timeout ${AB_TIMEOUT:-60} python3 exp/ab_time.py "v1$r" >> "$OUT/ab.txt" 2>&1
done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

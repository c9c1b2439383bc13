#!/usr/bin/env bash
# Scratch (prepared in session 30, not run): B75 done fairly. The producer acquires the dO stage
# before the Q stage (-DFLASH3_EXP_DO_FIRST: every head dim; the swapped loop of head dims 64, 128
# already releases dO first), and head dim 256's loop issues dV before dS so that it releases dO
# first too (-DFLASH3_EXP_DV_EARLY). build: both switches (pytest); build2: main. Apply
# docs/wip/bwd_dv_early_do_first_hdim256_at_9144ad6.patch first, cp -r docs/wip exp, then
# `bash exp/dofirst_run.sh` (about 9 minutes on a lent H100).
source exp/exp_builds.sh
b build "-DFLASH3_EXP_DO_FIRST -DFLASH3_EXP_DV_EARLY"
FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=python timeout 100 python3 -m pytest -q -x tests/test_torch.py -k "backward" > "$OUT/pytest_bwd.log" 2>&1
echo "pytest backward rc=$?: $(tail -1 "$OUT/pytest_bwd.log")"
b build2 ""
for r in 1 2; do
  FLASH3_LIB=$PWD/build2/libflash3.so HDIMS=${AB_HDIMS:-256,128,64} CAUSAL=0,1 SEQS=2048,4096,8192,16384 timeout 100 python3 exp/ab_time.py "v0$r" >> "$OUT/ab.txt" 2>&1
  FLASH3_LIB=$PWD/build/libflash3.so HDIMS=${AB_HDIMS:-256,128,64} CAUSAL=0,1 SEQS=2048,4096,8192,16384 timeout 100 python3 exp/ab_time.py "v1$r" >> "$OUT/ab.txt" 2>&1
done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

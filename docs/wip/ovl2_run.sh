#!/usr/bin/env bash
# Scratch (session 26, B61, call 2): the check with the default mode's run-to-run differences, the
# per-kernel breakdown (exp/kbreak.py) with the postprocess per pair (1) and after the main kernel (0),
# and the deterministic A/B.
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" EXP_TESTS=OFF source exp/exp_build.sh
timeout 150 python3 exp/ovl_check.py > "$OUT/check.txt" 2>&1; echo "check rc=$?: $(tail -1 "$OUT/check.txt")"
for v in 1 0; do
  FLASH3_EXP_DQ_OVERLAP=$v SEQS=2048,4096,8192 timeout 200 python3 exp/kbreak.py > "$OUT/kbreak$v.txt" 2>&1; echo "kbreak $v rc=$?"
done
for r in 1 2; do for v in 0 1; do
  FLASH3_EXP_DQ_OVERLAP=$v DET=1 HDIMS=64,128,256 CAUSAL=0,1 SEQS=2048,4096,8192 timeout 100 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab_det.txt" 2>&1
done; done
echo "deterministic: v0 postprocess after the main kernel, v1 per pair"; python3 exp/ab_summary.py "$OUT/ab_det.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

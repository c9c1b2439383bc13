#!/usr/bin/env bash
# Scratch (session 25): the TMA-store dK/dV epilogue in the one-block-per-item kernels too.
# One build; gtest Bwd*, pytest; A/B FLASH3_EXP_TMA_EPI=0 (v0, row-by-row) against 1 (v1), 3 rounds.
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" source exp/exp_build.sh
timeout 200 ./build/flash3_tests --gtest_filter='Bwd*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1; echo "gtest rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
grep -E "FAILED|Failure" "$OUT/gtest.log" | head -10
PYTHONPATH=python timeout 60 python3 -m pytest -q -x tests/test_torch.py 2>&1 | tail -1
echo "tests done $(( $(date +%s) - t0 )) s"
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_TMA_EPI=$v HDIMS=64,128,256 SEQS=${SEQS:-512,1024,2048,4096,8192,16384} timeout 120 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
done; echo "round $r $(( $(date +%s) - t0 )) s"; done
python3 exp/ab_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

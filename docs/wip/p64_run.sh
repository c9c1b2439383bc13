#!/usr/bin/env bash
# Scratch (session 24, not run): the head dim 64 persistent kernel with the per-item cost cut
# (bwd_persistent_hdim64_per_item_cost_at_ead469b.patch): check against the one-block kernel,
# gtest, pytest, A/B (v0 one block per item, v1 the patched persistent kernel), and the same
# with the row-by-row epilogue (FLASH3_EXP_TMA_EPI=0) as v1 for a second summary; then the
# per-item stamps (exp/pstamps64.py). Built with the stamps compiled in (inactive unless
# FLASH3_STAMPS_OUT is set: a null test per stamp in the persistent kernel only).
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB -DFLASH3_EXP_STAMPS" source exp/exp_build.sh
CAUSAL=1 ONLY64=1 timeout 60 python3 exp/persist_check.py 2>&1 | tee "$OUT/check.log"
grep -q "persist_check PASSED" "$OUT/check.log" || { echo "check failed: no timing"; exit 1; }
timeout 150 ./build/flash3_tests --gtest_filter='BwdGpuGraphs*:BwdGpuPersistent*:BwdGpuDeterministic*:BwdGpuSmall*:BwdGpuLong*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1; echo "gtest rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
grep -E "FAILED|Failure" "$OUT/gtest.log" | head -10
PYTHONPATH=python timeout 40 python3 -m pytest -q -x tests/test_torch.py 2>&1 | tail -1
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_PERSIST=$v HDIMS=64 CAUSAL=1 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
  [ $v = 1 ] && FLASH3_EXP_TMA_EPI=0 HDIMS=64 CAUSAL=1 timeout 60 python3 exp/ab_time.py "v1$r" >> "$OUT/ab_rows.txt" 2>&1
done; done
python3 exp/ab_summary.py "$OUT/ab.txt"
grep '^v0' "$OUT/ab.txt" >> "$OUT/ab_rows.txt"; echo "row-by-row epilogue:"; python3 exp/ab_summary.py "$OUT/ab_rows.txt"
timeout 60 python3 exp/pstamps64.py 2>&1 | tee "$OUT/pstamps64.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

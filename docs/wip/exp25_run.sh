#!/usr/bin/env bash
# Scratch (session 25): (a) head dim 64 non-causal persistent (with early K/V and TMA epilogue) against
# one block per item; (b) causal persistent: dK/dV staged in their own buffer (FLASH3_EXP_STAGE=1)
# against the dS^T buffers (0).
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB -DFLASH3_EXP_PERSIST_NONCAUSAL" source exp/exp_build.sh
for c in 0 1; do CAUSAL=$c ONLY64=1 timeout 60 python3 exp/persist_check.py 2>&1 | tee -a "$OUT/check.log"; done
[ "$(grep -c 'persist_check PASSED' "$OUT/check.log")" = 2 ] || { echo "check failed: no timing"; exit 1; }
FLASH3_EXP_STAGE=0 CAUSAL=1 ONLY64=1 timeout 60 python3 exp/persist_check.py 2>&1 | tail -1
timeout 200 ./build/flash3_tests --gtest_filter='Bwd*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1; echo "gtest rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
grep -E "FAILED|Failure" "$OUT/gtest.log" | head -10
PYTHONPATH=python timeout 60 python3 -m pytest -q -x tests/test_torch.py 2>&1 | tail -1
echo "tests done $(( $(date +%s) - t0 )) s"
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_PERSIST=$v HDIMS=64 CAUSAL=0 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab_nc.txt" 2>&1
  FLASH3_EXP_STAGE=$v HDIMS=64 CAUSAL=1 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab_stage.txt" 2>&1
done; done
echo "(a) non-causal: v0 one block per item, v1 persistent"; python3 exp/ab_summary.py "$OUT/ab_nc.txt"
echo "(b) causal persistent: v0 staged in dS^T buffers, v1 own staging buffer"; python3 exp/ab_summary.py "$OUT/ab_stage.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

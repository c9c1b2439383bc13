#!/usr/bin/env bash
# Scratch (session 25, call 5): the persistent kernel's next-item request early (v0, FLASH3_EXP_LATE=0)
# or after the item's last load (v1, FLASH3_EXP_LATE=1), deterministic and default, head dim 64.
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" source exp/exp_build.sh
for L in 0 1; do
  timeout 200 env FLASH3_EXP_LATE=$L ./build/flash3_tests --gtest_filter='BwdGpuPersistent*:BwdGpuDeterministic*:BwdGpuSmall*:BwdGpuGraphs*' --gtest_brief=1 > "$OUT/gtest$L.log" 2>&1; echo "late=$L gtest rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest$L.log" | tr '\n' ' ')"
done
PYTHONPATH=python timeout 60 python3 -m pytest -q -x tests/test_torch.py 2>&1 | tail -1
echo "tests done $(( $(date +%s) - t0 )) s"
for r in 1 2 3; do for v in 0 1; do for det in 0 1; do
  FLASH3_EXP_LATE=$v DET=$det HDIMS=64 CAUSAL=0,1 timeout 100 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab_det$det.txt" 2>&1
done; done; done
echo "deterministic: v0 early request, v1 late"; python3 exp/ab_summary.py "$OUT/ab_det1.txt"
echo "default: v0 early request, v1 late"; python3 exp/ab_summary.py "$OUT/ab_det0.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

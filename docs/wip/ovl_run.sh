#!/usr/bin/env bash
# Scratch (session 26, B61): the dQ postprocess per pair under the main kernel's tail (v1, default) or after
# the whole main kernel (v0, FLASH3_EXP_DQ_OVERLAP=0).
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" source exp/exp_build.sh
timeout 150 python3 exp/ovl_check.py > "$OUT/check.txt" 2>&1; echo "check rc=$?: $(tail -1 "$OUT/check.txt")"
timeout 240 ./build/flash3_tests --gtest_filter='Bwd*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1; echo "gtest rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
PYTHONPATH=python timeout 90 python3 -m pytest -q -x tests/test_torch.py > "$OUT/pytest.log" 2>&1; echo "pytest: $(tail -1 "$OUT/pytest.log")"
echo "tests done $(( $(date +%s) - t0 )) s"
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_DQ_OVERLAP=$v HDIMS=64,128,256 CAUSAL=0,1 timeout 100 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
done; done
echo "v0 postprocess after the main kernel, v1 per pair under its tail (columns: v0 rounds | v1 rounds | ratio)"; python3 exp/ab_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

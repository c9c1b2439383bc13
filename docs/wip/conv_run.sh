#!/usr/bin/env bash
# Scratch (session 27, B65): the dQ converter warp in the main kernel (v1, FLASH3_EXP_DQ_CONV=1) against
# B61's postprocess alone (v0).
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" source exp/exp_build.sh
CHECK_VAR=FLASH3_EXP_DQ_CONV HDIMS=128,256 timeout 150 python3 exp/ovl_check.py > "$OUT/check.txt" 2>&1; echo "check rc=$?: $(tail -1 "$OUT/check.txt")"
timeout 240 ./build/flash3_tests --gtest_filter='Bwd*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1; echo "gtest rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
PYTHONPATH=python timeout 90 python3 -m pytest -q -x tests/test_torch.py > "$OUT/pytest.log" 2>&1; echo "pytest: $(tail -1 "$OUT/pytest.log")"
echo "tests done $(( $(date +%s) - t0 )) s"
FLASH3_EXP_DQ_CONV=1 HDIMS=128,256 SEQS=2048,4096 timeout 100 python3 exp/kbreak.py > "$OUT/kbreak.txt" 2>&1; echo "kbreak rc=$?"
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_DQ_CONV=$v HDIMS=128,256 CAUSAL=0,1 timeout 100 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
done; done
echo "v0 B61 postprocess, v1 converter warp (columns: v0 rounds | v1 rounds | ratio)"; python3 exp/ab_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"
for v in 0 1; do  # the converter's cut-off: v0 4 visits left, v1 16 (8 above)
  FLASH3_EXP_CONV_LEFT=$(( v ? 16 : 4 )) HDIMS=128,256 SEQS=2048,4096 timeout 60 python3 exp/ab_time.py "v${v}1" >> "$OUT/ab_left.txt" 2>&1
done
echo "v0 conv_min_left 4, v1 16"; python3 exp/ab_summary.py "$OUT/ab_left.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

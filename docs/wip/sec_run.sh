#!/usr/bin/env bash
# Scratch (session 26, call 4, B63): the causal backward's sections as even as they go (v1) or B50's
# ceil(pairs / sections) with the last one the rest (v0, FLASH3_EXP_SECTIONS=0). The switch was on
# the measured build only (bwd_l2_sections under -DFLASH3_EXP_PERSIST_AB returned -size for B50's
# order, which bwd_kernel.h's bwd_causal_item then took); main keeps B50's sizes where the last
# section holds at least half of one (BwdSections), so both layouts are in causal_order.h.
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" source exp/exp_build.sh
./build/flash3_tests --gtest_filter='CausalOrder*' --gtest_brief=1 2>&1 | grep -E '^\[  (PASSED|FAILED) '
timeout 240 ./build/flash3_tests --gtest_filter='Bwd*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1; echo "gtest rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
PYTHONPATH=python timeout 90 python3 -m pytest -q -x tests/test_torch.py > "$OUT/pytest.log" 2>&1; echo "pytest: $(tail -1 "$OUT/pytest.log")"
echo "tests done $(( $(date +%s) - t0 )) s"
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_SECTIONS=$v HDIMS=64,128,256 CAUSAL=1 timeout 100 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
done; done
echo "v0 B50 sections, v1 even (columns: v0 rounds | v1 rounds | ratio)"; python3 exp/ab_summary.py "$OUT/ab.txt"
for v in 0 1; do FLASH3_EXP_SECTIONS=$v DET=1 HDIMS=64,128,256 CAUSAL=1 SEQS=4096,8192,16384 timeout 100 python3 exp/ab_time.py "v${v}1" >> "$OUT/ab_det.txt" 2>&1; done
echo "deterministic:"; python3 exp/ab_summary.py "$OUT/ab_det.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

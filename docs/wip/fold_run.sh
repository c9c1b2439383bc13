#!/usr/bin/env bash
# Scratch (prepared in session 26, not run): docs/wip/bwd_dq_fold_at_62fbfcd.patch, the dQ conversion in
# the main kernel (head dims 128, 256: the block whose writer completes a pair's count converts the
# pair's dQ; no postprocess kernel) against B61's postprocess (FLASH3_EXP_DQ_FOLD=0).
# git apply docs/wip/bwd_dq_fold_at_62fbfcd.patch; mkdir -p exp; cp docs/wip/{exp_build.sh,ab_time.py,ab_summary.py,ovl_check.py,kbreak.py} exp/
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" source exp/exp_build.sh
CHECK_VAR=FLASH3_EXP_DQ_FOLD HDIMS=128,256 timeout 150 python3 exp/ovl_check.py > "$OUT/check.txt" 2>&1; echo "check rc=$?: $(tail -1 "$OUT/check.txt")"
timeout 240 ./build/flash3_tests --gtest_filter='Bwd*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1; echo "gtest rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
PYTHONPATH=python timeout 90 python3 -m pytest -q -x tests/test_torch.py > "$OUT/pytest.log" 2>&1; echo "pytest: $(tail -1 "$OUT/pytest.log")"
echo "tests done $(( $(date +%s) - t0 )) s"
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_DQ_FOLD=$v HDIMS=128,256 CAUSAL=0,1 timeout 100 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
done; done
echo "v0 B61 postprocess, v1 dQ converted in the main kernel (columns: v0 rounds | v1 rounds | ratio)"; python3 exp/ab_summary.py "$OUT/ab.txt"
for v in 0 1; do  # the 2 MB limit (bwd_dq_fold): v1 folds every length, v0 as built
  FLASH3_EXP_DQ_FOLD_MB=$(( v ? 1024 : 2 )) HDIMS=128,256 SEQS=4096,8192,16384 timeout 100 python3 exp/ab_time.py "v${v}1" >> "$OUT/ab_limit.txt" 2>&1
done
echo "v0 fold up to 2 MB per pair, v1 fold everywhere"; python3 exp/ab_summary.py "$OUT/ab_limit.txt"
FLASH3_EXP_DQ_FOLD=1 HDIMS=128,256 SEQS=2048,4096 timeout 100 python3 exp/kbreak.py > "$OUT/kbreak.txt" 2>&1; echo "kbreak rc=$?"
echo "elapsed $(( $(date +%s) - t0 )) s"

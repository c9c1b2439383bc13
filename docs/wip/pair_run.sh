# Scratch (session 28, B71, device call 8): key-block pairs (two-block clusters) summing dQ on chip at head
# dim 256 (docs/wip/bwd_dq_pair_hdim256_at_*.patch, -DFLASH3_EXP_DQ_PAIR, FLASH3_EXP_DQ_PAIR=1/0 in one build).
# Copy ab_time.py, ab_summary.py, exp_build.sh, pair_dbg.py and this file to exp/, then `bash exp/pair_run.sh`.
# (In call 8 pair_dbg.py still toggled the switch between two calls in one process, which the binding's
# cached workspace size does not follow, and failed with a workspace-size error; it now compares with FP32
# autograd instead.)
EXP_FLAGS="-DFLASH3_EXP_DQ_PAIR" EXP_TESTS=ON source exp/exp_build.sh
export PYTHONPATH=python
for cfg in "128 1 1" "2048 2 2"; do set -- $cfg; S=$1 B=$2 H=$3 FLASH3_EXP_DQ_PAIR=1 timeout 60 python3 exp/pair_dbg.py 2>&1 | tail -2; done
FLASH3_EXP_DQ_PAIR=1 timeout 90 compute-sanitizer --tool memcheck --print-limit 5 python3 exp/pair_dbg.py > $OUT/san.txt 2>&1; echo "san rc=$?"; grep -E "ERROR SUMMARY|Invalid|max" $OUT/san.txt | head -5
export FLASH3_EXP_DQ_PAIR=1
t1=$(date +%s)
timeout 150 ./build/flash3_tests --gtest_filter='*d256*:BwdGpuSmall.*:BwdGpuLong.*' --gtest_brief=1 > "$OUT/gtest_pair.log" 2>&1
echo "gtest d256 + small + long (pairs on) rc=$? in $(( $(date +%s) - t1 )) s: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest_pair.log" | tr '\n' ' ' | cut -c1-300)"
grep -E "Failure" -A6 "$OUT/gtest_pair.log" | head -20
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_DQ_PAIR=$v HDIMS=256 CAUSAL=0 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab_pair.txt" 2>&1
done; done
echo "v0 main's kernel, v1 key-block pairs summing dQ on chip (head dim 256, non-causal)"; python3 exp/ab_summary.py "$OUT/ab_pair.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

# Scratch (session 28 call 9, B71's second version: bwd_dq_pair_v4_hdim256_at_*.patch, 16-byte pushes and one remote
# arrival per warp). Copy ab_time.py, ab_summary.py, exp_build.sh and this file to exp/, then `bash exp/pair2_run.sh`.
EXP_FLAGS="-DFLASH3_EXP_DQ_PAIR" EXP_TESTS=ON source exp/exp_build.sh
t1=$(date +%s)
FLASH3_EXP_DQ_PAIR=1 timeout 100 ./build/flash3_tests --gtest_filter='*BwdGpu.*d256_full*:BwdGpuSmall.Padded*' --gtest_brief=1 > "$OUT/gtest_pair.log" 2>&1
echo "gtest (pairs on) rc=$? in $(( $(date +%s) - t1 )) s: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest_pair.log" | tr '\n' ' ' | cut -c1-300)"
for r in 1 2; do for v in 0 1; do
  FLASH3_EXP_DQ_PAIR=$v HDIMS=256 CAUSAL=0 SEQS=1024,2048,4096,16384 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab_pair2.txt" 2>&1
done; done
echo "v0 main's kernel, v1 pairs (v4 pushes, one arrival per warp)"; python3 exp/ab_summary.py "$OUT/ab_pair2.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

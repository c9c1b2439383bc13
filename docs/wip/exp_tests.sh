# Scratch: the experiment scripts' backward checks, sourced from the repository root as
# exp/exp_tests.sh after a build with tests: gtest `Bwd*:CausalOrder*`, pytest `-k backward`, memcheck
# on `BwdGpuSmall.*`, logs under $OUT. TEST_BUILD: the build directory (default build; pytest then
# loads its libflash3.so); GTEST_TIMEOUT: gtest's limit in seconds (default 240).
TEST_BUILD=${TEST_BUILD:-build}
t1=$(date +%s)
timeout "${GTEST_TIMEOUT:-240}" "./$TEST_BUILD/flash3_tests" --gtest_filter='Bwd*:CausalOrder*' --gtest_brief=1 > "$OUT/gtest_bwd.log" 2>&1
echo "gtest Bwd* ($TEST_BUILD) rc=$? in $(( $(date +%s) - t1 )) s: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest_bwd.log" | tr '\n' ' ')"
grep -E "FAILED|Failure" "$OUT/gtest_bwd.log" | head -20
FLASH3_LIB=$PWD/$TEST_BUILD/libflash3.so PYTHONPATH=python timeout 200 python3 -m pytest -q -x tests/test_torch.py -k "backward" > "$OUT/pytest_bwd.log" 2>&1
echo "pytest backward ($TEST_BUILD) rc=$?: $(tail -1 "$OUT/pytest_bwd.log")"
timeout 150 compute-sanitizer --tool memcheck --error-exitcode 9 "./$TEST_BUILD/flash3_tests" --gtest_filter='BwdGpuSmall.*' --gtest_brief=1 > "$OUT/memcheck.log" 2>&1
echo "memcheck ($TEST_BUILD) rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"

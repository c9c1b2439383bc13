#!/usr/bin/env bash
# Scratch (session 27, B67): the head dim 64 persistent kernel on k fewer SMs than the GPU has
# (FLASH3_EXP_PGRID_SUB=k), so that the per-pair postprocess (B61) runs beside it on k SMs.
EXP_FLAGS="-DFLASH3_EXP_PERSIST_AB" source exp/exp_build.sh
timeout 240 ./build/flash3_tests --gtest_filter='Bwd*:CausalOrder*' --gtest_brief=1 > "$OUT/gtest.log" 2>&1; echo "gtest rc=$?: $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/gtest.log" | tr '\n' ' ')"
PYTHONPATH=python timeout 90 python3 -m pytest -q -x tests/test_torch.py > "$OUT/pytest.log" 2>&1; echo "pytest: $(tail -1 "$OUT/pytest.log")"
FLASH3_EXP_PGRID_SUB=4 PYTHONPATH=python timeout 90 python3 -m pytest -q -x tests/test_torch.py -k backward > "$OUT/pytest_pgrid.log" 2>&1; echo "pytest (128 SMs): $(tail -1 "$OUT/pytest_pgrid.log")"
FLASH3_EXP_PGRID_SUB=4 HDIMS=64 SEQS=2048,4096,8192 timeout 100 python3 exp/kbreak.py > "$OUT/kbreak.txt" 2>&1; echo "kbreak rc=$?"
for r in 1 2 3; do for v in 0 1; do
  FLASH3_EXP_PGRID_SUB=$(( v ? 4 : 0 )) HDIMS=64 CAUSAL=0,1 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab4.txt" 2>&1
  FLASH3_EXP_PGRID_SUB=$(( v ? 2 : 0 )) HDIMS=64 CAUSAL=1 SEQS=2048,4096,8192 timeout 60 python3 exp/ab_time.py "v$v$r" >> "$OUT/ab2.txt" 2>&1
done; done
echo "v0 132 SMs, v1 128 (head dim 64)"; python3 exp/ab_summary.py "$OUT/ab4.txt"
echo "v0 132 SMs, v1 130 (head dim 64 causal)"; python3 exp/ab_summary.py "$OUT/ab2.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# scratch (session 33, H2): the binding with and without ctx.set_materialize_grads(False), host time
# per backward call (bench/host_overhead.py) and no-spin event time at three sweep points,
# alternated; plus the whole pytest file with the new binding. Run from the repository root after
# `bash scripts/device_run.sh build`, with the old package in exp/py_old (git show HEAD~:...).
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
export FLASH3_LIB=$PWD/build/libflash3.so
PYTHONPATH=python timeout 300 python3 -m pytest -q tests/test_torch.py 2>&1 | tail -3 | tee "$OUT/pytest.txt"
for r in 1 2 3; do
  for v in old new; do
    dir=python; [ $v = old ] && dir=exp/py_old
    echo "== round $r $v" | tee -a "$OUT/host_ab.txt"
    PYTHONPATH=$dir python3 bench/host_overhead.py --calls 500 2>&1 | grep -E "backward|forward" | tee -a "$OUT/host_ab.txt"
    PYDIR=$dir IMPLS=flash3 python3 exp/host_gap.py 2>&1 | grep -v -i warn | tee -a "$OUT/host_ab.txt"
  done
done

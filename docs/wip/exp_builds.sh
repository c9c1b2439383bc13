# Scratch: the experiment scripts' common start, sourced from the repository root as
# exp/exp_builds.sh: $OUT, t0, and b DIR "FLAGS" [TESTS], which configures and builds the library
# (with the tests when TESTS is ON; the benchmark off) in DIR with FLAGS as CMAKE_CUDA_FLAGS and
# CMAKE_CXX_FLAGS, and exits the script on a failed build.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"; t0=$(date +%s)
b() {
  cmake -S . -B "$1" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DFLASH3_BUILD_TESTS=${3:-OFF} \
    -DCMAKE_CUDA_FLAGS="$2" -DCMAKE_CXX_FLAGS="$2" > "$OUT/cfg_$1.log" 2>&1
  cmake --build "$1" -j16 > "$OUT/build_$1.log" 2>&1 || { tail -30 "$OUT/build_$1.log"; exit 1; }
  echo "$1 built at $(( $(date +%s) - t0 )) s"
}
# abt ROUNDS DIR0 DIR1 ...: exp/ab_time.py over the builds in turn, ROUNDS times (tags v<k><round>,
# k = the build's place in the list), into $OUT/ab.txt, then exp/abn_summary.py over it. The points
# come from HDIMS, CAUSAL, SEQS (exported); AB_TIMEOUT limits each run (default 60 s).
abt() {
  local rounds=$1 r v d; shift
  for r in $(seq 1 "$rounds"); do
    v=0
    for d in "$@"; do
      FLASH3_LIB=$PWD/$d/libflash3.so timeout "${AB_TIMEOUT:-60}" python3 exp/ab_time.py "v$v$r" >> "$OUT/ab.txt" 2>&1
      v=$((v + 1))
    done
  done
  python3 exp/abn_summary.py "$OUT/ab.txt"
}
# pyt DIR: pytest `-k backward` with DIR's library, its last line echoed.
pyt() {
  FLASH3_LIB=$PWD/$1/libflash3.so PYTHONPATH=python timeout 100 python3 -m pytest -q -x tests/test_torch.py -k "backward" > "$OUT/pytest_bwd.log" 2>&1
  echo "pytest backward ($1) rc=$?: $(tail -1 "$OUT/pytest_bwd.log")"
}

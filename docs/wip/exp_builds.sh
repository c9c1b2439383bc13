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

# Scratch: the experiment scripts' common start, sourced from the repository root as exp/exp_build.sh
# with EXP_FLAGS set (CMAKE_CUDA_FLAGS of the experiment build; EXP_TESTS=OFF leaves the tests
# out and builds the library only): $OUT, t0, the build (benchmark off), FLASH3_LIB.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
t0=$(date +%s)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_BENCH=OFF -DFLASH3_BUILD_TESTS="${EXP_TESTS:-ON}" -DCMAKE_CUDA_FLAGS="$EXP_FLAGS" -DCMAKE_CXX_FLAGS="$EXP_FLAGS" > "$OUT/cfg.log" 2>&1
cmake --build build -j16 --target "$( [ "${EXP_TESTS:-ON}" = OFF ] && echo flash3 || echo all )" > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
export FLASH3_LIB=$PWD/build/libflash3.so

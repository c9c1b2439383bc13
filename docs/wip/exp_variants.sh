# Scratch (session 33): variants against main in one call, sourced from the repository root as
# exp/exp_variants.sh (after exp/exp_builds.sh): variants_ab TESTED NAME:FLAGS ..., each variant
# built in build_NAME (the one named TESTED with tests, then checked by exp_tests.sh: gtest Bwd*,
# pytest backward, memcheck), then main (build2), then ROUNDS (default 2) rounds of the A/B
# main / the variants in the order given (tags v0 = main, v1 = the first given, ...).
variants_ab() {
  local tested=$1 v name flags dirs=()
  shift
  for v in "$@"; do
    name=${v%%:*}; flags=${v#*:}
    if [ "$name" = "$tested" ]; then
      b "build_$name" "$flags" ON
      TEST_BUILD="build_$name" GTEST_TIMEOUT=200 source exp/exp_tests.sh
    else
      b "build_$name" "$flags"
    fi
    dirs+=("build_$name")
  done
  b build2 ""
  abt "${ROUNDS:-2}" build2 "${dirs[@]}"
}

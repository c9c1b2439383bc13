#!/usr/bin/env bash
# Scratch (session 33, B93): FA3's head dim 64 tile (B92's patch, applied) three ways against main:
# z = -DFLASH3_EXP_M128=2 -DFLASH3_EXP_DSFIRST (B92), y = z + -DFLASH3_EXP_FA3WAIT (dV waited for
# before dK is issued, dQ before the loop goes on: two GEMMs in flight at most, as FA3),
# x = y + -DFLASH3_EXP_DQWG (each warpgroup waits for the dQ buffer on its own barrier with the
# writer). x built with tests (gtest Bwd*, pytest backward, memcheck), then the A/B of
# main / z / y / x over HDIMS x CAUSAL x SEQS (exported by the caller), ROUNDS rounds.
source exp/exp_builds.sh
source exp/exp_variants.sh
Z="-DFLASH3_EXP_M128=2 -DFLASH3_EXP_DSFIRST"
variants_ab x "z:$Z" "y:$Z -DFLASH3_EXP_FA3WAIT" "x:$Z -DFLASH3_EXP_FA3WAIT -DFLASH3_EXP_DQWG"
echo "elapsed $(( $(date +%s) - t0 )) s"

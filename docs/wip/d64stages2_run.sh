#!/usr/bin/env bash
# Scratch (session 32, B84): head dim 64's Q/dO and dQ stages, after B82 (3 and 4): v1 four Q/dO
# stages and two dQ stages, v2 three and two, against main (v0). Needs the two macros
# FLASH3_EXP_D64_STAGES / FLASH3_EXP_D64_DQ in BwdTileConfig<64> (bwd_config.h; not on main).
# cp -r docs/wip exp; `bash exp/d64stages2_run.sh`.
source exp/exp_builds.sh
b build_v1 "-DFLASH3_EXP_D64_STAGES=4 -DFLASH3_EXP_D64_DQ=2"
pyt build_v1
b build_v2 "-DFLASH3_EXP_D64_STAGES=3 -DFLASH3_EXP_D64_DQ=2"
b build_v0 ""
export HDIMS=64 CAUSAL=0,1 SEQS=1024,2048,4096,8192,16384
abt 2 build_v0 build_v1 build_v2
echo "elapsed $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# Scratch (session 32, B82): head dim 64 with a third Q/dO stage (-DFLASH3_EXP_D64_STAGES=3, a
# macro for kStages in BwdTileConfig<64>, gone since B82 landed; 226.5 KB of shared memory with the
# persistent kernel's buffers) against main: gtest Bwd*, pytest backward, memcheck with it, then
# A/B three rounds. cp -r docs/wip exp; `bash exp/d64stages_run.sh`.
export HDIMS=64 CAUSAL=0,1 SEQS=1024,2048,4096,8192,16384
FLAGS="-DFLASH3_EXP_D64_STAGES=3" ROUNDS=3 bash exp/vab_run.sh

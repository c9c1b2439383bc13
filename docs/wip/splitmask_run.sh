#!/usr/bin/env bash
# Scratch (session 32, B89): head dim 64's swapped loop split in two, the visits that need no mask
# first with no mask code at all, then the masked ones (-DFLASH3_EXP_SPLIT_MASK in
# bwd_mainloop_swapped) against main. cp -r docs/wip exp; `bash exp/splitmask_run.sh`.
export HDIMS=64 CAUSAL=0,1 SEQS=1024,2048,4096,8192,16384
FLAGS="-DFLASH3_EXP_SPLIT_MASK" ROUNDS=3 bash exp/vab_run.sh

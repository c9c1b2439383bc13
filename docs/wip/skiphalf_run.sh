#!/usr/bin/env bash
# Scratch (session 32, B88): the causal visit whose warpgroup's 64 keys are all masked skips that
# warpgroup's S^T, dP^T, dV, dK GEMMs and exponentials (dS^T = 0 still stored for the dQ GEMM;
# -DFLASH3_EXP_SKIP_HALF in bwd_mainloop_swapped, head dims 64 and 128) against main.
# cp -r docs/wip exp; `bash exp/skiphalf_run.sh`.
export HDIMS=64,128 CAUSAL=1 SEQS=1024,2048,4096,8192,16384
FLAGS="-DFLASH3_EXP_SKIP_HALF" ROUNDS=3 bash exp/vab_run.sh

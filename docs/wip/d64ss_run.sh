#!/usr/bin/env bash
# Scratch (session 32, B81): head dim 64 with FlashAttention-3's layout, 128 x 128 not swapped,
# every GEMM from shared memory (-DFLASH3_EXP_D64_SS=<dQ stages>, bwd_config.h; the one-block
# kernel, no persistence) against main. Apply docs/wip/bwd_d64_ss_128x128_at_80e722d.patch first;
# cp -r docs/wip exp; `bash exp/d64ss_run.sh`.
export HDIMS=64 CAUSAL=0,1 SEQS=1024,2048,4096,8192,16384
FLAGS="-DFLASH3_EXP_D64_SS=${DQ_STAGES:-2}" ROUNDS=2 bash exp/vab_run.sh

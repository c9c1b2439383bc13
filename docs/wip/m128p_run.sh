#!/usr/bin/env bash
# Scratch (session 33, B93): x = FA3's head dim 64 tile with the per-warpgroup dQ hand-off, persistent
# (-DFLASH3_EXP_M128P: the persistent kernel without kEarlyKV, K, V loaded under the epilogue),
# with tests; w = the same, one block per item (B93's best of call 5); h = main with the
# per-warpgroup dQ hand-off at head dim 128 (-DFLASH3_EXP_DQWG -DFLASH3_EXP_DQWG128); main. A/B of
# main / w / x / h over HDIMS x CAUSAL x SEQS (exported), ROUNDS rounds.
source exp/exp_builds.sh
source exp/exp_variants.sh
W="-DFLASH3_EXP_M128=2 -DFLASH3_EXP_DSFIRST -DFLASH3_EXP_DQWG"
variants_ab x "w:$W" "x:$W -DFLASH3_EXP_M128P" "h:-DFLASH3_EXP_DQWG -DFLASH3_EXP_DQWG128"
echo "elapsed $(( $(date +%s) - t0 )) s"

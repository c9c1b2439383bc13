#!/usr/bin/env bash
# Scratch (prepared in session 30, not run): B75 done fairly. The producer acquires the dO stage
# before the Q stage (-DFLASH3_EXP_DO_FIRST: every head dim; the swapped loop of head dims 64, 128
# already releases dO first), and head dim 256's loop issues dV before dS so that it releases dO
# first too (-DFLASH3_EXP_DV_EARLY). build: both switches (pytest); build2: main. Apply
# docs/wip/bwd_dv_early_do_first_hdim256_at_9144ad6.patch first, cp -r docs/wip exp, then
# `bash exp/dofirst_run.sh` (about 9 minutes on a lent H100).
FLAGS="-DFLASH3_EXP_DO_FIRST -DFLASH3_EXP_DV_EARLY" AB_HDIMS=${AB_HDIMS:-256,128,64} AB_TIMEOUT=100 bash exp/dv_run.sh

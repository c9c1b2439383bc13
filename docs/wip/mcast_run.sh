#!/usr/bin/env bash
# Scratch (prepared in session 30, not run): head dim 256 non-causal, default mode, even key-block
# counts: key blocks 2p, 2p + 1 as two-block clusters loading each Q, dO tile once by TMA multicast
# (BwdTraits<..., kMcast = true>, -DFLASH3_EXP_MCAST; FLASH3_EXP_MCAST=0 at run time falls back to
# main's kernel in the same build). Apply docs/wip/bwd_mcast_qdo_hdim256_at_b9ec609.patch,
# cp -r docs/wip exp, then `bash exp/mcast_run.sh` (about 5 minutes on a lent H100).
source exp/exp_builds.sh
b build "-DFLASH3_EXP_MCAST" ON
TEST_BUILD=build source exp/exp_tests.sh
for r in 1 2 3; do
  FLASH3_EXP_MCAST=0 FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=0 timeout 90 python3 exp/ab_time.py "v0$r" >> "$OUT/ab.txt" 2>&1
  FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=0 timeout 90 python3 exp/ab_time.py "v1$r" >> "$OUT/ab.txt" 2>&1
done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

#!/usr/bin/env bash
# Scratch (session 30, B73): head dim 256 with S and dP each computed whole by one warpgroup
# (m64n64 SS, kSdPByGemm; build, tested) against main's split (m64n32 SS; build2,
# -DFLASH3_EXP_SDP_OFF). `bash exp/sdp_run.sh`.
source exp/exp_builds.sh
b build "" ON
cuobjdump --dump-sass build/CMakeFiles/flash3.dir/src/bwd/bwd_bf16_hdim256.cu.o | grep -oE "HGMMA\.[0-9x]+" | sort | uniq -c > "$OUT/hgmma256.txt"; cat "$OUT/hgmma256.txt"
TEST_BUILD=build source exp/exp_tests.sh
b build2 "-DFLASH3_EXP_SDP_OFF" OFF
for r in 1 2 3; do
  FLASH3_LIB=$PWD/build2/libflash3.so HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v0$r" >> "$OUT/ab.txt" 2>&1
  FLASH3_LIB=$PWD/build/libflash3.so HDIMS=256 CAUSAL=0,1 timeout 90 python3 exp/ab_time.py "v1$r" >> "$OUT/ab.txt" 2>&1
done
python3 exp/abn_summary.py "$OUT/ab.txt"
echo "elapsed $(( $(date +%s) - t0 )) s"

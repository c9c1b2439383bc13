#!/usr/bin/env bash
# flash3: everything the GPU machine does in one call: build with all cores, check the SASS and
# the register report, run the GPU tests (gtest + pytest), compute-sanitizer on a small subset,
# and the benchmarks. Logs and JSON go to $OUT (default ./out). The CUTLASS headers and the
# GoogleTest sources must already be in third_party/ (run scripts/setup.sh here, then carry
# third_party: the GPU machine has no network).
#   usage: bash scripts/device_run.sh [all|build|bwdcheck|test|sanitize|profile|prof|causal|bench|bwdbench|power|fp8|mask|varlen|decode|gqa|quick]...
# fp8: bench/bench_fp8.py (the FP8 forward beside FlashAttention-3's, Table 3, the quantizer);
# it needs .anchors/fa3_anchor.so.xz carried (../shared/anchors/fa3/), else runs without FA3.
# gqa: bench/compare_builds.py --gqa (GQA 8:1 shapes, head dim 128, forward and backward, beside
# FlashAttention-3 and cuDNN; the same anchor): $OUT/gqa.json and its charts.
# mask: bench/bench_mask.py (sliding window and softcap beside FlashAttention-3; the same anchor).
# varlen: bench/bench_varlen.py (variable-length batches beside FlashAttention-3; the same anchor).
# decode: bench/bench_decode.py (KV-cache decoding beside FlashAttention-3's inference build; it
# needs .anchors/fa3_decode.so.xz carried, ../shared/anchors/fa3_decode/).
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/out}"; mkdir -p "$OUT"
steps="${*:-all}"
has() { [[ " $steps " == *" all "* || " $steps " == *" $1 "* ]]; }
log() { echo "== $*" | tee -a "$OUT/summary.txt"; }
jobs=$(nproc)
# FlashAttention-3's prebuilt comparator, unpacked once to /tmp/fa3_anchor.so where carried:
# prints that path, or nothing (and fails) where the anchor is not there.
fa3_anchor() {
  [ -f .anchors/fa3_anchor.so.xz ] || return 1
  [ -f /tmp/fa3_anchor.so ] || python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
    .anchors/fa3_anchor.so.xz /tmp/fa3_anchor.so || return 1
  echo /tmp/fa3_anchor.so
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee -a "$OUT/summary.txt"

t0=$(date +%s)
# Explicit values: a build/ left by an experiment script (other flags in its cache) is reset.
# FLASH3_KERNELS (environment): only these kernel rows (experiments; the test steps expect all).
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DFLASH3_PTXAS_VERBOSE=ON -DFLASH3_BUILD_BENCH=ON -DFLASH3_BUILD_TESTS=ON -DFLASH3_BUILD_ABLATIONS=ON -DCMAKE_CUDA_FLAGS= -DCMAKE_CXX_FLAGS= "-DFLASH3_KERNELS=${FLASH3_KERNELS:-}" > "$OUT/build.log" 2>&1
cmake --build build -j"$jobs" >> "$OUT/build.log" 2>&1 || { log "BUILD FAILED"; tail -50 "$OUT/build.log"; exit 1; }
log "build: $(( $(date +%s) - t0 )) s with $jobs jobs"
# Register report: any spill, stack frame, ignored setmaxnreg (C7508) or serialized WGMMA (C7510-C7515)?
grep -E "Used [0-9]+ registers|spill|stack frame" "$OUT/build.log" | sort | uniq -c | sort -rn | head -8 | tee -a "$OUT/summary.txt"
grep -E "C75(08|1[0-9])" "$OUT/build.log" | sort | uniq -c | head -5 | tee -a "$OUT/summary.txt"
cuobjdump --dump-sass build/libflash3.so > "$OUT/sass.txt" 2>/dev/null
log "SASS: HGMMA/QGMMA $(grep -cE "[HQ]GMMA" "$OUT/sass.txt"), local-memory LDL/STL $(grep -cE '\b(LDL|STL)\b' "$OUT/sass.txt")"
python3 tools/check_overlap.py < "$OUT/sass.txt" | tee -a "$OUT/summary.txt"
gzip -f "$OUT/sass.txt"

if has bwdcheck; then
  FLASH3_LIB="$root/build/libflash3.so" timeout 300 python3 tools/bwd_check.py 2>&1 | tee "$OUT/bwd_check.log"
  log "bwd_check: $(tail -1 "$OUT/bwd_check.log")"
fi
if has test || has quick; then
  filter='*'; has quick && ! has test && filter='FwdGpuSmall.*:*bf16_d128*'
  t0=$(date +%s)
  timeout ${GTEST_TIMEOUT:-400} ./build/flash3_tests --gtest_filter="$filter" --gtest_brief=1 --gtest_output=json:"$OUT/gtest.json" > "$OUT/gtest.log" 2>&1
  log "gtest rc=$? in $(( $(date +%s) - t0 )) s: $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/gtest.log" | tr '\n' ' ')"
  grep -E "FAILED|Failure|error" "$OUT/gtest.log" | head -30
  FLASH3_LIB="$root/build/libflash3.so" PYTHONPATH="$root/python" timeout 420 python3 -m pytest -q -x tests/ > "$OUT/pytest.log" 2>&1
  log "pytest rc=$?: $(tail -1 "$OUT/pytest.log")"
fi
if has sanitize; then
  for tool in memcheck racecheck; do
    timeout 240 compute-sanitizer --tool $tool --error-exitcode 9 ./build/flash3_tests --gtest_filter='FwdGpuSmall.*:FwdGpuTailSplit.*:FwdGpuGraphs.GraphOutlivesTheStreamMemoryGrowing:BwdGpuSmall.*' --gtest_brief=1 > "$OUT/sanitize_$tool.log" 2>&1
    log "compute-sanitizer $tool rc=$?: $(grep -E '(ERROR|RACECHECK) SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)"
  done
fi
if has profile; then
  # Nsight Compute on two sweep points (clocks left alone): throughput and warp stall reasons.
  for cfg in "64 0 8192" "128 1 2048"; do
    set -- $cfg
    timeout 180 ncu --clock-control none -k regex:fwd_kernel -s 3 -c 1 --section SpeedOfLight \
      --section WarpStateStats --section ComputeWorkloadAnalysis \
      ./build/flash3_bench --hdims $1 --causal $2 --seqlens $3 --reps 1 > "$OUT/ncu_d$1_c$2_s$3.txt" 2>&1
    log "ncu hdim $1 causal $2 seqlen $3: rc=$?"
    grep -E "Compute \(SM\) Throughput|Memory Throughput|Duration|Issue Slots Busy|Stall|Warp Cycles Per Issued" "$OUT/ncu_d$1_c$2_s$3.txt" | head -20 | tee -a "$OUT/summary.txt"
  done
fi
if has prof; then
  # Nsight Compute over one flash3 call, one cuDNN call and (with the anchor carried) one
  # FlashAttention-3 call on the same inputs (tools/prof.py): every kernel's duration,
  # throughput and warp stall reasons, side by side; PROF_SOURCE=1 adds the stall samples per
  # source line (SourceCounters).
  # PROF_CFGS: "pass hdim seqlen causal [batch heads [window]]" entries separated by ';' (heads
  # H:HKV; window: the left window, (window, 0))
  IFS=';' read -ra cfgs <<< "${PROF_CFGS:-bwd 128 512 0;bwd 128 8192 0;fwd 128 2048 1}"
  prof_fa3=(); fa3_anchor > /dev/null && prof_fa3=(--fa3 /tmp/fa3_anchor.so)
  prof_src=(); [ "${PROF_SOURCE:-0}" = 1 ] && prof_src=(--section SourceCounters --import-source yes)
  for cfg in "${cfgs[@]}"; do
    set -- $cfg
    name="ncu_$1_d$2_s$3_c$4${6:+_h${6/:/-}}${7:+_w$7}"
    shape=(); [ -n "${6:-}" ] && shape=(--batch "$5" --heads "$6")
    [ -n "${7:-}" ] && shape+=(--window "$7")
    FLASH3_LIB="$root/build/libflash3.so" PYTHONPATH="$root/python" timeout 300 ncu --profile-from-start off \
      --clock-control none --cache-control none --section SpeedOfLight --section WarpStateStats \
      --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis "${prof_src[@]}" \
      python3 tools/prof.py --pass $1 --hdim $2 --seqlen $3 --causal $4 "${shape[@]}" "${prof_fa3[@]}" > "$OUT/$name.txt" 2>&1
    log "ncu $cfg: rc=$?"
    grep -E "^  [^ ].*\(|Duration|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Warp Cycles Per Issued|Registers Per|Grid Size|Dynamic Shared" \
      "$OUT/$name.txt" | head -80 | tee -a "$OUT/summary.txt"
  done
fi
# The causal tile schedules side by side: static persistent (variant 4), one block per tile
# (variant 1); the default (dynamic) is in the bench step's sweep, or run here with `causal`.
causal_schedules() {
  for v in "$@"; do
    case $v in 4) name=static ;; 1) name=noperst ;; *) name=v$v ;; esac
    timeout 60 ./build/flash3_bench --causal 1 --variant $v 2>&1 | tee "$OUT/bench_causal_$name.log"
  done
}
if has causal && ! has bench; then causal_schedules 0 4 1; fi
if has bench; then
  timeout 120 ./build/flash3_bench --json "$OUT/bench_cpp.json" 2>&1 | tee "$OUT/bench_cpp.log"
  causal_schedules 4 1
  timeout 60 ./build/flash3_bench --ablation 1 --json "$OUT/ablation.json" 2>&1 | tee "$OUT/ablation.log"
  FLASH3_LIB="$root/build/libflash3.so" PYTHONPATH="$root/python" PYTHONUNBUFFERED=1 \
    timeout ${BENCH_TIMEOUT:-240} python3 bench/bench_torch.py ${BENCH_ARGS:-} --json "$OUT/bench_torch.json" 2>&1 | tee "$OUT/bench_torch.log"
  python3 bench/plot.py "$OUT/bench_torch.json" "$OUT/fwd_chart.png" || true
fi
if has bwdbench; then
  FLASH3_LIB="$root/build/libflash3.so" PYTHONPATH="$root/python" PYTHONUNBUFFERED=1 \
    timeout ${BENCH_TIMEOUT:-300} python3 bench/bench_torch.py --pass bwd ${BWD_BENCH_ARGS:-} --json "$OUT/bench_torch_bwd.json" 2>&1 | tee "$OUT/bench_torch_bwd.log"
  python3 bench/plot.py "$OUT/bench_torch_bwd.json" "$OUT/bwd_chart.png" || true
  python3 bench/table.py "$OUT/bench_torch_bwd.json" | tee -a "$OUT/summary.txt" || true
fi
if has fp8; then
  fa3=$(fa3_anchor) || fa3=none
  FLASH3_LIB="$root/build/libflash3.so" PYTHONPATH="$root/python" PYTHONUNBUFFERED=1 \
    timeout ${FP8_TIMEOUT:-300} python3 bench/bench_fp8.py --fa3 "$fa3" ${FP8_ARGS:-} --json "$OUT/fp8.json" 2>&1 | tee "$OUT/bench_fp8.log"
  grep -E "^\||geomean|Table 3|quantizer|end to end" "$OUT/bench_fp8.log" >> "$OUT/summary.txt"
fi
if has mask || has varlen || has gqa; then fa3_anchor > /dev/null; fi
if has mask; then
  FLASH3_LIB="$root/build/libflash3.so" PYTHONPATH="$root/python" PYTHONUNBUFFERED=1 \
    timeout ${MASK_TIMEOUT:-300} python3 bench/bench_mask.py --fa3 /tmp/fa3_anchor.so --json "$OUT/mask.json" ${MASK_ARGS:-} > "$OUT/mask.log" 2>&1
  log "mask rc=$?: $(grep -E '^summary:' "$OUT/mask.log" | tail -1)"
fi
if has varlen; then
  FLASH3_LIB="$root/build/libflash3.so" PYTHONPATH="$root/python" PYTHONUNBUFFERED=1 \
    timeout ${VARLEN_TIMEOUT:-300} python3 bench/bench_varlen.py --fa3 /tmp/fa3_anchor.so --json "$OUT/varlen.json" ${VARLEN_ARGS:-} > "$OUT/varlen.log" 2>&1
  log "varlen rc=$?"
  grep -E "^(equal|packed) " "$OUT/varlen.log" >> "$OUT/summary.txt"
fi
if has gqa; then
  FLASH3_LIB="$root/build/libflash3.so" PYTHONPATH="$root/python" PYTHONUNBUFFERED=1 \
    timeout ${GQA_TIMEOUT:-400} python3 bench/compare_builds.py --build flash3=python:build/libflash3.so \
    --fa3 /tmp/fa3_anchor.so --cudnn --gqa --runs 3 --reps ${GQA_REPS:-10} --json "$OUT/gqa.json" ${GQA_ARGS:-} > "$OUT/gqa.log" 2>&1
  log "gqa rc=$?"
  grep -E "^(fwd|bwd) |^summary|geomean" "$OUT/gqa.log" >> "$OUT/summary.txt"
  for pss in fwd bwd; do python3 bench/plot.py "$OUT/gqa.json" "$OUT/gqa_$pss.png" --pass $pss || true; done
fi
if has decode; then
  FLASH3_LIB="$root/build/libflash3.so" PYTHONPATH="$root/python" PYTHONUNBUFFERED=1 \
    timeout ${DECODE_TIMEOUT:-300} python3 bench/bench_decode.py --fa3 .anchors/fa3_decode.so.xz --json "$OUT/decode.json" ${DECODE_ARGS:-} > "$OUT/decode.log" 2>&1
  log "decode rc=$?"
  grep -E "^ *(contiguous|paged[0-9]+) +[0-9]+ +[0-9]+ \|" "$OUT/decode.log" >> "$OUT/summary.txt"
fi
if has power; then
  # Backward under sustained load beside cuDNN, with the SM clock and power draw (tools/bwd_power.py;
  # its JSON goes into logs.tar.gz, its table into summary.txt).
  FLASH3_LIB="$root/build/libflash3.so" PYTHONPATH="$root/python" PYTHONUNBUFFERED=1 \
    timeout ${POWER_TIMEOUT:-200} python3 tools/bwd_power.py --json "$OUT/bwd_power.json" 2>&1 | tee -a "$OUT/summary.txt"
fi
# At most 8 files come back from the GPU machine: keep the key ones, pack the rest.
keep="summary.txt bench_torch.json fwd_chart.png bench_cpp.json ablation.json bench_torch_bwd.json bwd_chart.png"
(cd "$OUT" && rest=$(ls | grep -vxF -f <(tr ' ' '\n' <<< "$keep")) && [ -n "$rest" ] && \
   tar czf /tmp/logs.tar.gz $rest && rm -f $rest && mv /tmp/logs.tar.gz .)
cat "$OUT/summary.txt"

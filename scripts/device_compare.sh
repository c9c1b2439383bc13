#!/usr/bin/env bash
# flash3 before/after in one process, beside FlashAttention-3 and cuDNN (issue 40, "What must not
# change"): bench/compare_builds.py on the paper's sweep, forward and backward, 3 same-process runs.
# Runs on the GPU machine from the repository root, after `bash scripts/device_run.sh build`
# (the new library in build/), with these ignored folders carried:
#   .old/      the pre-redesign build: python/flash3 (its package) and libflash3.so (or .so.xz)
#   .anchors/  fa3_anchor.so.xz (../shared/anchors/fa3/)
# Writes $OUT/compare.json, $OUT/compare.log and, where matplotlib is installed, the charts
# $OUT/compare_chart_fwd.png and $OUT/compare_chart_bwd.png (bench/plot.py; optional).
#   usage: bash scripts/device_compare.sh [more compare_builds.py arguments, e.g. --quick]
# Environment: REPS (forward reps per point per run, default 30), BWD_REPS (default 20), RUNS (3),
# COMPARE_TIMEOUT (seconds, default 540).
# Time (H100/H200, from session 25/34's sweep times): one repetition of all 36 points takes about
# 0.14 s forward and 0.5 s backward for old + new + FA3 + cuDNN (kernels plus the spin kernels);
# with 3 warm-ups and 3 runs that is about 15 s forward and 40 s backward, plus about 30 s of
# start-up and per-point set-up: about 1.5 min in all, well inside the 540 s limit.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/out}"; mkdir -p "$OUT"
log="$OUT/compare.log"
fail() { echo "device_compare: $*" | tee -a "$log"; exit 1; }

new_lib="build/libflash3.so"
old_lib=".old/libflash3.so"; [ -f "$old_lib" ] || old_lib=".old/libflash3.so.xz"  # compare_builds unpacks .xz
[ -f "$new_lib" ] || fail "no $new_lib: run 'bash scripts/device_run.sh build' first"
[ -f .old/python/flash3/__init__.py ] || fail "no .old/python/flash3: carry .old"
[ -f "$old_lib" ] || fail "no .old/libflash3.so(.xz): carry .old"
[ -f .anchors/fa3_anchor.so.xz ] || fail "no .anchors/fa3_anchor.so.xz: carry .anchors"

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  [ -f .old/SOURCE.txt ] && cat .old/SOURCE.txt
  echo "nvcc here (built the new library): $(nvcc --version 2>/dev/null | tail -1)"; } 2>&1 | tee "$log"
fa3_so=/tmp/fa3_anchor.so
python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
  .anchors/fa3_anchor.so.xz "$fa3_so" || fail "could not unpack .anchors/fa3_anchor.so.xz"

t0=$(date +%s)
PYTHONUNBUFFERED=1 timeout "${COMPARE_TIMEOUT:-540}" python3 bench/compare_builds.py \
  --build "old=.old/python:$old_lib" --build "new=python:$new_lib" --fa3 "$fa3_so" --cudnn \
  --pass both --runs "${RUNS:-3}" --reps "${REPS:-30}" --bwd-reps "${BWD_REPS:-20}" \
  --json "$OUT/compare.json" "$@" 2>&1 | tee -a "$log"
rc=${PIPESTATUS[0]}
echo "compare_builds: rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$log"

if [ -f "$OUT/compare.json" ]; then
  for p in fwd bwd; do
    python3 bench/plot.py "$OUT/compare.json" "$OUT/compare_chart_$p.png" --pass $p >> "$log" 2>&1 \
      || echo "chart $p: skipped (bench/plot.py failed; matplotlib missing?)" | tee -a "$log"
  done
fi
exit "$rc"

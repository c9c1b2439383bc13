#!/usr/bin/env bash
# flash3 on the GPU machine, issue 41's examples: the host-time benchmark beside FlashAttention-3
# (bench/host_overhead.py) and the GPT training example (examples/train_gpt.py). Run from the
# repository root, with these ignored folders carried:
#   .anchors/      fa3_anchor.so.xz (../shared/anchors/fa3/), unpacked here to /tmp/fa3_anchor.so
#   third_party/   only where build/libflash3.so is not there yet (this script then builds the
#                  library alone, about 70-120 s on 16 cores)
#   usage: bash scripts/device_examples.sh [host] [train]        (default: both)
# Writes to $OUT (default ./out), 5 files: host_overhead.json, host_overhead.log, train_gpt.png,
# train_gpt.json, train_gpt.log (with the build's log in it where this script built).
# Environment (all optional):
#   FLASH3_LIB          the library (default build/libflash3.so where it exists; unset: the
#                       package finds its own, e.g. after a pip install)
#   FLASH3_PYTHONPATH   prepended to PYTHONPATH (default ./python; empty: the installed package)
#   HOST_ARGS           more bench/host_overhead.py arguments (e.g. "--reps 11 --profile")
#   TRAIN_ARGS          more examples/train_gpt.py arguments (e.g. "--steps 200 --batch 8")
#   HOST_TIMEOUT, TRAIN_TIMEOUT  seconds (default 150 and 420)
# Time on an H100: the benchmark about 30-60 s; the training about 2.5-4 minutes (3 runs of 300
# steps, 32k tokens each, plus compilation); with a build first, 2 minutes more.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
OUT="${OUT:-$root/out}"; mkdir -p "$OUT"
steps="${*:-host train}"
has() { [[ " $steps " == *" $1 "* ]]; }
export PYTHONUNBUFFERED=1
pp="${FLASH3_PYTHONPATH-$root/python}"
[ -n "$pp" ] && export PYTHONPATH="$pp${PYTHONPATH:+:$PYTHONPATH}"
if [ -z "${FLASH3_LIB:-}" ] && [ -f build/libflash3.so ]; then export FLASH3_LIB="$root/build/libflash3.so"; fi

build_log="$OUT/build_examples.log"
if [ -z "${FLASH3_LIB:-}" ] && [ -n "$pp" ] && [ ! -f build/libflash3.so ]; then
  # the library alone: no tests, no benchmark, no ablations
  t0=$(date +%s)
  gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  { cmake -S . -B build "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DFLASH3_BUILD_TESTS=OFF -DFLASH3_BUILD_BENCH=OFF \
      && cmake --build build -j"$(nproc)" --target flash3; } > "$build_log" 2>&1
  rc=$?
  echo "build (library only): rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$build_log"
  [ $rc -eq 0 ] || { tail -30 "$build_log"; exit 1; }
  export FLASH3_LIB="$root/build/libflash3.so"
fi

{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import sys, torch; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuDNN', torch.backends.cudnn.version())"
  python3 - <<'PY'
import os
try:
    import flash3
    print("flash3", flash3.__file__, "version", flash3.version(), "FLASH3_LIB=" + os.environ.get("FLASH3_LIB", ""))
except Exception as e:
    print("flash3 not usable:", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
PY
} 2>&1 | tee "$OUT/host_overhead.log"

rc_all=0
if has host; then
  fa3_so=/tmp/fa3_anchor.so
  fa3_arg=(--fa3 "$fa3_so")
  if [ -f .anchors/fa3_anchor.so.xz ]; then
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
      .anchors/fa3_anchor.so.xz "$fa3_so" || { echo "could not unpack .anchors/fa3_anchor.so.xz"; fa3_arg=(--fa3 none); }
  elif [ ! -f "$fa3_so" ]; then
    echo "no .anchors/fa3_anchor.so.xz (carry .anchors): the benchmark runs without FlashAttention-3" | tee -a "$OUT/host_overhead.log"
    fa3_arg=(--fa3 none)
  fi
  t0=$(date +%s)
  timeout "${HOST_TIMEOUT:-150}" python3 bench/host_overhead.py "${fa3_arg[@]}" --json "$OUT/host_overhead.json" \
    ${HOST_ARGS:-} 2>&1 | tee -a "$OUT/host_overhead.log"
  rc=${PIPESTATUS[0]}
  echo "host_overhead: rc=$rc in $(( $(date +%s) - t0 )) s" | tee -a "$OUT/host_overhead.log"
  [ $rc -eq 0 ] || rc_all=$rc
fi

if has train; then
  t0=$(date +%s)
  timeout "${TRAIN_TIMEOUT:-420}" python3 examples/train_gpt.py --out "$OUT" ${TRAIN_ARGS:-} 2>&1 | tee "$OUT/train_gpt.log"
  rc=${PIPESTATUS[0]}
  echo "train_gpt: rc=$rc in $(( $(date +%s) - t0 )) s (rc 1: the loss check failed; 124: timed out)" | tee -a "$OUT/train_gpt.log"
  [ $rc -eq 0 ] || rc_all=$rc
  [ -f "$build_log" ] && { echo "== build log"; cat "$build_log"; } >> "$OUT/train_gpt.log" && rm -f "$build_log"
fi
exit $rc_all

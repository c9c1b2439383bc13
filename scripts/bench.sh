#!/usr/bin/env bash
# The main job: set up, build and install (scripts/build.sh: pip install . into build/venv), run
# the forward benchmark (the paper's sweep), then, where PyTorch is installed, the side-by-side
# comparisons with cuDNN and FlashAttention-2, forward and backward.
# Without a Hopper GPU it says so in one line and exits non-zero.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh" > "$root/build.log" 2>&1 || { tail -30 "$root/build.log"; exit 1; }
"$root/build/flash3_bench" "$@"
py="$root/build/venv/bin/python"
[ -x "$py" ] || py=python3
if "$py" -c "import torch" 2>/dev/null; then
  "$py" "$root/bench/bench_torch.py"
  "$py" "$root/bench/bench_torch.py" --pass bwd
fi

#!/usr/bin/env bash
# Set up, build and run every test. GPU tests report themselves as skipped without a Hopper GPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/build.sh"
cd "$root/build"
ctest --output-on-failure -j"$(nproc)"
# The PyTorch binding's tests, where PyTorch is installed (they skip without a Hopper GPU).
if python3 -c "import torch, pytest" 2>/dev/null; then
  FLASH3_LIB="$root/build/libflash3.so" PYTHONPATH="$root/python" python3 -m pytest -q "$root/tests/test_torch.py"
fi

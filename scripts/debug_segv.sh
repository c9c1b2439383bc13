#!/usr/bin/env bash
# Reproduce a crash of the Python binding under cuda-gdb (the GPU machine has no gdb).
cd "$(dirname "$0")/.."
cat > /tmp/segv.py <<'PY'
import torch, flash3
q = torch.randn(1, 16, 4, 96, device="cuda", dtype=torch.bfloat16)
try:
    flash3.flash_attn_func(q, q, q)
except ValueError as e:
    print("ValueError:", e)
PY
FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=$PWD/python python3 /tmp/segv.py; echo "python rc=$?"
FLASH3_LIB=$PWD/build/libflash3.so PYTHONPATH=$PWD/python timeout 120 cuda-gdb -batch -ex run -ex bt --args python3 /tmp/segv.py 2>&1 | tail -30

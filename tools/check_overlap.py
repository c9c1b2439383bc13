#!/usr/bin/env python3
"""Checks in the SASS that the intra-warpgroup GEMM-softmax overlap (Algorithm 2) survived the
compiler (the paper's Appendix B.2): in the mainloop, the exponentials (MUFU.EX2) of the next
block's softmax must sit between `WARPGROUP.DEPBAR.LE gsb0, 0x1` (S is ready, PV still running;
0x2 in the 3-stage pipeline, where the next S GEMM runs too) and `WARPGROUP.DEPBAR.LE gsb0, 0x0`
(PV done).

The backward kernels at head dim 64 are checked the same way: P^T's exponentials between the
waits for S^T (0x1) and dP^T (0x0), i.e. computed while the dP^T GEMM runs (ptxas 13.0 keeps 6
of the 32 there in the in-order loop; docs/perf-log.md B27).

usage: cuobjdump --dump-sass build/libflash3.so | tools/check_overlap.py
Prints one line per forward kernel and per head-dim-64 backward kernel; exits 1 if a kernel
built with the overlap has none."""
import re
import sys

kernels, name, lines = {}, None, []
for line in sys.stdin:
    m = re.search(r"Function : (\S+)", line)
    if m:
        name = m.group(1)
        kernels[name] = []
    elif name:
        m = re.search(r"(WARPGROUP\.DEPBAR\.LE gsb0, 0x[012]|MUFU\.EX2|HGMMA)", line)
        if m:
            kernels[name].append(m.group(1))

bad = 0
for name, ops in kernels.items():
    is_bwd64 = "bwd_kernel" in name and "Li64ELb" in name
    if "HGMMA" not in ops or ("fwd_kernel" not in name and not is_bwd64):
        continue
    inside, best = None, 0
    for op in ops:
        if op.endswith("0x1") or op.endswith("0x2"):  # 0x2: the 3-stage pipeline (S_{j-1} also in flight)
            inside = 0
        elif op.endswith("0x0"):
            if inside is not None:
                best = max(best, inside)
            inside = None
        elif op == "MUFU.EX2" and inside is not None:
            inside += 1
    variant = re.search(r"Li(\d+)ELb([01])ENS_\d+(\w+?)EE", name)
    label = f"hdim {variant.group(1)} causal {variant.group(2)} {variant.group(3)}" if variant else name
    if is_bwd64:
        dtype = "bf16" if "bfloat16" in name else "fp16"
        label = f"backward {dtype} hdim 64 causal {re.search(r'Li64ELb([01])', name).group(1)}"
    expect = "NoOverlap" not in name
    ok = best > 0 or not expect
    bad += not ok
    print(f"{'ok ' if ok else 'BAD'} {label:45s} MUFU.EX2 between the two waits: {best}")
sys.exit(1 if bad else 0)

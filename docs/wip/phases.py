# Scratch (session 30): run a head dim 256 backward a few times on a build with -DFLASH3_EXP_PHASES;
# each call's preprocess prints the previous call's per-phase clocks (bwd_kernel.h).
import os, sys
import torch
from exp_inputs import bwd_call
for spec in os.environ.get("POINTS", "256:0:2048,256:0:16384,256:1:4096").split(","):
    hd, c, s = spec.split(":"); hd, c, s = int(hd), bool(int(c)), int(s)
    f, _ = bwd_call(hd, c, s)
    print(f"== hdim {hd} causal {int(c)} seqlen {s}", flush=True)
    for _ in range(4):
        f(); torch.cuda.synchronize()
    sys.stdout.flush()

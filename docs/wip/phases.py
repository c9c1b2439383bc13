# Scratch (session 30): run a head dim 256 backward a few times on a build with -DFLASH3_EXP_PHASES;
# each call's preprocess prints the previous call's per-phase clocks (bwd_kernel.h).
import os, sys
import torch
sys.path.insert(0, "python")
import flash3
for spec in os.environ.get("POINTS", "256:0:2048,256:0:16384,256:1:4096").split(","):
    hd, c, s = spec.split(":"); hd, c, s = int(hd), bool(int(c)), int(s)
    torch.manual_seed(0)
    b, h = 16384 // s, 2048 // hd
    q, k, v = [torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    flash3.forward_into(q, k, v, out, lse, causal=c)
    dout = torch.randn_like(q)
    dq, dk, dv = [torch.empty_like(x) for x in (q, k, v)]
    f = lambda: flash3.backward_into(dout, q, k, v, out, lse, dq, dk, dv, causal=c)
    print(f"== hdim {hd} causal {int(c)} seqlen {s}", flush=True)
    for _ in range(4):
        f(); torch.cuda.synchronize()
    sys.stdout.flush()

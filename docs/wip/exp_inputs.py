# Scratch: one backward call on the paper's sweep shapes (batch 16384 / seqlen, hidden 2048, bf16,
# random inputs, seed 0, the forward run once for out and lse), for ab_time.py and phases.py.
import sys
import torch
sys.path.insert(0, "python")
import flash3


def bwd_call(hd, causal, s, det=False):
    """Returns (f, flops): f() runs flash3's backward once; flops counts it (2.5x the forward)."""
    torch.manual_seed(0)
    b, h = 16384 // s, 2048 // hd
    q, k, v = [torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    flash3.forward_into(q, k, v, out, lse, causal=causal)
    dout = torch.randn_like(q)
    dq, dk, dv = [torch.empty_like(x) for x in (q, k, v)]
    f = lambda: flash3.backward_into(dout, q, k, v, out, lse, dq, dk, dv, causal=causal, deterministic=det)
    return f, 4 * b * h * s * s * hd * (0.5 if causal else 1.0) * 2.5

# Scratch (session 34): the gradients of one build (FLASH3_LIB) on long causal head dim 64
# problems (more than 32 key blocks: no store-first, so the F2L experiment's first-to-last order
# runs), max |err| against an FP32 reference by torch autograd, beside the same for a plain bf16
# computation (the tests' 2x rule). Prints one line per case: tag, case, err / (2 x plain err).
import sys
import torch
sys.path.insert(0, "python")
import flash3

tag = sys.argv[1]


def ref(q, k, v, dout, scale, dtype):
    q, k, v = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    s = torch.einsum("bqhd,bkhd->bhqk", q * scale, k)
    n = q.shape[1]
    s = s.masked_fill(torch.ones(n, n, device=q.device, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v)
    o.backward(dout.to(dtype))
    return q.grad, k.grad, v.grad


worst = 0.0
for seed, (b, s, h, hkv) in enumerate([(1, 8192, 2, 2), (1, 4100 + 128 * 3, 4, 1), (1, 5000, 2, 2)]):
    torch.manual_seed(100 + seed)
    q = torch.randn(b, s, h, 64, device="cuda", dtype=torch.bfloat16)
    k, v = [torch.randn(b, s, hkv, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    dout = torch.randn_like(q)
    out = torch.empty_like(q)
    lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    flash3.forward_into(q, k, v, out, lse, causal=True)
    dq, dk, dv = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    flash3.backward_into(dout, q, k, v, out, lse, dq, dk, dv, causal=True, deterministic=False)
    scale = 64 ** -0.5
    rep = h // hkv
    kk, vv = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    gr = ref(q, kk, vv, dout, scale, torch.float32)
    gp = ref(q, kk, vv, dout, scale, torch.bfloat16)
    def fold(g):
        return g if rep == 1 else g.view(b, s, hkv, rep, 64).sum(3)
    r = [gr[0], fold(gr[1]), fold(gr[2])]
    p = [gp[0].float(), fold(gp[1].float()), fold(gp[2].float())]
    ratios = []
    for name, mine, rr, pp in zip("qkv", (dq, dk, dv), r, p):
        e = (mine.float() - rr).abs().max().item()
        ep = (pp - rr).abs().max().item()
        ratios.append(e / (2 * ep + 1e-4))
    worst = max(worst, max(ratios))
    print(tag, f"b{b} s{s} h{h}/{hkv}", " ".join(f"d{n} {x:.3f}" for n, x in zip("qkv", ratios)), flush=True)
print(tag, "PASS" if worst <= 1.0 else "FAIL", f"worst {worst:.3f}")

import os, sys, torch
sys.path.insert(0, "python")
import flash3
torch.manual_seed(0)
s = int(os.environ.get("S", "128")); b = int(os.environ.get("B", "1")); h = int(os.environ.get("H", "1"))
q, k, v = [torch.randn(b, s, h, 256, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
out = torch.empty_like(q); lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
flash3.forward_into(q, k, v, out, lse, causal=False)
dout = torch.randn_like(q)
dq, dk, dv = [torch.empty_like(x) for x in (q, k, v)]
flash3.backward_into(dout, q, k, v, out, lse, dq, dk, dv, causal=False)
torch.cuda.synchronize()
os.environ["FLASH3_EXP_DQ_PAIR"] = "0"
dq0, dk0, dv0 = [torch.empty_like(x) for x in (q, k, v)]
flash3.backward_into(dout, q, k, v, out, lse, dq0, dk0, dv0, causal=False)
torch.cuda.synchronize()
print("max |pair - main|: dq %.3g dk %.3g dv %.3g (|dq| max %.3g)" % ((dq.float()-dq0.float()).abs().max(), (dk.float()-dk0.float()).abs().max(), (dv.float()-dv0.float()).abs().max(), dq0.float().abs().max()))

# Scratch (session 31): flash3's and cuDNN's backward, each run back to back for ~1.5 s on the
# paper's sweep shapes, with the SM clock and board power sampled by nvidia-smi while they run;
# also the bench's per-call way (spin kernel, median of 10). Does flash3 hit the power limit
# harder than cuDNN (lower clocks in its timed calls)? `python3 exp/power.py` on the GPU machine.
import os, statistics, subprocess, sys, threading, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, "python")
import flash3

FIELDS = ["clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active"]
def smi(fields):
    r = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True)
    return r.returncode, r.stdout.strip()
if smi(FIELDS)[0] != 0:
    FIELDS = FIELDS[:3]

def sampler(stop, out):
    while not stop.is_set():
        rc, s = smi(FIELDS)
        if rc == 0:
            out.append(s.split(", "))
        time.sleep(0.1)

def impls(causal):
    def cudnn(q, k, v):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal).transpose(1, 2)
    return {"flash3": lambda q, k, v: flash3.flash_attn_func(q, k, v, causal=causal), "cudnn": cudnn}

points = [(64, 1, 16384), (64, 0, 16384), (64, 1, 4096), (128, 1, 2048), (128, 0, 16384), (256, 0, 2048), (256, 1, 4096)]
print(f"fields: {FIELDS}")
print(f"{'point':>14} {'impl':>6} | {'bench':>6} {'sustained':>9} | {'MHz':>5} {'W':>5} {'C':>3} reasons")
for d, c, s in points:
    b, h = 16384 // s, 2048 // d
    flops = 4 * b * h * s * s * d * (0.5 if c else 1.0) * 2.5
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    for name, fn in impls(bool(c)).items():
        out = fn(q, k, v)
        call = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for _ in range(3):
            call()
        ts = []
        for _ in range(10):
            torch.cuda._sleep(1_000_000)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(); call(); e1.record(); e1.synchronize()
            ts.append(e0.elapsed_time(e1))
        bench = flops / statistics.median(ts) / 1e9
        n = max(20, int(1500 / statistics.median(ts)))
        samples, stop = [], threading.Event()
        th = threading.Thread(target=sampler, args=(stop, samples)); th.start()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            call()
        e1.record(); e1.synchronize()
        stop.set(); th.join()
        sus = flops * n / e0.elapsed_time(e1) / 1e9
        mid = samples[len(samples) // 4: max(len(samples) // 4 + 1, 3 * len(samples) // 4)]
        mhz = statistics.median(float(x[0]) for x in mid)
        w = statistics.median(float(x[1]) for x in mid)
        tc = statistics.median(float(x[2]) for x in mid)
        reasons = sorted({x[3] for x in mid}) if len(FIELDS) > 3 else []
        print(f"{d:>4} {c} {s:>6} {name:>8} | {bench:6.1f} {sus:9.1f} | {mhz:5.0f} {w:5.0f} {tc:3.0f} {' '.join(reasons)}",
              flush=True)
        del out
    del q, k, v, dout
    torch.cuda.empty_cache()

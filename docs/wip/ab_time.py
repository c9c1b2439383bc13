# Scratch (session 23): flash3 backward TFLOP/s over a few sweep points, for A/B runs of two builds.
import json, os, sys
import torch
from exp_inputs import bwd_call
tag = sys.argv[1]
hds = [int(x) for x in os.environ.get("HDIMS", "64,128").split(",")]
seqs = [int(x) for x in os.environ.get("SEQS", "512,1024,2048,4096,8192,16384").split(",")]
reps = 10
row = {}
for hd in hds:
    for c in [bool(int(x)) for x in os.environ.get("CAUSAL", "0,1").split(",")]:
        for s in seqs:
            f, fl = bwd_call(hd, c, s, os.environ.get('DET') == '1')
            for _ in range(3):
                f()
            ts = []
            for _ in range(reps):
                torch.cuda._sleep(1_000_000)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record(); f(); e1.record(); e1.synchronize()
                ts.append(e0.elapsed_time(e1))
            ms = sorted(ts)[len(ts) // 2]
            row[f"{hd} {int(c)} {s}"] = fl / ms / 1e9
print(tag, json.dumps({k: round(v, 1) for k, v in row.items()}), flush=True)

# Scratch (session 24, not run): per-item %globaltimer stamps of the head dim 64 persistent kernel with
# the per-item cost patch (-DFLASH3_EXP_STAMPS -DFLASH3_EXP_PERSIST_AB), its TMA-store epilogue (TMA=1)
# against the row-by-row one (TMA=0). Stamps per item: 0 item received, 4 previous staging read
# (consumers met), 1 K/V landed, 2 loop done, 3 epilogue done, 5/6 writers done, 7 smid.
import os, sys, collections
import numpy as np, torch
sys.path.insert(0, "python")
import flash3
for s in [int(x) for x in os.environ.get("SEQS", "2048,8192").split(",")]:
    hd = 64
    b, h = 16384 // s, 2048 // hd
    torch.manual_seed(0)
    q, k, v = [torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    out = torch.empty_like(q); lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    flash3.forward_into(q, k, v, out, lse, causal=True)
    dout = torch.randn_like(q); dq, dk, dv = [torch.empty_like(x) for x in (q, k, v)]
    f = lambda: flash3.backward_into(dout, q, k, v, out, lse, dq, dk, dv, causal=True)
    for mode in ("1", "0"):
        os.environ["FLASH3_EXP_TMA_EPI"] = mode
        for _ in range(3): f()
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(1_000_000); e0.record(); f(); e1.record(); e1.synchronize(); ts.append(e0.elapsed_time(e1) * 1e3)
        os.environ["FLASH3_STAMPS_OUT"] = "/tmp/st.bin"
        f(); torch.cuda.synchronize()
        del os.environ["FLASH3_STAMPS_OUT"]
        a = np.fromfile("/tmp/st.bin", dtype=np.uint64).reshape(-1, 8).astype(np.int64)
        t0 = a[:, 0].min()
        st = {i: (a[:, i] - t0) / 1e3 for i in range(7)}
        by = collections.defaultdict(list)
        for i in range(len(a)): by[a[i, 7]].append(i)
        gaps = []
        for ids in by.values():
            ids.sort(key=lambda i: st[0][i])
            for x, y in zip(ids, ids[1:]): gaps.append(st[0][y] - st[3][x])
        end = np.maximum.reduce([st[3], st[5], st[6]])
        print(f"hd 64 causal s {s} TMA epilogue {mode}: call {sorted(ts)[2]:.0f} us, span {end.max():.0f} us, items {len(a)} on {len(by)} SMs; "
              f"per item mean: start -> consumers met {np.mean(st[4] - st[0]):.2f}, -> K/V landed {np.mean(st[1] - st[4]):.2f}, "
              f"loop {np.mean(st[2] - st[1]):.2f} (sum {np.sum(st[2] - st[1]):.0f}), epilogue {np.mean(st[3] - st[2]):.2f}, "
              f"writers after loop {np.mean(np.maximum(st[5], st[6]) - st[2]):.2f}; epilogue end -> next item start median "
              f"{np.median(gaps):.2f}; loop share of SM-span {np.sum(st[2] - st[1]) / (len(by) * end.max()) * 100:.1f}%", flush=True)

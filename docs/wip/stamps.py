# Scratch (session 23): per-block globaltimer stamps of the backward main kernel (-DFLASH3_EXP_STAMPS):
# 0 consumer entry, 1 K/V landed, 2 main loop done, 3 dK/dV stored (MHA), 5/6 writer 0/1 done, 7 smid.
import os, sys, collections
import numpy as np, torch
sys.path.insert(0, "python")
import flash3
for hd, c, s in [(64, 1, 2048), (64, 0, 2048), (64, 1, 8192), (128, 1, 2048), (128, 0, 2048), (128, 0, 512)]:
    b, h = 16384 // s, 2048 // hd
    torch.manual_seed(0)
    q, k, v = [torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    out = torch.empty_like(q); lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    flash3.forward_into(q, k, v, out, lse, causal=bool(c))
    dout = torch.randn_like(q); dq, dk, dv = [torch.empty_like(x) for x in (q, k, v)]
    f = lambda: flash3.backward_into(dout, q, k, v, out, lse, dq, dk, dv, causal=bool(c))
    for _ in range(3): f()
    torch.cuda.synchronize()
    os.environ["FLASH3_STAMPS_OUT"] = "/tmp/st.bin"
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(); f(); e1.record(); torch.cuda.synchronize()
    del os.environ["FLASH3_STAMPS_OUT"]
    a = np.fromfile("/tmp/st.bin", dtype=np.uint64).reshape(-1, 8).astype(np.int64)
    t0 = a[:, 0].min()
    ent, kv, loop, epi, w0, w1, sm = (a[:, i] - (t0 if i < 7 else 0) for i in (0, 1, 2, 3, 5, 6, 7))
    end = np.maximum.reduce([epi, w0, w1, loop])
    span = end.max() / 1e3
    nblk = len(a)
    # m_count per block from the problem (for per-visit time)
    gaps, firsts = [], 0
    by = collections.defaultdict(list)
    for i in range(nblk): by[sm[i]].append(i)
    for smid, ids in by.items():
        ids.sort(key=lambda i: ent[i])
        for x, y in zip(ids, ids[1:]): gaps.append(ent[y] - end[x])
    gaps = np.array(gaps) / 1e3
    pro = (kv - ent) / 1e3; lp = (loop - kv) / 1e3; ep = (epi - loop) / 1e3; wt = (np.maximum(w0, w1) - loop) / 1e3
    busy = (end - ent).sum() / 1e3
    nsm = len(by)
    print(f"hd {hd} causal {c} s {s}: blocks {nblk} SMs {nsm} span {span:.0f} us (events {e0.elapsed_time(e1)*1e3:.0f} us); "
          f"per block mean: prologue (entry->K,V landed) {pro.mean():.2f}, loop {lp.mean():.2f}, epilogue {ep.mean():.2f}, "
          f"writers after loop {wt.mean():.2f}; gap between blocks on an SM: mean {gaps.mean():.2f} median {np.median(gaps):.2f} p90 {np.percentile(gaps,90):.2f}; "
          f"first block start spread {(ent[:132].max()-ent[:132].min())/1e3:.1f}; SM busy {busy/(nsm*span)*100:.1f}% of span; "
          f"idle tail: last end - first SM done {(end.max()-min(max(end[i] for i in ids) for ids in by.values()))/1e3:.1f}", flush=True)

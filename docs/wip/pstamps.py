# Scratch (session 24): per-item globaltimer stamps, one-block-per-item (FLASH3_EXP_PERSIST=0) against the
# persistent causal backward (=1), on the same items. Stamps per item t: 0 start (old: block entry; new:
# item received), 4 (new) dQ buffers drained, 1 K/V landed, 2 loop done, 3 dK/dV stored, 5/6 writers done, 7 smid.
import os, sys, collections
import numpy as np, torch
sys.path.insert(0, "python")
import flash3
pts = [(int(a), int(b)) for a, b in (x.split(":") for x in os.environ.get("PTS", "64:2048,64:16384,128:2048,128:16384").split(","))]
for hd, s in pts:
    b, h = 16384 // s, 2048 // hd
    torch.manual_seed(0)
    q, k, v = [torch.randn(b, s, h, hd, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    out = torch.empty_like(q); lse = torch.empty(b, h, s, device="cuda", dtype=torch.float32)
    flash3.forward_into(q, k, v, out, lse, causal=True)
    dout = torch.randn_like(q); dq, dk, dv = [torch.empty_like(x) for x in (q, k, v)]
    f = lambda: flash3.backward_into(dout, q, k, v, out, lse, dq, dk, dv, causal=True)
    res = {}
    for mode in ("0", "1"):
        os.environ["FLASH3_EXP_PERSIST"] = mode
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
        end = np.maximum.reduce([st[3], st[5], st[6]])
        by = collections.defaultdict(list)
        for i in range(len(a)): by[a[i, 7]].append(i)
        gaps = []
        for ids in by.values():
            ids.sort(key=lambda i: st[0][i])
            for x, y in zip(ids, ids[1:]): gaps.append(st[0][y] - st[3][x])
        gaps = np.array(gaps)
        res[mode] = dict(time=sorted(ts)[2], span=end.max(), loop=(st[2] - st[1]).sum(),
                         pre=(st[1] - st[0]).mean(), epi=(st[3] - st[2]).mean(), wr=(np.maximum(st[5], st[6]) - st[2]).mean(),
                         drained=((st[4] - st[0]).mean() if mode == "1" else 0.0), kvwait=((st[1] - st[4]).mean() if mode == "1" else 0.0),
                         gap=np.median(gaps), gapmean=gaps.mean(), busy=(st[2] - st[1]).sum() / (len(by) * end.max()),
                         tail=end.max() - min(max(end[i] for i in ids) for ids in by.values()), n=len(a), sms=len(by))
    o, p = res["0"], res["1"]
    print(f"hd {hd} s {s}: items {o['n']} SMs {o['sms']}/{p['sms']}; call us {o['time']:.0f} -> {p['time']:.0f}; span {o['span']:.0f} -> {p['span']:.0f}; "
          f"sum loop {o['loop']:.0f} -> {p['loop']:.0f} ({p['loop']/o['loop']:.3f}); per item: start->KV {o['pre']:.2f} -> {p['pre']:.2f} "
          f"(new: drained {p['drained']:.2f}, kv wait {p['kvwait']:.2f}); epi {o['epi']:.2f} -> {p['epi']:.2f}; writers after loop {o['wr']:.2f} -> {p['wr']:.2f}; "
          f"gap end->next start median {o['gap']:.2f} -> {p['gap']:.2f} (mean {o['gapmean']:.2f} -> {p['gapmean']:.2f}); "
          f"loop share of SM-span {o['busy']*100:.1f}% -> {p['busy']*100:.1f}%; idle tail {o['tail']:.0f} -> {p['tail']:.0f}", flush=True)

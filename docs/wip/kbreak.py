# scratch: per-kernel device time of one backward (flash3 and cuDNN via SDPA) over the bwd sweep, by torch.profiler.
import sys, os, statistics, json
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "python"))
import torch, flash3
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import profile, ProfilerActivity

TOKENS, HIDDEN, REPS = 16384, 2048, 5
hdims = [int(x) for x in os.environ.get("HDIMS", "64,128,256").split(",")]
seqs = [int(x) for x in os.environ.get("SEQS", "512,1024,2048,4096,8192,16384").split(",")]


def cat(name, impl):
    n = name.lower()
    if impl == "flash3":
        if "bwd_preprocess" in n: return "pre"
        if "bwd_postprocess_dq" in n: return "post"
        if "bwd_kernel" in n: return "main"
        return "other"
    if "dot_do_o" in n: return "pre"
    if "convert_dq" in n: return "post"
    if "cudnn_generated" in n or "sm90" in n or "flash" in n: return "main"
    return "other"


def run_point(d, causal, s):
    b, h = TOKENS // s, HIDDEN // d
    torch.manual_seed(0)
    mk = lambda: torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    q, k, v = mk(), mk(), mk()
    dout = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
    out_f3 = flash3.flash_attn_func(q, k, v, causal=causal)
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        out_cd = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal).transpose(1, 2)
    res = {}
    for impl, out in (("flash3", out_f3), ("cudnn", out_cd)):
        fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for _ in range(3): fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(REPS): fn()
            torch.cuda.synchronize()
        ev = sorted((e.time_range.start, e.time_range.end, cat(e.name, impl)) for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA)
        # pre and other (setup) kernels belong to the next main kernel, post kernels to the last one
        calls, pending = [], []
        for x in ev:
            if x[2] == "main":
                calls.append(pending + [x]); pending = []
            elif x[2] == "post" and calls:
                calls[-1].append(x)
            else:
                pending.append(x)
        parts = {"span": [], "pre": [], "main": [], "post": [], "gaps": []}
        for c in calls:
            get = lambda kind: [y for y in c if y[2] == kind]
            pre, main, post = get("pre"), get("main"), get("post")
            if not (pre and main):  # (no post kernel where the main kernel converts dQ itself)
                continue
            span = max(y[1] for y in c) - min(y[0] for y in c)
            pre_x = pre[0][1] - pre[0][0]
            main_x = main[-1][1] - max(pre[-1][1], main[0][0])
            post_x = max(y[1] for y in c) - main[-1][1]
            for key, val in (("span", span), ("pre", pre_x), ("main", main_x), ("post", post_x),
                           ("gaps", span - pre_x - main_x - post_x)):
                parts[key].append(val)
        tot = {k: (statistics.median(v) if v else float("nan")) for k, v in parts.items()}
        tot["calls"] = len(parts["span"])
        res[impl] = tot
    fl = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * 2.5
    return fl, res


print(f"{'hdim':>4} {'causal':>6} {'seqlen':>6} | f3 span   pre  main  post  gap | cd span   pre  main  post  gap | "
      f"span cd/f3 main cd/f3 | f3 side% cd side% | f3 TF(span) f3 TF(main)")
rows = []
for d in hdims:
    for causal in (False, True):
        for s in seqs:
            fl, r = run_point(d, causal, s)
            f, c = r["flash3"], r["cudnn"]
            rows.append(dict(hdim=d, causal=causal, seqlen=s, flash3=f, cudnn=c))
            print(f"{d:>4} {causal!s:>6} {s:>6} | {f['span']:7.0f} {f['pre']:5.0f} {f['main']:5.0f} {f['post']:5.0f} {f['gaps']:4.0f} | "
                  f"{c['span']:7.0f} {c['pre']:5.0f} {c['main']:5.0f} {c['post']:5.0f} {c['gaps']:4.0f} | "
                  f"{c['span']/f['span']:10.3f} {c['main']/f['main']:10.3f} | {100*(1-f['main']/f['span']):6.1f} {100*(1-c['main']/c['span']):7.1f} | "
                  f"{fl/f['span']/1e6:11.0f} {fl/f['main']/1e6:11.0f}", flush=True)
            torch.cuda.empty_cache()
json.dump(rows, open(os.environ.get("JSON", "/dev/null"), "w"), indent=1)

# scratch (session 33): where the no-spin backward time goes beyond the kernels, flash3 beside
# cuDNN: host latency of one call from an idle GPU, and the GPU timeline of one call (torch.profiler,
# CPU + CUDA), at a few sweep points.
import os, sys, time, statistics
# Run as exp/host_gap.py from the repository root. PYDIR: the flash3 package to use (default:
# the repository's python/); PROFILE=1: one call's timeline.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.environ.get("PYDIR") or os.path.join(ROOT, "python"))
sys.path.insert(1, os.path.join(ROOT, "tools"))
import torch
from torch.profiler import profile, ProfilerActivity
from prof import paper_problem  # tools/prof.py: the sweep's inputs and the flash3, cuDNN calls

POINTS = [(64, True, 8192), (128, True, 2048), (64, False, 2048)]
spin = torch.cuda._sleep


def run(d, causal, s):
    (q, k, v, dout), impls = paper_problem(d, s, causal)
    outs = {name: fn(q, k, v) for name, fn in impls.items()}
    for impl, out in outs.items():
        if impl not in os.environ.get("IMPLS", "flash3,cudnn").split(","):
            continue
        fn = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        res = {}
        for mode in ("spin", "nospin"):
            gpu, host = [], []
            for _ in range(15):
                st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                if mode == "spin":
                    spin(1000000)
                st.record()
                t0 = time.perf_counter()
                fn()
                t1 = time.perf_counter()
                en.record()
                en.synchronize()
                gpu.append(st.elapsed_time(en))
                host.append((t1 - t0) * 1e3)
            res[mode] = (statistics.median(gpu), statistics.median(host))
        print(f"{d:4} {causal!s:5} {s:6} {impl:7} | spin: events {res['spin'][0]:.3f} ms, host {res['spin'][1]:.3f} ms"
              f" | nospin: events {res['nospin'][0]:.3f} ms, host {res['nospin'][1]:.3f} ms", flush=True)
        if os.environ.get("PROFILE") != "1":
            continue
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        evs = [e for e in prof.events()]
        t_start = min(e.time_range.start for e in evs)
        rows = []
        for e in evs:
            cuda = e.device_type == torch.autograd.DeviceType.CUDA
            n = e.name
            if cuda or "Launch" in n or "Memset" in n or "Memcpy" in n or "Synchronize" in n or "cudaFuncSetAttribute" in n \
                    or n.startswith("autograd::") or "FlashAttnFunc" in n or "empty" in n or "Malloc" in n:
                rows.append((e.time_range.start - t_start, e.time_range.end - e.time_range.start,
                             "GPU" if cuda else "CPU", n[:90]))
        for r in sorted(rows)[:40]:
            print(f"    {r[0]:9.1f} us +{r[1]:8.1f} {r[2]} {r[3]}")


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), flush=True)
    for p in POINTS:
        run(*p)

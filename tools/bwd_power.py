#!/usr/bin/env python3
"""Backward speed under sustained load, with the SM clock and board power while it runs.

  FLASH3_LIB=build/libflash3.so PYTHONPATH=python python3 tools/bwd_power.py
      [--points 64:1:4096,128:0:16384] [--seconds 1.5] [--json out.json]

For each sweep point (paper shapes: batch = 16384 / seqlen, heads = 2048 / hdim, bf16) flash3's and
cuDNN's backward (PyTorch SDPA) are each timed two ways on the same inputs:
  bench      the benchmark's way (bench/bench_torch.py): spin kernel, one call, median of 10;
  sustained  calls back to back for --seconds, TFLOP/s over the whole loop,
and while the sustained loop runs, a thread samples nvidia-smi (SM clock, power draw, temperature,
clock event reasons) every 0.1 s; the medians of the middle half of the samples are reported,
with TFLOP/s per joule and TFLOP/s per GHz (speed at equal clocks).

Why: an H100 caps board power at 700 W. Where a kernel reaches the cap, the SM clock drops until
the power is back under it, so a kernel that does more per clock can run at a lower clock than a
slower one that stays under the cap; its speed then rises with energy per FLOP saved, not with
latency hidden. docs/perf-log.md B79 has the first measurement.
"""
import argparse
import json
import statistics
import subprocess
import threading
import time

import torch

from prof import paper_problem  # tools/prof.py (this script's folder is on sys.path)

FIELDS = ["clocks.sm", "power.draw", "temperature.gpu", "clocks_throttle_reasons.active"]
DEFAULT_POINTS = "64:0:4096,64:1:4096,64:1:16384,128:0:16384,128:1:2048,256:0:2048,256:1:4096"


def smi(fields):
    r = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True)
    return r.returncode, r.stdout.strip().splitlines()[0] if r.stdout.strip() else ""


def parse_points(s):
    out = []
    for item in s.split(","):
        parts = item.split(":")
        if len(parts) != 3:
            raise SystemExit(f"--points: expected hdim:causal:seqlen items, got {item!r}")
        d, c, n = (int(x) for x in parts)
        if d not in (64, 128, 256) or c not in (0, 1) or n < 128 or 16384 % n:
            raise SystemExit(f"--points: {item!r}: hdim must be 64, 128 or 256, causal 0 or 1, "
                             "seqlen a divisor of 16384 of at least 128")
        out.append((d, c, n))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--points", default=DEFAULT_POINTS)
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    points = parse_points(a.points)
    fields = FIELDS if smi(FIELDS)[0] == 0 else FIELDS[:3]

    def sampler(stop, out):
        while not stop.is_set():
            rc, line = smi(fields)
            if rc == 0 and line:
                out.append([x.strip() for x in line.split(",")])
            time.sleep(0.1)

    def timed(call, n):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(n):
            call()
        e1.record()
        e1.synchronize()
        return e0.elapsed_time(e1)

    rows = []
    print(f"{torch.cuda.get_device_name()}; nvidia-smi fields: {fields}")
    print(f"{'hdim':>4} {'causal':>6} {'seqlen':>6} {'impl':>6} | {'bench':>6} {'sustained':>9} | "
          f"{'MHz':>5} {'W':>4} {'C':>3} {'TF/J':>5} {'TF/GHz':>6} reasons")
    for d, c, s in points:
        causal = bool(c)
        (q, k, v, dout), impls = paper_problem(d, s, causal)
        b, h = q.shape[0], q.shape[2]
        flops = 4 * b * h * s * s * d * (0.5 if causal else 1.0) * 2.5
        for name, fn in impls.items():
            out = fn(q, k, v)
            call = lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)  # noqa: E731
            for _ in range(3):
                call()
            ts = []
            for _ in range(10):
                torch.cuda._sleep(1_000_000)
                ts.append(timed(call, 1))
            ms = statistics.median(ts)
            n = max(20, int(a.seconds * 1000 / ms))
            samples, stop = [], threading.Event()
            th = threading.Thread(target=sampler, args=(stop, samples))
            th.start()
            total = timed(call, n)
            stop.set()
            th.join()
            mid = samples[len(samples) // 4: max(len(samples) // 4 + 1, 3 * len(samples) // 4)]
            row = {"hdim": d, "causal": causal, "seqlen": s, "batch": b, "nheads": h, "impl": name,
                   "bench_tflops": flops / ms / 1e9, "sustained_tflops": flops * n / total / 1e9,
                   "sustained_calls": n, "samples": len(mid)}
            if mid:
                row["sm_mhz"] = statistics.median(float(x[0]) for x in mid)
                row["power_w"] = statistics.median(float(x[1]) for x in mid)
                row["temp_c"] = statistics.median(float(x[2]) for x in mid)
                if len(fields) > 3:
                    row["clock_event_reasons"] = sorted({x[3] for x in mid})
                row["tflops_per_joule"] = row["sustained_tflops"] / row["power_w"]
                row["tflops_per_ghz"] = row["sustained_tflops"] / (row["sm_mhz"] / 1000)
            rows.append(row)
            print(f"{d:>4} {c:>6} {s:>6} {name:>6} | {row['bench_tflops']:6.1f} {row['sustained_tflops']:9.1f} | "
                  f"{row.get('sm_mhz', 0):5.0f} {row.get('power_w', 0):4.0f} {row.get('temp_c', 0):3.0f} "
                  f"{row.get('tflops_per_joule', 0):5.3f} {row.get('tflops_per_ghz', 0):6.1f} "
                  f"{' '.join(row.get('clock_event_reasons', []))}", flush=True)
            del out
        del q, k, v, dout
        torch.cuda.empty_cache()
    print("flash3 over cuDNN: bench / sustained / SM clock / TFLOP/s per GHz / TFLOP/s per joule")
    by = {(r["hdim"], r["causal"], r["seqlen"], r["impl"]): r for r in rows}
    for d, c, s in points:
        f, g = by.get((d, bool(c), s, "flash3")), by.get((d, bool(c), s, "cudnn"))
        if not (f and g and "sm_mhz" in f and "sm_mhz" in g):
            continue
        print(f"{d:>4} {c:>6} {s:>6} | {f['bench_tflops'] / g['bench_tflops']:.3f} "
              f"{f['sustained_tflops'] / g['sustained_tflops']:.3f} {f['sm_mhz'] / g['sm_mhz']:.3f} "
              f"{f['tflops_per_ghz'] / g['tflops_per_ghz']:.3f} {f['tflops_per_joule'] / g['tflops_per_joule']:.3f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(), "fields": fields, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

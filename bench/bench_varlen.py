#!/usr/bin/env python3
"""Variable-length batch speed: flash3 beside FlashAttention-3 in one process, round robin (issue 43).

    python3 bench/bench_varlen.py --fa3 /tmp/fa3_anchor.so [--hdims 64,128,256] [--runs 3] [--reps 10]
        [--warmup 3] [--passes fwd,bwd] [--tokens 16384] [--json out.json]

All bf16, N(0, 1) inputs (one seed per point, the same in every run), hidden 2048 (nheads = 2048 /
head_dim), causal and not, --tokens tokens (16384) per batch.
  equal   8 sequences of tokens / 8: flash3's fixed-length call (q (8, tokens / 8, h, d)) and its
          varlen call on the same tokens packed (cu_seqlens of equal steps), and FA3's varlen call.
          Ratio varlen / fixed of flash3 (target <= 1.03).
  packed  documents with lengths drawn log-uniformly from [64, 8192] (random.Random(0)), the last
          one cut so that they sum to --tokens: flash3 and FA3 varlen. Ratio t_fa3 / t_flash3
          (target >= 1.0).
flash3: flash3.forward_varlen_into (into preallocated out and lse, without the check of the
cu_seqlens values, which synchronizes) / flash_attn_func (backward: torch.autograd.grad through
flash_attn_varlen_func / flash_attn_func, the forward once outside the timed call); FA3: torch.ops.flash_attn_3.fwd / bwd with cu_seqlens_q/k, max_seqlen_q/k.
Timing as bench/timing.py (spin kernel, CUDA events, round robin, median per run); reported per
point the median over runs of each time and each ratio as median [min-max] over runs.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import (SPIN_CYCLES, doc_lengths, first_line, hopper_torch, ints, load_fa3, log,  # noqa: E402
                    median_or_none, rel_diff, rng, round_robin, spread)

HIDDEN = 2048
EQUAL_TARGET = 1.03
FA3_TARGET = 1.0


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fa3", default="/tmp/fa3_anchor.so")
    p.add_argument("--hdims", type=ints, default=[64, 128, 256])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--passes", default="fwd,bwd")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--json")
    a = p.parse_args(argv)
    torch = hopper_torch("bench_varlen")
    if torch is None:
        return 0
    import flash3
    fa3, fa3_info = None, None
    if a.fa3 != "none" and os.path.exists(a.fa3):
        fa3, fa3_info = load_fa3(torch, a.fa3, tempfile.mkdtemp())
    dev = torch.device("cuda")
    docs = doc_lengths(a.tokens)
    parts = {"equal": [a.tokens // 8] * 8, "packed": docs}
    log(f"packed documents ({len(docs)}): {docs}")
    rows = []
    for part, lens in parts.items():
        for pss in a.passes.split(","):
            for d in a.hdims:
                for causal in (False, True):
                    rows.append({"part": part, "pass": pss, "hdim": d, "causal": causal, "lens": lens,
                                 "ms_runs": {}, "errors": {}, "check": {}})
    for run in range(a.runs):
        for i, r in enumerate(rows):
            d, causal, lens, pss = r["hdim"], r["causal"], r["lens"], r["pass"]
            h = HIDDEN // d
            g = torch.Generator(device=dev)
            g.manual_seed(1000 + i)
            total = sum(lens)
            q, k, v, dout = (torch.randn(total, h, d, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(4))
            cu = torch.tensor([0] + list(__import__("itertools").accumulate(lens)), device=dev, dtype=torch.int32)
            m = max(lens)
            calls = {}
            if pss == "fwd":
                out_b = torch.empty_like(q)
                lse_b = torch.empty(h, total, device=dev, dtype=torch.float32)

                def call_f3(out_b=out_b, lse_b=lse_b):
                    flash3.forward_varlen_into(q, k, v, out_b, lse_b, cu, cu, m, m, causal=causal,
                                               check_seqlens=False)
                    return out_b
                calls["flash3"] = call_f3
                if r["part"] == "equal":
                    b = len(lens)
                    qb, kb, vb = (t.view(b, total // b, h, d) for t in (q, k, v))
                    calls["flash3_fixed"] = lambda: flash3.flash_attn_func(qb, kb, vb, causal=causal)
                if fa3 is not None:
                    calls["fa3"] = lambda: fa3.fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                                   max_seqlen_k=m, is_causal=causal)[0]
            else:
                qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                o = flash3.flash_attn_varlen_func(qg, kg, vg, cu, cu, m, m, causal=causal)
                o = o[0] if isinstance(o, tuple) else o
                calls["flash3"] = lambda o=o: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True)
                if r["part"] == "equal":
                    b = len(lens)
                    qb, kb, vb = (t.detach().view(b, total // b, h, d).requires_grad_() for t in (q, k, v))
                    ob = flash3.flash_attn_func(qb, kb, vb, causal=causal)
                    ob = ob[0] if isinstance(ob, tuple) else ob
                    calls["flash3_fixed"] = lambda ob=ob: torch.autograd.grad(ob, (qb, kb, vb), dout.view_as(ob),
                                                                              retain_graph=True)
                if fa3 is not None:
                    out, lse = fa3.fwd(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m,
                                       is_causal=causal)[:2]
                    gr = tuple(torch.empty_like(t) for t in (q, k, v))
                    def call_fa3(out=out, lse=lse, gr=gr):
                        fa3.bwd(dout, q, k, v, out, lse, *gr, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m,
                                max_seqlen_k=m, is_causal=causal)
                        return gr
                    calls["fa3"] = call_fa3
            errors = r["errors"]
            if run == 0:
                res = {}
                for n, c in calls.items():
                    try:
                        x = c()
                        res[n] = x[0] if isinstance(x, tuple) and pss == "fwd" else x
                    except Exception as e:  # noqa: BLE001
                        errors[n] = first_line(e)
                torch.cuda.synchronize()
                if pss == "fwd" and "flash3" in res and "fa3" in res:
                    r["check"]["vs_fa3"] = rel_diff(res["flash3"], res["fa3"])
                if pss == "fwd" and "flash3" in res and "flash3_fixed" in res:
                    r["check"]["vs_fixed"] = rel_diff(res["flash3"], res["flash3_fixed"].reshape(res["flash3"].shape))
                if pss == "bwd" and "flash3" in res and "fa3" in res:
                    r["check"]["vs_fa3"] = max(rel_diff(x, y) for x, y in zip(res["flash3"], res["fa3"]))
            times = round_robin(torch, {n: c for n, c in calls.items() if n not in errors}, a.warmup, a.reps,
                                SPIN_CYCLES[pss], errors)
            for n, t in times.items():
                r["ms_runs"].setdefault(n, [None] * a.runs)[run] = statistics.median(t) if t else None
            del calls, q, k, v, dout
        log(f"run {run + 1}/{a.runs} done")
    print(f"{'part':7} {'pass':4} {'hdim':>4} {'causal':>6} {'flash3 ms':>10} {'fa3 ms':>8}  "
          f"{'FA3/flash3':>22}  {'varlen/fixed':>22}  check")
    for r in rows:
        ms = r["ms_runs"]
        f3, fa, fx = ms.get("flash3", []), ms.get("fa3", []), ms.get("flash3_fixed", [])
        r["fa3_over_flash3"] = spread([x / y if x and y else None for x, y in zip(fa, f3)])
        r["varlen_over_fixed"] = spread([x / y if x and y else None for x, y in zip(f3, fx)]) if fx else None
        r["flash3_ms"], r["fa3_ms"] = median_or_none(f3), median_or_none(fa)
        print(f"{r['part']:7} {r['pass']:4} {r['hdim']:>4} {str(r['causal']):>6} "
              f"{(r['flash3_ms'] or float('nan')):>10.3f} {(r['fa3_ms'] or float('nan')):>8.3f}  "
              f"{rng(r['fa3_over_flash3']):>22}  {rng(r['varlen_over_fixed']):>22}  "
              f"{json.dumps(r['check'])} {json.dumps(r['errors']) if r['errors'] else ''}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fa3": fa3_info,
                       "options": vars(a), "targets": {"equal_varlen_over_fixed_max": EQUAL_TARGET,
                                                       "packed_fa3_over_flash3_min": FA3_TARGET},
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

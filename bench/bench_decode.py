#!/usr/bin/env python3
"""Decoding speed: flash3's KV-cache attention beside FlashAttention-3's inference build, in one
process, round robin (issue 44).

    python3 bench/bench_decode.py --fa3 .anchors/fa3_decode.so.xz [--batches 1,8,64,128]
        [--caches 1024,8192,65536,131072] [--layouts contiguous,paged256,paged16] [--heads 32,4]
        [--splits 1,4,16,64] [--append N] [--mla] [--runs 3] [--reps 20] [--warmup 5] [--l2 cold|shared]
        [--json out.json]

One point per (layout, batch, cache length): q (batch, 1, heads_q, 128) bf16 over a cache k, v of
heads_kv heads bf16 (--heads: 32 query heads over 4 kv heads, GQA 8:1, as issue 44 asks),
cache_seqlens = the cache length for every entry, causal. Layouts: contiguous (batch, cache,
heads_kv, 128); pagedN: pages of N rows (num_pages, N, heads_kv, 128), each sequence's pages in
a random order (a permutation as page_table). A point whose cache and the copy's two buffers (half
of the cache each) would not fit in 80% of the free GPU memory is skipped.
  flash3: flash3.forward_kvcache_into into preallocated out and lse (its split heuristic);
  FA3:    torch.ops.flash_attn_3.fwd(q, k_cache, v_cache, seqused_k=cache_seqlens, is_causal=True,
          [page_table=]) (its own split and GQA-packing heuristics);
  --mla:  MLA decoding (DeepSeek's shape): q (batch, 1, heads_q, 64) and qv (batch, 1, heads_q,
          512) over a cache k (..., heads_kv, 64), v (..., heads_kv, 512) (--heads 16,1 or 128,1);
          FA3 with its q_v argument (not timed where its build has no such kernel: an error, or an
          output further than FA3_AGREES from flash3's);
  --append N: each call also appends N new tokens (k, v of shape (batch, N, heads_kv, 128)) with
          rotary (cos, sin of the cache length x 64, not interleaved) at cache_seqlens = the cache
          length - N; both libraries write them in place (the same slots every call);
  copy:   the ceiling, a device-to-device copy of half of the cache's bytes (so that it reads and
          writes as many bytes as the cache holds; bytes read + written per second).
Reported per point: each time, t_fa3 / t_flash3 as median [min-max] over runs (>= 1: flash3 at or
above FlashAttention-3), and the fraction of the copy's bandwidth at which each reads the cache
(bytes of k and v / time / copy bandwidth). Timing as bench/timing.py (spin kernel, CUDA events,
round robin, median per run).
  --l2 cold (default): every timed call (the copy's too) follows an L2 flush (timing.l2_flush), so
          each starts from the same empty L2, as a model's decode step finds its layer's cache
          after the other layers' weights have passed through. --l2 shared: no flush, each call
          finds what the one before it (another library's, the copy's) left in the L2, which
          differs by library: round robin puts flash3 after FA3 in most repetitions and FA3
          after the copy.
"""
import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from timing import (first_line, hopper_torch, ints, l2_flush, log, median_or_none, rel_diff, rng,  # noqa: E402
                    round_robin, sha256, spread)

HDIM = 128
MLA_ROPE, MLA_LATENT = 64, 512
SPIN = 200_000
# FA3's output within this relative difference of flash3's: the same computation, so it is timed
# (bf16 outputs differ by about 3e-3; a build without the kernel, e.g. MLA's head dim 512, gives O(1)).
FA3_AGREES = 0.05


def load_decode_anchor(torch, path):
    """torch.ops.flash_attn_3 of FlashAttention-3's inference build (a .so, or a .so.xz unpacked
    into a temporary folder) and its info."""
    import lzma
    import shutil
    so = path
    if path.endswith(".xz"):
        so = os.path.join(tempfile.mkdtemp(), "fa3_decode.so")
        with lzma.open(path) as f, open(so, "wb") as g:
            shutil.copyfileobj(f, g)
    torch.ops.load_library(so)
    fa3 = torch.ops.flash_attn_3
    return fa3, {"path": os.path.abspath(path), "sha256": sha256(so), "fwd_schema": str(fa3.fwd.default._schema)}


def time_point(torch, flash3, fa3, r, run, a, heads_q, heads_kv, seed, before=None):
    """One run of one point: the calls timed round robin, each one's median into r["ms_runs"]
    (the tensors are freed on return, before the next point's)."""
    dev = torch.device("cuda")
    b, c, layout = r["batch"], r["cache"], r["layout"]
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    hd, hd_v = (MLA_ROPE, MLA_LATENT) if a.mla else (HDIM, HDIM)
    q = torch.randn(b, 1, heads_q, hd, device=dev, dtype=torch.bfloat16, generator=g)
    paged = {}
    if a.mla:
        paged["qv"] = torch.randn(b, 1, heads_q, hd_v, device=dev, dtype=torch.bfloat16, generator=g)
    if layout == "contiguous":
        shape = (b, c, heads_kv)
    else:
        ps = int(layout[len("paged"):])
        per_seq = -(-c // ps)
        shape = (b * per_seq, ps, heads_kv)
        perm = torch.randperm(b * per_seq, device=dev, generator=g)
        paged["page_table"] = perm.view(b, per_seq).to(torch.int32)
    k = torch.randn(*shape, hd, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(*shape, hd_v, device=dev, dtype=torch.bfloat16, generator=g)
    lens = torch.full((b,), c - a.append, dtype=torch.int32, device=dev)
    if a.append:
        kn = torch.randn(b, a.append, heads_kv, hd, device=dev, dtype=torch.bfloat16, generator=g)
        vn = torch.randn(b, a.append, heads_kv, hd_v, device=dev, dtype=torch.bfloat16, generator=g)
        ang = torch.rand(c, hd // 2, device=dev, generator=g) * 6.2832
        paged.update(k_new=kn, v_new=vn, rotary_cos=ang.cos().bfloat16(), rotary_sin=ang.sin().bfloat16(),
                     rotary_interleaved=False)
    out = torch.empty(b, 1, heads_q, hd_v, device=dev, dtype=torch.bfloat16)
    lse = torch.empty(b, heads_q, 1, device=dev, dtype=torch.float32)
    # the copy moves |k| + |v| bytes: half of them read, half written (its contents do not matter)
    copy_src = torch.empty((k.numel() + v.numel()) // 2, device=dev, dtype=torch.bfloat16)
    copy_dst = torch.empty_like(copy_src)
    calls = {
        "flash3": lambda: flash3.forward_kvcache_into(q, k, v, out, lse, lens, causal=True, **paged)[0],
        "copy": lambda: copy_dst.copy_(copy_src),
    }
    for n in a.splits:  # flash3 at fixed split counts, beside its heuristic's
        calls[f"flash3_s{n}"] = lambda n=n: flash3.forward_kvcache_into(q, k, v, out, lse, lens, causal=True,
                                                                       num_splits=n, **paged)[0]
    if fa3 is not None:
        fa3_names = {"rotary_interleaved": "is_rotary_interleaved", "qv": "q_v"}
        fa3_args = {fa3_names.get(n, n): t for n, t in paged.items()}
        calls["fa3"] = lambda: fa3.fwd(q, k, v, seqused_k=lens, is_causal=True, **fa3_args)[0]
    errors = r["errors"]
    if run == 0 and fa3 is not None:
        try:
            r["check"]["vs_fa3"] = rel_diff(calls["flash3"]().clone(), calls["fa3"]())
            if r["check"]["vs_fa3"] > FA3_AGREES:  # not the same computation (a kernel it lacks): not timed
                errors["fa3"] = f"output differs from flash3's (relative difference {r['check']['vs_fa3']:.3g})"
        except Exception as e:  # noqa: BLE001 - recorded
            errors["check"] = first_line(e)
    times = round_robin(torch, {n: f for n, f in calls.items() if n not in errors}, a.warmup, a.reps, SPIN, errors,
                        before)
    for n, t in times.items():
        r["ms_runs"].setdefault(n, [None] * a.runs)[run] = statistics.median(t) if t else None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fa3", default=".anchors/fa3_decode.so.xz")
    p.add_argument("--batches", type=ints, default=[1, 8, 64, 128])
    p.add_argument("--caches", type=ints, default=[1024, 8192, 65536, 131072])
    p.add_argument("--layouts", default="contiguous,paged256,paged16")
    p.add_argument("--splits", type=ints, default=[], help="also time flash3 at these num_splits")
    p.add_argument("--mla", action="store_true", help="MLA decoding (q 64 + qv 512 over k 64, v 512)")
    p.add_argument("--append", type=int, default=0, help="new tokens appended with rotary per call")
    p.add_argument("--heads", type=ints, default=[32, 4], help="query heads, kv heads")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--l2", choices=("cold", "shared"), default="cold",
                   help="cold: an L2 flush before every timed call; shared: none")
    p.add_argument("--json")
    return p.parse_args(argv)


def main(argv=None):
    a = parse_args(argv)
    heads_q, heads_kv = a.heads
    torch = hopper_torch("bench_decode")
    if torch is None:
        return 0
    import flash3
    fa3, fa3_info = None, None
    if a.fa3 != "none" and os.path.exists(a.fa3):
        fa3, fa3_info = load_decode_anchor(torch, a.fa3)
    flush = l2_flush(torch) if a.l2 == "cold" else None
    rows = [{"layout": lay, "batch": b, "cache": c, "ms_runs": {}, "errors": {}, "check": {}}
            for lay in a.layouts.split(",") for b in a.batches for c in a.caches]
    for run in range(a.runs):
        for i, r in enumerate(rows):
            b, c = r["batch"], r["cache"]
            kv_bytes = b * c * heads_kv * ((MLA_ROPE + MLA_LATENT) if a.mla else 2 * HDIM) * 2
            free, _ = torch.cuda.mem_get_info()
            if 2 * kv_bytes > 0.8 * free:  # k, v and the copy's two buffers (half of kv each)
                r["skipped"] = f"cache of {kv_bytes / 2**30:.1f} GiB does not fit"
                continue
            r["kv_bytes"] = kv_bytes  # the copy also moves |k| + |v| bytes (half read, half written)
            time_point(torch, flash3, fa3, r, run, a, heads_q, heads_kv, seed=1000 + i, before=flush)
            torch.cuda.empty_cache()
        log(f"run {run + 1}/{a.runs} done")
    dims = f"{MLA_ROPE} + qv {MLA_LATENT}" if a.mla else f"{HDIM}"
    cache = f"k {MLA_ROPE}, v {MLA_LATENT}" if a.mla else f"{HDIM}"
    print(f"device: {torch.cuda.get_device_name()}; q (b, 1, {heads_q}, {dims}), cache of {heads_kv} heads of {cache} "
          f"bf16, causal{f', {a.append} appended' if a.append else ''}; L2 {a.l2}; FA3 {fa3_info['path'] if fa3_info else 'none'}")
    print(f"{'layout':>10} {'batch':>5} {'cache':>7} | {'flash3 us':>9} {'fa3 us':>8} {'copy us':>8} | {'FA3/flash3':>22} | "
          f"{'flash3 / copy bw':>16} {'fa3 / copy bw':>14} | check")
    for r in rows:
        if r.get("skipped"):
            print(f"{r['layout']:>10} {r['batch']:>5} {r['cache']:>7} | skipped: {r['skipped']}")
            continue
        ms = r["ms_runs"]
        f3, fa, cp = ms.get("flash3", []), ms.get("fa3", []), ms.get("copy", [])
        r["fa3_over_flash3"] = spread([x / y if x and y else None for x, y in zip(fa, f3)])
        # fraction of the copy's bandwidth: (kv bytes / t) / (copy bytes / t_copy)
        r["flash3_of_copy_bw"] = spread([c / x if x and c else None for x, c in zip(f3, cp)])
        r["fa3_of_copy_bw"] = spread([c / x if x and c else None for x, c in zip(fa, cp)])
        r["flash3_ms"], r["fa3_ms"], r["copy_ms"] = median_or_none(f3), median_or_none(fa), median_or_none(cp)
        us = lambda x: f"{1000 * x:.1f}" if x else "-"  # noqa: E731
        print(f"{r['layout']:>10} {r['batch']:>5} {r['cache']:>7} | {us(r['flash3_ms']):>9} {us(r['fa3_ms']):>8} "
              f"{us(r['copy_ms']):>8} | {rng(r['fa3_over_flash3']):>22} | "
              f"{(r['flash3_of_copy_bw'] or {}).get('median', float('nan')):>16.3f} "
              f"{(r['fa3_of_copy_bw'] or {}).get('median', float('nan')):>14.3f} | "
              f"{json.dumps(r['check'])} {json.dumps(r['errors']) if r['errors'] else ''}")
        if a.splits:
            r["split_us"] = {n: median_or_none(ms.get(f"flash3_s{n}", [])) for n in a.splits}
            print(" " * 26 + "fixed num_splits, us: " + "  ".join(
                f"{n}: {us(t)}" for n, t in r["split_us"].items()))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fa3": fa3_info,
                       "options": vars(a), "shape": {"heads_q": heads_q, "heads_kv": heads_kv,
                                                     "hdim": MLA_ROPE if a.mla else HDIM,
                                                     "hdim_v": MLA_LATENT if a.mla else HDIM},
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

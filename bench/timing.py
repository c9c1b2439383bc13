"""Conventions and timing helpers shared by bench/bench_torch.py and bench/compare_builds.py.

The paper's sweep (FlashAttention-3, section 4.1): bf16, batch x seqlen = 16k tokens, hidden 2048
(nheads = 2048 / head dim); FLOPs = 4 * batch * nheads * seqlen_q * seqlen_k * hdim, halved for
causal; the backward counts BWD_FLOPS_FACTOR times that (5 matmuls against the forward's 2).

Timing: CUDA events around one call, after a short spin kernel (torch.cuda._sleep) that keeps the
GPU busy while the host launches, so host launch overhead is hidden (every implementation alike).
Needs no torch at import: the functions that time take the torch module as an argument.
"""
import hashlib
import lzma
import math
import os
import random
import shutil
import statistics

TOKENS, HIDDEN = 16384, 2048
DEFAULT_HDIMS = [64, 128, 256]
DEFAULT_SEQLENS = [512, 1024, 2048, 4096, 8192, 16384]
BWD_FLOPS_FACTOR = 2.5  # backward FLOPs / forward FLOPs (the paper's convention)
SPIN_CYCLES = {"fwd": 200_000, "bwd": 1_000_000}  # about 0.1 ms / 0.5 ms at 1.98 GHz
MISMATCH = 1e-2  # relative (norm) difference to the reference above which a point is flagged


def log(*a):
    print(*a, flush=True)


def ints(s):
    return [int(x) for x in s.split(",") if x]


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def ratio(x, y):
    return x / y if x is not None and y else None


def spread(xs):
    """{"median", "min", "max"} of the numbers in xs (None skipped); None when there are none."""
    xs = [x for x in xs if x is not None]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def median_or_none(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rng(st, spec=".3f"):
    """'median [min-max]' of a ratio's statistics (spread), '-' where there is none."""
    if not st or st.get("median") is None:
        return "-"
    return f"{st['median']:{spec}} [{st['min']:{spec}}-{st['max']:{spec}}]"


def geomean(xs):
    """Geometric mean of the positive numbers in xs (None and 0 skipped); None when there are none."""
    xs = [x for x in xs if x]
    return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else None


def sha256(path):
    """The hex SHA-256 of a file (to name which library a result came from)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def first_line(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def sweep_points(hdims, causals, seqlens, factor=1):
    """(hdim, causal, seqlen, batch, nheads, FLOPs) of each point of the paper's sweep: 16k tokens,
    hidden 2048; FLOPs = factor x 4 b h s^2 d, halved for causal."""
    for d in hdims:
        for causal in causals:
            for s in seqlens:
                b, h = max(1, TOKENS // s), max(1, HIDDEN // d)
                yield d, causal, s, b, h, factor * 4 * b * h * s * s * d / (2 if causal else 1)


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def spin_kernel(torch):
    """torch's spin kernel (torch.cuda._sleep(cycles)), or None where this torch has none."""
    return getattr(torch.cuda, "_sleep", None)


def l2_flush(torch):
    """A callable that empties the GPU's L2 of what the last calls left there by reading a buffer
    of twice its size (a read, not a write: no dirty lines left for the next call to write back)."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    size = 2 * int(getattr(props, "L2_cache_size", 0) or (50 << 20))
    buf = torch.ones(size // 4, device="cuda")
    return lambda: buf.sum()


def time_call_ms(torch, fn, spin_cycles, before=None):
    """Milliseconds of one call of fn between two CUDA events, the GPU first given spin_cycles of
    spin (0 or None: none) so that the host's launch work overlaps it; before (untimed, ahead of
    the spin) e.g. an L2 flush."""
    spin = spin_kernel(torch)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if before is not None:
        before()
    if spin is not None and spin_cycles:
        spin(spin_cycles)  # the GPU is busy while the host launches: time only the kernel(s)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def median_time_ms(torch, fn, warmup, reps, spin_cycles):
    """warmup untimed calls, then the median of reps calls timed by time_call_ms."""
    for _ in range(warmup):
        fn()
    return statistics.median(time_call_ms(torch, fn, spin_cycles) for _ in range(reps))


def gemm_tflops(torch, dev, warmup=3, reps=10, spin_cycles=SPIN_CYCLES["fwd"], n=8192):
    """The ceiling: TFLOP/s of one bf16 n^3 matrix product (random normal inputs)."""
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    y = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    ms = median_time_ms(torch, lambda: torch.matmul(x, y), warmup, reps, spin_cycles)
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def sdpa(F, sdpa_kernel, backend):
    """fn(q, k, v, causal) on flash3's layout (batch, seqlen, nheads, hdim) through torch's
    scaled_dot_product_attention restricted to one backend (e.g. SDPBackend.CUDNN_ATTENTION)."""
    def run(q, k, v, causal):
        gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}  # fewer kv heads (GQA/MQA)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal, **gqa).transpose(1, 2)
    return run


def rel_diff(got, ref):
    """Relative norm difference |got - ref| / |ref| (in float32), the absolute norm where ref is 0."""
    g, r = got.float(), ref.float()
    n = r.norm().item()
    d = (g - r).norm().item()
    return d / n if n else d


def load_fa3(torch, path, tmp):
    """torch.ops.flash_attn_3 from path (a .so, or a .so.xz unpacked into the folder tmp), and its
    info (path, sha256, schemas): (ops, info)."""
    so = path
    if path.endswith(".xz"):
        so = os.path.join(tmp, "fa3_anchor.so")
        with lzma.open(path) as f, open(so, "wb") as g:
            shutil.copyfileobj(f, g)
    torch.ops.load_library(so)
    fa3 = torch.ops.flash_attn_3
    return fa3, {"path": os.path.abspath(path), "sha256": sha256(so),
                 "fwd_schema": str(fa3.fwd.default._schema), "bwd_schema": str(fa3.bwd.default._schema)}


def round_robin(torch, calls, warmup, reps, spin_cycles, errors, before=None):
    """times[impl] = reps CUDA-event times (ms): warmup calls each, then each repetition times every
    implementation once, the order rotated by one per repetition (each timed call after before(),
    where given: time_call_ms). One that fails (or is already in errors) is dropped, its first
    error line recorded in errors."""
    names = [n for n in calls if n not in errors]
    for n in list(names):
        try:
            for _ in range(warmup):
                calls[n]()
        except Exception as e:  # noqa: BLE001 - recorded, the others go on
            errors[n] = first_line(e)
            names.remove(n)
    times = {n: [] for n in names}
    for r in range(reps):
        j = r % len(names) if names else 0
        for n in names[j:] + names[:j]:
            if n in errors:
                continue
            try:
                times[n].append(time_call_ms(torch, calls[n], spin_cycles, before))
            except Exception as e:  # noqa: BLE001
                errors[n] = first_line(e)
    return {n: t for n, t in times.items() if n not in errors}


def hopper_torch(name):
    """The torch module where a Hopper GPU is there to time on; else None, after saying why
    (`name` starts the message)."""
    try:
        import torch
    except ImportError:
        log(f"{name}: torch is not installed")
        return None
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        log(f"{name}: no Hopper GPU (cuda available: {torch.cuda.is_available()}, capability: {cap})")
        return None
    return torch


def doc_lengths(tokens, lo=64, hi=8192, seed=0):
    """Log-uniform document lengths in [lo, hi] summing to tokens (the last one cut)."""
    r = random.Random(seed)
    out = []
    while sum(out) < tokens:
        out.append(int(round(math.exp(r.uniform(math.log(lo), math.log(hi))))))
    out[-1] -= sum(out) - tokens
    return [x for x in out if x > 0]

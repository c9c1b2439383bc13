#!/usr/bin/env python3
"""A small GPT trained on the bytes of this repository's own text files, with flash3's attention
and with PyTorch's scaled_dot_product_attention, both under torch.compile.

    FLASH3_LIB=build/libflash3.so PYTHONPATH=python python3 examples/train_gpt.py [--out DIR]
    python3 examples/train_gpt.py --attn sdpa --no-compile --device cpu \\
        --layers 2 --width 64 --heads 2 --seqlen 64 --batch 4 --steps 20     # a CPU smoke test

Runs (--attn all, the default), each the same model, optimizer and schedule:
  flash3       attention = flash3.flash_attn_func(q, k, v, causal=True)        seed --seed
  sdpa         attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)  seed --seed
  sdpa_seed2   as sdpa with seed --seed + 1 (another init and another data order): the spread
flash3 and sdpa start from the same weights and see the same batches in the same order. SDPA is
left to PyTorch's own choice of backend (flash, cuDNN or memory-efficient), as a model would call it.

Model: pre-LayerNorm GPT (learned positions, GELU MLP of 4x width, no biases in the projections,
GPT-2 initialisation with the residual projections scaled by 1/sqrt(2 * layers)), vocabulary =
the 256 byte values; default 8 layers, width 1024, 8 heads of head dim 128, seqlen 2048: about
103M parameters; batch 16 x 2048 = 32k tokens a step. Training: fp32 parameters, bf16
autocast, fused AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1 on matrices and embeddings),
30 warm-up steps then cosine decay to 10 %, gradient clipping at 1.

Data: every UTF-8 text file (no NUL byte, at most 4 MB) under src/ include/ docs/ tests/ python/
bench/ tools/ scripts/ examples/ and the top-level README.md and CMakeLists.txt, in sorted path
order, concatenated: about 1.8 MB (half of it bench/baselines/compare.json); nothing is
downloaded or vendored. Each batch is --batch windows of seqlen + 1 bytes at random offsets (a
generator seeded by the run's seed). At the defaults 300 steps see about 5 passes over the data:
the model memorizes much of it, alike with either attention.

Speed: tokens/s over the steps after the first --warm (compilation and warm-up excluded),
torch.cuda.synchronize() at both ends. Per step the model does about
6 * params * tokens + 7 * layers * batch * seqlen^2 * width FLOPs (matmuls: forward 2, backward 4
per parameter and token; causal attention: forward 2 b s^2 w per layer, backward 2.5x that):
23.7 TFLOP at the defaults, so about 0.08-0.16 s per step at 150-300 TFLOP/s on an H100: 300
steps take 25-50 s a run, plus compilation (about 30-60 s for the first run, less after): all
three runs take about 2.5-4 minutes.

Check (--attn all): m(X) = mean loss of the last 50 steps of run X;
  spread = |m(sdpa) - m(sdpa_seed2)|,
  floor  = 2 * sqrt(2) * max_X noise(X) / sqrt(50), noise(X) = the standard deviation of X's
           last 50 losses around their least-squares line (the step-to-step noise, trend
           removed): two standard errors of the difference of two 50-step means, taking the step
           losses as independent draws (each step's batch is drawn independently), so that two
           SDPA runs that happen to land close together do not make the test stricter than the
           batch noise allows;
  PASS iff |m(flash3) - (m(sdpa) + m(sdpa_seed2)) / 2| <= max(spread, floor).
Outputs in --out (default ./out, ignored by git): train_gpt.png (loss curves, with matplotlib;
skipped where it is not installed), train_gpt.json (config, data, per run the losses, times,
tokens/s, and the check).
"""
import argparse
import hashlib
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA_DIRS = ("src", "include", "docs", "tests", "python", "bench", "tools", "scripts", "examples")
DATA_FILES = ("README.md", "CMakeLists.txt")
MAX_FILE_BYTES = 4 << 20
LAST = 50  # steps averaged by the check
COLORS = {"flash3": (214, 39, 40), "sdpa": (31, 119, 180), "sdpa_seed2": (44, 160, 44)}


def log(*a):
    print(*a, flush=True)


# ---- data ----------------------------------------------------------------------------------------

def is_text(raw):
    if b"\0" in raw:
        return False
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def repo_text_files(root=ROOT):
    """The repository's own text files (DATA_DIRS walked, DATA_FILES), sorted relative paths."""
    paths = [f for f in DATA_FILES if os.path.isfile(os.path.join(root, f))]
    for d in DATA_DIRS:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, d)):
            # hidden folders, caches and outputs are not the project's text
            dirnames[:] = [x for x in dirnames if not x.startswith(".") and x not in ("__pycache__", "out")]
            for name in filenames:
                if name.startswith(".") or name.endswith((".pyc", ".png", ".so", ".xz", ".gz")):
                    continue
                paths.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(set(paths))


def load_corpus(root=ROOT):
    """(bytes, info): the text files concatenated in path order, each followed by a newline."""
    parts, used = [], []
    for rel in repo_text_files(root):
        path = os.path.join(root, rel)
        if os.path.getsize(path) > MAX_FILE_BYTES:
            continue
        with open(path, "rb") as f:
            raw = f.read()
        if raw and is_text(raw):
            parts.append(raw if raw.endswith(b"\n") else raw + b"\n")
            used.append(rel)
    data = b"".join(parts)
    return data, {"files": len(used), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                  "first_files": used[:5], "last_files": used[-5:]}


def batch_offsets(torch, n_bytes, seqlen, batch, steps, seed):
    """(steps, batch) start offsets of windows of seqlen + 1 bytes, from a CPU generator seeded by
    seed: the same on every machine for the same corpus and seed."""
    if n_bytes < seqlen + 2:
        raise ValueError(f"corpus of {n_bytes} bytes is shorter than seqlen + 2 = {seqlen + 2}")
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_bytes - seqlen - 1, (steps, batch), generator=g)


def get_batch(torch, data, offsets, seqlen):
    """(x, y) int64 (batch, seqlen) on data's device: windows at offsets, y shifted by one."""
    idx = offsets.to(data.device)[:, None] + torch.arange(seqlen + 1, device=data.device)
    w = data[idx].long()
    return w[:, :-1], w[:, 1:]


# ---- model ---------------------------------------------------------------------------------------

def build_model(torch, cfg, attn_fn):
    nn, F = torch.nn, torch.nn.functional

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            w = cfg["width"]
            self.ln1, self.ln2 = nn.LayerNorm(w), nn.LayerNorm(w)
            self.qkv = nn.Linear(w, 3 * w, bias=False)
            self.proj = nn.Linear(w, w, bias=False)
            self.fc = nn.Linear(w, 4 * w, bias=False)
            self.fc_out = nn.Linear(4 * w, w, bias=False)

        def forward(self, x):
            b, s, w = x.shape
            h = cfg["heads"]
            q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, h, w // h).unbind(2)  # (b, s, h, d) each
            x = x + self.proj(attn_fn(q, k, v).reshape(b, s, w))
            return x + self.fc_out(F.gelu(self.fc(self.ln2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            w = cfg["width"]
            self.tok = nn.Embedding(256, w)
            self.pos = nn.Embedding(cfg["seqlen"], w)
            self.blocks = nn.ModuleList(Block() for _ in range(cfg["layers"]))
            self.ln = nn.LayerNorm(w)
            self.head = nn.Linear(w, 256, bias=False)
            for name, p in self.named_parameters():
                if p.dim() == 2:
                    std = 0.02 / math.sqrt(2 * cfg["layers"]) if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                    nn.init.normal_(p, 0.0, std)

        def forward(self, x, y):
            pos = torch.arange(x.shape[1], device=x.device)
            h = self.tok(x) + self.pos(pos)
            for blk in self.blocks:
                h = blk(h)
            logits = self.head(self.ln(h))
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.reshape(-1))

    return GPT()


def attention(torch, kind):
    """attn(q, k, v) -> out, all (batch, seqlen, heads, head_dim), causal."""
    if kind == "flash3":
        import flash3

        def attn(q, k, v):
            out = flash3.flash_attn_func(q, k, v, causal=True)
            return out[0] if isinstance(out, (tuple, list)) else out
        return attn
    F = torch.nn.functional

    def attn(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=True).transpose(1, 2)
    return attn


def n_params(model):
    return sum(p.numel() for p in model.parameters())


def flops_per_step(cfg, params):
    """6 * (params doing matmuls) * tokens + causal attention (forward 2 b s^2 w per layer, x3.5)."""
    tokens = cfg["batch"] * cfg["seqlen"]
    matmul_params = params - 256 * cfg["width"] - cfg["seqlen"] * cfg["width"]  # embeddings are lookups
    attn = 7 * cfg["layers"] * cfg["batch"] * cfg["seqlen"] ** 2 * cfg["width"]
    return 6 * matmul_params * tokens + attn


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def graph_breaks(torch):
    try:
        from torch._dynamo.utils import counters
        return sum(counters["graph_break"].values())
    except Exception:  # noqa: BLE001 - a diagnostic only
        return None


def train(torch, cfg, name, kind, seed, data, log_every=25):
    """One run; returns its record (losses, times, tokens/s)."""
    dev = torch.device(cfg["device"])
    cuda = dev.type == "cuda"
    if cfg["compile"]:
        torch._dynamo.reset()  # drops the previous run's compiled code (and its hold on that model)
        try:
            from torch._dynamo.utils import counters
            counters.clear()
        except Exception:  # noqa: BLE001
            pass
    if cuda:
        torch.cuda.empty_cache()  # the previous run's memory
    torch.manual_seed(seed)
    model = build_model(torch, cfg, attention(torch, kind)).to(dev)  # built on the CPU: same init everywhere
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=(0.9, 0.95), eps=1e-8, fused=cuda)
    step_fn = torch.compile(model) if cfg["compile"] else model
    offsets = batch_offsets(torch, data.numel(), cfg["seqlen"], cfg["batch"], cfg["steps"], seed)
    tokens = cfg["batch"] * cfg["seqlen"]
    warm = min(cfg["warm"], cfg["steps"] - 1)
    losses = []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    t_start = time.perf_counter()
    t_warm = None
    first_step_s = None
    for step in range(cfg["steps"]):
        if step == warm:
            if cuda:
                torch.cuda.synchronize()
            t_warm = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg["steps"], cfg["lr"], cfg["lr_warmup"])
        x, y = get_batch(torch, data, offsets[step], cfg["seqlen"])
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16):
            loss = step_fn(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        if step == 0:
            first_step_s = time.perf_counter() - t_start  # loss.backward() waited for compilation
        if (step + 1) % log_every == 0 or step + 1 == cfg["steps"]:
            cur = losses[-1].item()  # synchronizes
            if not math.isfinite(cur):
                raise RuntimeError(f"[{name}] loss is not finite at step {step + 1}: {cur}")
            el = time.perf_counter() - t_start
            rate = ""
            if t_warm is not None and step + 1 > warm:
                rate = f", {(step + 1 - warm) * tokens / (time.perf_counter() - t_warm):,.0f} tokens/s"
            log(f"  [{name}] step {step + 1:4d}/{cfg['steps']} loss {cur:.4f} ({el:.1f} s{rate})")
    if cuda:
        torch.cuda.synchronize()
    t_end = time.perf_counter()
    vals = [float(x) for x in torch.stack(losses).float().cpu()]
    timed = cfg["steps"] - warm
    tps = timed * tokens / (t_end - t_warm) if t_warm is not None and t_end > t_warm else None
    last = vals[-LAST:]
    mean = sum(last) / len(last)
    std = math.sqrt(sum((v - mean) ** 2 for v in last) / max(1, len(last) - 1))
    noise = residual_std(last)
    rec = {"name": name, "attn": kind, "seed": seed, "losses": vals,
           "last50_mean": mean, "last50_std": std, "last50_noise": noise, "last_n": len(last),
           "tokens_per_s": tps, "timed_steps": timed, "step_ms": None if tps is None else tokens / tps * 1e3,
           "first_step_s": first_step_s, "total_s": t_end - t_start,
           "graph_breaks": graph_breaks(torch) if cfg["compile"] else None,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2 ** 30 if cuda else None}
    if tps is not None:
        rec["tflops"] = flops_per_step(cfg, n_params(model)) * tps / tokens / 1e12
    del model, opt, step_fn
    return rec


def residual_std(vals):
    """Standard deviation of vals around their least-squares line (the step-to-step noise without
    the downward trend of the loss)."""
    n = len(vals)
    if n < 3:
        return 0.0
    xm, ym = (n - 1) / 2, sum(vals) / n
    sxx = sum((i - xm) ** 2 for i in range(n))
    slope = sum((i - xm) * (v - ym) for i, v in enumerate(vals)) / sxx
    return math.sqrt(sum((v - ym - slope * (i - xm)) ** 2 for i, v in enumerate(vals)) / (n - 2))


def spread_check(runs):
    """The PASS/FAIL check of the module docstring over runs {name: record}; None when a run is
    missing."""
    if not all(k in runs for k in ("flash3", "sdpa", "sdpa_seed2")):
        return None
    m = {k: runs[k]["last50_mean"] for k in ("flash3", "sdpa", "sdpa_seed2")}
    n = min(runs[k]["last_n"] for k in m)
    spread = abs(m["sdpa"] - m["sdpa_seed2"])
    floor = 2 * math.sqrt(2) * max(runs[k]["last50_noise"] for k in m) / math.sqrt(n)
    ref = (m["sdpa"] + m["sdpa_seed2"]) / 2
    diff = abs(m["flash3"] - ref)
    tol = max(spread, floor)
    same = [abs(a - b) for a, b in zip(runs["flash3"]["losses"], runs["sdpa"]["losses"])]
    return {"last_n": n, "means": m, "sdpa_mean": ref, "diff": diff, "spread": spread, "floor": floor,
            "tolerance": tol, "pass": diff <= tol,
            "flash3_vs_sdpa_same_seed_max_abs_step_diff": max(same) if same else None,
            "flash3_vs_sdpa_same_seed_mean_diff_last": m["flash3"] - m["sdpa"]}


# ---- PNG -----------------------------------------------------------------------------------------

def smooth(vals, k=10):
    out, acc = [], []
    for v in vals:
        acc.append(v)
        if len(acc) > k:
            acc.pop(0)
        out.append(sum(acc) / len(acc))
    return out


def chart_series(runs):
    """(loss series, difference series) for the chart: losses per run; the per-step loss minus
    sdpa's (seed --seed) loss, smoothed over 10 steps."""
    order = sorted(runs, key=lambda k: k == "flash3")  # flash3 drawn last, on top

    def label(k):
        tps = runs[k].get("tokens_per_s")
        return f"{k} ({tps / 1e3:,.0f}k tokens/s)" if tps and tps >= 1e3 else k
    loss = [(label(k), COLORS.get(k, (0, 0, 0)), runs[k]["losses"]) for k in order]
    diff = []
    if "sdpa" in runs:
        base = runs["sdpa"]["losses"]
        for k in order:
            r = runs[k]
            if k != "sdpa":
                diff.append((f"{k} - sdpa", COLORS.get(k, (0, 0, 0)),
                             smooth([a - b for a, b in zip(r["losses"], base)])))
    return loss, diff


def write_png_matplotlib(path, runs, title):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    loss, diff = chart_series(runs)
    fig, axes = plt.subplots(2 if diff else 1, 1, figsize=(9, 7.6 if diff else 4.8), squeeze=False,
                             gridspec_kw={"height_ratios": [2, 1] if diff else [1]})
    ax = axes[0][0]
    for label, color, vals in loss:
        ax.plot(range(1, len(vals) + 1), vals, label=label, color=[c / 255 for c in color], lw=1.2)
    ys = [v for _, _, vals in loss for v in vals[min(5, len(vals) - 1):] if math.isfinite(v)]
    if ys:
        pad = 0.03 * (max(ys) - min(ys) or 1)
        ax.set_ylim(min(ys) - pad, max(ys) + pad)
    ax.set_title(title, fontsize=10)
    ax.set_ylabel("training loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend()
    if diff:
        bx = axes[1][0]
        for label, color, vals in diff:
            bx.plot(range(1, len(vals) + 1), vals, label=label, color=[c / 255 for c in color], lw=1.2)
        bx.axhline(0, color="k", lw=0.6)
        bx.set_ylabel("loss - sdpa (10-step mean)")
        bx.grid(alpha=0.3)
        bx.legend()
    axes[-1][0].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_png(path, runs, title):
    """Writes the chart with matplotlib; returns whether it did (no matplotlib: no chart)."""
    try:
        write_png_matplotlib(path, runs, title)
        return True
    except ImportError as e:
        log(f"chart skipped: {e}")
        return False


# ---- main ----------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--attn", choices=("flash3", "sdpa", "all"), default="all",
                   help="all: flash3, sdpa, and sdpa with another seed (the spread) [all]")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=None, help="default: width / 128 (head dim 128)")
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--lr-warmup", type=int, default=30, help="linear learning-rate warm-up steps")
    p.add_argument("--warm", type=int, default=10, help="first steps left out of tokens/s (compilation)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default=None, help="default: cuda where available, else cpu")
    p.add_argument("--out", default=os.path.join(ROOT, "out"), help="output folder [./out]")
    p.add_argument("--log-every", type=int, default=25)
    a = p.parse_args(argv)
    if a.heads is None:
        a.heads = max(1, a.width // 128)
    if a.width % a.heads:
        p.error(f"--width {a.width} is not a multiple of --heads {a.heads}")
    if a.steps < 2 or a.batch < 1 or a.seqlen < 2 or a.layers < 1:
        p.error("--steps >= 2, --batch >= 1, --seqlen >= 2, --layers >= 1")
    return a


def main(argv=None):
    a = parse_args(argv)
    import torch
    dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = {"layers": a.layers, "width": a.width, "heads": a.heads, "head_dim": a.width // a.heads,
           "seqlen": a.seqlen, "batch": a.batch, "steps": a.steps, "lr": a.lr, "lr_warmup": a.lr_warmup,
           "warm": a.warm, "seed": a.seed, "compile": a.compile, "device": dev,
           "dtype": "fp32 params, bf16 autocast", "optimizer": "AdamW(0.9, 0.95), wd 0.1, clip 1.0"}
    runs_todo = {"flash3": [("flash3", "flash3", a.seed)], "sdpa": [("sdpa", "sdpa", a.seed)],
                 "all": [("flash3", "flash3", a.seed), ("sdpa", "sdpa", a.seed),
                         ("sdpa_seed2", "sdpa", a.seed + 1)]}[a.attn]
    if dev.startswith("cpu") and any(k == "flash3" for _, k, _ in runs_todo):
        log("train_gpt: flash3 needs a CUDA (Hopper) device; on the CPU use --attn sdpa")
        return 2
    os.makedirs(a.out, exist_ok=True)
    raw, info = load_corpus()
    log(f"data: {info['files']} text files of this repository, {info['bytes']:,} bytes "
        f"(sha256 {info['sha256'][:12]})")
    data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev)
    probe = build_model(torch, cfg, None)
    params = n_params(probe)
    del probe
    fl = flops_per_step(cfg, params)
    tokens = a.batch * a.seqlen
    cfg["params"] = params
    cfg["flops_per_step"] = fl
    log(f"model: {a.layers} layers, width {a.width}, {a.heads} heads of {a.width // a.heads}, seqlen {a.seqlen}, "
        f"{params / 1e6:.1f}M parameters; batch {a.batch} x {a.seqlen} = {tokens:,} tokens/step, "
        f"{fl / 1e12:.2f} TFLOP/step ({a.steps} steps: {a.steps * fl / 300e12:.0f}-{a.steps * fl / 150e12:.0f} s "
        f"a run at 300-150 TFLOP/s); device {dev}, torch {torch.__version__}, compile {a.compile}")
    if dev.startswith("cuda"):
        log(f"GPU: {torch.cuda.get_device_name()}")
    out_json = os.path.join(a.out, "train_gpt.json")
    result = {"config": cfg, "data": info, "torch": torch.__version__, "python": sys.version.split()[0],
              "device_name": torch.cuda.get_device_name() if dev.startswith("cuda") else "cpu",
              "argv": sys.argv[1:], "runs": {}}
    if any(k == "flash3" for _, k, _ in runs_todo):
        import flash3
        try:
            version = flash3.version() if hasattr(flash3, "version") else None
        except Exception as e:  # noqa: BLE001 - the first attention call says why, with its traceback
            version = f"? ({type(e).__name__}: {e})"
        result["flash3"] = {"module": os.path.abspath(flash3.__file__), "version": version}
        log(f"flash3: {result['flash3']['module']}, version {version}")
    t0 = time.time()
    for name, kind, seed in runs_todo:
        log(f"run {name}: attention {kind}, seed {seed}")
        rec = train(torch, cfg, name, kind, seed, data, a.log_every)
        result["runs"][name] = rec
        log(f"run {name}: {fmt_rate(rec)}; first step (compilation) {rec['first_step_s']:.1f} s, "
            f"total {rec['total_s']:.1f} s; last-{rec['last_n']} mean loss {rec['last50_mean']:.4f} "
            f"(std {rec['last50_std']:.4f})"
            + ("" if rec["graph_breaks"] is None else f"; graph breaks {rec['graph_breaks']}")
            + ("" if rec["peak_mem_gib"] is None else f"; peak memory {rec['peak_mem_gib']:.1f} GiB"))
        with open(out_json, "w") as f:
            json.dump(result, f, indent=1)
    result["seconds"] = round(time.time() - t0, 1)

    log("")
    log(f"{'run':12s} {'tokens/s':>12s} {'ms/step':>8s} {'TFLOP/s':>8s} {'last-50 loss':>13s}")
    for name, r in result["runs"].items():
        log(f"{name:12s} {fmt(r['tokens_per_s'], '12,.0f')} {fmt(r['step_ms'], '8.1f')} "
            f"{fmt(r.get('tflops'), '8.1f')} {r['last50_mean']:13.4f}")
    chk = spread_check(result["runs"])
    result["check"] = chk
    if chk:
        m = chk["means"]
        log(f"check: |flash3 - mean(sdpa, sdpa_seed2)| = |{m['flash3']:.4f} - {chk['sdpa_mean']:.4f}| = "
            f"{chk['diff']:.4f} <= max(spread |{m['sdpa']:.4f} - {m['sdpa_seed2']:.4f}| = {chk['spread']:.4f}, "
            f"floor {chk['floor']:.4f}) = {chk['tolerance']:.4f}: {'PASS' if chk['pass'] else 'FAIL'}")
        log(f"  flash3 vs sdpa (same seed, same batches): last-50 mean difference "
            f"{chk['flash3_vs_sdpa_same_seed_mean_diff_last']:+.4f}, largest per-step difference "
            f"{chk['flash3_vs_sdpa_same_seed_max_abs_step_diff']:.4f}")
        if "flash3" in result["runs"] and "sdpa" in result["runs"]:
            f3, sd = result["runs"]["flash3"]["tokens_per_s"], result["runs"]["sdpa"]["tokens_per_s"]
            if f3 and sd:
                log(f"  tokens/s flash3 / sdpa: {f3 / sd:.3f}")
    title = (f"GPT {a.layers}x{a.width}, {a.heads} heads of {a.width // a.heads}, seqlen {a.seqlen}, "
             f"batch {a.batch}, {result['device_name']}")
    if chk:
        title += (f"\nlast-50 mean: flash3 {chk['means']['flash3']:.4f}, sdpa {chk['means']['sdpa']:.4f}, "
                  f"sdpa_seed2 {chk['means']['sdpa_seed2']:.4f}; |diff| {chk['diff']:.4f} <= "
                  f"{chk['tolerance']:.4f}: {'PASS' if chk['pass'] else 'FAIL'}")
    png = os.path.join(a.out, "train_gpt.png")
    result["chart"] = write_png(png, result["runs"], title)
    with open(out_json, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {png if result['chart'] else 'no chart'} and {out_json}")
    return 0 if chk is None or chk["pass"] else 1


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def fmt_rate(rec):
    if rec["tokens_per_s"] is None:
        return "tokens/s -"
    return (f"{rec['tokens_per_s']:,.0f} tokens/s over {rec['timed_steps']} steps "
            f"({rec['step_ms']:.1f} ms/step" + (f", {rec['tflops']:.0f} TFLOP/s" if "tflops" in rec else "") + ")")


if __name__ == "__main__":
    sys.exit(main())

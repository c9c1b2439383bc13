#!/usr/bin/env python3
"""Chart of bench/bench_torch.py's JSON in the style of Figures 5 (forward) and 6 (backward) of the
FlashAttention-3 paper.

One panel per (causal no/yes) x (head dim), grouped bars per sequence length (per shape,
"seqlen batch heads:kv_heads", for rows with fewer kv heads, as compare_builds.py --gqa writes): FlashAttention-2
(torch SDPA), cuDNN (torch SDPA), flash3, flash3 with deterministic=True (backward runs) and,
where the JSON has FA3's ratio to cuDNN from the anchors, FA3 implied as cuDNN x that ratio
(hatched). TFLOP/s printed on top of each bar; a series with no value anywhere gets no slot.

    python3 bench/plot.py IN.json OUT.png [--pass fwd|bwd]

The JSON's own 'pass' ("fwd" when absent) says what its top-level 'rows' are; --pass defaults to
it. A pass other than the file's is read from a section of that name ({'rows': [...]} or a list
of rows). Unknown keys are ignored. A JSON may name its own bars and geomeans (as
bench/compare_builds.py's does): 'series' = [[label, row key], ...] and 'geomean_labels' =
[[geomean key, label], ...].
"""
import argparse
import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

PASS_NAMES = {"fwd": "Forward", "bwd": "Backward"}
# (label, how to get the value from a row, style)
SERIES = [
    ("FlashAttention-2 (torch)", lambda r, p: r.get("fa2_tflops"), dict(color="#f28e2b")),
    ("cuDNN", lambda r, p: r.get("cudnn_tflops"), dict(color="#e15759")),
    ("flash3", lambda r, p: r.get("flash3_tflops"), dict(color="#7b4fa6")),
    ("flash3 (deterministic)", lambda r, p: r.get("flash3_det_tflops"), dict(color="#b79bd3")),
    ("FA3 (implied: cuDNN x anchor ratio)", lambda r, p: implied_fa3(r, p),
     dict(facecolor="#e6dcf0", edgecolor="#7b4fa6", hatch="////", linewidth=0.6)),
]

PALETTE = ["#9c9c9c", "#7b4fa6", "#e15759", "#f28e2b", "#4e79a7", "#59a14f"]
GEOMEAN_LABELS = [("flash3_over_cudnn", "flash3/cuDNN"), ("flash3_det_over_cudnn", "deterministic/cuDNN"),
                  ("flash3_det_over_flash3", "deterministic/default"), ("flash3_over_fa2", "flash3/FA2"),
                  ("flash3_over_fa3_implied", "flash3/FA3 (implied)"),
                  ("flash3_over_fa3_implied_same_method", "same, both without spin")]


def series_of(data):
    """The JSON's own series ([label, row key] pairs), else SERIES."""
    own = data.get("series")
    if not own:
        return SERIES
    return [(label, (lambda r, p, k=key: r.get(k)), dict(color=PALETTE[i % len(PALETTE)]))
            for i, (label, key) in enumerate(own)]


def implied_fa3(row, pss):
    if row.get("fa3_implied_tflops"):  # backward runs: the anchor ratio times cuDNN timed the anchors' way
        return row["fa3_implied_tflops"]
    cudnn = row.get("cudnn_tflops")
    ratio = row.get(f"fa3_over_cudnn_{pss}", row.get("fa3_over_cudnn"))
    return cudnn * ratio if cudnn and ratio else None


def seqlen_label(s):
    return f"{s // 1024}k" if s >= 1024 and s % 1024 == 0 else str(s)


def x_key(r, gqa):
    return (r["seqlen"], r.get("batch"), r.get("nheads"), r.get("nheads_kv")) if gqa else r["seqlen"]


def x_label(key, gqa):
    if not gqa:
        return seqlen_label(key)
    s, b, h, hkv = key
    return f"{seqlen_label(s)}\nb{b} {h}:{hkv}"


def file_pass(data):
    """The pass of a JSON's top-level rows (bench_torch.py writes 'pass'; older files are fwd)."""
    return data.get("pass") or "fwd"


def rows_for(data, pss):
    if file_pass(data) == pss and isinstance(data.get("rows"), list):
        return data["rows"]
    sec = data.get(pss)
    if isinstance(sec, dict) and isinstance(sec.get("rows"), list):
        return sec["rows"]
    if isinstance(sec, list):
        return sec
    return None


def geomean_for(data, pss):
    if file_pass(data) == pss and isinstance(data.get("geomean"), dict):
        return data["geomean"]
    sec = data.get(pss)
    if isinstance(sec, dict) and isinstance(sec.get("geomean"), dict):
        return sec["geomean"]
    return None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("inp", metavar="IN.json")
    p.add_argument("out", metavar="OUT.png")
    p.add_argument("--pass", dest="pss", choices=sorted(PASS_NAMES), default=None,
                   help="which pass to draw (default: the JSON's own 'pass', else fwd)")
    p.add_argument("--dpi", type=int, default=150)
    a = p.parse_args()

    with open(a.inp) as f:
        data = json.load(f)
    if a.pss is None:
        a.pss = file_pass(data) if file_pass(data) in PASS_NAMES else "fwd"
    rows = [r for r in (rows_for(data, a.pss) or []) if isinstance(r, dict)
            and all(k in r for k in ("hdim", "causal", "seqlen"))]
    if not rows:
        print(f"plot: no '{a.pss}' rows in {a.inp}", file=sys.stderr)
        return 1

    hdims = sorted({r["hdim"] for r in rows})
    causals = sorted({bool(r["causal"]) for r in rows})
    gqa = any(r.get("nheads_kv", r.get("nheads")) != r.get("nheads") for r in rows)
    seqlens = sorted({x_key(r, gqa) for r in rows})
    by_key = {(r["hdim"], bool(r["causal"]), x_key(r, gqa)): r for r in rows}
    # Only the series with at least one value anywhere get a bar slot (e.g. no anchors: 3 bars).
    series = [s for s in series_of(data) if any(s[1](r, a.pss) for r in rows)]
    nser = len(series)

    narrow = len(hdims) < 3  # e.g. --hdims 128: title on two lines, legend on two rows
    head_in = 1.35 if narrow else 0.95  # inches above the panels for title, subtitle, legend
    fig, axes = plt.subplots(len(causals), len(hdims), squeeze=False,
                             figsize=(max(9.0, 6.2 * len(hdims)), 4.3 * len(causals) + head_in + 0.4))
    width = 0.84 / max(nser, 1)
    label_fs = 5.5 if nser * len(seqlens) > 16 else 7
    for i, causal in enumerate(causals):
        for j, hd in enumerate(hdims):
            ax = axes[i][j]
            ymax = 0.0
            for k, (name, get, style) in enumerate(series):
                for x, s in enumerate(seqlens):
                    r = by_key.get((hd, causal, s))
                    v = get(r, a.pss) if r else None
                    if not v:
                        continue
                    xpos = x + (k - (nser - 1) / 2) * width
                    ax.bar(xpos, v, width, zorder=3, **style)
                    ax.text(xpos, v, f" {v:.0f}", ha="center", va="bottom", rotation=90,
                            fontsize=label_fs, zorder=4)
                    ymax = max(ymax, v)
            ax.set_xticks(range(len(seqlens)))
            ax.set_xticklabels([x_label(s, gqa) for s in seqlens])
            ax.set_xlim(-0.55, len(seqlens) - 0.45)
            ax.set_ylim(0, ymax * 1.17 if ymax else 1)
            ax.grid(axis="y", alpha=0.35, zorder=0)
            ax.set_axisbelow(True)
            ax.tick_params(labelsize=8)
            ax.set_title(f"{PASS_NAMES[a.pss]}, head dim {hd}{', causal' if causal else ''}",
                         fontsize=10, fontweight="bold")
            if j == 0:
                ax.set_ylabel("Speed (TFLOP/s)", fontsize=9)
            if i == len(causals) - 1:
                ax.set_xlabel("Sequence length" + (", batch, query:kv heads" if gqa else ""), fontsize=9)

    # Lay the panels out first: tight_layout would otherwise also make room for the suptitle.
    fig.tight_layout(rect=(0, 0, 1, 1 - head_in / fig.get_figheight()), h_pad=1.2, w_pad=1.0)

    dev = data.get("device") or "unknown device"
    gemm = data.get("gemm_bf16_tflops")
    title = f"Attention {PASS_NAMES[a.pss].lower()} speed (bf16) on {dev}"
    if gemm:
        title += ("\n" if narrow else "  |  ") + f"bf16 GEMM ceiling (8192\u00b3): {gemm:.0f} TFLOP/s"
    sub = []
    for key, lab in data.get("geomean_labels") or GEOMEAN_LABELS:
        g = (geomean_for(data, a.pss) or {}).get(key)
        if isinstance(g, (int, float)):
            sub.append(f"{lab} {g:.3f}")
    meta = [f"{k} {data[k]}" for k in ("torch", "cuda", "date") if data.get(k)]
    figh = fig.get_figheight()
    fig.suptitle(title, fontsize=13, fontweight="bold", y=1 - 0.05 / figh, va="top")
    sub_y = 1 - (0.62 if narrow else 0.36) / figh
    if sub or meta:
        fig.text(0.5, sub_y, ("geomean: " + ", ".join(sub) + ("   |   " if sub and meta else "") if sub else "")
                 + ", ".join(meta), ha="center", va="top", fontsize=8.5, color="#444444")
    handles = [Patch(label=name, **style) for name, _, style in series]
    fig.legend(handles=handles, loc="upper center", ncol=2 if narrow else len(handles), fontsize=9,
               frameon=False, bbox_to_anchor=(0.5, sub_y - 0.2 / figh))
    fig.savefig(a.out, dpi=a.dpi)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

# Scratch (session 29): summary of ab_time.py runs with tags v<k><round>, k = 0..9: per point the
# medians of each variant and their ratio to v0's.
import json, sys, math, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    if not line.startswith("v"): continue
    tag, js = line.split(" ", 1); runs[tag[:2]].append(json.loads(js))
vs = sorted(runs); keys = list(runs["v0"][0]); med = lambda xs: sorted(xs)[len(xs) // 2]
g = collections.defaultdict(list)
print(f"{'point':>14} | " + " | ".join(f"{v:>12}" for v in vs) + " | " + " ".join(f"{v}/v0" for v in vs[1:]))
for k in keys:
    m = {v: med([r[k] for r in runs[v]]) for v in vs}
    for v in vs[1:]: g[v].append(m[v] / m["v0"])
    print(f"{k:>14} | " + " | ".join(f"{' '.join(f'{r[k]:.0f}' for r in runs[v]):>12}" for v in vs) + " | "
          + " ".join(f"{m[v] / m['v0']:.3f}" for v in vs[1:]))
for v in vs[1:]: print(f"geomean {v}/v0", round(math.exp(sum(map(math.log, g[v])) / len(g[v])), 4))

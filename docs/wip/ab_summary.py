import json, sys, math, collections
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    if line.startswith("#"): continue
    tag, js = line.split(" ", 1); runs[tag[:2]].append(json.loads(js))
keys = list(runs["v0"][0]); med = lambda xs: sorted(xs)[len(xs) // 2]; g = []
print(f"{'point':>14} | {'one item per block':>18} | {'persistent':>14} | ratio")
for k in keys:
    a = sorted(r[k] for r in runs["v0"]); b = sorted(r[k] for r in runs["v1"]); g.append(med(b) / med(a))
    print(f"{k:>14} | {' '.join(f'{x:.0f}' for x in a):>18} | {' '.join(f'{x:.0f}' for x in b):>14} | {med(b)/med(a):.3f}")
print("geomean persistent / one item per block", round(math.exp(sum(map(math.log, g)) / len(g)), 4))

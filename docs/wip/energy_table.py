# Scratch (prepared in session 31, not run): reads energy_ncu_run.sh's CSVs (ncu --csv, one row per
# kernel and metric) and prints, per point and library, each metric summed over the call's kernels
# and divided by the call's FLOPs (the paper's convention, 2.5 x forward), in bytes (or instructions)
# per kFLOP, then flash3 over cuDNN. `python3 exp/energy_table.py OUTDIR`.
import csv, glob, os, re, sys
from collections import defaultdict

out = sys.argv[1]
SECTOR = 32
rows = defaultdict(lambda: defaultdict(float))
for path in sorted(glob.glob(os.path.join(out, "ncu_*_d*_c*_s*.csv"))):
    m = re.search(r"ncu_(\w+?)_d(\d+)_c(\d)_s(\d+)\.csv$", path)
    impl, d, c, s = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
    with open(path) as fh:
        lines = [l for l in fh if l.startswith('"')]
    for r in csv.DictReader(lines):
        name, unit, value = r.get("Metric Name"), r.get("Metric Unit", ""), r.get("Metric Value", "")
        try:
            v = float(value.replace(",", ""))
        except (TypeError, ValueError):
            continue
        scale = {"Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "byte": 1.0, "usecond": 1e-6, "msecond": 1e-3,
                 "nsecond": 1e-9, "second": 1.0, "ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}.get(unit, 1.0)
        if name.endswith("hit_rate.pct"):
            rows[(d, c, s, impl)]["l2_hit_pct_max"] = max(rows[(d, c, s, impl)]["l2_hit_pct_max"], v)
        else:
            rows[(d, c, s, impl)][name] += v * scale
keys = [("lts__t_sectors_op_read.sum", SECTOR, "L2 read B"), ("lts__t_sectors_op_write.sum", SECTOR, "L2 write B"),
        ("lts__t_sectors_op_red.sum", SECTOR, "L2 red B"), ("dram__bytes_read.sum", 1, "DRAM rd B"),
        ("dram__bytes_write.sum", 1, "DRAM wr B"), ("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", 128, "smem B~"),
        ("smsp__inst_executed.sum", 1, "instr")]
print("per kFLOP (flash3 / cuDNN); smem bytes ~ wavefronts x 128")
for (d, c, s) in sorted({k[:3] for k in rows}):
    b, h = 16384 // s, 2048 // d
    kflop = 4 * b * h * s * s * d * (0.5 if c else 1.0) * 2.5 / 1e3
    f, g = rows.get((d, c, s, "flash3"), {}), rows.get((d, c, s, "cudnn"), {})
    cells = []
    for key, mult, label in keys:
        x, y = f.get(key, 0) * mult / kflop, g.get(key, 0) * mult / kflop
        cells.append(f"{label} {x:.2f}/{y:.2f}")
    t = f"time {f.get('gpu__time_duration.sum', 0) * 1e3:.3f}/{g.get('gpu__time_duration.sum', 0) * 1e3:.3f} ms"
    print(f"{d:>3} {'causal' if c else 'full':>6} {s:>5}: " + "; ".join(cells) + "; " + t)

"""Summarize an Nsight Compute per-instruction SASS export (``ncu -i REP --page source --print-source sass --csv``):
warp-stall samples by reason, grouped by how often each instruction ran (in a warp-specialized kernel the count
tells the partitions apart: e.g. 16384 = a consumer K loop at 128 CTAs x 32 K tiles x 4 warps), then the hottest
instructions with their top reasons. ``benchmarks/profile_kernels.sh s18`` writes such exports.

    python benchmarks/ncu_sass_stalls.py ncu_w4g_m64_sass.csv [--top 20]
"""
from __future__ import annotations

import argparse
import collections
import csv


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20)
    args = ap.parse_args()
    rows = list(csv.reader(open(args.csv)))
    hdr, data = rows[1], rows[2:]
    ix = {h: i for i, h in enumerate(hdr)}

    def val(r, k):
        try:
            return float(r[ix[k]].replace(",", ""))
        except (KeyError, ValueError):
            return 0.0

    samples = "Warp Stall Sampling (All Samples)"
    tot = sum(val(r, samples) for r in data) or 1.0
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    overall = collections.Counter({h[6:]: sum(val(r, h) for r in data) / tot for h in reasons})
    print(f"total samples {tot:.0f}; by reason:", {k: round(v, 3) for k, v in overall.most_common(10)})
    groups = collections.defaultdict(collections.Counter)
    for r in data:
        g = groups[int(val(r, "Instructions Executed"))]
        g["samples"] += val(r, samples)
        g["instructions"] += 1
        for h in reasons:
            g[h[6:]] += val(r, h)
    print("by execution count (share of all samples):")
    for k, g in sorted(groups.items(), key=lambda kv: -kv[1]["samples"])[:8]:
        top = sorted(((c, h) for h, c in g.items() if h not in ("samples", "instructions")), reverse=True)[:5]
        print(f"  executed {k}: {g['instructions']} instructions, {g['samples'] / tot:.3f}",
              [(h, round(c / tot, 3)) for c, h in top])
    print("hottest instructions:")
    for r in sorted(data, key=lambda r: -val(r, samples))[:args.top]:
        top = sorted(((val(r, h), h[6:]) for h in reasons), reverse=True)[:3]
        print(f"  {val(r, samples) / tot:.3f} {r[ix['Source']].strip()[:64]:64s} executed "
              f"{int(val(r, 'Instructions Executed'))}", [(h, round(c / tot, 3)) for c, h in top if c > 0])


if __name__ == "__main__":
    main()

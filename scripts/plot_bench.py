#!/usr/bin/env python3
"""Draws epcomm-bench CSV rows (--csv, scripts/bench_sweep.sh): GB/s per rank by DeepEP's accounting against the
SM budget and against the token count, one line per operation and rank count, into one PNG.

    python3 scripts/plot_bench.py bench.csv [more.csv ...] -o sweep.png
"""
import argparse
import csv
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", nargs="+")
    ap.add_argument("-o", "--output", default="bench.png")
    ap.add_argument("--ops", default="HT dispatch,HT combine,HT dispatch fp8", help="operations to draw")
    args = ap.parse_args()
    rows = []
    for path in args.csv:
        with open(path, newline="") as f:
            rows += list(csv.DictReader(f))
    ops = args.ops.split(",")
    rows = [r for r in rows if r["op"] in ops]
    if not rows:
        raise SystemExit(f"no rows of {ops} in {args.csv}")
    for r in rows:
        for k in ("ranks", "tokens", "sms"):
            r[k] = int(r[k])
        r["deepep_gbs"] = float(r["deepep_gbs"])
    max_tokens = max(r["tokens"] for r in rows)
    max_sms = max(r["sms"] for r in rows)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 5))
    for ax, x_key, fixed_key, fixed in ((a1, "sms", "tokens", max_tokens), (a2, "tokens", "sms", max_sms)):
        lines = defaultdict(dict)
        for r in rows:
            if r[fixed_key] == fixed:
                lines[(r["op"], r["ranks"])][r[x_key]] = r["deepep_gbs"]
        # Colour by operation, line style by rank count: a dozen lines stay apart.
        op_names = sorted({op for op, _ in lines})
        rank_counts = sorted({r for _, r in lines})
        styles = ["-", "--", ":", "-."]
        for (op, ranks), pts in sorted(lines.items()):
            xs = sorted(pts)
            ax.plot(xs, [pts[x] for x in xs], marker="o", color=f"C{op_names.index(op) % 10}",
                    linestyle=styles[rank_counts.index(ranks) % len(styles)], label=f"{op}, R={ranks}")
        ax.set_xlabel("SM budget (blocks per kernel)" if x_key == "sms" else "tokens per rank")
        ax.set_ylabel("GB/s per rank (DeepEP accounting)")
        ax.set_title(f"{'SM sweep' if x_key == 'sms' else 'token sweep'} at {fixed_key} = {fixed}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Plot qbl_bench results: time over the floor, per shape, one panel per dtype.

    python3 benchmarks/plot.py results.csv out.png [--forward COLUMN] [--graph COLUMN]

Bars: forward/floor (qbl's fused layer) and eager/floor (the unfused eager-like chain), with
graph/floor as a third series where the CSV has it (launch-bound shapes). floor = bare cuBLASLt
GEMM+bias + reading x and writing mixed once at copy bandwidth, so 1.0 is the best any
implementation can do and 1.10 is "within 10 % of it". The y axis turns logarithmic when the
eager chain is far above the fused layer, so that both stay readable.

--forward and --graph pick other columns for the forward and graph-replay bars (defaults
forward_over_floor and graph_over_floor), e.g. train_over_floor; a column ending in _ms is divided
by floor_ms.
"""

import argparse
import csv
import math
import sys

import matplotlib

matplotlib.use("Agg")  # headless: no display on the benchmark machines
import matplotlib.pyplot as plt  # noqa: E402  (must follow matplotlib.use)
import matplotlib.ticker  # noqa: E402


def number(row, key):
    """The float in column `key`, or None when the column is missing or blank."""
    value = (row.get(key) or "").strip()
    if not value:
        return None
    try:
        v = float(value)
    except ValueError:
        return None
    return v if math.isfinite(v) else None


def over_floor(row, key):
    """Column `key` as time / floor: as it is, or divided by floor_ms where it ends in _ms."""
    v = number(row, key)
    if v is None or not key.endswith("_ms"):
        return v
    floor = number(row, "floor_ms")
    return v / floor if floor else None


def plot_panel(ax, rows, dtype, forward_key, graph_key):
    labels = [f"{r['B']}x{r['T']}x{r['D']}" for r in rows]
    forward = [over_floor(r, forward_key) for r in rows]
    eager = [number(r, "eager_over_floor") for r in rows]
    graph = [over_floor(r, graph_key) for r in rows]
    series = [("forward / floor", forward, "tab:blue"), ("eager chain / floor", eager, "tab:red")]
    if any(g is not None for g in graph):
        series.insert(1, ("graph replay / floor", graph, "tab:green"))
    width = 0.8 / len(series)
    for s, (name, values, color) in enumerate(series):
        xs = [i + (s - (len(series) - 1) / 2) * width for i in range(len(rows))]
        present = [(x, v) for x, v in zip(xs, values) if v is not None]
        if not present:
            continue
        bars = ax.bar([x for x, _ in present], [v for _, v in present], width, label=name,
                      color=color)
        ax.bar_label(bars, labels=[f"{v:.2f}" for _, v in present], fontsize=7, padding=2)

    all_values = [v for _, values, _ in series for v in values if v is not None]
    if all_values and max(all_values) > 4.0:
        ax.set_yscale("log")
        # Plain numbers instead of 10^k: the interesting range is 1 .. a few.
        top = max(all_values)
        ticks = [t for t in (0.9, 1.0, 1.1, 1.25, 1.5, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000)
                 if t <= top * 1.2]
        ax.set_yticks(ticks)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.axhline(1.0, color="black", linewidth=1.0, label="floor (1.0)")
    ax.axhline(1.10, color="gray", linewidth=1.0, linestyle="--", label="1.10 x floor")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(labels, rotation=20)
    ax.set_xlabel("shape B x T x D (tokens = B*T, in = out = D)")
    ax.set_ylabel("time / floor (lower is better)")
    ax.set_title(dtype, fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3, which="both")


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("csv_path")
    ap.add_argument("png_path")
    ap.add_argument("--forward", default="forward_over_floor", help="column of the forward bars")
    ap.add_argument("--graph", default="graph_over_floor", help="column of the graph bars")
    args = ap.parse_args(argv[1:])
    csv_path, png_path = args.csv_path, args.png_path
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        print(f"plot.py: no rows in {csv_path}", file=sys.stderr)
        return 1
    for key, default in ((args.forward, "forward_over_floor"), (args.graph, "graph_over_floor")):
        if key != default and key not in rows[0]:  # older CSVs may lack the default columns
            print(f"plot.py: {csv_path} has no column {key}", file=sys.stderr)
            return 1

    gpu = (rows[0].get("gpu") or "").strip()
    dtypes = []
    for r in rows:
        r.setdefault("dtype", "fp32")
        if r["dtype"] not in dtypes:
            dtypes.append(r["dtype"])
    shapes = max(sum(1 for r in rows if r["dtype"] == d) for d in dtypes)
    fig, axes = plt.subplots(len(dtypes), 1, squeeze=False,
                             figsize=(max(8.0, 1.3 * shapes + 3.0), 4.6 * len(dtypes)))
    for ax, dtype in zip(axes[:, 0], dtypes):
        plot_panel(ax, [r for r in rows if r["dtype"] == dtype], dtype, args.forward, args.graph)
    title = "qbl QuantBlendLinear: time over the floor (bare GEMM + one x read, one mixed write)"
    fig.suptitle(f"{title}\n{gpu}" if gpu else title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=150)
    print(f"wrote {png_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
"""Timing of qbl's sharded forward: x split along the tokens over every GPU, amax all-reduced
through NCCL between the two steps.

    pip install --no-build-isolation ./python                    # once, from the repository root
    torchrun --nproc-per-node 2 examples/pytorch/sharded_timing.py
    torchrun --nproc-per-node 8 examples/pytorch/sharded_timing.py --dtypes bfloat16 --shapes 4

Each rank holds tokens / world rows of x and times, per forward (ms, CUDA events around each run,
runs of all variants interleaved in rounds, inputs rotating over 3 x L2 in at most 256 copies, the
graphs over at most 64 of them, a barrier before each batch so that the ranks start their
collectives together):
- local_amax: torch.ops.qbl.local_amax on the shard
- all_reduce: qbl.all_reduce_amax, the integer MAX all-reduce of amax's bits (4 bytes)
- from_stats: torch.ops.qbl.forward on the shard with the reduced stats given (amax from stats[0])
- sharded: the three in a row, and sharded graph: the same replayed from a CUDA graph
- unsharded: torch.ops.qbl.forward on the same shard, and its graph (no communication: what the
  sharded forward costs beyond it is the price of one amax over every rank)
Rank 0 prints one markdown table per dtype: the median of each rank's median, and the largest.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import qbl  # noqa: E402
from compare import DTYPES, parse_shapes, shape_str  # noqa: E402

MAX_COPIES, MAX_GRAPHS = 256, 64  # input copies at most; graphs (one per copy) at most


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="all",
                    help="BENCH_SHAPES indices or BxTxD, comma-separated")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="comma-separated: " + ", ".join(DTYPES))
    ap.add_argument("--samples", type=int, default=200, help="timed runs per variant, at least")
    ap.add_argument("--batch", type=int, default=20, help="runs of one variant per round")
    ap.add_argument("--warmup", type=int, default=20, help="untimed runs per variant")
    args = ap.parse_args()
    try:
        args.shapes = parse_shapes(args.shapes)
    except (ValueError, IndexError) as e:
        ap.error(f"--shapes: {e}")
    names = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not names or any(d not in DTYPES for d in names):
        ap.error(f"--dtypes: choose from {', '.join(DTYPES)}")
    args.dtypes = [DTYPES[d] for d in names]
    return args


def shard_inputs(shape, dtype, rank, world, device):
    """Copies of this rank's x and logits rows (>= 3 x L2 together), weight and bias."""
    b, t, d = shape
    rows = b * t // world
    if rows == 0:
        raise SystemExit(f"{b}x{t}x{d}: fewer tokens ({b * t}) than ranks ({world})")
    per_copy = (rows * d + rows) * torch.finfo(dtype).bits // 8
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
    count = max(2, min(MAX_COPIES, math.ceil(3 * max(l2, 2**20) / per_copy)))
    agreed = torch.tensor([count], device=device)  # every rank replays the same graphs
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    count = int(agreed.item())
    gen = torch.Generator(device=device).manual_seed(1000 + rank)
    xs = [torch.randn(rows, d, generator=gen, device=device).to(dtype) for _ in range(count)]
    ls = [torch.randn(rows, generator=gen, device=device).to(dtype) for _ in range(count)]
    w = (torch.randn(d, d, generator=gen, device=device) / math.sqrt(d)).to(dtype)
    bias = torch.randn(d, generator=gen, device=device).to(dtype)
    return xs, ls, w, bias


def variants(xs, ls, w, bias):
    """name -> run(i), i the rotation index."""
    stats = [torch.ops.qbl.local_amax(x) for x in xs]

    def sharded(i):
        reduced = qbl.all_reduce_amax(torch.ops.qbl.local_amax(xs[i]))
        return torch.ops.qbl.forward(xs[i], ls[i], w, bias, reduced)

    def unsharded(i):
        return torch.ops.qbl.forward(xs[i], ls[i], w, bias)

    def graphs(fn):
        """One CUDA graph per input copy (capture after a warm-up on a side stream)."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(3):
                fn(i % len(xs))
        torch.cuda.current_stream().wait_stream(side)
        gs = []
        for i in range(min(len(xs), MAX_GRAPHS)):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn(i)
            gs.append(g)
        return lambda i: gs[i % len(gs)].replay()

    return {
        "local_amax": lambda i: torch.ops.qbl.local_amax(xs[i]),
        "all_reduce": lambda i: qbl.all_reduce_amax(stats[i]),
        "from_stats": lambda i: torch.ops.qbl.forward(xs[i], ls[i], w, bias, stats[i]),
        "sharded": sharded,
        "unsharded": unsharded,
        "sharded graph": graphs(sharded),
        "unsharded graph": graphs(unsharded),
    }


def time_variants(runs, count, args):
    """name -> list of ms, the variants taking turns in rounds of args.batch runs each."""
    times = {name: [] for name in runs}
    start = [torch.cuda.Event(enable_timing=True) for _ in range(args.batch)]
    end = [torch.cuda.Event(enable_timing=True) for _ in range(args.batch)]
    i = 0
    for name, run in runs.items():
        for _ in range(args.warmup):
            run(i % count)
            i += 1
    while min(map(len, times.values())) < args.samples:
        for name, run in runs.items():
            torch.cuda.synchronize()
            dist.barrier()
            for k in range(args.batch):
                start[k].record()
                run(i % count)
                end[k].record()
                i += 1
            torch.cuda.synchronize()
            times[name] += [s.elapsed_time(e) for s, e in zip(start, end)]
    return times


def main():
    args = parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    names = None
    for dtype in args.dtypes:
        rows_out = []
        for shape in args.shapes:
            xs, ls, w, bias = shard_inputs(shape, dtype, rank, world, device)
            runs = variants(xs, ls, w, bias)
            med = {n: statistics.median(v) for n, v in time_variants(runs, len(xs), args).items()}
            names = list(med)
            every = [None] * world
            dist.all_gather_object(every, med)
            rows_out.append((shape, every))
            del xs, ls, w, bias, runs
            qbl.clear_cache()
            torch.cuda.empty_cache()
        if rank == 0:
            name = str(dtype).replace("torch.", "")
            print(f"## {name}, {world} GPUs ({torch.cuda.get_device_name(device)}), x split along "
                  "the tokens; ms per forward: median over ranks of each rank's median / largest\n")
            print("| B x T x D | rows per rank | " + " | ".join(names) + " |")
            print("|---|---:|" + "---:|" * len(names))
            for shape, every in rows_out:
                cells = [f"{statistics.median(r[n] for r in every):.4f} / "
                         f"{max(r[n] for r in every):.4f}" for n in names]
                rows = shape[0] * shape[1] // world
                print(f"| {shape_str(shape)} | {rows} | " + " | ".join(cells) + " |")
            print(flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

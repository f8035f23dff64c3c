"""qbl's CPU kernels against the eager reference module on the CPU: one layer's forward and forward
+ backward, side by side in interleaved rounds, medians.

    python benchmarks/cpu_bench.py [--shapes 4096x1024 2048x2048] [--dtypes fp32 bf16]
                                   [--rounds 9] [--reps 3] [--json FILE]

Each round runs every variant `reps` times in turn (eager reference, qbl, and the bare GEMMs:
F.linear for the forward, F.linear plus its two backward GEMMs and the bias sum for forward +
backward -- the floor below which neither goes, since both run the same ATen GEMMs), so that a
drift of the machine's speed spreads over all of them; the table gives the median over rounds of
each variant's mean time per call, and eager / qbl. The JSON holds every round's numbers, the
arguments, the commit and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import qbl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                                "pytorch"))
import reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def machine() -> dict:
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
    except OSError:
        pass
    return {"cpu": model or platform.processor(), "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(), "platform": platform.platform()}


def commit() -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        return rev + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def variants(tokens: int, d: int, dtype: torch.dtype) -> dict:
    """The calls to time, each a closure: forward (no_grad) and forward + backward of the
    reference module, qbl's module with the same parameters, and the bare GEMMs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, d, generator=gen).to(dtype)
    logits = (torch.randn(tokens, generator=gen) * 2).to(dtype)
    grad = torch.randn(tokens, d, generator=gen).to(dtype)
    ref = reference.Model(d).to(dtype)
    layer = qbl.QuantBlendLinear(d, d, dtype=dtype)
    with torch.no_grad():
        layer.weight.copy_(ref.out_proj.weight)
        layer.bias.copy_(ref.out_proj.bias)
    w, b = layer.weight.detach(), layer.bias.detach()
    xg, lg = x.clone().requires_grad_(), logits.clone().requires_grad_()

    def forward(module):
        def run():
            with torch.no_grad():
                module(x, logits)
        return run

    def train(module):
        def run():
            module.zero_grad(set_to_none=True)
            module(xg, lg).backward(grad)
        return run

    def gemms_forward():
        F.linear(x, w, b)

    def gemms_train():
        F.linear(x, w, b)
        grad.mm(w)
        grad.t().mm(x)
        grad.sum(0)

    return {"forward": {"eager": forward(ref), "qbl": forward(layer), "gemms": gemms_forward},
            "forward+backward": {"eager": train(ref), "qbl": train(layer),
                                 "gemms": gemms_train}}


def measure(calls: dict, rounds: int, reps: int) -> dict:
    for f in calls.values():  # warm-up
        f()
    times = {k: [] for k in calls}
    for _ in range(rounds):
        for k, f in calls.items():
            t = time.perf_counter()
            for _ in range(reps):
                f()
            times[k].append((time.perf_counter() - t) / reps * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["4096x1024", "2048x2048", "16384x256"],
                   help="tokens x features (the layer is features -> features)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=list(DTYPES))
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", default="")
    args = p.parse_args()
    info = {"args": vars(args), "commit": commit(), "machine": machine(),
            "date": time.strftime("%Y-%m-%d"), "results": []}
    print(f"# cpu_bench {' '.join(sys.argv[1:])}  commit {info['commit']}")
    print(f"# {info['machine']}")
    print("| shape | dtype | pass | eager ms | qbl ms | GEMMs ms | eager / qbl | qbl over GEMMs |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for shape in args.shapes:
        tokens, d = (int(v) for v in shape.split("x"))
        for name in args.dtypes:
            for kind, calls in variants(tokens, d, DTYPES[name]).items():
                times = measure(calls, args.rounds, args.reps)
                med = {k: statistics.median(v) for k, v in times.items()}
                info["results"].append({"tokens": tokens, "features": d, "dtype": name,
                                        "pass": kind, "ms": times, "median_ms": med})
                print(f"| {tokens}x{d} | {name} | {kind} | {med['eager']:.2f} | {med['qbl']:.2f} "
                      f"| {med['gemms']:.2f} | {med['eager'] / med['qbl']:.2f}x "
                      f"| {med['qbl'] - med['gemms']:+.2f} ms |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()

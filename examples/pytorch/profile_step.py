#!/usr/bin/env python3
"""Where a training step of train_qat.py's model spends its time: torch.profiler over a few steps
of each variant (reference and qbl, eager and compiled), and the host time of one layer's forward
and backward against nn.Linear's.

    python3 examples/pytorch/profile_step.py                       # D = 1024, bf16 and autocast
    python3 examples/pytorch/profile_step.py --d 2048 --precision autocast --no-layer
    python3 examples/pytorch/profile_step.py --d 2048 --no-layer --overlap both --timed-rounds 5

Printed per variant: the host time per step (the profiled region's wall time), the GPU's busy time
per step (the sum of its kernels) and active time (the time some kernel runs: overlapping kernels
count once), the kernels launched per step, and the operators and kernels that take the most of
each. --overlap both runs qbl's variants with wgrad beside dgrad and after it; --timed-rounds
times every variant without the profiler first (the A/B of that choice inside a model).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

import qbl  # noqa: E402
import train_qat  # noqa: E402


def device_us(evt) -> float:
    return getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)


def gpu_active_us(intervals) -> float:
    """The time some kernel runs (the union of the kernels' intervals): unlike the busy time (their
    sum), kernels that overlap count once. Well under the step time: the host sets the pace."""
    total, start, end = 0.0, None, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += 0.0 if end is None else end - start
            start, end = s, e
        else:
            end = max(end, e)
    return total + (0.0 if end is None else end - start)


def profile_variant(step, batches, steps: int, rows: int, out) -> tuple:
    for i in range(3):
        step(*batches[i % len(batches)])
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for i in range(steps):
            step(*batches[i % len(batches)])
        host = (time.perf_counter() - t0) / steps
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=device_us, reverse=True)
    busy = sum(device_us(e) for e in kernels) / steps
    launched = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    active = gpu_active_us([(e.time_range.start, e.time_range.end) for e in launched]) / steps
    cpu = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.self_cpu_time_total, reverse=True)
    out.write(f"  host {host * 1e3:.3f} ms per step, GPU busy {busy / 1e3:.3f} ms per step, GPU "
              f"active {active / 1e3:.3f} ms per step, {len(launched) / steps:.0f} kernels per "
              "step\n")
    out.write("  self CPU per step (us, calls per step): "
              + ", ".join(f"{e.key} {e.self_cpu_time_total / steps:.0f} ({e.count // steps})"
                          for e in cpu[:rows]) + "\n")
    out.write("  kernels per step (us, calls per step): "
              + ", ".join(f"{e.key[:60]} {device_us(e) / steps:.0f} ({e.count // steps})"
                          for e in kernels[:rows]) + "\n")
    return host, busy


def host_us_per_call(fn, calls: int = 200) -> float:
    """Median host time of fn() over batches of 20 calls, the GPU kept busy so no call waits."""
    big = torch.empty(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = []
    for _ in range(calls // 20):
        torch.cuda.synchronize()
        torch.matmul(big, big)  # keeps the device busy while the host enqueues
        t0 = time.perf_counter()
        for _ in range(20):
            fn()
        times.append((time.perf_counter() - t0) / 20 * 1e6)
    torch.cuda.synchronize()
    return statistics.median(times)


def host_events(fn, rows: int, calls: int = 40) -> str:
    """The host-side events (operators, CUDA runtime calls) of fn() by self time per call."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type != torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return ", ".join(f"{e.key} {e.self_cpu_time_total / calls:.1f} ({e.count / calls:g})"
                     for e in events[:rows])


def layer_host_times(d: int, tokens: int, out, rows: int = 0) -> None:
    for precision in ("bf16", "autocast"):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        x = torch.randn(tokens, d, device="cuda", dtype=dtype, requires_grad=True)
        # The gate's logits come from a bf16 Linear in both: bf16 parameters, or autocast.
        logits = torch.randn(tokens, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        q = qbl.QuantBlendLinear(d, 4 * d, device="cuda", dtype=dtype)
        lin = nn.Linear(d, 4 * d, device="cuda", dtype=dtype)
        grad = torch.randn(tokens, 4 * d, device="cuda", dtype=torch.bfloat16)
        ac = precision == "autocast"

        def qbl_call():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ac):
                y = q(x, logits)
            y.backward(grad)

        def linear_call():
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=ac):
                y = lin(x)
            y.backward(grad)

        for f in (qbl_call, linear_call):
            f()
        qt, lt = host_us_per_call(qbl_call), host_us_per_call(linear_call)
        out.write(f"layer {tokens}x{d}->{4 * d} {precision}: host per fwd+bwd call: qbl {qt:.1f} "
                  f"us, nn.Linear {lt:.1f} us ({qt / lt:.2f}x)\n")
        if rows:
            for name, f in (("qbl", qbl_call), ("nn.Linear", linear_call)):
                out.write(f"  {name} {precision}, host events per fwd+bwd call (self us, calls): "
                          + host_events(f, rows) + "\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=1024)
    ap.add_argument("--precision", default="bf16,autocast")
    ap.add_argument("--variants", default="reference eager,reference compile,qbl eager,"
                    "qbl compile")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--no-layer", action="store_true", help="skip the one-layer host times")
    ap.add_argument("--layer-rows", type=int, default=0,
                    help="also list this many of one layer call's host events (profiled)")
    ap.add_argument("--overlap", default="env", choices=("env", "by_shape", "off", "both"),
                    help="qbl's wgrad as the environment's QBL_OVERLAP_WGRAD says (default), "
                         "beside dgrad as its plan decides (QBL_OVERLAP_WGRAD unset), serialized "
                         "with it on the caller's stream (QBL_OVERLAP_WGRAD=0), or each of the last "
                         "two in turn")
    ap.add_argument("--timed-rounds", type=int, default=0,
                    help="first time every variant without the profiler, in this many rounds "
                         "of --round-steps steps, the variants taking turns")
    ap.add_argument("--round-steps", type=int, default=6)
    args = ap.parse_args()
    out = sys.stdout
    ns = train_qat.model_args(args.lr)
    batches, _ = train_qat.make_batches(8, ns)
    if not args.no_layer:
        layer_host_times(args.d, ns.batch * ns.seq, out, args.layer_rows)
    overlaps = {"env": [KEEP], "by_shape": [None], "off": ["0"],
                "both": [None, "0"]}[args.overlap]
    for precision in args.precision.split(","):
        models = train_qat.Models(ns, args.d, precision)
        names = [n.split() for n in args.variants.split(",")]
        runs = [(variant, mode, ov) for variant, mode in names
                for ov in (overlaps if variant.startswith("qbl") else [None])]
        steps = {}
        for run in runs:
            set_overlap(run[2])
            steps[run] = train_qat.make_step(*models.get(*run[:2]), precision, models.lr)
        if args.timed_rounds > 0:
            time_runs(steps, batches, args, out, f"D={args.d} {precision}")
        for run in runs:
            variant, mode, ov = run
            out.write(f"D={args.d} {precision} {variant} {mode}"
                      f"{'' if not variant.startswith('qbl') else ', overlap ' + overlap_name(ov)}"
                      ":\n")
            set_overlap(ov)
            profile_variant(steps[run], batches, args.steps, args.rows, out)
            if mode == "compile":
                c = torch._dynamo.utils.counters
                out.write(f"  dynamo: graphs {dict(c['stats'])}, graph breaks "
                          f"{sum(c['graph_break'].values())} {dict(c['graph_break'])}\n")
            out.flush()
        del models, steps
        qbl.clear_cache()
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return 0


KEEP = "keep"  # an overlap setting: QBL_OVERLAP_WGRAD as the environment has it


def overlap_name(value) -> str:
    if value == KEEP:
        return "as QBL_OVERLAP_WGRAD says" if os.environ.get("QBL_OVERLAP_WGRAD") else "by shape"
    return "by shape" if value is None else "off"


def set_overlap(value) -> None:
    """QBL_OVERLAP_WGRAD = value (None: unset, the plan decides by shape; KEEP: as it is), read
    when qbl plans a layer: the cached layers are dropped, and the next call plans them again."""
    if value == KEEP:
        return
    if value is None:
        os.environ.pop("QBL_OVERLAP_WGRAD", None)
    else:
        os.environ["QBL_OVERLAP_WGRAD"] = value
    qbl.clear_cache()


def time_runs(steps, batches, args, out, label: str) -> None:
    """Every run's ms per step (CUDA events) and host ms per step, medians over interleaved
    rounds; each round starts with an untimed step (a changed setting plans again there)."""
    for step in steps.values():  # warm-up: compiling, planning
        for i in range(3):
            step(*batches[i % len(batches)])
    times = {run: ([], []) for run in steps}
    runs = list(steps)
    for r in range(args.timed_rounds):
        for j in range(len(runs)):
            run = runs[(r + j) % len(runs)]  # the order rotates: none always goes first
            set_overlap(run[2])
            steps[run](*batches[0])
            gpu_ms, host_ms, _ = train_qat.timed_steps(steps[run], batches, args.round_steps,
                                                       r * args.round_steps)
            times[run][0].append(gpu_ms)
            times[run][1].append(host_ms)
    base = [statistics.median(g) for run, (g, _) in times.items()
            if run[:2] == ("reference", "compile")]
    out.write(f"{label}, timed ({args.timed_rounds} rounds of {args.round_steps} steps, "
              "medians):\n")
    for (variant, mode, ov), (g, h) in times.items():
        ms = statistics.median(g)
        vs = f", reference compiled / this {base[0] / ms:.3f}" if base else ""
        ov_text = "" if not variant.startswith("qbl") else f", overlap {overlap_name(ov)}"
        out.write(f"  {variant} {mode}{ov_text}: {ms:.3f} ms per step (host "
                  f"{statistics.median(h):.3f}){vs}; rounds {', '.join(f'{v:.2f}' for v in g)}\n")
    out.flush()


if __name__ == "__main__":
    sys.exit(main())

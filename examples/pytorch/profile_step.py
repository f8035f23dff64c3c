#!/usr/bin/env python3
"""Where a training step of train_qat.py's model spends its time: torch.profiler over a few steps
of each variant (reference and qbl, eager and compiled), and the host time of one layer's forward
and backward against nn.Linear's.

    python3 examples/pytorch/profile_step.py                       # D = 1024, bf16 and autocast
    python3 examples/pytorch/profile_step.py --d 2048 --precision autocast --no-layer

Printed per variant: the host time per step (the profiled region's wall time), the GPU's busy time
per step (the sum of its kernels), and the operators and kernels that take the most of each.
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
    cpu = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.self_cpu_time_total, reverse=True)
    out.write(f"  host {host * 1e3:.3f} ms per step, GPU busy {busy / 1e3:.3f} ms per step\n")
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
    args = ap.parse_args()
    out = sys.stdout
    ns = argparse.Namespace(vocab=4096, blocks=4, batch=8, seq=1024, seed=0, lr=args.lr)
    batches, _ = train_qat.make_batches(8, ns)
    if not args.no_layer:
        layer_host_times(args.d, ns.batch * ns.seq, out, args.layer_rows)
    for precision in args.precision.split(","):
        models = train_qat.Models(ns, args.d, precision)
        for name in args.variants.split(","):
            variant, mode = name.split()
            out.write(f"D={args.d} {precision} {variant} {mode}:\n")
            step = train_qat.make_step(*models.get(variant, mode), precision, models.lr)
            profile_variant(step, batches, args.steps, args.rows, out)
            if mode == "compile":
                c = torch._dynamo.utils.counters
                out.write(f"  dynamo: graphs {dict(c['stats'])}, graph breaks "
                          f"{sum(c['graph_break'].values())} {dict(c['graph_break'])}\n")
            out.flush()
        del models
        torch._dynamo.reset()
        qbl.clear_cache()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Timing of ModelNew (qbl) against the reference Model: eager, torch.compile and bare GEMMs.

    pip install --no-build-isolation ./python                    # once, from the repository root
    python3 examples/pytorch/compare.py                          # every BENCH_SHAPE, fp32 and bf16
    python3 examples/pytorch/compare.py --shapes 0,32x1024x1024 --dtypes bfloat16 --quick
    python3 examples/pytorch/compare.py --out results.md --csv results.csv

Times the forward (no_grad) and the forward + backward of eager Model, torch.compile(Model)
(default and max-autotune-no-cudagraphs), ModelNew and torch's bare GEMMs, interleaved, with CUDA
events around each run and the inputs rotating over >= 3 x L2; and the host time of one forward
call at 1x8x1024. README.md says how. Progress goes to stderr, the markdown tables to stdout.
Exits non-zero only if something failed to run (a failed sanity check counts: a broken setup).
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import itertools
import math
import os
import statistics
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qbl  # noqa: E402
from model_new import ModelNew  # noqa: E402
from reference import BENCH_SHAPES, Model, get_inputs  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
VARIANTS = ("eager", "compile", "compile-maxat", "qbl")  # then "gemm", the bare GEMMs
COMPILE_MODES = {"compile": None, "compile-maxat": "max-autotune-no-cudagraphs"}
SANITY_TOL = {torch.float32: 1e-2, torch.bfloat16: 6e-2, torch.float16: 2e-2}
MAX_COPIES, MEM_FRAC = 4096, 0.25  # input copies: at most this many, in this share of free memory
MAX_BATCH, MIN_ROUNDS = 200, 3  # runs of one variant per round at most; rounds at least
HOST_SHAPE, HOST_CALLS = (1, 8, 1024), 32  # calls per host batch: too few launches to fill a queue


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


def exact_fp32_matmul() -> str:
    """TF32 off for float32 GEMMs: torch >= 2.9's fp32_precision where it exists (setting the
    older allow_tf32 there warns), allow_tf32 before."""
    matmul = torch.backends.cuda.matmul
    if hasattr(matmul, "fp32_precision"):
        matmul.fp32_precision = "ieee"
        return 'torch.backends.cuda.matmul.fp32_precision = "ieee"'
    matmul.allow_tf32 = False
    return "torch.backends.cuda.matmul.allow_tf32 = False"


def parse_shapes(spec: str):
    if spec in ("", "all"):
        return list(BENCH_SHAPES)
    shapes = []
    for tok in (t.strip().lower() for t in spec.replace(";", ",").split(",")):
        if "x" in tok:
            shapes.append(tuple(int(v) for v in tok.split("x")))
            if len(shapes[-1]) != 3:
                raise ValueError(f"{tok!r} is not BxTxD")
        elif tok:
            shapes.append(BENCH_SHAPES[int(tok)])
    return shapes


def shape_str(shape):
    return "x".join(str(v) for v in shape)


def make_models(d, dtype):
    """The reference Model and ModelNew with one state dict."""
    torch.manual_seed(0)
    eager = Model(d).to(device="cuda", dtype=dtype)
    new = ModelNew(d).to(device="cuda", dtype=dtype)
    new.load_state_dict(eager.state_dict())
    return eager, new


def rotation(shape, dtype, rotate_mb):
    """Copies of x and logits (both requiring grad) and of g, their bytes adding up to >=
    rotate_mb MiB: at least 2, at most MAX_COPIES and what MEM_FRAC of the free memory holds."""
    b, t, d = shape
    per_copy = (2 * b * t * d + b * t) * torch.finfo(dtype).bits // 8
    fits = int(torch.cuda.mem_get_info()[0] * MEM_FRAC) // per_copy
    count = max(2, min(math.ceil(rotate_mb * 2**20 / per_copy), MAX_COPIES, fits))
    xs, ls, gs = [], [], []
    for _ in range(count):
        x, logits = get_inputs(b, t, d, dtype=dtype, device="cuda")
        xs.append(x.requires_grad_())
        ls.append(logits.requires_grad_())
        gs.append(torch.randn(b, t, d, dtype=dtype, device="cuda"))
    log(f"    inputs rotate over {count} copies ({count * per_copy / 2**20:.0f} MiB)")
    return xs, ls, gs


def sanity_check(eager, new, x, logits):
    """Raises unless ModelNew's forward is close to eager's and records autograd."""
    with torch.no_grad():
        want, got = eager(x, logits), new(x, logits)
    tol = SANITY_TOL[x.dtype]
    if not torch.allclose(got, want, atol=tol, rtol=tol):
        diff = (got.float() - want.float()).abs().max().item()
        raise RuntimeError(f"sanity check: ModelNew's forward differs from eager's by {diff:.3g}")
    if not new(x, logits).requires_grad:
        raise RuntimeError("sanity check: ModelNew's output does not require grad")


def compile_model(model, mode, x, logits):
    """torch.compile(model), traced once on (x, logits) under no_grad: fullgraph=True, or False
    where the graph does not trace whole."""
    t0 = time.perf_counter()
    for fullgraph in (True, False):
        fn = torch.compile(model, mode=mode, dynamic=False, fullgraph=fullgraph)
        try:
            with torch.no_grad():
                fn(x, logits)
            log(f"    torch.compile(mode={mode}, fullgraph={fullgraph}) "
                f"{time.perf_counter() - t0:.1f} s")
            return fn
        except Exception as e:  # noqa: BLE001
            if not fullgraph:
                raise
            log(f"    torch.compile(mode={mode}, fullgraph=True) did not trace: {type(e).__name__}")


# What is timed: name -> (prep, run), both taking the rotation index; prep (or None) is untimed.

def forward_runs(models, xs, ls):
    def runner(model):
        return lambda i: model(xs[i], ls[i])
    return {name: (None, runner(m)) for name, m in models.items()}


def training_runs(models, xs, ls, gs):
    def pair(model):
        params = list(model.parameters())

        def prep(i):  # every gradient to None: no run accumulates into an existing .grad
            xs[i].grad = ls[i].grad = None
            for p in params:
                p.grad = None

        def run(i):
            model(xs[i], ls[i]).backward(gs[i])
        return prep, run
    return {name: pair(m) for name, m in models.items()}


def gemm_run(linear, xs, gs, backward):
    """torch's GEMMs on a ready `mixed` (the rotating x stands in for it): F.linear(mixed, W, b),
    and with `backward` also dgrad g @ W and wgrad g^T @ mixed, g.sum(0)."""
    w, b = linear.weight.detach(), linear.bias.detach()

    def run(i):
        mixed = xs[i].detach().view(-1, w.shape[1])
        F.linear(mixed, w, b)
        if backward:
            g = gs[i].view(-1, w.shape[0])
            g @ w
            g.t() @ mixed
            g.sum(0)
    return None, run


def timed_batch(prep, run, k, order):
    """k runs, each on the next rotation index and between its own two CUDA events: ms each."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(k)]
    for start, end in events:
        i = next(order)
        if prep is not None:
            prep(i)
        start.record()
        run(i)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def warm_up(runs, order, args, label, failures):
    """Runs each variant args.warmup times (compiling what is compiled), dropping those that
    raise. Returns name -> (prep, run, runs per round of about args.round_ms)."""
    ready = {}
    for name, (prep, run) in runs.items():
        t0 = time.perf_counter()
        try:
            timed_batch(prep, run, args.warmup, order)
            est = statistics.median(timed_batch(prep, run, 5, order))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            failures.append(f"{label} {name}: {type(e).__name__}: {e}")
            continue
        if time.perf_counter() - t0 > 2:
            log(f"    {name}: warm-up {time.perf_counter() - t0:.1f} s")
        ready[name] = (prep, run, max(1, min(MAX_BATCH, int(args.round_ms / max(est, 1e-3)))))
    return ready


def time_interleaved(ready, order, args):
    """Rounds in which every variant runs its batch, until each has args.samples times and
    MIN_ROUNDS rounds have passed. Returns name -> list of ms."""
    times = {name: [] for name in ready}
    rounds = 0
    while times and (rounds < MIN_ROUNDS or min(map(len, times.values())) < args.samples):
        for name, (prep, run, k) in ready.items():
            times[name] += timed_batch(prep, run, k, order)
        rounds += 1
    return times


def do_bench_ms(runs):
    """triton.testing.do_bench medians (ms) on the first input copy, no rotation: a cross-check."""
    import triton.testing
    return {name: triton.testing.do_bench(lambda: run(0), return_mode="median")
            for name, (_, run) in runs.items()}


def bench_shape(shape, dtype, args, failures):
    """{(variant, mode): list of ms} for one shape and dtype, modes "fwd" and "fwd+bwd"."""
    label = f"{shape_str(shape)} {str(dtype).replace('torch.', '')}"
    log(f"== {label}")
    torch._dynamo.reset()
    xs, ls, gs = rotation(shape, dtype, args.rotate_mb)
    eager, new = make_models(shape[2], dtype)
    sanity_check(eager, new, xs[0], ls[0])
    models = {"eager": eager}
    for name, mode in COMPILE_MODES.items():
        if args.compile and (args.default_compile if mode is None else args.max_autotune):
            try:
                models[name] = compile_model(copy.deepcopy(eager), mode, xs[0], ls[0])
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                failures.append(f"{label} {name}: {type(e).__name__}: {e}")
    models["qbl"] = new
    order = itertools.cycle(range(len(xs)))
    results = {}
    for mode, grad in (("fwd", False), ("fwd+bwd", True)):
        with torch.set_grad_enabled(grad):
            runs = training_runs(models, xs, ls, gs) if grad else forward_runs(models, xs, ls)
            runs["gemm"] = gemm_run(eager.out_proj, xs, gs, backward=grad)
            times = time_interleaved(warm_up(runs, order, args, f"{label} {mode}", failures),
                                     order, args)
            if args.cross_check and not grad:
                cross = do_bench_ms(runs)
                log("    do_bench fwd: " + ", ".join(f"{n} {v:.4f}" for n, v in cross.items()))
        results.update({(name, mode): v for name, v in times.items()})
        log(f"    {mode} ms: " + ", ".join(f"{n} {statistics.median(v):.4f}"
                                         for n, v in times.items()))
    return results


def sleep_cycles_per_ms():
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10**7)
    end.record()
    end.synchronize()
    return 10**7 / start.elapsed_time(end)


def host_batch_us(call, n, sleep_cycles):
    """Host time per call (us) of n calls enqueued behind a GPU sleep of sleep_cycles, so that no
    launch waits for the GPU; the clock stops before the synchronize."""
    torch.cuda.synchronize()
    if sleep_cycles:
        torch.cuda._sleep(sleep_cycles)
    t0 = time.perf_counter_ns()
    for _ in range(n):
        call()
    t1 = time.perf_counter_ns()
    torch.cuda.synchronize()
    return (t1 - t0) / n / 1e3


def host_overhead(dtype, args):
    """call -> per-call host times (us), one per batch of HOST_CALLS, the calls taking turns."""
    b, t, d = HOST_SHAPE
    eager, new = make_models(d, dtype)
    x, logits = get_inputs(b, t, d, dtype=dtype, device="cuda")
    xg, lg = x.clone().requires_grad_(), logits.clone().requires_grad_()
    calls = {"nn.Linear (no_grad)": (False, lambda: eager.out_proj(x)),
             "eager Model (no_grad)": (False, lambda: eager(x, logits)),
             "qbl ModelNew (no_grad)": (False, lambda: new(x, logits)),
             "eager Model (grad)": (True, lambda: eager(xg, lg)),
             "qbl ModelNew (grad)": (True, lambda: new(xg, lg))}
    per_ms, sleep = sleep_cycles_per_ms(), {}
    for name, (grad, call) in calls.items():  # warm-up; then sleep 4x a batch's host time
        with torch.set_grad_enabled(grad):
            us = min(host_batch_us(call, HOST_CALLS, 0) for _ in range(3))
        sleep[name] = int(per_ms * max(1.0, 4e-3 * us * HOST_CALLS))
    times = {name: [] for name in calls}
    for _ in range(args.host_batches):
        for name, (grad, call) in calls.items():
            with torch.set_grad_enabled(grad):
                times[name].append(host_batch_us(call, HOST_CALLS, sleep[name]))
    return times


def fmt(v, spec="{:.4f}"):
    return "n/a" if math.isnan(v) else spec.format(v)


def dtype_table(dtype_name, per_shape):
    """Markdown table of one dtype; per_shape: [(shape, {(variant, mode): ms list} or None)]."""
    head = (["shape"] + [f"fwd {v} ms" for v in VARIANTS] + [f"fwd+bwd {v} ms" for v in VARIANTS]
            + ["3 bare GEMMs ms", "qbl fwd+bwd speedup vs compile", "vs compile-maxat"])
    lines = [f"## {dtype_name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape, res in per_shape:
        med = {k: statistics.median(v) for k, v in (res or {}).items()}
        get = lambda v, m: med.get((v, m), float("nan"))  # noqa: E731
        cells = [fmt(get(v, m)) for m in ("fwd", "fwd+bwd") for v in VARIANTS]
        cells.append(fmt(get("gemm", "fwd+bwd")))
        cells += [fmt(get(c, "fwd+bwd") / get("qbl", "fwd+bwd"), "{:.2f}x")
                  for c in ("compile", "compile-maxat")]
        cells = cells if res else ["failed"] * len(cells)
        lines.append(f"| {shape_str(shape)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def host_table(host):
    """host: {dtype_name: {call: list of us}}."""
    calls = list(next(iter(host.values())))
    lines = [f"## Host time per forward call, {shape_str(HOST_SHAPE)} (us, median of batches)",
             "", "| call | " + " | ".join(host) + " |", "|" + "---|" * (len(host) + 1)]
    for call in calls:
        lines.append(f"| {call} | " + " | ".join(
            fmt(statistics.median(h[call]), "{:.1f}") for h in host.values()) + " |")
    return "\n".join(lines) + "\n"


def csv_rows(shape, dtype_name, results, unit="ms"):
    for (variant, mode), v in results.items():
        q = statistics.quantiles(v, n=10) if len(v) > 1 else v * 9
        yield {"shape": shape_str(shape), "dtype": dtype_name, "variant": variant, "mode": mode,
               "unit": unit, "median": statistics.median(v), "p10": q[0], "p90": q[-1],
               "samples": len(v)}


def header(args, precision):
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "not installed"
    try:
        from importlib.metadata import version
        qbl_version = version("qbl")
    except Exception:  # noqa: BLE001
        qbl_version = "unknown"
    return "\n".join([
        "# qbl vs PyTorch: quantize-blend-linear, forward and forward + backward", "",
        f"- {props.name}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton "
        f"{triton_version}, qbl {qbl_version}; {precision}",
        f"- medians of >= {args.samples} runs per variant, each between CUDA events, variants "
        f"interleaved; x, logits and g rotate over >= {args.rotate_mb:.0f} MiB where memory allows",
        "- fwd: under torch.no_grad. fwd+bwd: out.backward(g); x, logits and parameters require "
        "grad; all gradients are set to None before each run, outside the timed region",
        "- compile: torch.compile(Model, dynamic=False, fullgraph=True); compile-maxat: "
        "mode=\"max-autotune-no-cudagraphs\"; 3 bare GEMMs: torch's F.linear(mixed, W, b), g @ W, "
        "g^T @ mixed and g.sum(0); speedup: compile time / qbl time", ""])


def write_files(args, text, rows):
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["shape"])
            wr.writeheader()
            wr.writerows(rows)


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="all",
                    help="BxTxD or BENCH_SHAPES indices, comma-separated")
    ap.add_argument("--dtypes", "--dtype", default="float32,bfloat16",
                    help="comma-separated, of " + ", ".join(DTYPES))
    ap.add_argument("--quick", action="store_true", help="fewer samples, warm-up runs, batches")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="skip torch.compile")
    ap.add_argument("--max-autotune", action=argparse.BooleanOptionalAction, default=True,
                    help="also time mode=\"max-autotune-no-cudagraphs\" (default: on)")
    ap.add_argument("--no-default-compile", dest="default_compile", action="store_false",
                    help="skip torch.compile's default mode (time max-autotune alone)")
    ap.add_argument("--samples", type=int, default=100, help="timed runs per variant, at least")
    ap.add_argument("--round-ms", type=float, default=5.0, help="GPU time per variant per round")
    ap.add_argument("--warmup", type=int, default=10, help="untimed runs per variant")
    ap.add_argument("--rotate-mb", type=float, default=None,
                    help="MiB of input copies to rotate over (default: 3 x L2, at least 180)")
    ap.add_argument("--host-batches", type=int, default=100, help="host-time batches per call")
    ap.add_argument("--no-host", dest="host", action="store_false", help="skip the host times")
    ap.add_argument("--cross-check", action="store_true",
                    help="also log triton.testing.do_bench forward times (no rotation)")
    ap.add_argument("--out", help="also write the markdown here")
    ap.add_argument("--csv", help="write one row per shape/dtype/variant/mode here")
    args = ap.parse_args()
    if args.quick:
        args.samples, args.warmup, args.host_batches = 25, 3, 20
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if any(d not in DTYPES for d in args.dtypes):
        ap.error(f"--dtypes: choose from {', '.join(DTYPES)}")
    try:
        args.shapes = parse_shapes(args.shapes)
    except (ValueError, IndexError) as e:
        ap.error(f"--shapes: {e}")
    return args


def main():
    args = parse_args()
    if not torch.cuda.is_available():
        log("compare.py needs a CUDA device")
        return 2
    if args.rotate_mb is None:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        args.rotate_mb = max(180.0, 3 * getattr(props, "L2_cache_size", 0) / 2**20)
    precision = exact_fp32_matmul()
    failures, rows, tables, host = [], [], [], {}
    t_start = time.perf_counter()
    for dtype_name in args.dtypes:
        per_shape = []
        for shape in args.shapes:
            res = None
            try:
                res = bench_shape(shape, DTYPES[dtype_name], args, failures)
                rows += csv_rows(shape, dtype_name, res)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                failures.append(f"{shape_str(shape)} {dtype_name}: {type(e).__name__}: {e}")
            per_shape.append((shape, res))
            # What is done so far goes to the files after every shape: a run stopped by a time
            # limit keeps it (the final write below replaces it).
            write_files(args, "\n".join([header(args, precision)] + tables
                                        + [dtype_table(dtype_name, per_shape)]), rows)
            torch._dynamo.reset()
            qbl.clear_cache()
            gc.collect()
            torch.cuda.empty_cache()
        tables.append(dtype_table(dtype_name, per_shape))
        if args.host:
            log(f"== host time, {shape_str(HOST_SHAPE)} {dtype_name}")
            try:
                host[dtype_name] = host_overhead(DTYPES[dtype_name], args)
                rows += csv_rows(HOST_SHAPE, dtype_name,
                                 {(n, "host"): v for n, v in host[dtype_name].items()}, unit="us")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                failures.append(f"host time {dtype_name}: {type(e).__name__}: {e}")
    text = "\n".join([header(args, precision)] + tables + ([host_table(host)] if host else []))
    if failures:
        text += "\nDid not run:\n\n" + "".join(f"- {f}\n" for f in failures)
    print(text, flush=True)
    write_files(args, text, rows)
    log(f"total {time.perf_counter() - t_start:.0f} s, {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

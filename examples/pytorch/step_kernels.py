"""Every kernel of a training step of train_qat.py's model, per variant: the GPU time per step of
each kernel (torch.profiler, 5 steps), the GPU's active time, and the step's time from interleaved
rounds timed before the profile (each round one untimed step, then 10 steps between two CUDA
events; medians). A variant is "<variant> <mode> <overlap>", overlap being 0 (qbl's wgrad
serialized with dgrad), by_shape (beside it, the plan's choice) or - (as the environment says).

    python3 examples/pytorch/step_kernels.py --json step_kernels.json
    python3 examples/pytorch/step_kernels.py --precision autocast --runs "reference compile -,qbl compile by_shape" --json k.json
"""
import json, os, sys, statistics
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from torch.profiler import ProfilerActivity, profile
import qbl, train_qat, profile_step as ps

args, ns, batches = train_qat.profiling_args(
    __doc__, "bf16", 8,
    runs=dict(default="reference compile -,qbl compile 0,qbl compile by_shape,qbl eager 0"),
    rounds=dict(type=int, default=8), json=dict(required=True))
out = {}
for precision in args.precision.split(","):
    models = train_qat.Models(ns, args.d, precision)
    runs = []
    for r in args.runs.split(","):
        v, m, ov = r.split()
        runs.append((v, m, None if ov == "by_shape" else ("0" if ov == "0" else ps.KEEP)))
    steps = {}
    for run in runs:
        ps.set_overlap(run[2])
        steps[run] = train_qat.make_step(*models.get(*run[:2]), precision, models.lr)
        for i in range(3):
            steps[run](*batches[i])
    torch.cuda.synchronize()
    # timed rounds
    times = {run: [] for run in runs}
    for r in range(args.rounds):
        for j in range(len(runs)):
            run = runs[(r + j) % len(runs)]
            ps.set_overlap(run[2]); steps[run](*batches[0])
            ms, _, _ = train_qat.timed_steps(steps[run], batches, 10, r * 10)
            times[run].append(ms)
    for run in runs:
        ps.set_overlap(run[2]); steps[run](*batches[0]); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(5):
                steps[run](*batches[i])
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        active = ps.gpu_active_us([(e.time_range.start, e.time_range.end) for e in evs]) / 5
        k = {}
        for e in prof.key_averages():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                k[e.key] = [ps.device_us(e) / 5, e.count / 5]
        name = f"{precision} {run[0]} {run[1]} overlap {run[2]}"
        out[name] = {"ms": times[run], "median": statistics.median(times[run]), "active_us": active, "kernels": k}
        print(f"{name}: {statistics.median(times[run]):.3f} ms (rounds {', '.join(f'{t:.2f}' for t in times[run])}), GPU active {active / 1e3:.3f} ms, busy {sum(v[0] for v in k.values()) / 1e3:.3f} ms", flush=True)
    del models, steps
    qbl.clear_cache(); torch._dynamo.reset(); torch.cuda.empty_cache()
json.dump(out, open(args.json, "w"), indent=1)

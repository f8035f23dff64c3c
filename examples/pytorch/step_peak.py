"""What is allocated at the peak of one training step of train_qat.py's model, per variant:
torch.cuda.memory's allocation history of one step, replayed to the moment of the peak, its live
blocks grouped by the code that allocated them.

    python3 examples/pytorch/step_peak.py --precision autocast --variants "reference compile,qbl eager"
"""
import collections, os, sys
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import qbl, train_qat

args, ns, batches = train_qat.profiling_args(
    __doc__, "autocast,bf16", 4,
    variants=dict(default="reference compile,qbl eager,qbl_recompute eager,qbl compile,"
                          "qbl_recompute compile"),
    top=dict(type=int, default=25))
SKIP = ("torch/", "contextlib", "<frozen", "threading")

def where(frames):
    keep = [f for f in frames if not any(s in f["filename"] for s in SKIP)]
    fs = keep[:2] if keep else frames[:2]
    return " < ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in fs)

for precision in args.precision.split(","):
    models = train_qat.Models(ns, args.d, precision)
    for vm in args.variants.split(","):
        variant, mode = vm.split()
        step = train_qat.make_step(*models.get(variant, mode), precision, models.lr)
        for i in range(3):
            step(*batches[i % 4])
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=200000, stacks="python")
        step(*batches[3])
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        trace = [e for t in snap["device_traces"] for e in t]
        live, cur, best, best_i = {}, 0, -1, 0
        for i, e in enumerate(trace):
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], i); cur += e["size"]
            elif e["action"] == "free_completed" and e["addr"] in live:
                cur -= live.pop(e["addr"])[0]
            if cur > best:
                best, best_i = cur, i
        # replay to the peak
        live = {}
        for i, e in enumerate(trace[: best_i + 1]):
            if e["action"] == "alloc":
                live[e["addr"]] = (e["size"], i)
            elif e["action"] == "free_completed":
                live.pop(e["addr"], None)
        groups = collections.defaultdict(lambda: [0, 0])
        for addr, (size, i) in live.items():
            k = where(trace[i].get("frames", []))
            groups[k][0] += size; groups[k][1] += 1
        pe = trace[best_i]
        print(f"== D={args.d} {precision} {variant} {mode}: peak {peak:.0f} MiB (trace {best / 2**20:.0f}), "
              f"at event {best_i}/{len(trace)} {pe['action']} {pe['size'] / 2**20:.1f} MiB from {where(pe.get('frames', []))}")
        for k, (s, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"   {s / 2**20:8.1f} MiB {n:3d}x  {k}")
        sys.stdout.flush()
        del step
    del models
    qbl.clear_cache(); torch._dynamo.reset(); torch.cuda.empty_cache()

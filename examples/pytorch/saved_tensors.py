"""The tensors autograd keeps between forward and backward in one training step of train_qat.py's
model, per variant: shape, dtype and MiB of each (storages counted once, parameters left out: they
are allocated anyway). What sets a step's peak memory, besides what the backward allocates.

    python3 examples/pytorch/saved_tensors.py --precision autocast
"""
import collections, os, sys, traceback
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
import qbl, train_qat

args, ns, batches = train_qat.profiling_args(
    __doc__, "autocast,bf16", 4,
    variants=dict(default="reference compile,qbl eager,qbl_recompute eager,"
                          "qbl_recompute compile"))

for precision in args.precision.split(","):
    models = train_qat.Models(ns, args.d, precision)
    for vm in args.variants.split(","):
        variant, mode = vm.split()
        module, fn = models.get(variant, mode)
        params = {p.data_ptr() for p in module.parameters()}
        step = train_qat.make_step(module, fn, precision, models.lr)
        for i in range(2):
            step(*batches[i])
        seen = {}
        def pack(t):
            try:
                ptr = t.untyped_storage().data_ptr(); nb = t.untyped_storage().nbytes()
            except Exception:
                return t
            if ptr not in seen:
                st = [f for f in traceback.extract_stack()[:-1] if "torch/" not in f.filename]
                w = f"{os.path.basename(st[-1].filename)}:{st[-1].lineno}" if st else "?"
                seen[ptr] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), nb, ptr in params, w)
            return t
        tokens, targets = batches[2]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=precision == "autocast"):
                loss = fn(tokens, targets)
        loss.backward()
        for p in module.parameters():
            p.grad = None
        groups = collections.Counter(); sizes = collections.Counter()
        tot = 0
        for shape, dt, nb, isp, w in seen.values():
            if isp:
                continue
            k = (shape, dt, w); groups[k] += 1; sizes[k] += nb; tot += nb
        print(f"== D={args.d} {precision} {variant} {mode}: saved (not parameters) {tot / 2**20:.0f} MiB in {sum(groups.values())} storages; parameters saved {sum(1 for v in seen.values() if v[3])}")
        for k, n in sorted(groups.items(), key=lambda kv: -sizes[kv[0]]):
            if sizes[k] >= 2**20:
                print(f"   {sizes[k] / 2**20:8.1f} MiB {n:3d}x {k[1]} {list(k[0])} {k[2]}")
        sys.stdout.flush()
        del step, loss
    del models
    qbl.clear_cache(); torch._dynamo.reset(); torch.cuda.empty_cache()

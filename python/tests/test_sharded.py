"""Sharded x: torch.ops.qbl.local_amax, a reduction of amax's bits, then torch.ops.qbl.forward
with the reduced stats. In one process, on the CPU and on CUDA: the split equals the fused forward
bit for bit (out, mixed, stats and every gradient); shards along the tokens and along the
features, reduced with an integer max of the bits, give the unsharded layer's `mixed` bit for bit
(NaN in one shard included); opcheck of the sharded operators; an empty shard; the process_group
path through a one-rank group (gloo on the CPU, NCCL on CUDA). On two or more GPUs: one process
per GPU, x sharded along the tokens or the features, amax all-reduced through NCCL, called
directly and replayed from a CUDA graph: `mixed` and [amax, scale] bit-equal to one GPU's on the
whole x. (Several CPU ranks through gloo: test_distributed.py.)"""

from __future__ import annotations

import helpers as H

import os

import pytest
import torch

import qbl

ACT_PARAMS = H.ACTIVATION_PARAMS


def _bits_max(stats_list):
    """Every shard's stats[0] := the integer max of all shards' stats[0] bits (what an all-reduce
    of int32 with MAX computes), on new tensors."""
    m = torch.stack([s[:1].view(torch.int32) for s in stats_list]).amax(0)
    out = []
    for s in stats_list:
        r = s.clone()
        r[:1].view(torch.int32).copy_(m)
        out.append(r)
    return out


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_split_equals_fused_forward_and_backward(dtype, device):
    """The forward from local_amax's stats (amax_reduce the identity) against the fused forward
    that computes amax itself: out and every gradient bit for bit; and the operators directly:
    local_amax's amax is the fused forward's, and the forward from it gives its stats, mixed and
    out bit for bit."""
    x, l, w, b = H.make_inputs((3, 41), 96, 40, dtype, device, seed=300)
    g = H.make_grad_out((3, 41, 40), dtype, device, seed=301)
    want = H.run_autograd(H.qbl_fn(), x, l, w, b, g)
    got = H.run_autograd(
        lambda *a: qbl.quant_blend_linear(*a, amax_reduce=lambda s: s), x, l, w, b, g)
    for name in ("out", "x", "logits", "weight", "bias"):
        H.assert_bits_equal(getattr(got, name), getattr(want, name), f"split vs fused: {name}")
    out_f, mixed_f, stats_f = torch.ops.qbl.forward(x, l, w, b)
    local = torch.ops.qbl.local_amax(x)
    out_s, mixed_s, stats_s = torch.ops.qbl.forward(x, l, w, b, local)
    H.assert_bits_equal(local[0], stats_f[0], "local_amax vs the fused forward's amax")
    H.assert_bits_equal(stats_s, stats_f, "stats")
    H.assert_bits_equal(mixed_s, mixed_f, "mixed")
    H.assert_bits_equal(out_s, out_f, "out")


LOCAL_AMAX_CASES = {
    "finite": None,
    "nan_in_x": float("nan"),
    "pos_inf_in_x": float("inf"),
    "neg_inf_in_x": float("-inf"),  # gelu, gelu_tanh and silu of -Inf are NaN (-Inf * 0)
}


@pytest.mark.parametrize("case", list(LOCAL_AMAX_CASES))
@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("act", ACT_PARAMS)
def test_local_amax_is_eagers_max_abs_of_the_activation(act, dtype, case, device):
    """torch.ops.qbl.local_amax(x, activation) against eager on the same device: a float32 [2]
    tensor on x's device, bit for bit [act(x).abs().max(), +0.0] with act eager's activation (the
    identity for "none") -- the max exact in x's dtype, widened exactly to float32, and
    NaN-propagating as torch.max: one NaN of act(x) (a NaN in x; for gelu, gelu_tanh and silu
    also -Inf in x, whose value is -Inf * 0) makes amax NaN; an Inf of act(x) makes it Inf. On the
    CPU the kernel calls eager's activation on the same tensor, so act(x) has eager's bits there
    whatever the vectorized loop does; on CUDA the activation is an element function."""
    x, _, _, _ = H.make_inputs((5, 37), 96, 8, dtype, device, seed=305)
    special = LOCAL_AMAX_CASES[case]
    if special is not None:
        x[3, 20, 50] = special
    stats = torch.ops.qbl.local_amax(x, act)
    amax = H.ACTIVATIONS[act](x).abs().max().float()
    H.assert_bits_equal(stats, torch.stack([amax, torch.zeros_like(amax)]),
                        f"local_amax(x, {act!r}) vs [max |{act}(x)|, 0]")
    if case == "nan_in_x" or (case == "neg_inf_in_x" and act in ("gelu", "gelu_tanh", "silu")):
        assert torch.isnan(stats[0]), f"{case}: amax of {act}(x) must be NaN, got {stats[0]}"
    _, _, fused = torch.ops.qbl.forward(x, *H.make_inputs((5, 37), 96, 8, dtype, device,
                                                           seed=306)[1:], activation=act)
    H.assert_bits_equal(stats[0], fused[0], f"local_amax(x, {act!r}) vs the fused forward's amax")


def _shard_cuts(axis, device, dtype, act):
    """Two shards of x [160, 128] along `axis`: cut at token 61 or at feature 40 -- on the CPU at
    token 64 in float32 or with an activation, and at feature 64 with an activation (see
    test_shards_equal_the_unsharded_layer)."""
    aligned = device.type == "cpu" and act != "none"
    if axis == "features":
        at = 64 if aligned else 40
        return [(slice(None), slice(0, at)), (slice(None), slice(at, 128))]
    at = 64 if aligned or (device.type == "cpu" and dtype == torch.float32) else 61
    return [(slice(0, at), slice(None)), (slice(at, 160), slice(None))]


@pytest.mark.parametrize("act", ACT_PARAMS)
@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan_in_one_shard"])
@pytest.mark.parametrize("axis", ["tokens", "features"])
def test_shards_equal_the_unsharded_layer(dtype, nan, axis, act, device):
    """x [160, 128] cut in two along the tokens or the features, each shard's
    local_amax(activation=) reduced by an integer max of the bits, each shard's forward from the
    reduced stats with the same activation: its `mixed` is the unsharded forward's part bit for
    bit, its [amax, scale] the unsharded one; a NaN in one shard makes the scale NaN (every
    activation maps NaN to NaN). The cuts are unaligned (token 61, feature 40), except on the
    CPU: there eager's float32 sigmoid and its activations (which the CPU kernel calls, so as to
    be eager's bit for bit) round an element differently in the vectorized body of their loop
    than in its scalar tail, so the sigmoid of a token shard of the logits, or the activation of
    a shard of x, that starts or ends elsewhere than at a multiple of 64 elements can differ from
    the unsharded one's in its last bit, in eager as in qbl (docs/sharded.md). So on the CPU the
    tokens are cut at token 64 in float32 or with an activation, and the features at feature 64
    with an activation. Without an activation the bf16 and fp16 sigmoid do not depend on the
    position, a feature shard takes every token's logit (the same sigmoid call as unsharded), and
    the blend is qbl's own element math, which does not depend on the position either."""
    x, l, w, b = H.make_inputs((160,), 128, 48, dtype, device, seed=310)
    if nan:
        x[150, 100] = float("nan")
    _, mixed_whole, stats_whole = torch.ops.qbl.forward(x, l, w, b, activation=act)
    cuts = _shard_cuts(axis, device, dtype, act)
    shards = [(x[r, c].contiguous(), l[r].contiguous(), w[:, c].contiguous()) for r, c in cuts]
    reduced = _bits_max([torch.ops.qbl.local_amax(xs, act) for xs, _, _ in shards])
    for (r, c), (xs, ls, ws), shard_stats in zip(cuts, shards, reduced):
        _, mixed, stats = torch.ops.qbl.forward(xs, ls, ws, b, shard_stats, activation=act)
        H.assert_bits_equal(mixed, mixed_whole[r, c], f"{axis} shard {r, c}: mixed")
        H.assert_bits_equal(stats, stats_whole, f"{axis} shard {r, c}: [amax, scale]")
    if nan:
        assert torch.isnan(stats_whole[1]), "a NaN in x must make the scale NaN"


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16")])
def test_opcheck_sharded_ops(dtype, device):
    """torch.library.opcheck of local_amax and of the forward given stats (schema, fake tensor,
    autograd registration, AOT dispatch): every check SUCCESS."""
    x, l, w, b = H.make_inputs((3, 5), 32, 24, dtype, device, seed=320)
    for op, args in ((torch.ops.qbl.local_amax.default, (x.detach().clone().requires_grad_(),)),
                     (torch.ops.qbl.forward.default,
                      tuple(t.requires_grad_() for t in (x, l, w, b))
                      + (torch.ops.qbl.local_amax(x.detach()),))):
        result = torch.library.opcheck(op, args, raise_exception=False)
        failed = {k: v for k, v in result.items() if v != "SUCCESS"}
        assert not failed, f"{op}: opcheck failures: {failed}"


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_empty_shard_contributes_zero(dtype, device):
    """A shard of no tokens reports amax +0.0 (all bits zero, the identity of the integer max),
    as a float32 tensor on x's device, with every activation."""
    x = torch.empty((0, 64), device=device, dtype=dtype)
    for act in H.ACTIVATIONS:
        stats = torch.ops.qbl.local_amax(x, act)
        assert stats.dtype == torch.float32 and stats.device == x.device, (
            f"stats ({act}): {stats.dtype} on {stats.device}")
        assert stats.view(torch.int32).tolist() == [0, 0], f"{act}: {stats.tolist()}"


def test_process_group_of_one_rank_equals_the_unsharded_layer(tmp_path, device):
    """QuantBlendLinear with a process_group of one rank (its shard the whole x; the all-reduce of
    amax's bits runs): out bit for bit the unsharded layer's -- a gloo group on the CPU, an NCCL
    group on CUDA."""
    dist = torch.distributed
    if device.type == "cuda":
        if not dist.is_available() or not dist.is_nccl_available():
            pytest.skip("torch.distributed with NCCL is not available")
        backend, kwargs = "nccl", {"device_id": device}
    else:
        assert dist.is_available() and dist.is_gloo_available(), (
            "torch.distributed with gloo, which every CPU build of torch has, is not available")
        backend, kwargs = "gloo", {}
    assert not dist.is_initialized(), "a process group is already initialized in this process"
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
    try:
        x, l, w, b = H.make_inputs((4, 33), 64, 32, torch.bfloat16, device, seed=330)
        layer = qbl.QuantBlendLinear(64, 32, device=device, dtype=torch.bfloat16,
                                     process_group=dist.group.WORLD)
        with torch.no_grad():
            layer.weight.copy_(w)
            layer.bias.copy_(b)
        got = layer(x, l)
        want = qbl.quant_blend_linear(x, l, w, b)
        H.assert_bits_equal(got, want, f"one-rank {backend} process group vs unsharded")
    finally:
        dist.destroy_process_group()


_WORKER = r"""
import os, sys, torch, torch.distributed as dist
import qbl
rank, world, path, store_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
axis, nan, graph = os.environ["QBL_SHARD_AXIS"], os.environ["QBL_SHARD_NAN"] == "1", \
    os.environ["QBL_SHARD_GRAPH"] == "1"
torch.cuda.set_device(rank)
dist.init_process_group("nccl", store=dist.FileStore(store_path, world), rank=rank,
                        world_size=world, device_id=torch.device("cuda", rank))
dev = torch.device("cuda", rank)


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(96, 128, generator=g) * (1 + seed % 3)).to(torch.bfloat16)
    if nan:
        x[90, 127] = float("nan")  # in the last rank's shard, along either axis
    l = torch.randn(96, generator=g).to(torch.bfloat16)
    w = (torch.randn(48, 128, generator=g) * 0.05).to(torch.bfloat16)
    return x, l, w


cut = slice(rank * (96 if axis == "tokens" else 128) // world,
            (rank + 1) * (96 if axis == "tokens" else 128) // world)


def shard(x, l, w):
    if axis == "tokens":
        return x[cut].to(dev), l[cut].to(dev), w.to(dev)
    return x[:, cut].contiguous().to(dev), l.to(dev), w[:, cut].contiguous().to(dev)


def sharded_forward(xs, ls, ws):
    stats = qbl.all_reduce_amax(torch.ops.qbl.local_amax(xs))
    return torch.ops.qbl.forward(xs, ls, ws, None, stats)


seeds = [340, 341, 342, 343]
results = []
if not graph:
    for seed in seeds[:1]:
        _, mixed, stats = sharded_forward(*shard(*inputs(seed)))
        results.append((inputs(seed), mixed.cpu(), stats.cpu()))
else:
    # Static inputs, a warm-up on a side stream, then the whole sharded forward (local amax, the
    # NCCL all-reduce, the forward from the reduced amax) captured once and replayed on new x.
    static = [t.clone() for t in shard(*inputs(seeds[0]))]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            sharded_forward(*static)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _, mixed, stats = sharded_forward(*static)
    for seed in seeds[1:]:
        for dst, src in zip(static, shard(*inputs(seed))):
            dst.copy_(src)
        g.replay()
        results.append((inputs(seed), mixed.cpu().clone(), stats.cpu().clone()))
    # A graph holding an NCCL operation keeps the communicator alive: free it before the group.
    torch.cuda.synchronize()
    del g
torch.cuda.synchronize()
torch.save({"results": results, "cut": (cut.start, cut.stop)}, path)
dist.destroy_process_group()
"""


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True], ids=["direct", "graph_replay"])
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan_on_one_rank"])
@pytest.mark.parametrize("axis", ["tokens", "features"])
def test_shards_across_gpus_equal_one_gpu(tmp_path, axis, nan, graph, cuda_device):
    """One process per GPU (all of them, at most 8), x sharded along `axis`, amax all-reduced
    through NCCL: each rank's `mixed` and [amax, scale] equal one GPU's on the whole x, bit for
    bit; a NaN on one rank makes every rank's scale NaN; captured in a CUDA graph, the sharded
    forward (NCCL all-reduce included) replays on new inputs with the same result."""
    world = min(torch.cuda.device_count(), 8)
    if world < 2:
        pytest.skip("needs two CUDA devices")
    _run_sharded_workers(tmp_path, world, axis, nan, graph, cuda_device)


@pytest.mark.cuda
@pytest.mark.parametrize("graph", [False, True], ids=["direct", "graph_replay"])
@pytest.mark.parametrize("nan", [False, True], ids=["finite", "nan"])
def test_sharded_worker_with_one_rank_equals_the_unsharded_layer(tmp_path, nan, graph,
                                                                 cuda_device):
    """The multi-GPU test's worker as a one-process NCCL group on one GPU (its shard is the whole
    x): the same launch, all-reduce inside a captured graph, replay and teardown, on any machine
    with one GPU."""
    _run_sharded_workers(tmp_path, 1, "tokens", nan, graph, cuda_device)


def _run_sharded_workers(tmp_path, world, axis, nan, graph, device):
    if not torch.distributed.is_available() or not torch.distributed.is_nccl_available():
        pytest.skip("torch.distributed with NCCL is not available")
    import subprocess
    import sys
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = dict(os.environ, QBL_SHARD_AXIS=axis, QBL_SHARD_NAN="1" if nan else "0",
               QBL_SHARD_GRAPH="1" if graph else "0")
    store = str(tmp_path / "store")
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world),
                               str(tmp_path / f"rank{r}.pt"), store], env=env)
             for r in range(world)]
    try:
        codes = [p.wait(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert codes == [0] * world, f"a rank failed: exit codes {codes}"
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    assert len(ranks[0]["results"]) == (3 if graph else 1)
    for i, (whole, _, _) in enumerate(ranks[0]["results"]):
        _, mixed_whole, stats_whole = torch.ops.qbl.forward(*(t.to(device) for t in whole),
                                                            None)
        if nan:
            assert torch.isnan(stats_whole[1]), "a NaN in x must make the scale NaN"
        for r, res in enumerate(ranks):
            inputs, mixed, stats = res["results"][i]
            assert all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                       for a, b in zip(inputs, whole)), f"rank {r}: inputs differ from rank 0's"
            lo, hi = res["cut"]
            want = mixed_whole[lo:hi] if axis == "tokens" else mixed_whole[:, lo:hi]
            H.assert_bits_equal(mixed.to(device), want, f"input {i}, rank {r}: mixed")
            H.assert_bits_equal(stats.to(device), stats_whole,
                                f"input {i}, rank {r}: [amax, scale]")

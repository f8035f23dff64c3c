"""Fake implementations of the torch.ops.qbl operators, and the functional form. The operators,
their autograd formula and their autocast behaviour are registered in C++ (csrc/: ops.cpp holds
the schema)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["quant_blend_linear", "all_reduce_amax", "clear_cache", "cache_info"]


@torch.library.register_fake("qbl::forward")
def _forward_fake(x, logits, weight, bias, stats=None, activation="none", keep_mixed=True,
                  straight_through=False, allow_tf32=False, gemm_dtype=None, plan_backward=False):
    g = gemm_dtype if gemm_dtype is not None else x.dtype
    out = x.new_empty((*x.shape[:-1], weight.shape[0]), dtype=g)
    mixed = x.new_empty(x.shape, dtype=g)
    stats_out = x.new_empty((2,), dtype=torch.float32)
    return out, mixed, stats_out


@torch.library.register_fake("qbl::local_amax")
def _local_amax_fake(x, activation="none"):
    return x.new_empty((2,), dtype=torch.float32)


@torch.library.register_fake("qbl::backward")
def _backward_fake(grad_out, x, logits, weight, mixed, stats, has_bias, output_mask,
                   activation="none", straight_through=False, allow_tf32=False, gemm_dtype=None):
    def maybe(want, shape, like):
        return like.new_empty(shape) if want else like.new_empty((0,))

    return (maybe(output_mask[0], x.shape, x), maybe(output_mask[1], logits.shape, logits),
            maybe(output_mask[2], weight.shape, weight),
            maybe(output_mask[3] and has_bias, (weight.shape[0],), weight))


def all_reduce_amax(stats: torch.Tensor, group=None) -> torch.Tensor:
    """The reduction between the two steps of a sharded forward, through torch.distributed:
    an integer MAX of amax's bits over `group`, in place. stats[0] (max |x|) has its sign bit
    clear, so its bits read as int32 order like the values, with NaN above +Inf: the integer max
    is the NaN-propagating float max (a float MAX all-reduce would drop NaN)."""
    torch.distributed.all_reduce(stats[:1].view(torch.int32), op=torch.distributed.ReduceOp.MAX,
                                 group=group)
    return stats


#: The input activations: None (no activation), or the name of F.gelu, F.gelu(approximate="tanh"),
#: F.relu, F.silu -- as the extension lists them (torch.ops.qbl.activations(), whose "none" is
#: None here).
ACTIVATIONS = (None,) + tuple(a for a in torch.ops.qbl.activations() if a != "none")

#: keep_mixed's default: keep mixed for the backward. Recomputing it there instead cut a model
#: step's peak memory by 22-31 % and cost 3-5 % of its time on an H200 (docs/training.md).
KEEP_MIXED_DEFAULT = True


def activation_name(activation: Optional[str]) -> str:
    """The operators' name of an activation argument; ValueError for an unknown one."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    return "none" if activation is None else activation


def quant_blend_linear(x: torch.Tensor, logits: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, straight_through: bool = False,
                       allow_tf32: bool = False, process_group=None,
                       amax_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
                       activation: Optional[str] = None,
                       keep_mixed: bool = KEEP_MIXED_DEFAULT) -> torch.Tensor:
    """out = (alpha * fake_quant(x) + (1 - alpha) * x) @ weight.T + bias, alpha = sigmoid(logits);
    with an activation, of act(x) instead of x.

    x [..., in_features], logits x.shape[:-1], weight [out_features, in_features], bias
    [out_features] or None; float32, bfloat16 or float16 CUDA tensors of one dtype on one device
    -- or, under torch.autocast, whatever dtypes autocast hands the layer: then it computes what
    eager computes for the reference module (the blend in the promoted dtype, the GEMM in the
    autocast dtype, out in the autocast dtype); float32 parameters are cast inside, and autograd
    keeps the float32 weight for the backward rather than a cast copy. Differentiable in
    x, logits, weight and bias. straight_through=True takes the quantizer's gradient as the
    identity (the straight-through estimator); the default is the reference's zero gradient.
    allow_tf32=True runs float32 GEMMs on TF32 tensor cores.

    activation: None, "gelu", "gelu_tanh", "relu" or "silu" -- the layer computes F.gelu(x) (or
    F.gelu(x, approximate="tanh"), F.relu(x), F.silu(x)) itself, bit for bit as eager does and in
    x's dtype (also under autocast, as eager's activation), never storing it: the backward keeps
    x, the activation's input, and x's gradient is that of the activation's input.
    keep_mixed: keep `mixed` (tokens x in_features in the GEMM's dtype) for the backward's weight
    gradient (True, the default), or recompute it there from x and the stats, bit for bit (False:
    less memory between forward and backward for more work in the backward).

    Sharded x (tensor or sequence parallelism): with `process_group`, amax is the max over every
    rank's shard (all_reduce_amax), so each rank's `mixed` is its part of the unsharded layer's:
    with token shards the output rows are the unsharded layer's too; with feature shards (a
    row-parallel linear) the output is this shard's partial product, which the surrounding
    parallel layout sums (add the bias on one rank only); `amax_reduce`
    takes any other reduction (a callable given this shard's [amax, 0] float32 tensor, returning
    the reduced one). The backward needs no communication for amax, which is detached.
    """
    act = activation_name(activation)
    if process_group is None and amax_reduce is None:
        return torch.ops.qbl.forward(x, logits, weight, bias, None, act, keep_mixed,
                                     straight_through, allow_tf32)[0]
    if amax_reduce is None:
        def amax_reduce(stats):
            return all_reduce_amax(stats, process_group)
    # stats is detached, as the reference module's amax.
    stats = amax_reduce(torch.ops.qbl.local_amax(x.detach(), act))
    return torch.ops.qbl.forward(x, logits, weight, bias, stats, act, keep_mixed,
                                 straight_through, allow_tf32)[0]


def clear_cache() -> None:
    """Synchronizes the devices that hold qbl layers and frees every cached layer's plans (and
    the side streams on which backwards run wgrad beside dgrad, one per calling stream). The next
    call plans again. Not to be called while another thread runs qbl."""
    torch.ops.qbl.clear_cache()


_DTYPES = {"Float": torch.float32, "BFloat16": torch.bfloat16, "Half": torch.float16}


def cache_info() -> list[dict]:
    """One dict per cached layer: device; x_dtype, gemm_dtype and logits_dtype (torch dtypes);
    activation (None or its name); in/out features; tf32; backward (its backward plan is made);
    max_tokens (its token capacity); forward_workspace_bytes and backward_workspace_bytes (the
    most one call takes from torch's caching allocator, at max_tokens, for as long as it runs;
    with a float32 weight under autocast a call also holds the weight's cast, out_features x
    in_features x 2 bytes, and its backward with wgrad beside dgrad one more buffer of the bias's
    partial sums, out_features x 256 bytes)."""
    numbers, names = torch.ops.qbl.cache_info()
    keys = ("device", "in_features", "out_features", "tf32", "backward", "max_tokens",
            "forward_workspace_bytes", "backward_workspace_bytes")
    rows = []
    for layer in range(len(numbers) // len(keys)):
        row = dict(zip(keys, numbers[layer * len(keys):(layer + 1) * len(keys)]))
        row["tf32"] = bool(row["tf32"])
        row["backward"] = bool(row["backward"])
        dtypes, act = names[4 * layer:4 * layer + 3], names[4 * layer + 3]
        for k, name in zip(("x_dtype", "gemm_dtype", "logits_dtype"), dtypes):
            row[k] = _DTYPES.get(name, name)
        row["activation"] = None if act == "none" else act
        rows.append(row)
    return rows

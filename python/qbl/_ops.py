"""Fake implementations and autograd of torch.ops.qbl.forward / backward, and the functional
form. The operators themselves are registered in C++ (csrc/qbl_torch.cu)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["quant_blend_linear", "all_reduce_amax", "clear_cache", "cache_info"]


@torch.library.register_fake("qbl::forward")
def _forward_fake(x, logits, weight, bias, straight_through=False, allow_tf32=False):
    out = x.new_empty((*x.shape[:-1], weight.shape[0]))
    mixed = x.new_empty(x.shape)
    stats = x.new_empty((2,), dtype=torch.float32)
    return out, mixed, stats


@torch.library.register_fake("qbl::local_amax")
def _local_amax_fake(x):
    return x.new_empty((2,), dtype=torch.float32)


@torch.library.register_fake("qbl::forward_from_amax")
def _forward_from_amax_fake(x, logits, weight, bias, amax, straight_through=False,
                            allow_tf32=False):
    return _forward_fake(x, logits, weight, bias, straight_through, allow_tf32)


@torch.library.register_fake("qbl::backward")
def _backward_fake(grad_out, x, logits, weight, mixed, stats, has_bias, output_mask,
                   straight_through=False, allow_tf32=False):
    def maybe(want, shape):
        return x.new_empty(shape) if want else x.new_empty((0,))

    return (maybe(output_mask[0], x.shape), maybe(output_mask[1], logits.shape),
            maybe(output_mask[2], weight.shape),
            maybe(output_mask[3] and has_bias, (weight.shape[0],)))


def _setup_context(ctx, inputs, output):
    if len(inputs) == 7:  # forward_from_amax: the amax (detached, as in the module) between
        x, logits, weight, bias, _, straight_through, allow_tf32 = inputs
    else:
        x, logits, weight, bias, straight_through, allow_tf32 = inputs
    ctx.n_inputs = len(inputs)
    _, mixed, stats = output
    need = ctx.needs_input_grad
    # mixed (the one tensor this layer adds) only where grad_weight will read it.
    ctx.save_for_backward(x, logits, weight, mixed if need[2] else None, stats)
    ctx.has_bias = bias is not None
    ctx.straight_through = straight_through
    ctx.allow_tf32 = allow_tf32
    ctx.mark_non_differentiable(mixed, stats)


def _backward(ctx, grad_out, _grad_mixed, _grad_stats):
    x, logits, weight, mixed, stats = ctx.saved_tensors
    need = ctx.needs_input_grad
    if mixed is None:  # not saved: grad_weight is not wanted, so the operator does not read it
        mixed = x
    mask = [need[0], need[1], need[2], need[3] and ctx.has_bias]
    gx, gl, gw, gb = torch.ops.qbl.backward(grad_out, x, logits, weight, mixed, stats,
                                            ctx.has_bias, mask, ctx.straight_through,
                                            ctx.allow_tf32)
    grads = (gx if need[0] else None, gl if need[1] else None, gw if need[2] else None,
             gb if mask[3] else None)
    return grads + (None,) * (ctx.n_inputs - 4)


torch.library.register_autograd("qbl::forward", _backward, setup_context=_setup_context)


def _local_amax_backward(ctx, grad_stats):
    return None  # amax is detached in the module: no gradient reaches x through it


torch.library.register_autograd("qbl::local_amax", _local_amax_backward)
torch.library.register_autograd("qbl::forward_from_amax", _backward, setup_context=_setup_context)


def all_reduce_amax(stats: torch.Tensor, group=None) -> torch.Tensor:
    """The reduction between the two steps of a sharded forward, through torch.distributed:
    an integer MAX of amax's bits over `group`, in place. stats[0] (max |x|) has its sign bit
    clear, so its bits read as int32 order like the values, with NaN above +Inf: the integer max
    is the NaN-propagating float max (a float MAX all-reduce would drop NaN)."""
    torch.distributed.all_reduce(stats[:1].view(torch.int32), op=torch.distributed.ReduceOp.MAX,
                                 group=group)
    return stats


def quant_blend_linear(x: torch.Tensor, logits: torch.Tensor, weight: torch.Tensor,
                       bias: Optional[torch.Tensor] = None, straight_through: bool = False,
                       allow_tf32: bool = False, process_group=None,
                       amax_reduce: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
                       ) -> torch.Tensor:
    """out = (alpha * fake_quant(x) + (1 - alpha) * x) @ weight.T + bias, alpha = sigmoid(logits).

    x [..., in_features], logits x.shape[:-1], weight [out_features, in_features], bias
    [out_features] or None; float32, bfloat16 or float16 CUDA tensors on one device. Differentiable
    in x, logits, weight and bias. straight_through=True takes the quantizer's gradient as the
    identity (the straight-through estimator); the default is the reference's zero gradient.
    allow_tf32=True runs float32 GEMMs on TF32 tensor cores.

    Sharded x (tensor or sequence parallelism): with `process_group`, amax is the max over every
    rank's shard (all_reduce_amax), so each rank's `mixed` is its part of the unsharded layer's:
    with token shards the output rows are the unsharded layer's too; with feature shards (a
    row-parallel linear) the output is this shard's partial product, which the surrounding
    parallel layout sums (add the bias on one rank only); `amax_reduce`
    takes any other reduction (a callable given this shard's [amax, 0] float32 tensor, returning
    the reduced one). The backward needs no communication for amax, which is detached.
    """
    if process_group is None and amax_reduce is None:
        return torch.ops.qbl.forward(x, logits, weight, bias, straight_through, allow_tf32)[0]
    if amax_reduce is None:
        def amax_reduce(stats):
            return all_reduce_amax(stats, process_group)
    amax = amax_reduce(torch.ops.qbl.local_amax(x.detach()))  # amax is detached, as in the module
    return torch.ops.qbl.forward_from_amax(x, logits, weight, bias, amax, straight_through,
                                           allow_tf32)[0]


def clear_cache() -> None:
    """Synchronizes the devices that hold qbl layers and frees every cached layer (plans and
    workspaces). The next call plans again. A CUDA graph captured before reads the freed
    workspaces: capture again after clearing. Not to be called while another thread runs qbl."""
    torch.ops.qbl.clear_cache()


def cache_info() -> list[dict]:
    """One dict per cached layer: device, dtype, in/out features, tf32, backward (a training
    layer), max_tokens (its token capacity) and workspace_bytes (from torch's caching allocator)."""
    flat = torch.ops.qbl.cache_info()
    keys = ("device", "dtype", "in_features", "out_features", "tf32", "backward", "max_tokens",
            "workspace_bytes")
    codes = {5: torch.float16, 6: torch.float32, 15: torch.bfloat16}  # c10::ScalarType numbers
    rows = []
    for i in range(0, len(flat), len(keys)):
        row = dict(zip(keys, flat[i:i + len(keys)]))
        row["dtype"] = codes.get(row["dtype"], row["dtype"])
        row["tf32"] = bool(row["tf32"])
        row["backward"] = bool(row["backward"])
        rows.append(row)
    return rows


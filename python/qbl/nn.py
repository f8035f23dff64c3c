"""qbl.QuantBlendLinear: the layer as an nn.Module with nn.Linear's parameters."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from ._ops import KEEP_MIXED_DEFAULT, activation_name, quant_blend_linear

__all__ = ["QuantBlendLinear"]


class QuantBlendLinear(nn.Module):
    """y = Linear(alpha * fake_quant_int8(x) + (1 - alpha) * x), alpha = sigmoid(logits).

    Parameters `weight` [out_features, in_features] and `bias` [out_features] are nn.Linear's
    (same names, shapes and initialization), so a state dict moves between this module and an
    nn.Linear. forward(x, logits): x [..., in_features], logits x.shape[:-1].

    activation: None, "gelu", "gelu_tanh", "relu" or "silu": the layer applies F.gelu (...) to
    its input itself, y = Linear(blend(quant(act(x)))), bit for bit as F.gelu followed by the
    layer, and keeps x (the activation's input) for the backward, not act(x). keep_mixed: keep
    `mixed` for the backward (True, the default), or recompute it there from x (False).
    straight_through: the quantizer's gradient taken as the identity (the straight-through
    estimator); default False, the reference's zero gradient. allow_tf32: float32 GEMMs on TF32
    tensor cores (default False: exact float32, as PyTorch's default matmul). process_group: x is
    a shard and amax is reduced over the group (see qbl.quant_blend_linear).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None,
                 dtype=None, straight_through: bool = False, allow_tf32: bool = False,
                 process_group=None, activation: Optional[str] = None,
                 keep_mixed: bool = KEEP_MIXED_DEFAULT):
        super().__init__()
        activation_name(activation)  # ValueError for an unknown one, here rather than at a call
        factory = {"device": device, "dtype": dtype}
        self.in_features = in_features
        self.out_features = out_features
        self.activation = activation
        self.keep_mixed = keep_mixed
        self.straight_through = straight_through
        self.allow_tf32 = allow_tf32
        self.process_group = process_group
        self.weight = nn.Parameter(torch.empty((out_features, in_features), **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's initialization.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features > 0 else 0
            nn.init.uniform_(self.bias, -bound, bound)

    def forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        return quant_blend_linear(x, logits, self.weight, self.bias, self.straight_through,
                                  self.allow_tf32, process_group=self.process_group,
                                  activation=self.activation, keep_mixed=self.keep_mixed)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activation={self.activation}, "
                f"keep_mixed={self.keep_mixed}, straight_through={self.straight_through}, "
                f"allow_tf32={self.allow_tf32}")

"""qbl for PyTorch: the fused fake-quantize, blend and linear layer, forward and backward.

    import torch, qbl
    layer = qbl.QuantBlendLinear(in_features, out_features, bias=True, device="cuda",
                                 dtype=torch.bfloat16)
    y = layer(x, logits)          # x [..., in], logits x.shape[:-1]; weight, bias as nn.Linear
    y.sum().backward()            # grads for x, logits, weight and bias from qbl's backward
    y = qbl.quant_blend_linear(x, logits, weight, bias, straight_through=False)

computes, bit for bit as PyTorch eager up to the GEMM,

    alpha = sigmoid(logits); amax = max |x|; scale = clamp(amax, 1e-8) / 127
    mixed = alpha * clamp(round(x / scale), -127, 127) * scale + (1 - alpha) * x
    out   = mixed @ weight.T + bias

The operators are torch.ops.qbl.forward and torch.ops.qbl.backward (registered in C++ with their
autograd formula and autocast behaviour; their fake implementations are registered here), so
torch.compile(fullgraph=True) traces through them and CUDA graphs capture them.
"""

import torch  # noqa: F401  (first: loads the libraries qbl._C links against)

from . import _C  # noqa: F401  (registers torch.ops.qbl.*)
from ._ops import all_reduce_amax, cache_info, clear_cache, quant_blend_linear
from .nn import QuantBlendLinear

__all__ = ["QuantBlendLinear", "quant_blend_linear", "all_reduce_amax", "clear_cache",
           "cache_info"]

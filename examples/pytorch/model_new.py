"""``ModelNew``: ``reference.Model`` with its forward and backward computed by qbl.

    import torch, qbl                      # pip install --no-build-isolation ./python
    from model_new import ModelNew
    model = ModelNew(d_model).cuda()
    model.load_state_dict(reference_model.state_dict())   # same parameters, same names
    y = model(x, layout_logits)                           # x [B, T, D], logits [B, T]
    y.backward(grad)                                      # grads for x, logits and out_proj

The constructor and the parameters are those of ``Model`` (``self.out_proj = nn.Linear(d_model,
d_model)``), so state dicts load both ways. ``forward`` is ``qbl.quant_blend_linear`` over
``out_proj.weight`` / ``out_proj.bias``: trainable, through qbl's backward, and traceable by
``torch.compile``. Set ``straight_through = True`` on an instance for the straight-through
quantizer gradient (``reference.ModelSTE``), ``allow_tf32 = True`` for float32 GEMMs on TF32
tensor cores.
"""

from __future__ import annotations

import torch
import torch.nn as nn

import qbl


class ModelNew(nn.Module):
    """``reference.Model`` computed by ``qbl.quant_blend_linear``."""

    #: The quantizer's gradient taken as the identity (reference.ModelSTE); False: zero (Model).
    straight_through: bool = False
    #: float32 GEMMs on TF32 tensor cores (as torch.backends.cuda.matmul.allow_tf32 = True).
    allow_tf32: bool = False

    def __init__(self, d_model: int):
        super().__init__()
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, layout_logits: torch.Tensor) -> torch.Tensor:
        return qbl.quant_blend_linear(x, layout_logits, self.out_proj.weight, self.out_proj.bias,
                                      straight_through=self.straight_through,
                                      allow_tf32=self.allow_tf32)

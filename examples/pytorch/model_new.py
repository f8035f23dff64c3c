"""``ModelNew``: a drop-in for ``reference.Model`` that runs the layer through qbl.

    from model_new import ModelNew
    model = ModelNew(d_model).cuda()
    model.load_state_dict(reference_model.state_dict())   # same parameters, same names
    y = model(x, layout_logits)                           # x [B, T, D], logits [B, T]

The constructor and the parameters are those of ``Model`` (``self.out_proj = nn.Linear(d_model,
d_model)``), so state dicts load both ways. ``forward`` hands ``x``, the logits and
``out_proj.weight`` / ``out_proj.bias`` to the qbl extension (``qbl_ext.load().forward``), which
computes amax, the fake-quantize + blend (bit for bit as eager fp32) and the Linear (cuBLASLt)
on the current CUDA stream.

Inference only: the extension records no autograd graph, so ``forward`` behaves as if it ran
under ``torch.no_grad()`` whatever the grad mode -- the output never requires grad and no
gradient reaches ``x`` or ``out_proj``. Train with ``reference.Model`` (same state dict).

Limits: float32, bfloat16 or float16 CUDA tensors only (``TypeError`` / ``RuntimeError`` otherwise); non-contiguous
inputs are made contiguous first. The GEMM is exact fp32 (no TF32) unless ``allow_tf32`` is set
to True on the instance (the counterpart of ``torch.backends.cuda.matmul.allow_tf32``).
One process-wide qbl layer per (device, d_model, dtype) serves every ``ModelNew`` of that size:
it holds workspace for the largest token count seen so far (rounded up to a power of two),
allocated with cudaMalloc outside torch's caching allocator. Do not run the same size
concurrently on two CUDA streams (the layer's ``mixed`` buffer is shared).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn as nn

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import qbl_ext  # noqa: E402


class ModelNew(nn.Module):
    """``reference.Model`` with its forward computed by qbl (inference only, see module doc)."""

    #: Run the GEMM with TF32 tensor cores (torch.backends.cuda.matmul.allow_tf32 = True).
    allow_tf32: bool = False

    def __init__(self, d_model: int):
        super().__init__()
        self.out_proj = nn.Linear(d_model, d_model)
        qbl_ext.load()  # build / load the extension now rather than inside the first forward

    def forward(self, x: torch.Tensor, layout_logits: torch.Tensor) -> torch.Tensor:
        ext = qbl_ext.load()  # cached module after the first call
        return ext.forward(x.contiguous(), layout_logits.contiguous(),
                           self.out_proj.weight.contiguous(), self.out_proj.bias,
                           self.allow_tf32)

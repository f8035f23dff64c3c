"""The PyTorch reference layer that qbl reproduces: ``Model`` (the quantizer's gradient is zero,
as torch.round's), ``ModelSTE`` (straight-through quantizer gradient), the benchmark shapes
``BENCH_SHAPES`` (B, T, D) and ``get_inputs``."""
import torch
import torch.nn as nn


def _fake_quant_symmetric_int8(x, scale):
    return torch.clamp(torch.round(x / scale), -127, 127) * scale


class Model(nn.Module):
    def __init__(self, d_model: int):
        super().__init__()
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(self, x, layout_logits):
        alpha = torch.sigmoid(layout_logits).unsqueeze(-1)
        amax = x.detach().abs().max().clamp(min=1e-8)
        scale = amax / 127.0
        x_q = _fake_quant_symmetric_int8(x, scale)
        mixed = alpha * x_q + (1.0 - alpha) * x
        return self.out_proj(mixed)


class _FakeQuantSTE(torch.autograd.Function):
    """Forward: exactly _fake_quant_symmetric_int8. Backward: the gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x, scale):
        return _fake_quant_symmetric_int8(x, scale)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ModelSTE(Model):
    """Model's forward, bit for bit; the fake quantizer passes gradients straight through."""

    def forward(self, x, layout_logits):
        alpha = torch.sigmoid(layout_logits).unsqueeze(-1)
        amax = x.detach().abs().max().clamp(min=1e-8)
        scale = amax / 127.0
        x_q = _FakeQuantSTE.apply(x, scale)
        mixed = alpha * x_q + (1.0 - alpha) * x
        return self.out_proj(mixed)


# The benchmark table (B, T, D): small/launch-bound, memory-heavy, balanced, GEMM-bound.
BENCH_SHAPES = [(1, 8, 1024), (16, 512, 512), (64, 512, 256), (128, 128, 768),
                (32, 1024, 1024), (8, 2048, 2048), (4, 4096, 4096)]


def get_inputs(b=16, t=512, d=512, dtype=torch.float32, device="cuda"):
    return [torch.randn(b, t, d, dtype=dtype, device=device),
            torch.randn(b, t, dtype=dtype, device=device)]

# examples/pytorch/reference.py -- the PyTorch reference layer that qbl reproduces (eager fp32).
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
BENCH_SHAPES = [(1, 8, 1024), (16, 512, 512), (64, 512, 256), (128, 128, 768),
                (32, 1024, 1024), (8, 2048, 2048), (4, 4096, 4096)]
def get_inputs(b=16, t=512, d=512, dtype=torch.float32, device="cuda"):
    return [torch.randn(b, t, d, dtype=dtype, device=device),
            torch.randn(b, t, dtype=dtype, device=device)]

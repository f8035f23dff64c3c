"""The CPU kernels against the CUDA kernels. Each computes its own device's eager arithmetic bit for
bit (test_forward, test_backward, test_activation), so the two agree with each other exactly where
eager's CPU and CUDA kernels agree, and these tests check that on the same inputs. Where eager's
two devices differ, and why (each difference is asserted below, so that the list stays true):

- the scale: eager's CPU kernel divides `amax / 127.0`, its CUDA kernel multiplies by fl(1/127);
  in float32 the two differ for some amax (and then nearly every element of `mixed` can differ),
  never for a power of two; in bfloat16 and float16 they agree for every amax;
- the sigmoid: eager's CPU computes exp with Sleef (the vectorized body of its loop) or the C
  library (the scalar tail), its CUDA kernel with CUDA's expf, so a float32 alpha can differ in the
  last place;
- the activations: erf, tanh and exp from different libraries, so GELU, tanh-GELU and SiLU can
  differ in the last place; ReLU of -0.0 is -0.0 on the CPU and +0.0 on CUDA.

The inputs are drawn so that max |act(x)| is a power of two (the scales agree) and the rest is
left to chance; every test asserts that the agreeing part is most of the tensor, so that it compares
something.
"""

from __future__ import annotations

import helpers as H

import pytest
import torch
import torch.nn.functional as F

import qbl

pytestmark = pytest.mark.cuda

ACTS = {None: lambda h: h, "gelu": F.gelu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
        "relu": F.relu, "silu": F.silu}
ACT_PARAMS = [pytest.param(a, id=a or "none") for a in ACTS]


def _power_of_two_amax(x):
    """x scaled into [-28, 28] with one element set to 32: max |act(x)| = 32 for every activation
    (GELU, tanh-GELU and SiLU of 32 round to 32 in every dtype; none is above 28 elsewhere), a
    power of two, whose scale eager's CPU and CUDA kernels round alike."""
    x = x.float()
    x = x / x.abs().max() * 28.0
    x.view(-1)[7] = 32.0
    return x


def _same(a, b):
    ints = H._BITS[a.dtype][0]
    return (a.view(ints) == b.view(ints)) | (torch.isnan(a) & torch.isnan(b))


def _agreeing(a_cpu, a_cuda, what, at_least=0.5):
    """The elements where eager's CPU and CUDA values are the same bits; at least `at_least` of
    all, so that a test over them checks something."""
    agree = _same(a_cpu, a_cuda.cpu())
    share = agree.float().mean().item()
    assert share >= at_least, f"{what}: eager's CPU and CUDA agree on {share:.1%} only"
    return agree


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("act", ACT_PARAMS)
def test_mixed_equal_where_eagers_devices_agree(act, dtype, cuda_device):
    x, l, w, b = H.make_inputs((6, 64), 256, 48, torch.float32, "cpu", seed=900)
    x, l, w, b = _power_of_two_amax(x).to(dtype), l.to(dtype), w.to(dtype), b.to(dtype)
    name = act or "none"
    eager = {d: H.eager_forward(ACTS[act](x.to(d)), l.to(d), w.to(d), b.to(d)).mixed
             for d in ("cpu", cuda_device)}
    got = {d: torch.ops.qbl.forward(x.to(d), l.to(d), w.to(d), b.to(d), activation=name)[1]
           for d in ("cpu", cuda_device)}
    for d in got:
        H.assert_bits_equal(got[d], eager[d], f"{name} {dtype}: qbl's mixed vs eager's on {d}")
    agree = _agreeing(eager["cpu"], eager[cuda_device], f"{name} {dtype}: eager's mixed")
    H.assert_bits_equal(got["cpu"][agree], got[cuda_device].cpu()[agree],
                        f"{name} {dtype}: qbl's CPU vs CUDA mixed where eager's devices agree")


def _scales_differ(amax, dtype):
    """Do eager's CPU rounding (amax / 127) and CUDA rounding (amax * fl(1/127)) of the scale
    differ for these amax values of `dtype` (each rounded to the dtype, as eager stores it)?"""
    inv = torch.tensor(1.0 / 127.0, dtype=torch.float32)
    ints = H._BITS[dtype][0]
    return (amax.float() / 127.0).to(dtype).view(ints) != (amax.float() * inv).to(dtype).view(ints)


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_stats_equal_and_the_scales_differ_as_eagers(dtype, cuda_device):
    """amax is the same bits on both devices; the scale is each device's eager rounding of
    amax / 127. In float32 the two roundings differ for some amax (the first one in [1, 2) is
    used); in bfloat16 and float16 they agree for every finite amax (checked over all of them),
    so the 16-bit scales are equal on both devices."""
    x, l, w, b = H.make_inputs((5, 7), 32, 16, dtype, "cpu", seed=901)
    amaxes = [4.0, 1.0 + 3.0 / 128]
    if dtype == torch.float32:
        grid = torch.arange(1.0, 2.0, 1.0 / 4096)
        separating = grid[_scales_differ(grid, dtype)]
        assert separating.numel() > 0, "no float32 amax in [1, 2) separates the two roundings"
        amaxes[1] = separating[0].item()
    else:
        ints = torch.arange(1, 0x7f80 if dtype == torch.bfloat16 else 0x7c00, dtype=torch.int32)
        every = ints.to(torch.int16).view(dtype)
        n = int(_scales_differ(every, dtype).sum())
        assert n == 0, f"{dtype}: {n} finite amax values whose CPU and CUDA scales differ"
    for amax in amaxes:
        xs = x.float() / x.float().abs().max() * (amax * 0.75)
        xs.view(-1)[3] = amax
        xs = xs.to(dtype)
        stats = {d: torch.ops.qbl.forward(xs.to(d), l.to(d), w.to(d), b.to(d))[2].cpu()
                 for d in ("cpu", cuda_device)}
        eager = {d: H.eager_stats(H.eager_forward(xs.to(d), l.to(d), w.to(d), b.to(d))).cpu()
                 for d in ("cpu", cuda_device)}
        for d in stats:
            H.assert_bits_equal(stats[d], eager[d], f"amax {amax}: stats vs eager's on {d}")
        H.assert_bits_equal(stats["cpu"][0], stats[cuda_device][0], f"amax {amax}: CPU vs CUDA")
        expect_same = amax == 4.0 or dtype != torch.float32
        same_scale = bool(_same(stats["cpu"][1:], stats[cuda_device][1:]).all())
        assert same_scale == expect_same, (
            f"amax {amax}: CPU scale {stats['cpu'][1].item()!r}, CUDA scale "
            f"{stats[cuda_device][1].item()!r}; expected {'equal' if expect_same else 'different'}")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("ste", [False, True], ids=["zero_grad", "straight_through"])
def test_grad_x_equal_where_the_gates_agree(ste, dtype, cuda_device):
    """W = I makes g_mixed = grad_out exactly on both devices, so grad_x is the blend's backward
    alone: equal bits on every token whose alpha (eager's sigmoid) is the same on both devices."""
    d = 64
    x, l, _, _ = H.make_inputs((3, 40), d, d, torch.float32, "cpu", seed=902)
    x, l = _power_of_two_amax(x).to(dtype), l.to(dtype)
    w, b = H.identity_layer_params(d, dtype, "cpu")
    g = H.make_grad_out((3, 40, d), dtype, "cpu", seed=903)
    grads = {dev: H.run_autograd(H.qbl_fn(ste), *(t.to(dev) for t in (x, l, w, b)), g.to(dev))
             for dev in ("cpu", cuda_device)}
    gates = _agreeing(torch.sigmoid(l), torch.sigmoid(l.to(cuda_device)), f"{dtype}: sigmoid")
    H.assert_bits_equal(grads["cpu"].x[gates], grads[cuda_device].x.cpu()[gates],
                        f"{dtype}: grad_x on the CPU vs CUDA where the gates agree")

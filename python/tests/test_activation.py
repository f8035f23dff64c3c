"""The input activation (activation="gelu" / "gelu_tanh" / "relu" / "silu") against eager: the layer
computes the reference module fed with eager's F.gelu / F.gelu(approximate="tanh") / F.relu /
F.silu output, bit for bit up to the GEMM, and its gradient of the activation's input is eager's
activation backward applied to grad_x -- over every value of each 16-bit type, and over special
and random float32 values. Also: the backward that recomputes `mixed` (keep_mixed=False) gives
the gradients of the one that keeps it, bit for bit.

With logits = -1e4, alpha = sigmoid(logits) is exactly 0, so mixed = 0 * x_q + 1 * act(h) is
act(h) itself, bit for bit; and with weight = I, grad_x = grad_out exactly, so h's gradient is
the activation's backward of grad_out itself: the tests below see act's and act's backward's bits
directly, and with random logits the whole blend on top of them.

Every test runs on the CPU and on CUDA (the `device` fixture), against eager on the same device.
On the CPU, whose kernel calls eager's own activation, its backward, GEMMs and bias sum on the
same tensors, the layer is also eager's unfused activation + reference module bit for bit in out,
grad_weight and grad_bias.
"""

from __future__ import annotations

import pytest

import helpers as H
from helpers import torch, qbl

ACTIVATIONS = {a: f for a, f in H.ACTIVATIONS.items() if a != "none"}
ACT_PARAMS = [pytest.param(a, id=a) for a in ACTIVATIONS]
DTYPES16 = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]
WIDTH = 256


def _every_value(dtype, device):
    """Every finite value of a 16-bit dtype, as [rows, WIDTH] (the count is a multiple of 256)."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16)
    h = bits.view(dtype)
    h = h[torch.isfinite(h)]
    assert h.numel() % WIDTH == 0
    return h.view(-1, WIDTH)


def _eager_layer(act, h, logits, weight, bias=None, straight_through=False):
    """The reference: eager's activation, then the reference module op by op."""
    return H.eager_forward(ACTIVATIONS[act](h), logits, weight, bias, straight_through)


def _qbl_forward(act, h, logits, weight, bias=None):
    out, mixed, stats = torch.ops.qbl.forward(h, logits, weight, bias, activation=act)
    return out, mixed, stats


def _without_overflowing_activation(act, h):
    """h with 0 where eager's act(h) is +-Inf for a finite h -- on the CPU, eager's F.gelu of
    |h| >= 2^127 (it forms h * (1 + erf(h / sqrt 2)) before halving, which overflows; CUDA's
    F.gelu and the other activations stay finite there). One such element makes amax Inf, so
    x_q and mixed are NaN everywhere, in eager's mixed as in qbl's: to see act's bits and the
    blend's, the tests feed those elements as 0 (the other elements keep their positions, so
    their bits are the same act call's). h itself where nothing overflows (CUDA)."""
    overflow = torch.isinf(ACTIVATIONS[act](h)) & torch.isfinite(h)
    if not bool(overflow.any()):
        return h
    assert bool((h[overflow].abs() >= 2.0 ** 127).all()), (
        f"eager's {act} overflows below 2^127 at h = {h[overflow & (h.abs() < 2.0 ** 127)][:4]}")
    return h.masked_fill(overflow, 0.0)


def _randn(shape, gen, device, std=1.0, dtype=torch.float32):
    """Normal values from a seeded CPU generator (the same on every device), on `device`."""
    return (torch.randn(shape, generator=gen) * std).to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("act", ACT_PARAMS)
def test_every_16bit_value_forward(act, dtype, device):
    """act(h) for every finite value of the dtype, bit for bit eager's on the same device (alpha
    = 0: mixed is act(h)); then the blend with random logits bit for bit the reference module's
    on eager's activation output, and stats too (on the CPU out as well: eager's F.linear). Where
    eager's act overflows to Inf (the CPU's gelu of bf16's values >= 2^127), mixed and stats of
    every value are eager's (NaN everywhere), and the checks of act's bits and of the blend feed
    0 in place of those values (_without_overflowing_activation)."""
    h = _every_value(dtype, device)
    w, _ = H.identity_layer_params(WIDTH, dtype, device)
    closed = torch.full(h.shape[:-1], -1e4, dtype=dtype, device=h.device)
    _, mixed, stats = _qbl_forward(act, h, closed, w)
    e = _eager_layer(act, h, closed, w)
    H.assert_bits_equal(mixed, e.mixed, f"mixed of {act}(h) with alpha = 0 vs eager's")
    H.assert_bits_equal(stats, H.eager_stats(e), f"stats of {act}(h) with alpha = 0 vs eager's")
    finite_h = _without_overflowing_activation(act, h)
    if finite_h is not h:
        h = finite_h
        _, mixed, _ = _qbl_forward(act, h, closed, w)
        e = _eager_layer(act, h, closed, w)
        H.assert_bits_equal(mixed, e.mixed, f"mixed of {act}(h), no overflow, alpha = 0")
    # With alpha = 0, eager's mixed is act(h) itself wherever x_q is finite (in fp16 the top
    # codes' 127 * scale overflows to Inf near 65504, and 0 * Inf is NaN in eager's mixed too):
    # there the comparison above is one of act(h)'s bits.
    act_h = ACTIVATIONS[act](h)
    finite_q = torch.isfinite(e.x_q)
    assert finite_q.float().mean().item() > 0.99, "x_q overflowed almost everywhere"
    H.assert_bits_equal(mixed[finite_q], act_h[finite_q], f"{act}(h) (as mixed, alpha = 0)")
    logits = _randn(h.shape[:-1], torch.Generator().manual_seed(3), device, 2.0, dtype)
    out, mixed, stats = _qbl_forward(act, h, logits, w)
    e = _eager_layer(act, h, logits, w)
    H.assert_bits_equal(mixed, e.mixed, f"mixed of {act}(h) vs eager's")
    H.assert_bits_equal(stats, H.eager_stats(e), f"stats of {act}(h) vs eager's")
    if device.type == "cpu":
        H.assert_bits_equal(out, e.out, f"out of {act}(h) vs eager's F.linear (CPU)")


@pytest.mark.parametrize("dtype", DTYPES16)
@pytest.mark.parametrize("act", ACT_PARAMS)
def test_every_16bit_value_backward(act, dtype, device):
    """The gradient of h for every finite value of the dtype: eager's activation backward of
    grad_x on the same device, bit for bit -- with alpha = 0 (grad_x = grad_out) and with random
    logits (on the CPU out too: eager's F.linear). Every value, those whose act overflows
    included: the CPU's gelu of bf16's values >= 2^127 is Inf, so amax is Inf and mixed and
    grad_logits are NaN everywhere, in eager as in qbl, while the gradient of h stays finite."""
    h = _every_value(dtype, device)
    w, _ = H.identity_layer_params(WIDTH, dtype, device)
    g = H.make_grad_out(h.shape, dtype, device, seed=5)
    gen = torch.Generator().manual_seed(4)
    for name, logits in (
            ("alpha = 0", torch.full(h.shape[:-1], -1e4, dtype=dtype, device=h.device)),
            ("random logits", _randn(h.shape[:-1], gen, device, 2.0, dtype))):
        q = H.run_autograd(lambda x, l, w_, b: qbl.quant_blend_linear(x, l, w_, b, activation=act),
                           h, logits, w, None, g, want=(True, True, False, False))
        e = H.run_autograd(lambda x, l, w_, b: _eager_layer(act, x, l, w_, b).out,
                           h, logits, w, None, g, want=(True, True, False, False))
        H.assert_bits_equal(q.x, e.x, f"grad of h through {act}, {name}")
        H.assert_same_nonfinite(q.logits, e.logits, f"grad_logits through {act}, {name}")
        if device.type == "cpu":
            H.assert_bits_equal(q.out, e.out, f"out through {act}, {name} (CPU)")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("act", ACT_PARAMS)
def test_nonfinite_inputs_as_eager(act, dtype, device):
    """An Inf or NaN among h: mixed, stats and the gradient of h as eager's (NaN where eager's is
    NaN), each special value on its own and -0.0 among them."""
    w, _ = H.identity_layer_params(WIDTH, dtype, device)
    gen = torch.Generator().manual_seed(6)
    base = _randn((3, WIDTH), gen, device, 3.0, dtype)
    logits = _randn((3,), gen, device, 2.0, dtype)
    g = H.make_grad_out(base.shape, dtype, device, seed=7)
    for special in (float("inf"), float("-inf"), float("nan"), -0.0):
        h = base.clone()
        h[1, 7] = special
        h[2, 0] = -0.0
        _, mixed, stats = _qbl_forward(act, h, logits, w)
        e = _eager_layer(act, h, logits, w)
        H.assert_bits_equal(mixed, e.mixed, f"mixed, {act} of {special}")
        H.assert_bits_equal(stats, H.eager_stats(e), f"stats, {act} of {special}")
        q = H.run_autograd(lambda x, l, w_, b: qbl.quant_blend_linear(x, l, w_, b, activation=act),
                           h, logits, w, None, g, want=(True, False, False, False))
        r = H.run_autograd(lambda x, l, w_, b: _eager_layer(act, x, l, w_, b).out,
                           h, logits, w, None, g, want=(True, False, False, False))
        H.assert_bits_equal(q.x, r.x, f"grad of h, {act} of {special}")


@pytest.mark.parametrize("act", ACT_PARAMS)
def test_fp32_special_and_random_values(act, device):
    """float32: h random over several scales with special finite values planted; act(h) (alpha
    = 0) and the gradient of h (weight = I) bit for bit eager's on the same device. Where eager's
    act overflows to Inf (the CPU's gelu of +-3e38), mixed is eager's (NaN everywhere), and
    act's bits are checked with 0 in place of those values (_without_overflowing_activation)."""
    dtype = torch.float32
    gen = torch.Generator().manual_seed(8)
    h = torch.cat([torch.randn(64, WIDTH, generator=gen) * s for s in (1e-3, 1.0, 3.0, 30.0)])
    specials = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-40, -1e-40, 5.0, -5.0, 80.0, -80.0,
                             1e4, -1e4, 3e38, -3e38])
    h.view(-1)[:specials.numel()] = specials
    h = h.to(device)
    w, _ = H.identity_layer_params(WIDTH, dtype, device)
    closed = torch.full(h.shape[:-1], -1e4, dtype=dtype, device=h.device)
    _, mixed, _ = _qbl_forward(act, h, closed, w)
    H.assert_bits_equal(mixed, _eager_layer(act, h, closed, w).mixed, "mixed vs eager's")
    finite_h = _without_overflowing_activation(act, h)
    if finite_h is not h:
        _, mixed, _ = _qbl_forward(act, finite_h, closed, w)
    H.assert_bits_equal(mixed, ACTIVATIONS[act](finite_h),
                        f"{act}(h) float32 (as mixed, alpha = 0)")
    g = H.make_grad_out(h.shape, dtype, device, seed=9)
    q = H.run_autograd(lambda x, l, w_, b: qbl.quant_blend_linear(x, l, w_, b, activation=act),
                       h, closed, w, None, g, want=(True, False, False, False))
    e = H.run_autograd(lambda x, l, w_, b: _eager_layer(act, x, l, w_, b).out,
                       h, closed, w, None, g, want=(True, False, False, False))
    H.assert_bits_equal(q.x, e.x, f"grad of h through {act}, float32")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("act", [pytest.param(None, id="none")] + ACT_PARAMS)
@pytest.mark.parametrize("lead,n_in,n_out,bias", H.SMALL_SHAPES)
def test_recomputed_mixed_gives_the_kept_gradients(lead, n_in, n_out, bias, act, dtype, device):
    """keep_mixed=False (the backward recomputes mixed from h and the stats) against
    keep_mixed=True: every gradient bit for bit, and the forward unchanged."""
    x, l, w, b = H.make_inputs(lead, n_in, n_out, dtype, device, bias=bias, seed=10)
    g = H.make_grad_out((*lead, n_out), dtype, device, seed=11)

    def fn(keep):
        return lambda x_, l_, w_, b_: qbl.quant_blend_linear(x_, l_, w_, b_, activation=act,
                                                             keep_mixed=keep)

    kept = H.run_autograd(fn(True), x, l, w, b, g)
    recomputed = H.run_autograd(fn(False), x, l, w, b, g)
    H.assert_bits_equal(recomputed.out, kept.out, "out")
    for name in ("x", "logits", "weight", "bias"):
        if getattr(kept, name) is not None:
            H.assert_bits_equal(getattr(recomputed, name), getattr(kept, name), f"grad of {name}")
    # Only the weight gradient wanted: mixed is recomputed without dgrad.
    kept_w = H.run_autograd(fn(True), x, l, w, b, g, want=(False, False, True, False))
    rec_w = H.run_autograd(fn(False), x, l, w, b, g, want=(False, False, True, False))
    H.assert_bits_equal(rec_w.weight, kept_w.weight, "grad of weight alone")


@pytest.mark.parametrize("act", ACT_PARAMS)
def test_activation_against_the_unfused_layer(act, device):
    """The fused activation equals F.<act> followed by qbl's plain layer: out and every gradient
    (float32, fresh random inputs)."""
    x, l, w, b = H.make_inputs((4, 33), 96, 40, torch.float32, device, seed=12)
    g = H.make_grad_out((4, 33, 40), torch.float32, device, seed=13)
    fused = H.run_autograd(lambda x_, l_, w_, b_: qbl.quant_blend_linear(x_, l_, w_, b_,
                                                                          activation=act),
                           x, l, w, b, g)
    plain = H.run_autograd(lambda x_, l_, w_, b_: qbl.quant_blend_linear(ACTIVATIONS[act](x_), l_,
                                                                          w_, b_),
                           x, l, w, b, g)
    for name in ("out", "x", "logits", "weight", "bias"):
        H.assert_bits_equal(getattr(fused, name), getattr(plain, name), name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act", ACT_PARAMS)
@pytest.mark.parametrize("lead,n_in,n_out,bias", H.SMALL_SHAPES)
def test_cpu_fused_activation_is_eagers_unfused_layer(lead, n_in, n_out, bias, act, dtype):
    """On the CPU the fused layer is eager's F.<act> followed by the reference module, bit for
    bit: mixed and out of the forward, and through autograd out, the gradient of the
    activation's input, grad_weight and grad_bias (eager's activation, its backward, F.linear,
    mm and sum, called by the CPU kernel on the same tensors as eager calls them); grad_logits,
    summed in double by the kernel, within twice eager's error of float64 plus one rounding. In
    both quantizer-gradient modes, with kept and with recomputed mixed."""
    device = torch.device("cpu")
    x, l, w, b = H.make_inputs(lead, n_in, n_out, dtype, device, bias=bias, seed=17)
    g = H.make_grad_out((*lead, n_out), dtype, device, seed=18)
    for ste in (False, True):
        out, mixed, stats = torch.ops.qbl.forward(x, l, w, b, activation=act, straight_through=ste)
        with torch.no_grad():
            fwd = _eager_layer(act, x, l, w, b, straight_through=ste)
        H.assert_bits_equal(mixed, fwd.mixed, f"mixed, ste {ste}")
        H.assert_bits_equal(stats, H.eager_stats(fwd), f"stats, ste {ste}")
        H.assert_bits_equal(out, fwd.out, f"out, ste {ste}")
        e = H.run_autograd(lambda x_, l_, w_, b_: _eager_layer(act, x_, l_, w_, b_, ste).out,
                           x, l, w, b, g)
        r = H.ref64_grads(ACTIVATIONS[act](x), l, w, fwd, g, straight_through=ste)
        for keep in (True, False):
            q = H.run_autograd(
                lambda x_, l_, w_, b_: qbl.quant_blend_linear(
                    x_, l_, w_, b_, straight_through=ste, activation=act, keep_mixed=keep),
                x, l, w, b, g)
            what = f"ste {ste}, keep_mixed {keep}: "
            for name in ("out", "x", "weight", "bias"):
                if getattr(e, name) is None:
                    assert getattr(q, name) is None, f"{what}grad_{name} should be None"
                    continue
                H.assert_bits_equal(getattr(q, name), getattr(e, name),
                                    f"{what}{name} vs eager's unfused layer")
            H.assert_norm_within_eager(q.logits, e.logits, r.logits, dtype, f"{what}grad_logits")


def test_module_and_errors(device):
    """The module carries the activation and keep_mixed; an unknown activation is a ValueError
    naming the choices, raised before anything runs."""
    layer = qbl.QuantBlendLinear(64, 32, activation="silu", keep_mixed=False, device=device)
    assert layer.activation == "silu" and layer.keep_mixed is False
    assert "activation=silu" in repr(layer) and "keep_mixed=False" in repr(layer)
    x, l, _, _ = H.make_inputs((5,), 64, 32, torch.float32, device, seed=14)
    H.assert_bits_equal(layer(x, l),
                        qbl.quant_blend_linear(x, l, layer.weight, layer.bias, activation="silu"),
                        "module vs functional")
    with pytest.raises(ValueError, match="gelu"):
        qbl.quant_blend_linear(x, l, layer.weight, layer.bias, activation="tanh")
    with pytest.raises(ValueError, match="activation"):
        qbl.QuantBlendLinear(64, 32, activation="elu")


#: (autocast dtype A, x's dtype): x float32 (a LayerNorm's output under autocast) or A, the
#: logits in A (a gate Linear's output), the parameters float32: the fused combinations.
AUTOCAST_CASES = [
    pytest.param(torch.bfloat16, torch.float32, id="bf16-x_fp32"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16-x_bf16"),
    pytest.param(torch.float16, torch.float32, id="fp16-x_fp32"),
    pytest.param(torch.float16, torch.float16, id="fp16-x_fp16"),
]


@pytest.mark.parametrize("ac,x_dtype", AUTOCAST_CASES)
@pytest.mark.parametrize("act", ACT_PARAMS)
def test_autocast_runs_the_activation_in_its_input_dtype(act, ac, x_dtype, device):
    """Under autocast(A) (CUDA's or the CPU's; A = bf16 or fp16, both of which torch's CPU
    autocast supports), x float32 or A, logits in A, float32 parameters: eager runs the
    activation in its input's dtype (none of F.gelu / F.relu / F.silu is on autocast's lists),
    then the reference module under autocast; qbl computes the same. Against eager's activation
    followed by the reference module under the same autocast: mixed bit for bit (eager's
    mixed.to(A), the GEMM operand) and the stats; out in A (on the CPU eager's bits); the
    gradient of h bit for bit (eager's activation backward of grad_x; with this general weight
    that also takes g_mixed to be eager's bits: on the CPU it is eager's own mm, on CUDA qbl's
    dgrad GEMM, which gave cuBLAS's bits in the bf16 cases on the H200,
    benchmarks/tests_h200_107d64f.txt); the other
    gradients as H.check_autocast_grads holds them (eager's dtypes; grad_logits, grad_weight and
    grad_bias within their bounds of float64; on the CPU eager's bits)."""
    x, l, w, b = H.make_inputs((3, 40), 128, 64, torch.float32, device, seed=15)
    x, l = x.to(x_dtype), l.to(ac)  # the gate Linear's output under autocast
    with torch.autocast(device.type, dtype=ac):
        out, mixed, stats = torch.ops.qbl.forward(x, l, w, b, activation=act)
        e = H.eager_forward(ACTIVATIONS[act](x), l, w, b)
    H.assert_bits_equal(mixed, e.mixed.to(ac), "mixed under autocast")
    H.assert_bits_equal(stats, H.eager_stats(e), "stats under autocast")
    assert out.dtype == e.out.dtype == ac, f"out dtype {out.dtype}, eager's {e.out.dtype}"
    if device.type == "cpu":
        H.assert_bits_equal(out, e.out, "out under autocast vs eager's (CPU)")
    g = H.make_grad_out(out.shape, ac, device, seed=16)

    def run(fn):
        with torch.autocast(device.type, dtype=ac):
            return H.run_autograd(fn, x, l, w, b, g)

    q = run(lambda x_, l_, w_, b_: qbl.quant_blend_linear(x_, l_, w_, b_, activation=act))
    r = run(lambda x_, l_, w_, b_: H.eager_forward(ACTIVATIONS[act](x_), l_, w_, b_).out)
    H.assert_bits_equal(q.x, r.x, "grad of h under autocast")
    H.check_autocast_grads(q, r, ACTIVATIONS[act](x), l, w, e, g, ac)

"""Shared helpers of the qbl tests: input makers, the eager reference computed op by op, float64
references, bit-exact comparisons and the tolerance checks. Every input maker takes the device
(the `device` fixture of conftest.py: the CPU, or CUDA).

The references here never use qbl: the eager forward is examples/pytorch/reference.py's arithmetic,
op by op, in the tensors' dtype and on their device, and the float64 references are plain float64
products and sums.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F

import qbl

# examples/pytorch/reference.py: the reference Model / ModelSTE, one copy for the examples and the
# tests. Put on the path here, not only in conftest.py, so that a subprocess importing helpers
# finds it too.
_EXAMPLES = os.path.normpath(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "pytorch"))
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import reference as reference_model  # noqa: E402

# ---- shapes shared by the forward and backward tests: (lead dims of x, in, out, bias) ----------

SMALL_SHAPES = [
    pytest.param((2, 37), 96, 40, True, id="3d_96to40"),
    pytest.param((50,), 1, 7, True, id="2d_1to7"),
    pytest.param((3, 5), 64, 64, False, id="3d_64to64_nobias"),
    pytest.param((130,), 24, 56, True, id="2d_24to56"),
]

# ---- the input activations ---------------------------------------------------------------------

#: The operators' activation names (activation= of torch.ops.qbl.*; the Python API takes None for
#: "none") and what eager computes for each: the layer applies it to x before the blend.
ACTIVATIONS = {
    "none": lambda h: h,
    "gelu": lambda h: F.gelu(h),
    "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
ACTIVATION_PARAMS = [pytest.param(a, id=a) for a in ACTIVATIONS]

# ---- dtypes and tolerances ------------------------------------------------------------------------

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_PARAMS = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
                pytest.param(torch.float16, id="fp16")]

#: u: one rounding to the dtype moves a value by at most u times its magnitude (normal range).
UNIT_ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}

#: The smallest relative Frobenius error limit of a GEMM result: 1e-5 in float32 (what the
#: project states for its exact-float32 GEMM); one rounding to the dtype (u) in bf16/fp16, whose
#: output rounding alone gives errors of that order.
GEMM_FLOOR = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}

_BITS = {torch.float64: (torch.int64, 0xFFFFFFFFFFFFFFFF, 16),
         torch.float32: (torch.int32, 0xFFFFFFFF, 8), torch.bfloat16: (torch.int16, 0xFFFF, 4),
         torch.float16: (torch.int16, 0xFFFF, 4)}


# ---- inputs -------------------------------------------------------------------------------------------


def make_inputs(lead, in_features, out_features, dtype, device, bias=True, seed=0, logit_std=2.0):
    """x [*lead, in], logits lead, weight [out, in] (std 1/sqrt(in)), bias [out] or None on
    `device`; drawn in float32 from a seeded CPU generator (the same values on every device), then
    rounded to `dtype`."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen) * std).to(dtype).to(device)

    x = randn(*lead, in_features)
    logits = randn(*lead, std=logit_std)
    weight = randn(out_features, in_features, std=1.0 / math.sqrt(in_features))
    b = randn(out_features) if bias else None
    return x, logits, weight, b


def make_grad_out(shape, dtype, device, seed=1):
    """A gradient of the output on `device` with signed zeros planted: -0.0 at every 13th element,
    +0.0 at every 17th (eager's autograd turns some -0.0 gradients into +0.0; qbl must do the
    same). The same values on every device."""
    gen = torch.Generator().manual_seed(seed)
    g = torch.randn(*shape, generator=gen).to(dtype).to(device)
    flat = g.view(-1)
    flat[0::13] = -0.0
    flat[5::17] = 0.0
    return g


def identity_layer_params(d, dtype, device):
    """weight = I (so that g_mixed = grad_out @ I = grad_out exactly) and bias = 0."""
    return (torch.eye(d, device=device, dtype=dtype), torch.zeros(d, device=device, dtype=dtype))


# ---- the eager reference --------------------------------------------------------------------------


@dataclass
class Eager:
    alpha: "torch.Tensor"      # sigmoid(logits).unsqueeze(-1), dtype
    amax_raw: "torch.Tensor"   # max |x| before the clamp, dtype
    scale: "torch.Tensor"      # clamp(amax, 1e-8) / 127.0, dtype
    x_q: "torch.Tensor"
    mixed: "torch.Tensor"
    out: "torch.Tensor"


def eager_forward(x, logits, weight, bias=None, straight_through=False) -> Eager:
    """reference_model.Model's (ModelSTE's) forward op by op, for any in/out features and an
    optional bias, in the inputs' dtype. Differentiable exactly as eager's autograd of the model."""
    alpha = torch.sigmoid(logits).unsqueeze(-1)
    amax_raw = x.detach().abs().max()
    amax = amax_raw.clamp(min=1e-8)
    scale = amax / 127.0
    if straight_through:
        x_q = reference_model._FakeQuantSTE.apply(x, scale)
    else:
        x_q = reference_model._fake_quant_symmetric_int8(x, scale)
    mixed = alpha * x_q + (1.0 - alpha) * x
    out = F.linear(mixed, weight, bias)
    return Eager(alpha, amax_raw, scale, x_q, mixed, out)


def eager_stats(e: Eager) -> "torch.Tensor":
    """The float32 [amax before the clamp, scale] that qbl's forward reports, from eager's values."""
    return torch.stack([e.amax_raw.float(), e.scale.float()])


def qbl_fn(straight_through=False, allow_tf32=False) -> Callable:
    return lambda x, l, w, b: qbl.quant_blend_linear(x, l, w, b, straight_through=straight_through,
                                                      allow_tf32=allow_tf32)


def eager_fn(straight_through=False) -> Callable:
    return lambda x, l, w, b: eager_forward(x, l, w, b, straight_through=straight_through).out


@dataclass
class Grads:
    out: "torch.Tensor"
    x: Optional["torch.Tensor"]
    logits: Optional["torch.Tensor"]
    weight: Optional["torch.Tensor"]
    bias: Optional["torch.Tensor"]


def run_autograd(fn, x, logits, weight, bias, grad_out, want=(True, True, True, True)) -> Grads:
    """fn(x, logits, weight, bias) on fresh leaf copies (those selected by `want` require grad),
    then torch.autograd.grad with grad_out. Grads of inputs not wanted (or a None bias) are None."""
    leaves = []
    for t, w in zip((x, logits, weight, bias), want):
        leaves.append(None if t is None else t.detach().clone().requires_grad_(w))
    out = fn(*leaves)
    wanted = [t for t in leaves if t is not None and t.requires_grad]
    got = iter(torch.autograd.grad(out, wanted, grad_out)) if wanted else iter(())
    grads = [next(got) if t is not None and t.requires_grad else None for t in leaves]
    return Grads(out.detach(), *grads)


# ---- float64 references ---------------------------------------------------------------------------


def ref64_out(mixed, weight, bias):
    """The float64 product of eager's `mixed` with the weight, plus the bias, and the matching
    sum of magnitudes |mixed| @ |W|^T + |b| (what bounds the GEMM's rounding errors)."""
    m, w = mixed.detach().double(), weight.detach().double()
    ref, mag = m @ w.t(), m.abs() @ w.abs().t()
    if bias is not None:
        ref, mag = ref + bias.detach().double(), mag + bias.detach().double().abs()
    return ref, mag


@dataclass
class Ref64Grads:
    x: "torch.Tensor"
    logits: "torch.Tensor"
    weight: "torch.Tensor"
    bias: "torch.Tensor"
    bias_abs: "torch.Tensor"  # sum over tokens of |g|


def ref64_grads(x, logits, weight, e: Eager, grad_out, straight_through=False) -> Ref64Grads:
    """The gradients in float64, from eager's forward values (alpha, x_q, mixed in the dtype):
    g_mixed = g @ W; grad_x = g_mixed * (1 - alpha) (straight-through: g_mixed * alpha +
    g_mixed * (1 - alpha)); grad_logits = sum_f g_mixed * (x_q - x) * (1 - a) * a with a the exact
    sigmoid; grad_W = g^T @ mixed; grad_b = sum_tokens g."""
    n_out, n_in = weight.shape
    g = grad_out.detach().double()
    alpha = e.alpha.detach()
    one_minus = (1.0 - alpha).double()
    g_mixed = g @ weight.detach().double()
    gx = g_mixed * (alpha.double() + one_minus) if straight_through else g_mixed * one_minus
    a64 = torch.sigmoid(logits.detach().double())
    ga = (g_mixed * (e.x_q.detach().double() - x.detach().double())).sum(-1)
    gl = ga * (1.0 - a64) * a64
    g2 = g.reshape(-1, n_out)
    gw = g2.t() @ e.mixed.detach().double().reshape(-1, n_in)
    return Ref64Grads(gx, gl, gw, g2.sum(0), g2.abs().sum(0))


# ---- comparisons ----------------------------------------------------------------------------------


def _describe(actual, expected, bad, limit=6) -> str:
    ints, mask, width = _BITS[actual.dtype]
    a_bits, e_bits = actual.view(ints), expected.view(ints)
    lines = []
    for idx in torch.nonzero(bad)[:limit].tolist():
        t = tuple(idx)
        lines.append(f"    at {t}: actual {actual[t].item()!r} (0x{a_bits[t].item() & mask:0{width}x}), "
                     f"expected {expected[t].item()!r} (0x{e_bits[t].item() & mask:0{width}x})")
    return "\n".join(lines)


def _check_like(actual, expected, what):
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}")
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.device == expected.device, (
        f"{what}: device {actual.device}, expected {expected.device}")


def assert_bits_equal(actual, expected, what, signed_zeros=True):
    """Bit for bit (compared as integers, so -0.0 differs from +0.0), any NaN equal to any NaN.
    signed_zeros=False compares values instead (+0.0 == -0.0), NaN still equal to NaN."""
    _check_like(actual, expected, what)
    ints = _BITS[actual.dtype][0]
    same = (actual.view(ints) == expected.view(ints)) if signed_zeros else (actual == expected)
    bad = ~(same | (torch.isnan(actual) & torch.isnan(expected)))
    n = int(bad.sum().item())
    if n:
        rule = "-0.0 differs from +0.0" if signed_zeros else "+0.0 equals -0.0"
        raise AssertionError(
            f"{what}: {n} of {actual.numel()} elements differ (bitwise, any NaN equals any NaN, "
            f"{rule}); first ones:\n{_describe(actual, expected, bad)}")


def assert_same_nonfinite(actual, expected, what):
    """NaN, +Inf and -Inf exactly where `expected` has them."""
    _check_like(actual, expected, what)
    for name, test in (("NaN", torch.isnan), ("+Inf", torch.isposinf), ("-Inf", torch.isneginf)):
        a, e = test(actual), test(expected)
        if not torch.equal(a, e):
            bad = a != e
            raise AssertionError(
                f"{what}: {name} pattern differs at {int(bad.sum().item())} elements (actual has "
                f"{int(a.sum().item())}, expected {int(e.sum().item())}); first ones:\n"
                f"{_describe(actual, expected, bad)}")


def _norm(t) -> float:
    return torch.linalg.vector_norm(t.double()).item()


def rel_fro(actual, ref64) -> float:
    """||actual - ref||_F / ||ref||_F (the absolute norm where ref is zero)."""
    den = _norm(ref64)
    num = _norm(actual.double() - ref64)
    return num / den if den > 0 else num


def assert_all_finite(t, what):
    bad = ~torch.isfinite(t)
    assert not bool(bad.any()), f"{what}: {int(bad.sum().item())} non-finite elements"


def assert_gemm_close(actual, eager, ref64, dtype, what):
    """Relative Frobenius error against the float64 reference at most max(2 x eager's own error
    in the same dtype, GEMM_FLOOR[dtype])."""
    assert actual.shape == ref64.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref64.shape)}"
    assert actual.dtype == dtype, f"{what}: dtype {actual.dtype}, expected {dtype}"
    assert_all_finite(actual, what)
    err, err_eager = rel_fro(actual, ref64), rel_fro(eager, ref64)
    limit = max(2.0 * err_eager, GEMM_FLOOR[dtype])
    assert err <= limit, (
        f"{what}: relative Frobenius error vs float64 {err:.3e} > limit {limit:.3e} "
        f"= max(2 x eager's {err_eager:.3e}, floor {GEMM_FLOOR[dtype]:.1e})")


def _assert_within(actual, ref64, bound, what, bound_name, ref_name):
    """|actual - ref64| <= bound elementwise (a NaN difference counts as outside); the message
    names the first five elements outside."""
    err = (actual.double() - ref64.double()).abs()
    bad = ~(err <= bound)
    n = int(bad.sum().item())
    if n:
        idx = [tuple(i) for i in torch.nonzero(bad)[:5].tolist()]
        detail = "\n".join(f"    at {t}: actual {actual[t].item()!r}, {ref_name} {ref64[t].item()!r}, "
                           f"bound {bound[t].item():.3e}" for t in idx)
        raise AssertionError(f"{what}: {n} of {actual.numel()} elements outside the {bound_name}:\n"
                             f"{detail}")


def assert_gemm_elementwise(actual, ref64, mag64, k, dtype, what):
    """Every element of a GEMM with fp32 accumulation of k products (plus a bias), rounded to the
    dtype, within 2u |ref| + (k + 2) 2^-24 (|A| |B| + |b|) (1 + 2u) + tiny of the float64 product:
    the fp32 sum of k + 1 terms in any order (and fp32 products of fp32 operands) errs by at most
    (k + 1) 2^-24 times the sum of magnitudes, then one rounding to the dtype (u |value|; two
    allowed: an epilogue that rounds twice); tiny covers a result in the subnormal range."""
    u = UNIT_ROUNDOFF[dtype]
    bound = (2 * u * ref64.abs() + (k + 2) * 2.0 ** -24 * mag64 * (1 + 2 * u)
             + torch.finfo(dtype).tiny)
    _assert_within(actual, ref64, bound, what, "GEMM bound", "float64")


def assert_norm_within_eager(actual, eager, ref64, dtype, what, factor=2.0):
    """||actual - ref|| <= factor * ||eager - ref|| + eps(dtype) * ||ref|| (Frobenius norms).
    eps = 2u: one rounding of every element to the dtype moves it by at most u |value|, so this
    allows twice eager's own error plus one extra rounding of each element."""
    assert actual.shape == ref64.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(ref64.shape)}"
    assert_all_finite(actual, what)
    err = _norm(actual.double() - ref64)
    err_eager = _norm(eager.double() - ref64)
    limit = factor * err_eager + torch.finfo(dtype).eps * _norm(ref64)
    assert err <= limit, (
        f"{what}: ||actual - float64|| = {err:.3e} > limit {limit:.3e} = {factor} x eager's "
        f"{err_eager:.3e} + eps x ||float64|| ({_norm(ref64):.3e})")


def assert_sum_close(actual, ref64, abs_sum64, n_terms, dtype, what, factor=1.0):
    """Elementwise bound of a column sum of n terms accumulated in fp32 in any order, rounded to
    the dtype (twice at most): (n - 1) 2^-24 sum|g| + 2u |S| + 2^-20 sum|g| + tiny, times
    `factor` (2 when comparing two such sums with each other)."""
    u = UNIT_ROUNDOFF[dtype]
    bound = factor * ((max(n_terms - 1, 0) * 2.0 ** -24 + 2.0 ** -20) * abs_sum64
                      + 2 * u * ref64.abs() + torch.finfo(dtype).tiny)
    _assert_within(actual, ref64, bound, what, "sum bound", "expected")


def check_all_grads(q: Grads, e: Grads, x, l, w, b, g, dtype, ste, what=""):
    """qbl's grads `q` against eager autograd's `e` and the float64 references: grad_x and
    grad_weight within max(2 x eager's relative error, GEMM floor); grad_logits within 2 x eager's
    error + one rounding, in norm; grad_bias within the bound of an fp32 sum in any order, against
    float64 and (twice that) against the plain g.sum() in the dtype."""
    with torch.no_grad():
        fwd = eager_forward(x, l, w, b, straight_through=ste)
    r = ref64_grads(x, l, w, fwd, g, straight_through=ste)
    assert_gemm_close(q.x, e.x, r.x, dtype, f"{what}grad_x")
    assert_norm_within_eager(q.logits, e.logits, r.logits, dtype, f"{what}grad_logits")
    assert_gemm_close(q.weight, e.weight, r.weight, dtype, f"{what}grad_weight")
    if b is None:
        assert q.bias is None, f"{what}grad_bias should be None without a bias"
        return
    tokens = g.numel() // g.shape[-1]
    assert_sum_close(q.bias, r.bias, r.bias_abs, tokens, dtype, f"{what}grad_bias vs float64")
    plain = g.reshape(-1, g.shape[-1]).sum(0)  # the plain reduction, in the dtype
    assert_sum_close(q.bias, plain.double(), r.bias_abs, tokens, dtype,
                     f"{what}grad_bias vs g.sum(tokens)", factor=2.0)


def check_autocast_grads(q: Grads, e: Grads, h, logits, weight, fwd: Eager, g, ac, what=""):
    """qbl's gradients `q` under autocast(ac) against eager autograd's `e` of the reference module
    under the same autocast (float32 parameters; h the activation's output, as the module sees
    it; fwd eager's forward values there): each gradient in its input's dtype as eager's;
    grad_logits within 2 x eager's error of the float64 value + one rounding (norm), from
    g_mixed = g @ RN_A(W) and eager's alpha and x_q; grad_weight within max(2 x eager's relative
    error, the float32 floor) of the float64 g^T @ RN_A(mixed), and grad_bias within the bound of
    an fp32 sum in any order rounded to A (both run in A, widened to float32 by the cast's
    backward). On the CPU out, grad_weight and grad_bias bit for bit eager's (eager's own
    F.linear, mm and sum on the same operands). grad_x is the caller's: its bits depend on
    whether g_mixed is eager's."""
    for name in ("x", "logits", "weight", "bias"):
        got, want = getattr(q, name), getattr(e, name)
        assert got is not None and got.dtype == want.dtype, (
            f"{what}grad of {name}: {None if got is None else got.dtype}, eager's {want.dtype}")
    if q.x.device.type == "cpu":
        for name in ("out", "weight", "bias"):
            assert_bits_equal(getattr(q, name), getattr(e, name),
                              f"{what}{name} under autocast vs eager autograd's (CPU)")
    n_out, n_in = weight.shape
    r = ref64_grads(h.float(), logits.float(), weight.to(ac), fwd, g.float())
    assert_norm_within_eager(q.logits, e.logits, r.logits, ac, f"{what}grad_logits under autocast")
    g2 = g.double().reshape(-1, n_out)
    m2 = fwd.mixed.detach().to(ac).double().reshape(-1, n_in)
    assert_gemm_close(q.weight, e.weight, g2.t() @ m2, torch.float32,
                      f"{what}grad_weight under autocast")
    assert_sum_close(q.bias, g2.sum(0), g2.abs().sum(0), g2.shape[0], ac,
                     f"{what}grad_bias under autocast")


# ---- the non-finite and edge input table (forward and backward) -----------------------------------

_NAN, _INF = float("nan"), float("inf")


def _put(t, index, value):
    t = t.clone()
    t.view(-1)[index] = value
    return t


def _every_fifth_negative_zero(x):
    flat = x.clone().view(-1)
    flat[0::5] = -0.0
    return flat.view_as(x)


#: name -> f(x, logits) -> (x, logits). x has at least 101 elements, logits at least 8.
NONFINITE_CASES = {
    "nan_in_x": lambda x, l: (_put(x, 100, _NAN), l),
    "pos_inf_in_x": lambda x, l: (_put(x, 3, _INF), l),
    "neg_inf_in_x": lambda x, l: (_put(x, x.numel() - 1, -_INF), l),
    "nan_logit": lambda x, l: (x, _put(l, 7, _NAN)),
    "pos_inf_logit": lambda x, l: (x, _put(l, 7, _INF)),
    "neg_inf_logit": lambda x, l: (x, _put(l, 7, -_INF)),
    "all_zero_x": lambda x, l: (torch.zeros_like(x), l),
    "all_negative_zero_x": lambda x, l: (torch.full_like(x, -0.0), l),
    "negative_zeros_among_values": lambda x, l: (_every_fifth_negative_zero(x), l),
    "denormal_x": lambda x, l: (
        (x.float() * (1e-5 if x.dtype == torch.float16 else 1e-39)).to(x.dtype), l),
    "top_of_range_x": lambda x, l: (x / x.abs().max() * torch.finfo(x.dtype).max, l),
}
NONFINITE_IDS = list(NONFINITE_CASES)

"""torch.ops.qbl.forward against eager PyTorch: `mixed` and the stats bit for bit, `out` within
GEMM tolerance of a float64 product, the non-finite and edge input table, any number of leading
dimensions, zero tokens."""

from __future__ import annotations

import helpers as H

import pytest
import torch
import torch.nn.functional as F

import qbl
import reference as reference_model

# (lead dims of x, in_features, out_features, bias)
SHAPES = H.SMALL_SHAPES + [
    pytest.param((8, 512), 1024, 1024, True, id="medium_3d_1024"),
]


def _forward(x, l, w, b, **kw):
    out, mixed, stats = torch.ops.qbl.forward(x, l, w, b, **kw)
    return out, mixed, stats


def test_eager_helper_reproduces_reference_model(device):
    """The tests' op-by-op eager forward is reference_model.Model's / ModelSTE's, bit for bit
    (so that every comparison below is against the reference itself)."""
    d = 48
    x, l, _, _ = H.make_inputs((3, 7), d, d, torch.float32, device, seed=3)
    for cls, ste in ((reference_model.Model, False), (reference_model.ModelSTE, True)):
        model = cls(d).to(device)
        with torch.no_grad():
            want = model(x, l)
            got = H.eager_forward(x, l, model.out_proj.weight, model.out_proj.bias, ste).out
        H.assert_bits_equal(got, want, f"helpers.eager_forward vs {cls.__name__}")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("lead,n_in,n_out,bias", SHAPES)
def test_mixed_and_stats_bit_exact(lead, n_in, n_out, bias, dtype, device):
    x, l, w, b = H.make_inputs(lead, n_in, n_out, dtype, device, bias=bias, seed=11)
    out, mixed, stats = _forward(x, l, w, b)
    e = H.eager_forward(x, l, w, b)
    assert out.shape == (*lead, n_out) and out.dtype == dtype and out.device == x.device, (
        f"out: {tuple(out.shape)} {out.dtype} {out.device}, expected {(*lead, n_out)} {dtype} "
        f"{x.device}")
    H.assert_bits_equal(mixed, e.mixed, "mixed vs eager's mixed")
    assert stats.dtype == torch.float32 and stats.shape == (2,), f"stats: {stats.dtype} {stats.shape}"
    H.assert_bits_equal(stats, H.eager_stats(e), "stats [amax before clamp, scale] vs eager's")
    if device.type == "cpu":  # the CPU kernel's GEMM is eager's own F.linear on eager's mixed
        H.assert_bits_equal(out, e.out, "out vs eager's (the same F.linear call)")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("lead,n_in,n_out,bias", SHAPES)
def test_out_within_gemm_tolerance(lead, n_in, n_out, bias, dtype, cuda_device):
    """out vs the float64 product of eager's own `mixed` (bit-identical to qbl's, checked above),
    so the comparison measures the GEMM alone: relative Frobenius error at most max(2 x eager's
    error in the same dtype, 1e-5 for fp32 / one rounding u for 16-bit), and every element
    within the rigorous bound of an fp32-accumulated GEMM rounded to the dtype. (On the CPU the
    GEMM is eager's own F.linear: test_mixed_and_stats_bit_exact checks out's bits instead.)"""
    x, l, w, b = H.make_inputs(lead, n_in, n_out, dtype, cuda_device, bias=bias, seed=12)
    out = qbl.quant_blend_linear(x, l, w, b)
    e = H.eager_forward(x, l, w, b)
    ref, mag = H.ref64_out(e.mixed, w, b)
    H.assert_gemm_close(out, e.out, ref, dtype, "out")
    H.assert_gemm_elementwise(out, ref, mag, n_in, dtype, "out")


@pytest.mark.cuda
def test_tf32_gemm(cuda_device):
    """allow_tf32=True: mixed still bit-exact, out within TF32 accuracy (10 fraction bits, fp32
    accumulation: 4e-3 relative, as the C++ tests allow), in a layer cached apart (tf32 flag)."""
    x, l, w, b = H.make_inputs((4, 33), 128, 48, torch.float32, cuda_device, seed=13)
    out, mixed, _ = _forward(x, l, w, b, allow_tf32=True)
    e = H.eager_forward(x, l, w, b)
    H.assert_bits_equal(mixed, e.mixed, "mixed (allow_tf32=True) vs eager's")
    ref, _ = H.ref64_out(e.mixed, w, b)
    err = H.rel_fro(out, ref)
    assert err <= 4e-3, f"out with TF32: relative Frobenius error {err:.3e} > 4e-3"
    rows = [r for r in qbl.cache_info() if (r["in_features"], r["out_features"]) == (128, 48)
            and r["x_dtype"] == torch.float32]
    assert any(r["tf32"] for r in rows), f"no TF32 layer cached for 128 -> 48: {rows}"


def test_allow_tf32_is_exact_float32_on_the_cpu():
    """TF32 is a CUDA tensor-core format: on the CPU allow_tf32=True computes the same exact
    float32 GEMM, out bit for bit eager's."""
    x, l, w, b = H.make_inputs((4, 33), 128, 48, torch.float32, "cpu", seed=13)
    out, mixed, _ = _forward(x, l, w, b, allow_tf32=True)
    e = H.eager_forward(x, l, w, b)
    H.assert_bits_equal(mixed, e.mixed, "mixed (allow_tf32=True) vs eager's")
    H.assert_bits_equal(out, e.out, "out (allow_tf32=True) vs eager's float32 F.linear")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_identity_weight_out_equals_eager_mixed(dtype, device):
    """With weight = I and bias = 0 the GEMM is exact, so out equals eager's mixed in value (the
    +0 terms of the sums turn -0.0 into +0.0, in eager's matmul too: values, not bits)."""
    d = 64
    x, l, _, _ = H.make_inputs((3, 21), d, d, dtype, device, seed=14)
    x = H.NONFINITE_CASES["negative_zeros_among_values"](x, l)[0]
    w, b = H.identity_layer_params(d, dtype, device)
    out = qbl.quant_blend_linear(x, l, w, b)
    H.assert_bits_equal(out, H.eager_forward(x, l, w, b).mixed, "out (W = I, b = 0) vs eager mixed",
                        signed_zeros=False)


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("case", H.NONFINITE_IDS)
def test_nonfinite_and_edge_inputs(case, dtype, device):
    """The table of compare.py: mixed and stats bit-equal to eager's (NaN for NaN), and out NaN /
    Inf exactly where eager's is (except near the top of the range, where the GEMM overflows and
    where inf - inf turns into NaN depends on each library's summation order)."""
    x0, l0, w, b = H.make_inputs((2, 19), 96, 40, dtype, device, seed=15)
    x, l = H.NONFINITE_CASES[case](x0, l0)
    out, mixed, stats = _forward(x, l, w, b)
    e = H.eager_forward(x, l, w, b)
    H.assert_bits_equal(mixed, e.mixed, f"{case}: mixed vs eager's")
    H.assert_bits_equal(stats, H.eager_stats(e), f"{case}: stats [amax, scale] vs eager's")
    if case != "top_of_range_x":
        H.assert_same_nonfinite(out, e.out, f"{case}: out")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_nonfinite_propagation_as_documented(dtype, device):
    """What the README promises, checked on qbl's own output without reference to eager: one
    NaN or Inf in x makes every output NaN; one NaN logit makes exactly its row NaN."""
    x, l, w, b = H.make_inputs((4, 9), 32, 16, dtype, device, seed=16)
    for name in ("nan_in_x", "pos_inf_in_x", "neg_inf_in_x"):
        xs, ls = H.NONFINITE_CASES[name](x, l)
        out = qbl.quant_blend_linear(xs, ls, w, b)
        assert bool(torch.isnan(out).all()), (
            f"{name}: {int(torch.isnan(out).sum())} of {out.numel()} outputs NaN, expected all")
    ls = l.clone()
    ls[1, 5] = float("nan")
    out = qbl.quant_blend_linear(x, ls, w, b)
    row_nan = torch.isnan(out).all(-1)
    expected = torch.zeros_like(row_nan)
    expected[1, 5] = True
    assert torch.equal(row_nan, expected) and not bool(torch.isnan(out[~expected]).any()), (
        f"NaN logit at [1, 5]: rows all-NaN at {torch.nonzero(row_nan).tolist()}, expected [[1, 5]] "
        f"and no NaN elsewhere")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("lead", [(0,), (2, 0), (0, 3)], ids=["0", "2x0", "0x3"])
def test_zero_tokens(lead, dtype, device):
    x, l, w, b = H.make_inputs(lead, 96, 40, dtype, device, seed=17)
    out, mixed, stats = _forward(x, l, w, b)
    assert out.shape == (*lead, 40) and out.dtype == dtype, f"out: {tuple(out.shape)} {out.dtype}"
    assert mixed.shape == x.shape and mixed.dtype == dtype, f"mixed: {tuple(mixed.shape)}"
    assert stats.shape == (2,) and stats.dtype == torch.float32, f"stats: {tuple(stats.shape)}"
    # A normal call afterwards is unaffected.
    x2, l2, _, _ = H.make_inputs((5,), 96, 40, dtype, device, seed=18)
    H.assert_bits_equal(_forward(x2, l2, w, b)[1], H.eager_forward(x2, l2, w, b).mixed,
                        "mixed after a zero-token call")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_any_number_of_leading_dims(dtype, device):
    """x of 1 to 4 dimensions (features last): mixed bit-exact in each; and the same tokens as
    2-D, 3-D and 4-D give bit-identical outputs (one cached layer, one plan, deterministic)."""
    n_in, n_out = 32, 24
    x, l, w, b = H.make_inputs((2, 3, 4), n_in, n_out, dtype, device, seed=19)
    outs = {}
    for name, xs, ls in (("4-D", x, l), ("3-D", x.reshape(6, 4, n_in), l.reshape(6, 4)),
                         ("2-D", x.reshape(24, n_in), l.reshape(24))):
        out, mixed, stats = _forward(xs, ls, w, b)
        e = H.eager_forward(xs, ls, w, b)
        H.assert_bits_equal(mixed, e.mixed, f"mixed, {name} x")
        H.assert_bits_equal(stats, H.eager_stats(e), f"stats, {name} x")
        outs[name] = out.reshape(24, n_out)
    H.assert_bits_equal(outs["3-D"], outs["2-D"], "out of 3-D x vs the same tokens as 2-D")
    H.assert_bits_equal(outs["4-D"], outs["2-D"], "out of 4-D x vs the same tokens as 2-D")
    # 1-D x: one token, logits a 0-d tensor.
    x1, l1 = x[0, 0, 0], l[0, 0, 0]
    out1, mixed1, _ = _forward(x1, l1, w, b)
    e1 = H.eager_forward(x1, l1, w, b)
    assert out1.shape == (n_out,), f"out of 1-D x: shape {tuple(out1.shape)}, expected ({n_out},)"
    H.assert_bits_equal(mixed1, e1.mixed, "mixed, 1-D x")
    H.assert_gemm_close(out1, e1.out, H.ref64_out(e1.mixed, w, b)[0], dtype, "out, 1-D x")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_strided_and_misaligned_inputs(dtype, device):
    """Non-contiguous x / logits / weight / bias and a weight and bias at an odd element offset
    (2-byte alignment in 16-bit: cuBLASLt may refuse it, the fallback GEMM runs): mixed still
    bit-exact, out within GEMM tolerance -- on the CPU, out bit for bit eager's F.linear of the
    same operands (whose own error exceeds that bound where a strided bias is added after the
    product's rounding)."""
    n_in, n_out = 64, 40
    x, l, w, b = H.make_inputs((9, 5), n_in, n_out, dtype, device, seed=20)
    e = H.eager_forward(x, l, w, b)
    ref, mag = H.ref64_out(e.mixed, w, b)
    w_odd = torch.empty(w.numel() + 1, device=w.device, dtype=dtype)[1:].view_as(w)
    w_odd.copy_(w)
    b_odd = torch.empty(n_out + 1, device=w.device, dtype=dtype)[1:]
    b_odd.copy_(b)
    b_strided = torch.empty(2 * n_out, device=w.device, dtype=dtype)[::2]
    b_strided.copy_(b)
    variants = {
        "transposed x and logits": (x.transpose(0, 1).contiguous().transpose(0, 1),
                                    l.t().contiguous().t(), w, b),
        "column-major weight": (x, l, w.t().contiguous().t(), b),
        "strided bias": (x, l, w, b_strided),
        "weight and bias at an odd element offset": (x, l, w_odd, b_odd),
    }
    for name, (xs, ls, ws, bs) in variants.items():
        out, mixed, _ = _forward(xs, ls, ws, bs)
        H.assert_bits_equal(mixed, e.mixed, f"{name}: mixed")
        if device.type == "cpu":
            H.assert_bits_equal(out, F.linear(e.mixed, ws, bs), f"{name}: out vs eager's F.linear")
            continue
        H.assert_gemm_close(out, e.out, ref, dtype, f"{name}: out")
        H.assert_gemm_elementwise(out, ref, mag, n_in, dtype, f"{name}: out")

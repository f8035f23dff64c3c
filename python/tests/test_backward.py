"""qbl's backward (through autograd and torch.ops.qbl.backward) against eager PyTorch's autograd
of the reference and float64 references: grad_x bit for bit where the dgrad GEMM is exact
(W = I), grad_logits within twice eager's own error, grad_weight / grad_bias within GEMM and sum
tolerances; straight-through as reference_model.ModelSTE; requested subsets; zero tokens; the
non-finite table."""

from __future__ import annotations

import helpers as H  # first: skips this module cleanly when torch or qbl cannot be imported

import pytest
import torch

import qbl
import reference as reference_model

SHAPES = H.SMALL_SHAPES + [
    pytest.param((4, 512), 512, 768, True, id="medium_3d_512to768"),
]
STE_PARAMS = [pytest.param(False, id="zero_grad"), pytest.param(True, id="straight_through")]


def _with_saturated_logits(l):
    """Logits of +-40 in some tokens: sigmoid(40) rounds to exactly 1 in every dtype, so 1 - alpha
    = 0 and g_mixed * (1 - alpha) is -0.0 for a negative g_mixed, which eager's added zero
    gradient of the quantized branch turns into +0.0 (qbl must too)."""
    l = l.clone()
    l.view(-1)[0::7] = 40.0
    l.view(-1)[3::11] = -40.0
    return l


@pytest.mark.parametrize("ste", STE_PARAMS)
@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("lead", [(2, 33), (70,)], ids=["3d", "2d"])
def test_grad_x_bit_exact_with_identity_weight(lead, dtype, ste):
    """W = I, b = 0: g_mixed = g @ I = g exactly in eager and in qbl, so grad_x must be eager
    autograd's bit for bit, signed zeros included (zero mode: RN(g (1 - alpha)) + the quantized
    branch's +0; straight-through: RN(g alpha) + RN(g (1 - alpha)), ModelSTE's sum)."""
    d = 64
    x, l, _, _ = H.make_inputs(lead, d, d, dtype, seed=21)
    l = _with_saturated_logits(l)
    w, b = H.identity_layer_params(d, dtype)
    g = H.make_grad_out((*lead, d), dtype)
    q = H.run_autograd(H.qbl_fn(ste), x, l, w, b, g)
    e = H.run_autograd(H.eager_fn(ste), x, l, w, b, g)
    H.assert_bits_equal(q.x, e.x, "grad_x (W = I) vs eager autograd's")
    H.assert_bits_equal(q.out, e.out, "out (W = I, b = 0) vs eager's", signed_zeros=False)
    H.check_all_grads(q, e, x, l, w, b, g, dtype, ste)


@pytest.mark.parametrize("ste", STE_PARAMS)
@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("lead,n_in,n_out,bias", SHAPES)
def test_gradients_general_weight(lead, n_in, n_out, bias, dtype, ste):
    """grad_x and grad_weight within max(2 x eager's relative error, GEMM floor) of float64;
    grad_logits within 2 x eager's error + one rounding (in norm: its two T-rounded sums of nearly
    equal size cancel, so no elementwise relative bound holds, in eager either); grad_bias within
    the bound of an fp32 sum in any order, against float64 and against g.sum()."""
    x, l, w, b = H.make_inputs(lead, n_in, n_out, dtype, bias=bias, seed=22)
    g = H.make_grad_out((*lead, n_out), dtype, seed=23)
    q = H.run_autograd(H.qbl_fn(ste), x, l, w, b, g)
    e = H.run_autograd(H.eager_fn(ste), x, l, w, b, g)
    H.check_all_grads(q, e, x, l, w, b, g, dtype, ste)


@pytest.mark.parametrize("ste", STE_PARAMS)
@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_module_matches_reference_model_autograd(dtype, ste):
    """qbl.QuantBlendLinear(straight_through=ste) loaded from reference_model.Model's (ModelSTE's)
    out_proj, W = I: grad_x bit-identical to the reference module's autograd; the other grads
    within tolerance; the parameters' .grad filled by backward()."""
    d = 64
    cls = reference_model.ModelSTE if ste else reference_model.Model
    ref = cls(d).to(device=H.device(), dtype=dtype)
    w, b = H.identity_layer_params(d, dtype)
    with torch.no_grad():
        ref.out_proj.weight.copy_(w)
        ref.out_proj.bias.copy_(b)
    layer = qbl.QuantBlendLinear(d, d, device=H.device(), dtype=dtype, straight_through=ste)
    layer.load_state_dict(ref.out_proj.state_dict())
    x, l, _, _ = H.make_inputs((3, 17), d, d, dtype, seed=24)
    l = _with_saturated_logits(l)
    g = H.make_grad_out((3, 17, d), dtype, seed=25)
    grads = {}
    for name, fn in (("qbl", lambda xx, ll: layer(xx, ll)), ("ref", lambda xx, ll: ref(xx, ll))):
        xx, ll = x.clone().requires_grad_(), l.clone().requires_grad_()
        fn(xx, ll).backward(g)
        params = layer if name == "qbl" else ref.out_proj
        grads[name] = H.Grads(None, xx.grad, ll.grad, params.weight.grad, params.bias.grad)
    q, e = grads["qbl"], grads["ref"]
    assert q.weight is not None and q.bias is not None, "backward() left layer.weight/bias.grad None"
    H.assert_bits_equal(q.x, e.x, f"grad_x vs {cls.__name__} autograd (W = I)")
    H.check_all_grads(q, e, x, l, w, b, g, dtype, ste, what=f"vs {cls.__name__}: ")


SUBSETS = [(True, False, False, False), (False, True, False, False), (False, False, True, False),
           (False, False, False, True), (True, True, False, False), (False, False, True, True),
           (True, False, True, False), (False, True, False, True), (True, True, True, False),
           (True, True, False, True)]
NAMES = ("x", "logits", "weight", "bias")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_requested_subsets_give_identical_bits(dtype):
    """Asking autograd for any subset of (x, logits, weight, bias) gives each requested gradient
    bit-identical to the run that asks for all four, and no gradient for the others. Each gradient
    comes from one plan whatever else is asked: grad_x and grad_logits from the dgrad GEMM and the
    element kernel, grad_weight from the wgrad GEMM (beside dgrad or after it, the same
    algorithm), grad_bias from the column-sum kernel; the same cached plans on the same operands
    (without grad_weight the forward saves no `mixed` and the backward is handed x in its place).
    The weight-without-bias and bias-without-weight results are also held to the float64
    references."""
    x, l, w, b = H.make_inputs((5, 13), 80, 48, dtype, seed=26)
    g = H.make_grad_out((5, 13, 48), dtype, seed=27)
    refs = {wb: H.run_autograd(H.qbl_fn(), x, l, w, b, g, want=(True, True) + wb)
            for wb in ((True, True), (True, False), (False, True))}
    for want in SUBSETS:
        sub = H.run_autograd(H.qbl_fn(), x, l, w, b, g, want=want)
        for name, wanted in zip(NAMES, want):
            got = getattr(sub, name)
            if wanted:
                H.assert_bits_equal(got, getattr(refs[(True, True)], name),
                                    f"grad_{name} when requesting {want}")
            else:
                assert got is None, f"grad_{name} not requested ({want}) but returned"
    e = H.run_autograd(H.eager_fn(), x, l, w, b, g)
    r = H.ref64_grads(x, l, w, H.eager_forward(x, l, w, b), g)
    H.assert_gemm_close(refs[(True, False)].weight, e.weight, r.weight, dtype,
                        "grad_weight without grad_bias")
    H.assert_sum_close(refs[(False, True)].bias, r.bias, r.bias_abs, 65, dtype,
                       "grad_bias without grad_weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_op_output_mask(dtype):
    """torch.ops.qbl.backward: a gradient not asked for (or grad_bias with has_bias=False) is an
    empty [0] tensor of the dtype; the asked-for ones are bit-identical to those of the call that
    asks for all four."""
    x, l, w, b = H.make_inputs((6, 11), 48, 32, dtype, seed=28)
    _, mixed, stats = torch.ops.qbl.forward(x, l, w, b)
    g = H.make_grad_out((6, 11, 32), dtype, seed=29)
    full = torch.ops.qbl.backward(g, x, l, w, mixed, stats, True, [True] * 4)
    shapes = (x.shape, l.shape, w.shape, b.shape)
    for i, (t, s) in enumerate(zip(full, shapes)):
        assert t.shape == s and t.dtype == dtype, (
            f"grad_{NAMES[i]}: {tuple(t.shape)} {t.dtype}, expected {tuple(s)} {dtype}")
    for mask in SUBSETS + [(False, False, False, False)]:
        for has_bias in (True, False):
            got = torch.ops.qbl.backward(g, x, l, w, mixed, stats, has_bias, list(mask))
            asked = (mask[0], mask[1], mask[2], mask[3] and has_bias)
            for i, name in enumerate(NAMES):
                what = f"grad_{name}, mask {mask}, has_bias {has_bias}"
                if asked[i]:
                    H.assert_bits_equal(got[i], full[i], what)
                else:
                    assert got[i].shape == (0,) and got[i].dtype == dtype, (
                        f"{what}: not requested, got {tuple(got[i].shape)} {got[i].dtype}, "
                        f"expected an empty [0] {dtype}")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["0", "2x0"])
def test_zero_tokens_backward(lead, dtype):
    """No token: grad_x and grad_logits empty with the inputs' shapes, grad_weight and grad_bias
    zeros (sums of nothing), through autograd and through the operator."""
    x, l, w, b = H.make_inputs(lead, 96, 40, dtype, seed=30)
    g = torch.zeros(*lead, 40, device=x.device, dtype=dtype)
    q = H.run_autograd(H.qbl_fn(), x, l, w, b, g)
    assert q.out.shape == (*lead, 40), f"out: {tuple(q.out.shape)}"
    assert q.x.shape == x.shape and q.logits.shape == l.shape, (
        f"grad_x {tuple(q.x.shape)} / grad_logits {tuple(q.logits.shape)}, expected "
        f"{tuple(x.shape)} / {tuple(l.shape)}")
    H.assert_bits_equal(q.weight, torch.zeros_like(w), "grad_weight with 0 tokens")
    H.assert_bits_equal(q.bias, torch.zeros_like(b), "grad_bias with 0 tokens")
    _, mixed, stats = torch.ops.qbl.forward(x, l, w, b)
    gx, gl, gw, gb = torch.ops.qbl.backward(g, x, l, w, mixed, stats, True, [True] * 4)
    assert gx.shape == x.shape and gl.shape == l.shape, f"op: {tuple(gx.shape)} {tuple(gl.shape)}"
    H.assert_bits_equal(gw, torch.zeros_like(w), "operator grad_weight with 0 tokens")
    H.assert_bits_equal(gb, torch.zeros_like(b), "operator grad_bias with 0 tokens")


@pytest.mark.parametrize("ste", STE_PARAMS)
@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("case", H.NONFINITE_IDS)
def test_nonfinite_and_edge_inputs_backward(case, dtype, ste):
    """The non-finite table through the backward, W = I (so grad_x is compared bit for bit,
    NaN for NaN, signed zeros included): grad_logits and grad_weight NaN / Inf exactly where eager
    autograd's are (except near the top of the range, where sums overflow and inf - inf depends on
    the summation order); grad_bias (from g alone) within the sum bound."""
    d = 64
    x0, l0, _, _ = H.make_inputs((2, 19), d, d, dtype, seed=31)
    x, l = H.NONFINITE_CASES[case](x0, l0)
    w, b = H.identity_layer_params(d, dtype)
    g = H.make_grad_out((2, 19, d), dtype, seed=32)
    q = H.run_autograd(H.qbl_fn(ste), x, l, w, b, g)
    e = H.run_autograd(H.eager_fn(ste), x, l, w, b, g)
    H.assert_bits_equal(q.x, e.x, f"{case}: grad_x vs eager autograd's")
    if case != "top_of_range_x":
        H.assert_same_nonfinite(q.logits, e.logits, f"{case}: grad_logits")
        H.assert_same_nonfinite(q.weight, e.weight, f"{case}: grad_weight")
    g64 = g.double().reshape(-1, d)
    H.assert_sum_close(q.bias, g64.sum(0), g64.abs().sum(0), 38, dtype, f"{case}: grad_bias")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_nan_in_x_makes_grad_weight_nan(dtype):
    """One NaN in x, general weight: every grad_weight element NaN (mixed is all NaN), as eager's
    autograd; grad_x and grad_logits NaN where eager's are; grad_bias finite."""
    x0, l, w, b = H.make_inputs((3, 10), 96, 40, dtype, seed=33)
    x, _ = H.NONFINITE_CASES["nan_in_x"](x0, l)
    g = H.make_grad_out((3, 10, 40), dtype, seed=34)
    q = H.run_autograd(H.qbl_fn(), x, l, w, b, g)
    e = H.run_autograd(H.eager_fn(), x, l, w, b, g)
    assert bool(torch.isnan(e.weight).all()), "eager's grad_weight is expected to be all NaN"
    H.assert_same_nonfinite(q.weight, e.weight, "grad_weight with a NaN in x")
    H.assert_same_nonfinite(q.x, e.x, "grad_x with a NaN in x")
    H.assert_same_nonfinite(q.logits, e.logits, "grad_logits with a NaN in x")
    H.assert_all_finite(q.bias, "grad_bias with a NaN in x")


def test_output_requires_grad_flags():
    """out requires grad when an input does (not under no_grad); mixed and stats never do."""
    x, l, w, b = H.make_inputs((4, 6), 32, 16, torch.float32, seed=35)
    out, mixed, stats = torch.ops.qbl.forward(x, l, w.requires_grad_(), b)
    assert out.requires_grad and out.grad_fn is not None, "out should require grad (weight does)"
    assert not mixed.requires_grad and not stats.requires_grad, (
        f"mixed.requires_grad={mixed.requires_grad}, stats.requires_grad={stats.requires_grad}")
    with torch.no_grad():
        assert not qbl.quant_blend_linear(x, l, w, b).requires_grad, "out requires grad in no_grad"
    with torch.inference_mode():
        y = qbl.quant_blend_linear(x, l, w.detach(), b)
    H.assert_bits_equal(y, out.detach(), "inference_mode out vs the grad-mode out")

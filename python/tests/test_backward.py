"""qbl's backward (through autograd and torch.ops.qbl.backward) against eager PyTorch's autograd
of the reference and float64 references: grad_x bit for bit where the dgrad GEMM is exact
(W = I), grad_logits within twice eager's own error, grad_weight / grad_bias within GEMM and sum
tolerances; straight-through as reference_model.ModelSTE; requested subsets; every output mask of
the operator with each activation (against the all-outputs call bit for bit, and against eager);
zero tokens; the non-finite table. On the CPU and on CUDA (the `device` fixture); on the CPU,
whose kernel runs eager's own GEMMs and bias sum on the same operands, out, grad_x, grad_weight
and grad_bias are also held to eager autograd's bits (grad_logits, summed in double there, to the
same bounds)."""

from __future__ import annotations

import itertools
import math

import helpers as H

import pytest
import torch

import qbl
import reference as reference_model

SHAPES = H.SMALL_SHAPES + [
    pytest.param((4, 512), 512, 768, True, id="medium_3d_512to768"),
]
STE_PARAMS = [pytest.param(False, id="zero_grad"), pytest.param(True, id="straight_through")]

#: fp16 GEMMs are ~50x slower than bf16's on the CPU: there an fp16 case takes at most this many
#: tokens (the medium shape's first 512 of 2048).
CPU_FP16_MAX_TOKENS = 512


def _lead_for(lead, dtype, device):
    """lead, except in fp16 on the CPU beyond CPU_FP16_MAX_TOKENS tokens: then (1, ..., 1,
    CPU_FP16_MAX_TOKENS), as many dimensions."""
    if device.type == "cpu" and dtype == torch.float16 and math.prod(lead) > CPU_FP16_MAX_TOKENS:
        return (1,) * (len(lead) - 1) + (CPU_FP16_MAX_TOKENS,)
    return lead


def _assert_cpu_bits_are_eagers(q: H.Grads, e: H.Grads, device, what=""):
    """On the CPU: out, grad_x, grad_weight and grad_bias bit for bit eager autograd's (the CPU
    kernel calls eager's F.linear, mm and sum on the same operands; grad_x is exact element
    math). Those of `e` that are None (not asked for, no bias) must be None in `q` too. Nothing
    on CUDA, whose GEMMs are qbl's own (held to the bounds instead)."""
    if device.type != "cpu":
        return
    for name in ("out", "x", "weight", "bias"):
        got, want = getattr(q, name), getattr(e, name)
        if want is None:
            assert got is None, f"{what}{name}: eager's is None, qbl's is not"
            continue
        H.assert_bits_equal(got, want, f"{what}{name} vs eager autograd's (CPU: bit for bit)")


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
def test_grad_x_bit_exact_with_identity_weight(lead, dtype, ste, device):
    """W = I, b = 0: g_mixed = g @ I = g exactly in eager and in qbl, so grad_x must be eager
    autograd's bit for bit, signed zeros included (zero mode: RN(g (1 - alpha)) + the quantized
    branch's +0; straight-through: RN(g alpha) + RN(g (1 - alpha)), ModelSTE's sum). On the
    CPU also out (signed zeros included), grad_weight and grad_bias bit for bit eager's."""
    d = 64
    x, l, _, _ = H.make_inputs(lead, d, d, dtype, device, seed=21)
    l = _with_saturated_logits(l)
    w, b = H.identity_layer_params(d, dtype, device)
    g = H.make_grad_out((*lead, d), dtype, device)
    q = H.run_autograd(H.qbl_fn(ste), x, l, w, b, g)
    e = H.run_autograd(H.eager_fn(ste), x, l, w, b, g)
    H.assert_bits_equal(q.x, e.x, "grad_x (W = I) vs eager autograd's")
    H.assert_bits_equal(q.out, e.out, "out (W = I, b = 0) vs eager's", signed_zeros=False)
    H.check_all_grads(q, e, x, l, w, b, g, dtype, ste)
    _assert_cpu_bits_are_eagers(q, e, device)


@pytest.mark.parametrize("ste", STE_PARAMS)
@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("lead,n_in,n_out,bias", SHAPES)
def test_gradients_general_weight(lead, n_in, n_out, bias, dtype, ste, device):
    """grad_x and grad_weight within max(2 x eager's relative error, GEMM floor) of float64;
    grad_logits within 2 x eager's error + one rounding (in norm: its two T-rounded sums of nearly
    equal size cancel, so no elementwise relative bound holds, in eager either); grad_bias within
    the bound of an fp32 sum in any order, against float64 and against g.sum(). On the CPU
    also out, grad_x, grad_weight and grad_bias bit for bit eager autograd's (the medium shape
    in fp16 on its first 512 tokens there: _lead_for)."""
    lead = _lead_for(lead, dtype, device)
    x, l, w, b = H.make_inputs(lead, n_in, n_out, dtype, device, bias=bias, seed=22)
    g = H.make_grad_out((*lead, n_out), dtype, device, seed=23)
    q = H.run_autograd(H.qbl_fn(ste), x, l, w, b, g)
    e = H.run_autograd(H.eager_fn(ste), x, l, w, b, g)
    H.check_all_grads(q, e, x, l, w, b, g, dtype, ste)
    _assert_cpu_bits_are_eagers(q, e, device)


@pytest.mark.parametrize("ste", STE_PARAMS)
@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_module_matches_reference_model_autograd(dtype, ste, device):
    """qbl.QuantBlendLinear(straight_through=ste) loaded from reference_model.Model's (ModelSTE's)
    out_proj, W = I: grad_x bit-identical to the reference module's autograd; the other grads
    within tolerance (on the CPU: the parameters' grads bit for bit the reference's); the
    parameters' .grad filled by backward()."""
    d = 64
    cls = reference_model.ModelSTE if ste else reference_model.Model
    ref = cls(d).to(device=device, dtype=dtype)
    w, b = H.identity_layer_params(d, dtype, device)
    with torch.no_grad():
        ref.out_proj.weight.copy_(w)
        ref.out_proj.bias.copy_(b)
    layer = qbl.QuantBlendLinear(d, d, device=device, dtype=dtype, straight_through=ste)
    layer.load_state_dict(ref.out_proj.state_dict())
    x, l, _, _ = H.make_inputs((3, 17), d, d, dtype, device, seed=24)
    l = _with_saturated_logits(l)
    g = H.make_grad_out((3, 17, d), dtype, device, seed=25)
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
    if device.type == "cpu":
        for name in ("weight", "bias"):
            H.assert_bits_equal(getattr(q, name), getattr(e, name),
                                f"{name}.grad vs {cls.__name__}'s (CPU: bit for bit)")


SUBSETS = [(True, False, False, False), (False, True, False, False), (False, False, True, False),
           (False, False, False, True), (True, True, False, False), (False, False, True, True),
           (True, False, True, False), (False, True, False, True), (True, True, True, False),
           (True, True, False, True)]
NAMES = ("x", "logits", "weight", "bias")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_requested_subsets_give_identical_bits(dtype, device):
    """Asking autograd for any subset of (x, logits, weight, bias) gives each requested gradient
    bit-identical to the run that asks for all four, and no gradient for the others. Each gradient
    comes from one plan whatever else is asked: grad_x and grad_logits from the dgrad GEMM and the
    element kernel, grad_weight from the wgrad GEMM (beside dgrad or after it, the same
    algorithm), grad_bias from the column-sum kernel; the same cached plans on the same operands
    (without grad_weight the forward saves no `mixed` and the backward is handed x in its place).
    The weight-without-bias and bias-without-weight results are also held to the float64
    references (on the CPU: bit for bit eager autograd's)."""
    x, l, w, b = H.make_inputs((5, 13), 80, 48, dtype, device, seed=26)
    g = H.make_grad_out((5, 13, 48), dtype, device, seed=27)
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
    if device.type == "cpu":
        H.assert_bits_equal(refs[(True, False)].weight, e.weight,
                            "grad_weight without grad_bias vs eager's (CPU)")
        H.assert_bits_equal(refs[(False, True)].bias, e.bias,
                            "grad_bias without grad_weight vs eager's (CPU)")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_op_output_mask(dtype, device):
    """torch.ops.qbl.backward: a gradient not asked for (or grad_bias with has_bias=False) is an
    empty [0] tensor of the dtype; the asked-for ones are bit-identical to those of the call that
    asks for all four."""
    x, l, w, b = H.make_inputs((6, 11), 48, 32, dtype, device, seed=28)
    _, mixed, stats = torch.ops.qbl.forward(x, l, w, b)
    g = H.make_grad_out((6, 11, 32), dtype, device, seed=29)
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


ALL_MASKS = list(itertools.product((False, True), repeat=4))
ACT_PARAMS = [pytest.param(None, id="no_act")] + [
    pytest.param(a, id=a) for a in ("gelu", "gelu_tanh", "relu", "silu")]


def _eager_references(act, x, l, w, b, g, ste):
    """Eager autograd of act followed by the reference module (ModelSTE's with `ste`), and the
    float64 references: ref64_grads from eager's forward values on act(x), with the gradient of
    h carried through the activation in float64 (eager's activation differentiated by autograd
    on float64 h)."""
    fn = H.ACTIVATIONS[act]
    e = H.run_autograd(lambda x_, l_, w_, b_: H.eager_forward(fn(x_), l_, w_, b_, ste).out,
                       x, l, w, b, g)
    with torch.no_grad():
        fwd = H.eager_forward(fn(x), l, w, b, straight_through=ste)
    r = H.ref64_grads(fn(x), l, w, fwd, g, straight_through=ste)
    h64 = x.detach().double().requires_grad_()
    r.x = torch.autograd.grad(fn(h64), h64, r.x)[0] if act != "none" else r.x
    return e, r


def _check_one_grad_against_eager(name, got, e: H.Grads, r: H.Ref64Grads, tokens, dtype, device,
                                  what):
    """One gradient of a backward call against eager's and the float64 reference, within the
    bounds check_all_grads uses: grad_x (of h) and grad_weight within max(2 x eager's relative
    error, the GEMM floor); grad_logits within 2 x eager's error + one rounding (norm); grad_bias
    within the bound of an fp32 sum in any order. On the CPU grad_x, grad_weight and grad_bias
    bit for bit eager's (eager's own mm, sum and activation backward on the same operands)."""
    if name == "logits":
        H.assert_norm_within_eager(got, e.logits, r.logits, dtype, what)
        return
    if name == "bias":
        H.assert_sum_close(got, r.bias, r.bias_abs, tokens, dtype, what)
    else:
        H.assert_gemm_close(got, getattr(e, name), getattr(r, name), dtype, what)
    if device.type == "cpu":
        H.assert_bits_equal(got, getattr(e, name), f"{what} vs eager autograd's (CPU)")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("act", ACT_PARAMS)
def test_every_output_mask_with_kept_and_recomputed_mixed(act, dtype, device):
    """torch.ops.qbl.backward on one set of inputs for each of the 16 output masks, with `mixed`
    kept (the forward's) and recomputed (None), with and without a bias, in both quantizer-gradient
    modes: each requested output bit-identical to that of the call asking for all four with the
    kept mixed (whatever else is asked and wherever mixed comes from, each gradient is computed
    the same way: on CUDA the element kernel runs other code for grad_x and grad_logits together
    than for one of them alone), each other one an empty [0] tensor of its dtype. With an
    activation the backward is handed the activation's input and recomputes act(x) where it needs
    it. Each requested output is also held to an independent reference, eager autograd of the
    activation followed by the reference module (ModelSTE with straight_through), and float64:
    _check_one_grad_against_eager's bounds (on the CPU eager's bits but for grad_logits)."""
    lead, n_in, n_out = (4, 9), 48, 32
    x, l, w, b = H.make_inputs(lead, n_in, n_out, dtype, device, seed=36)
    g = H.make_grad_out((*lead, n_out), dtype, device, seed=37)
    name = "none" if act is None else act
    shapes = (x.shape, l.shape, w.shape, b.shape)
    tokens = x.numel() // n_in
    for ste in (False, True):
        _, mixed, stats = torch.ops.qbl.forward(x, l, w, b, activation=name, straight_through=ste)
        full = torch.ops.qbl.backward(g, x, l, w, mixed, stats, True, [True] * 4, activation=name,
                                      straight_through=ste)
        for i, (t, shape) in enumerate(zip(full, shapes)):
            assert t.shape == shape and t.dtype == dtype, (
                f"grad_{NAMES[i]} (all asked, ste {ste}): {tuple(t.shape)} {t.dtype}, expected "
                f"{tuple(shape)} {dtype}")
        e, r = _eager_references(name, x, l, w, b, g, ste)
        for source, given in (("kept", mixed), ("recomputed", None)):
            for has_bias in (True, False):
                for mask in ALL_MASKS:
                    got = torch.ops.qbl.backward(g, x, l, w, given, stats, has_bias, list(mask),
                                                 activation=name, straight_through=ste)
                    asked = (mask[0], mask[1], mask[2], mask[3] and has_bias)
                    for i, grad in enumerate(NAMES):
                        what = (f"grad_{grad}, mask {mask}, {source} mixed, has_bias {has_bias}, "
                                f"straight_through {ste}")
                        if asked[i]:
                            H.assert_bits_equal(got[i], full[i], f"{what} vs all asked, kept mixed")
                            _check_one_grad_against_eager(grad, got[i], e, r, tokens, dtype,
                                                          device, f"{what} vs eager")
                        else:
                            assert got[i].shape == (0,) and got[i].dtype == dtype, (
                                f"{what}: not requested, got {tuple(got[i].shape)} "
                                f"{got[i].dtype}, expected an empty [0] {dtype}")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["0", "2x0"])
def test_zero_tokens_backward(lead, dtype, device):
    """No token: grad_x and grad_logits empty with the inputs' shapes, grad_weight and grad_bias
    zeros (sums of nothing), through autograd and through the operator."""
    x, l, w, b = H.make_inputs(lead, 96, 40, dtype, device, seed=30)
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
def test_nonfinite_and_edge_inputs_backward(case, dtype, ste, device):
    """The non-finite table through the backward, W = I (so grad_x is compared bit for bit,
    NaN for NaN, signed zeros included): grad_logits and grad_weight NaN / Inf exactly where eager
    autograd's are (except near the top of the range, where sums overflow and inf - inf depends on
    the summation order); grad_bias (from g alone) within the sum bound. On the CPU, out,
    grad_weight and grad_bias bit for bit eager's in every case, the top of the range included
    (the same GEMMs and sum on the same operands)."""
    d = 64
    x0, l0, _, _ = H.make_inputs((2, 19), d, d, dtype, device, seed=31)
    x, l = H.NONFINITE_CASES[case](x0, l0)
    w, b = H.identity_layer_params(d, dtype, device)
    g = H.make_grad_out((2, 19, d), dtype, device, seed=32)
    q = H.run_autograd(H.qbl_fn(ste), x, l, w, b, g)
    e = H.run_autograd(H.eager_fn(ste), x, l, w, b, g)
    H.assert_bits_equal(q.x, e.x, f"{case}: grad_x vs eager autograd's")
    if case != "top_of_range_x":
        H.assert_same_nonfinite(q.logits, e.logits, f"{case}: grad_logits")
        H.assert_same_nonfinite(q.weight, e.weight, f"{case}: grad_weight")
    g64 = g.double().reshape(-1, d)
    H.assert_sum_close(q.bias, g64.sum(0), g64.abs().sum(0), 38, dtype, f"{case}: grad_bias")
    _assert_cpu_bits_are_eagers(q, e, device, f"{case}: ")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_nan_in_x_makes_grad_weight_nan(dtype, device):
    """One NaN in x, general weight: every grad_weight element NaN (mixed is all NaN), as eager's
    autograd; grad_x and grad_logits NaN where eager's are; grad_bias finite (on the CPU: out and
    the gradients but grad_logits bit for bit eager's)."""
    x0, l, w, b = H.make_inputs((3, 10), 96, 40, dtype, device, seed=33)
    x, _ = H.NONFINITE_CASES["nan_in_x"](x0, l)
    g = H.make_grad_out((3, 10, 40), dtype, device, seed=34)
    q = H.run_autograd(H.qbl_fn(), x, l, w, b, g)
    e = H.run_autograd(H.eager_fn(), x, l, w, b, g)
    assert bool(torch.isnan(e.weight).all()), "eager's grad_weight is expected to be all NaN"
    H.assert_same_nonfinite(q.weight, e.weight, "grad_weight with a NaN in x")
    H.assert_same_nonfinite(q.x, e.x, "grad_x with a NaN in x")
    H.assert_same_nonfinite(q.logits, e.logits, "grad_logits with a NaN in x")
    H.assert_all_finite(q.bias, "grad_bias with a NaN in x")
    _assert_cpu_bits_are_eagers(q, e, device, "NaN in x: ")


def test_output_requires_grad_flags(device):
    """out requires grad when an input does (not under no_grad); mixed and stats never do."""
    x, l, w, b = H.make_inputs((4, 6), 32, 16, torch.float32, device, seed=35)
    out, mixed, stats = torch.ops.qbl.forward(x, l, w.requires_grad_(), b)
    assert out.requires_grad and out.grad_fn is not None, "out should require grad (weight does)"
    assert not mixed.requires_grad and not stats.requires_grad, (
        f"mixed.requires_grad={mixed.requires_grad}, stats.requires_grad={stats.requires_grad}")
    with torch.no_grad():
        assert not qbl.quant_blend_linear(x, l, w, b).requires_grad, "out requires grad in no_grad"
    with torch.inference_mode():
        y = qbl.quant_blend_linear(x, l, w.detach(), b)
    H.assert_bits_equal(y, out.detach(), "inference_mode out vs the grad-mode out")

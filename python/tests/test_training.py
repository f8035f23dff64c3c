"""qbl as training uses it: under torch.autocast (values, dtypes, gradients, a float32 weight used
twice in one region, torch.compile), the backward that recomputes `mixed` (with the
straight-through estimator; under autocast with every activation), and grad_logits' accuracy
against eager's -- on the CPU and on CUDA (the `device` fixture; CPU autocast in bf16 and fp16
as on CUDA). CUDA's alone: a captured training step, the same layer on two streams at once (and
on one while a capture on the other is open), planning on another thread, wgrad beside dgrad
(QBL_OVERLAP_WGRAD), and the host time of a call against nn.Linear's.

The autocast reference is the reference module's arithmetic run by eager under autocast on the
same device (helpers.eager_forward inside torch.autocast(device.type)): F.linear casts mixed,
weight and bias to the autocast dtype (weight and bias through autocast's cast cache), and
autograd records the casts. qbl casts float32 parameters inside its operators instead, and keeps
the float32 weight for the backward: the same values and gradients, without a cast copy of the
weight between the two. On the CPU qbl's GEMMs are eager's own ATen calls on the same operands,
so there out, grad_weight and grad_bias are held to eager's bits; on CUDA (qbl's own GEMM) to
the GEMM bounds.
"""

from __future__ import annotations

import helpers as H

import statistics
import threading
import time

import pytest
import torch

import qbl

AC = torch.bfloat16  # the usual autocast dtype; fp16 is covered where it differs


def _autocast(device, dtype=AC, cache=True):
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


# (autocast dtype, x dtype, logits dtype): what autocast hands the layer. The fused ones run qbl's
# kernels; an fp16 gate under bf16 autocast runs the reference's own ops, so it too is eager's.
# (bf16 inputs under fp16 autocast, or the reverse, are not a combination autocast produces.)
AUTOCAST_FORWARD_CASES = [
    pytest.param(AC, torch.float32, AC, id="bf16-x_fp32_gate_bf16"),
    pytest.param(AC, torch.float32, torch.float32, id="bf16-x_fp32_gate_fp32"),
    pytest.param(AC, AC, AC, id="bf16-x_bf16_gate_bf16"),
    pytest.param(AC, torch.float32, torch.float16, id="bf16-x_fp32_gate_fp16_unfused"),
    pytest.param(torch.float16, torch.float32, torch.float32, id="fp16-x_fp32_gate_fp32"),
    pytest.param(torch.float16, torch.float32, torch.float16, id="fp16-x_fp32_gate_fp16"),
    pytest.param(torch.float16, torch.float16, torch.float16, id="fp16-x_fp16_gate_fp16"),
]

# (x dtype, logits dtype) under bf16 autocast, the fused combinations.
AUTOCAST_INPUTS = [
    pytest.param(torch.float32, AC, id="x_fp32_gate_bf16"),
    pytest.param(torch.float32, torch.float32, id="x_fp32_gate_fp32"),
    pytest.param(AC, AC, id="x_bf16_gate_bf16"),
]


@pytest.mark.parametrize("ac,x_dtype,l_dtype", AUTOCAST_FORWARD_CASES)
def test_autocast_forward_is_eagers(ac, x_dtype, l_dtype, device):
    """Under autocast: out in the autocast dtype; `mixed` bit-identical to eager's mixed cast to it
    (where qbl's kernels run) and the stats to eager's amax and scale; out as close to the float64
    product of those operands as a GEMM in that dtype allows on CUDA, and bit for bit eager's out
    on the CPU (eager's F.linear of the same operands) -- on the unfused path bit-identical to
    eager's out on every device."""
    x, l, w, b = H.make_inputs((4, 33), 64, 48, torch.float32, device, seed=200)
    x, l = x.to(x_dtype), l.to(l_dtype)
    w, b = w.requires_grad_(), b.requires_grad_()  # fp32 parameters, as a model's
    with _autocast(device, ac):
        out, mixed, stats = torch.ops.qbl.forward(x, l, w, b)
        e = H.eager_forward(x, l, w, b)
    assert out.dtype == ac, f"out dtype {out.dtype}, expected the autocast dtype {ac}"
    assert e.out.dtype == ac
    if l_dtype == torch.float16 and ac == AC:  # the unfused path: eager's own ops
        H.assert_bits_equal(out.detach(), e.out.detach(), "out (unfused path) vs eager's")
        return
    assert mixed.dtype == ac, f"mixed dtype {mixed.dtype}, expected {ac}"
    H.assert_bits_equal(mixed, e.mixed.detach().to(ac), "mixed vs eager's mixed.to(autocast dtype)")
    H.assert_bits_equal(stats, H.eager_stats(e), "stats vs eager's amax and scale")
    if device.type == "cpu":  # eager's F.linear on the same operands
        H.assert_bits_equal(out.detach(), e.out.detach(), "out under autocast vs eager's")
        return
    ref, _ = H.ref64_out(e.mixed.detach().to(ac), w.detach().to(ac), b.detach().to(ac))
    H.assert_gemm_close(out.detach(), e.out.detach(), ref, ac, "out under autocast")


@pytest.mark.parametrize("computed", [False, True], ids=["parameter", "computed_weight"])
@pytest.mark.parametrize("x_dtype,l_dtype", AUTOCAST_INPUTS)
def test_autocast_gradients_follow_the_casts(x_dtype, l_dtype, computed, device):
    """Each input's gradient in its own dtype, as eager's autograd gives it through autocast's
    casts (x.grad in x's, logits.grad in the logits', weight.grad and bias.grad fp32); with W = I
    g_mixed is grad_out exactly, so grad_x is bit-identical to eager's; grad_logits within the
    backward's bound of eager's; grad_weight and grad_bias within the GEMM and sum bounds on CUDA,
    and bit for bit eager's on the CPU (the same ATen calls, cast to float32 as eager's cast
    backward casts them). The weight a parameter (qbl casts it inside), or computed from one
    (w * 1.0, not a leaf: cast as F.linear casts it), its gradient reaching the parameter."""
    d = 64
    x, l, _, _ = H.make_inputs((5, 29), d, d, torch.float32, device, seed=201)
    x, l = x.to(x_dtype), l.to(l_dtype)
    w, b = H.identity_layer_params(d, torch.float32, device)
    g = H.make_grad_out((5, 29, d), AC, device, seed=202)
    runs = {}
    for name, fn in (("qbl", H.qbl_fn()), ("eager", H.eager_fn())):
        leaves = [t.detach().clone().requires_grad_() for t in (x, l, w, b)]
        with _autocast(device):
            args = leaves[:2] + [leaves[2] * 1.0 if computed else leaves[2], leaves[3]]
            out = fn(*args)
        assert out.dtype == AC, f"{name}: out dtype {out.dtype}"
        out.backward(g)
        runs[name] = [t.grad for t in leaves]
    for i, (name, t) in enumerate(zip(("x", "logits", "weight", "bias"), (x, l, w, b))):
        q, e = runs["qbl"][i], runs["eager"][i]
        assert q is not None and q.dtype == t.dtype == e.dtype, (
            f"grad_{name}: dtype {None if q is None else q.dtype}, eager's {e.dtype}, "
            f"input {t.dtype}")
        H.assert_all_finite(q, f"grad_{name}")
    H.assert_bits_equal(runs["qbl"][0], runs["eager"][0], "grad_x (W = I) vs eager's")
    with torch.no_grad(), _autocast(device):
        e = H.eager_forward(x, l, w, b)
    # grad_logits: both from the same g_mixed (W = I): the same formula, sums in another order.
    r = H.ref64_grads(x.float(), l.float(), w, e, g.float())
    H.assert_norm_within_eager(runs["qbl"][1].float(), runs["eager"][1].float(), r.logits,
                               l_dtype, "grad_logits under autocast")
    if device.type == "cpu":  # eager's mm and sum on the same operands, cast to float32
        H.assert_bits_equal(runs["qbl"][2], runs["eager"][2], "grad_weight under autocast")
        H.assert_bits_equal(runs["qbl"][3], runs["eager"][3], "grad_bias under autocast")
    # weight and bias: bf16 products widened to fp32, as eager's cast backward widens them.
    tokens = g.numel() // d
    gw64 = g.double().reshape(-1, d).t() @ e.mixed.detach().to(AC).double().reshape(-1, d)
    H.assert_gemm_close(runs["qbl"][2], runs["eager"][2], gw64, torch.float32,
                        "grad_weight under autocast")
    g2 = g.double().reshape(-1, d)
    H.assert_sum_close(runs["qbl"][3], g2.sum(0), g2.abs().sum(0), tokens, AC,
                       "grad_bias under autocast")


@pytest.mark.parametrize("ac", [AC, torch.float16], ids=["bf16", "fp16"])
def test_float32_weight_used_twice_in_one_autocast_region(ac, device):
    """One float32 weight and bias used by two calls in one autocast region (as a layer applied
    twice). Eager casts the parameters once (autocast's cast cache): both calls' gradients reach
    the one cast, where autograd sums them in the autocast dtype A before widening them to
    float32. qbl casts inside each call and returns each call's gradients in float32, which
    autograd then sums in float32. With E1, E2 each call's gradient (A values, widened) and
    s = fl32(E1 + E2), qbl's gradient is s and eager's is RN_A(s), so

        |qbl - eager| = |s - RN_A(s)| <= u_A |s| (+ A's smallest normal, for a subnormal s)

    with u_A A's unit roundoff (2^-8 bf16, 2^-11 fp16): the bound checked, with s and E1, E2
    from eager's own calls (each call's gradients alone, in the same region). On the CPU, where
    qbl's per-call gradients are eager's bits, qbl's gradient is s bit for bit and eager's is
    qbl's rounded to A bit for bit. On CUDA qbl's per-call GEMMs differ from cuBLAS's by their
    own rounding: there the bound adds |Q1 - E1| + |Q2 - E2| (qbl's per-call gradients Qi, from
    the same region; zero on the CPU) and an fp32 rounding of each of the two sums,
    2^-23 (|qbl| + |s|). On every device qbl's gradient is also within 2 x eager's error of the
    float64 sum of the two products (Frobenius norm). Eager's gradient differs from s somewhere
    (the test's premise: eager sums in A)."""
    n_in, n_out, lead = 64, 48, (4, 33)
    x1, l1, w, b = H.make_inputs(lead, n_in, n_out, torch.float32, device, seed=250)
    x2, l2, _, _ = H.make_inputs(lead, n_in, n_out, torch.float32, device, seed=251)
    g1 = H.make_grad_out((*lead, n_out), ac, device, seed=252)
    g2 = H.make_grad_out((*lead, n_out), ac, device, seed=253)

    def grads(fn):
        """(weight, bias) gradients of both calls together, of the first alone, of the second
        alone -- each from one region in which the parameters serve both calls."""
        result = []
        for which in ((0, 1), (0,), (1,)):
            wl, bl = w.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
            with _autocast(device, ac):
                outs = [fn(x1, l1.to(ac), wl, bl), fn(x2, l2.to(ac), wl, bl)]
            gw, gb = torch.autograd.grad([outs[i] for i in which], [wl, bl],
                                         [(g1, g2)[i] for i in which])
            assert gw.dtype == gb.dtype == torch.float32, f"gradient dtypes {gw.dtype}, {gb.dtype}"
            result.append((gw, gb))
        return result

    q, q1, q2 = grads(H.qbl_fn())
    e, e1, e2 = grads(H.eager_fn())
    u, tiny = H.UNIT_ROUNDOFF[ac], torch.finfo(ac).tiny
    with torch.no_grad(), _autocast(device, ac):
        m1 = H.eager_forward(x1, l1.to(ac), w, b).mixed.to(ac).double().reshape(-1, n_in)
        m2 = H.eager_forward(x2, l2.to(ac), w, b).mixed.to(ac).double().reshape(-1, n_in)
    g1d, g2d = g1.double().reshape(-1, n_out), g2.double().reshape(-1, n_out)
    refs = {"grad_weight": g1d.t() @ m1 + g2d.t() @ m2, "grad_bias": g1d.sum(0) + g2d.sum(0)}
    for i, name in enumerate(("grad_weight", "grad_bias")):
        s = e1[i] + e2[i]  # eager's per-call gradients summed in float32
        assert not torch.equal(e[i], s), (
            f"{name}: eager's sum equals the float32 sum everywhere (the test's premise: eager "
            "sums in the autocast dtype)")
        if device.type == "cpu":
            H.assert_bits_equal(q[i], s,
                                f"{name}: qbl vs eager's per-call gradients summed in fp32")
            H.assert_bits_equal(q[i].to(ac).float(), e[i],
                                f"{name}: qbl's rounded to {ac} vs eager's (summed in {ac})")
        per_call = (q1[i] - e1[i]).abs() + (q2[i] - e2[i]).abs()
        bound = u * s.abs() + per_call + 2.0 ** -23 * (q[i].abs() + s.abs()) + tiny
        H._assert_within(q[i], e[i], bound.double(), f"{name}: qbl vs eager's",
                         "bound u_A |s| + per-call differences", "eager's")
        H.assert_gemm_close(q[i], e[i], refs[name], torch.float32, f"{name} (two calls)")


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_recomputed_mixed_with_straight_through_gives_the_kept_gradients(dtype, device):
    """keep_mixed=False (the backward recomputes mixed from x and the stats) with
    straight_through=True against keep_mixed=True: out and every gradient bit for bit, also the
    weight gradient alone (mixed recomputed without dgrad) -- as test_activation checks without
    the straight-through estimator (under autocast, with every activation:
    test_recomputed_mixed_under_autocast_gives_the_kept_gradients). And the gradients against
    ModelSTE's eager autograd: the backward's bounds (check_all_grads), grad_x bit for bit."""
    lead, n_in, n_out = (3, 37), 96, 40
    x, l, w, b = H.make_inputs(lead, n_in, n_out, dtype, device, seed=260)
    g = H.make_grad_out((*lead, n_out), dtype, device, seed=261)

    def fn(keep):
        return lambda x_, l_, w_, b_: qbl.quant_blend_linear(x_, l_, w_, b_, straight_through=True,
                                                             keep_mixed=keep)

    kept = H.run_autograd(fn(True), x, l, w, b, g)
    recomputed = H.run_autograd(fn(False), x, l, w, b, g)
    H.assert_bits_equal(recomputed.out, kept.out, "out")
    for name in ("x", "logits", "weight", "bias"):
        H.assert_bits_equal(getattr(recomputed, name), getattr(kept, name), f"grad of {name}")
    kept_w = H.run_autograd(fn(True), x, l, w, b, g, want=(False, False, True, False))
    rec_w = H.run_autograd(fn(False), x, l, w, b, g, want=(False, False, True, False))
    H.assert_bits_equal(rec_w.weight, kept_w.weight, "grad of weight alone")
    eager = H.run_autograd(H.eager_fn(straight_through=True), x, l, w, b, g)
    H.assert_bits_equal(recomputed.x, eager.x, "grad_x vs ModelSTE's eager autograd")
    H.check_all_grads(recomputed, eager, x, l, w, b, g, dtype, True, "recomputed, STE: ")


#: (autocast dtype A, x's dtype) with logits in A and float32 parameters: the fused combinations.
RECOMPUTE_AUTOCAST_CASES = [
    pytest.param(AC, torch.float32, id="bf16-x_fp32"),
    pytest.param(AC, AC, id="bf16-x_bf16"),
    pytest.param(torch.float16, torch.float32, id="fp16-x_fp32"),
    pytest.param(torch.float16, torch.float16, id="fp16-x_fp16"),
]


@pytest.mark.parametrize("ste", [False, True], ids=["zero_grad", "straight_through"])
@pytest.mark.parametrize("act", H.ACTIVATION_PARAMS)
@pytest.mark.parametrize("ac,x_dtype", RECOMPUTE_AUTOCAST_CASES)
def test_recomputed_mixed_under_autocast_gives_the_kept_gradients(ac, x_dtype, act, ste, device):
    """keep_mixed=False under autocast(A) (bf16 or fp16; x float32 or A, logits in A, float32
    parameters, which qbl casts inside: mixed recomputed from x and the stats in the GEMM's dtype
    A), with every activation and both quantizer gradients, against keep_mixed=True in the same
    region: out and every gradient bit for bit, also the weight gradient alone (mixed recomputed
    without dgrad) -- the promise that the gradients are the same bits either way. Against
    eager's activation + the reference module (ModelSTE's with straight_through) under the same
    autocast, the gradients as H.check_autocast_grads holds them (eager's dtypes; grad_logits,
    grad_weight and grad_bias within their bounds of float64; on the CPU eager's bits), and the
    gradient of h bit for bit: with W = I and b = 0 (exact in A) g_mixed = grad_out exactly in
    eager and in qbl, so it is eager's activation backward of eager's grad_x. Each with a general
    weight and with W = I (the bits of h's gradient with W = I only)."""
    d, lead = 64, (3, 37)
    x, l, w_general, b_general = H.make_inputs(lead, d, d, torch.float32, device, seed=262)
    x, l = x.to(x_dtype), l.to(ac)
    g = H.make_grad_out((*lead, d), ac, device, seed=263)
    fn_act = None if act == "none" else act
    h = H.ACTIVATIONS[act](x)

    def fn(keep):
        def call(x_, l_, w_, b_):
            with _autocast(device, ac):
                return qbl.quant_blend_linear(x_, l_, w_, b_, straight_through=ste,
                                              activation=fn_act, keep_mixed=keep)
        return call

    def eager(x_, l_, w_, b_):
        with _autocast(device, ac):
            return H.eager_forward(H.ACTIVATIONS[act](x_), l_, w_, b_, straight_through=ste).out

    for weight, (w, b) in (("general weight", (w_general, b_general)),
                           ("W = I", H.identity_layer_params(d, torch.float32, device))):
        kept = H.run_autograd(fn(True), x, l, w, b, g)
        recomputed = H.run_autograd(fn(False), x, l, w, b, g)
        H.assert_bits_equal(recomputed.out, kept.out, f"{weight}: out")
        for name in ("x", "logits", "weight", "bias"):
            H.assert_bits_equal(getattr(recomputed, name), getattr(kept, name),
                                f"{weight}: grad of {name}")
        kept_w = H.run_autograd(fn(True), x, l, w, b, g, want=(False, False, True, False))
        rec_w = H.run_autograd(fn(False), x, l, w, b, g, want=(False, False, True, False))
        H.assert_bits_equal(rec_w.weight, kept_w.weight, f"{weight}: grad of weight alone")
        e = H.run_autograd(eager, x, l, w, b, g)
        with torch.no_grad(), _autocast(device, ac):
            fwd = H.eager_forward(h, l, w, b, straight_through=ste)
        H.check_autocast_grads(recomputed, e, h, l, w, fwd, g, ac, f"{weight}, recomputed: ")
        if weight == "W = I":
            H.assert_bits_equal(recomputed.x, e.x, "grad of h (W = I) vs eager's under autocast")


def test_mixed_dtypes_outside_autocast_raise(device):
    """Outside autocast the operator takes one dtype: an fp32 x with a bf16 gate is a TypeError
    naming the two, and nothing is computed."""
    x, l, w, b = H.make_inputs((3, 4), 32, 16, torch.float32, device, seed=203)
    with pytest.raises(TypeError, match="logits has dtype BFloat16 but x is Float"):
        qbl.quant_blend_linear(x, l.bfloat16(), w, b)
    with pytest.raises(TypeError, match="weight has dtype BFloat16"):
        qbl.quant_blend_linear(x, l, w.bfloat16(), b)


@pytest.mark.parametrize("keep_mixed", [True, False], ids=["keep_mixed", "recompute"])
def test_autocast_keeps_the_float32_weight_not_a_cast_copy(keep_mixed, device):
    """Under autocast with float32 parameters, autograd keeps the weight parameter itself for the
    backward (the operator casts it to the autocast dtype in the forward and again in the
    backward) rather than a copy in the autocast dtype: the saved tensors include the weight's own
    storage, and none has the weight's shape in the autocast dtype -- what eager's F.linear
    keeps."""
    x, l, w, b = H.make_inputs((4, 33), 64, 48, torch.float32, device, seed=206)
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    runs = {}
    for name, fn in (("qbl", lambda: qbl.quant_blend_linear(x, l.to(AC), w, b,
                                                            keep_mixed=keep_mixed)),
                     ("eager", lambda: H.eager_forward(x, l.to(AC), w, b).out)):
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(device):
            fn()
        runs[name] = saved
    # A copy of the weight, or of its transpose (addmm keeps weight.t()): its size in AC. No other
    # tensor here has as many elements (48 x 64: x and mixed have 4 x 33 x 64).
    def copies(saved):
        return [tuple(t.shape) for t in saved if t.dtype == AC and t.numel() == w.numel()]

    assert copies(runs["eager"]), (
        "eager's F.linear under autocast keeps the weight's cast (the test's premise): "
        f"{[(tuple(t.shape), t.dtype) for t in runs['eager']]}")
    q = runs["qbl"]
    assert any(t.dtype == torch.float32 and t.data_ptr() == w.data_ptr() for t in q), (
        f"qbl keeps {[(tuple(t.shape), t.dtype) for t in q]}: not the float32 weight")
    assert not copies(q), (
        f"qbl keeps a {AC} copy of the weight: {[(tuple(t.shape), t.dtype) for t in q]}")


def test_compiled_autocast_keeps_the_float32_weight_not_a_cast_copy(device):
    """The same under torch.compile, where AOTAutograd traces the parameters as non-leaf tensors:
    the operator still takes the float32 weight, so the compiled graph keeps the parameter itself
    for the backward (its own storage, in float32) and no copy of it in the autocast dtype.
    Compiled with Inductor on CUDA, with aot_eager on the CPU (the same AOTAutograd tracing and
    partitioning of what is saved, without compiling C++ kernels)."""
    torch._dynamo.reset()
    layer = qbl.QuantBlendLinear(64, 48, device=device)
    x, l, _, _ = H.make_inputs((4, 33), 64, 48, torch.float32, device, seed=207)
    x, l = x.requires_grad_(), l.to(AC)
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(layer, backend=backend)
    for _ in range(2):  # the second call runs the compiled graph as compiled
        saved = []

        def pack(t):
            saved.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(device):
            out = compiled(x, l)
        out.float().sum().backward()
    w = layer.weight
    kept = [(tuple(t.shape), t.dtype) for t in saved]
    assert any(t.dtype == torch.float32 and t.data_ptr() == w.data_ptr() for t in saved), (
        f"the compiled graph keeps {kept}: not the float32 weight")
    assert not any(t.dtype == AC and t.numel() == w.numel() for t in saved), (
        f"the compiled graph keeps a {AC} copy of the weight: {kept}")
    torch._dynamo.reset()


def test_autocast_keeps_a_cast_copy_of_a_computed_float32_weight(device):
    """A computed float32 weight under autocast (not a leaf: a merged or parametrized weight) is
    cast as F.linear casts it, so that autograd keeps the copy in the autocast dtype, as eager
    does, and not the float32 intermediate (which eager frees after the forward). Its gradients:
    test_autocast_gradients_follow_the_casts[computed_weight]."""
    x, l, w, b = H.make_inputs((4, 33), 64, 48, torch.float32, device, seed=216)
    x, w, b = x.requires_grad_(), w.requires_grad_(), b.requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _autocast(device):
        computed = w * 1.0  # float32, not a leaf
        qbl.quant_blend_linear(x, l.to(AC), computed, b)
    kept = [(tuple(t.shape), t.dtype) for t in saved]
    assert not any(t.data_ptr() == computed.data_ptr() for t in saved), (
        f"qbl keeps the computed float32 weight for the backward: {kept}")
    assert any(t.dtype == AC and t.numel() == w.numel() for t in saved), (
        f"qbl keeps no {AC} copy of the computed weight: {kept}")


def _check_backward_casts_a_float32_weight(ac, kept, mask, has_bias, device):
    """qbl.forward and qbl.backward with gemm_dtype and float32 parameters against the same calls
    with the parameters cast: the bits of the cast call, parameter gradients cast to float32."""
    x, l, w, b = H.make_inputs((3, 41), 64, 48, torch.float32, device, bias=has_bias, seed=207)
    l = l.to(ac)
    b16 = None if b is None else b.to(ac)
    out, mixed, stats = torch.ops.qbl.forward(x, l, w, b, gemm_dtype=ac)
    out2, mixed2, stats2 = torch.ops.qbl.forward(x, l, w.to(ac), b16, gemm_dtype=ac)
    for name, a, e in (("out", out, out2), ("mixed", mixed, mixed2), ("stats", stats, stats2)):
        H.assert_bits_equal(a, e, f"forward's {name}, float32 parameters vs cast ones")
    g = H.make_grad_out((3, 41, 48), ac, device, seed=208)
    m = mixed if kept else None
    got = torch.ops.qbl.backward(g, x, l, w, m, stats, has_bias, mask, gemm_dtype=ac)
    want = torch.ops.qbl.backward(g, x, l, w.to(ac), m, stats, has_bias, mask, gemm_dtype=ac)
    assert [t.dtype for t in got] == [torch.float32, ac, torch.float32, torch.float32], (
        f"gradient dtypes {[t.dtype for t in got]}")
    names = ("grad_x", "grad_logits", "grad_weight", "grad_bias")
    for name, wanted, a, e in zip(names, mask[:3] + [mask[3] and has_bias], got, want):
        assert a.numel() == (e.numel() if wanted else 0), f"{name}: shape {tuple(a.shape)}"
        H.assert_bits_equal(a, e.to(a.dtype), f"{name}, float32 weight vs cast weight")


BACKWARD_MASKS = [
    pytest.param([True, True, True, True], True, id="all"),
    pytest.param([True, False, True, True], True, id="x_weight_bias"),
    pytest.param([False, True, False, True], True, id="logits_bias"),
    pytest.param([True, True, True, False], False, id="nobias")]


@pytest.mark.parametrize("mask,has_bias", BACKWARD_MASKS)
@pytest.mark.parametrize("kept", [True, False], ids=["mixed", "mixed_none"])
@pytest.mark.parametrize("ac", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_backward_casts_a_float32_weight_to_gemm_dtype(ac, kept, mask, has_bias, device):
    """qbl.backward with gemm_dtype and a float32 weight computes with the weight cast to the
    GEMM's dtype and returns grad_weight and grad_bias in float32: bit for bit the same call with
    the cast weight, its parameter gradients cast to float32 (as autograd casts them through a
    cast); qbl.forward likewise gives the bits of the call with the cast parameters. (CUDA's wgrad
    beside dgrad, or serialized with it: the test below.)"""
    _check_backward_casts_a_float32_weight(ac, kept, mask, has_bias, device)


@pytest.mark.cuda
@pytest.mark.parametrize("overlap", ["1", "0"], ids=["wgrad_beside_dgrad", "wgrad_serialized"])
@pytest.mark.parametrize("mask,has_bias", BACKWARD_MASKS)
@pytest.mark.parametrize("kept", [True, False], ids=["mixed", "mixed_none"])
@pytest.mark.parametrize("ac", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_backward_casts_a_float32_weight_with_wgrad_overlap(ac, kept, mask, has_bias, overlap,
                                                            monkeypatch, cuda_device):
    """The same on CUDA whether wgrad runs beside dgrad (the float32 weight's cast then runs
    beside wgrad, on the side stream) or serialized with it (QBL_OVERLAP_WGRAD, read when a layer
    is planned: the cache is cleared around the test)."""
    monkeypatch.setenv("QBL_OVERLAP_WGRAD", overlap)
    qbl.clear_cache()
    try:
        _check_backward_casts_a_float32_weight(ac, kept, mask, has_bias, cuda_device)
    finally:
        monkeypatch.delenv("QBL_OVERLAP_WGRAD", raising=False)
        qbl.clear_cache()


def test_gemm_dtype_takes_parameters_of_it_or_float32(device):
    """With gemm_dtype, weight is of that dtype or float32 and bias of weight's: anything else is
    a TypeError naming the dtypes, raised before anything runs."""
    x, l, w, b = H.make_inputs((3, 4), 32, 16, torch.float32, device, seed=209)
    with pytest.raises(TypeError, match="weight has dtype Half but gemm_dtype is BFloat16"):
        torch.ops.qbl.forward(x, l, w.half(), b.half(), gemm_dtype=AC)
    with pytest.raises(TypeError, match="bias has dtype BFloat16 but weight is Float"):
        torch.ops.qbl.forward(x, l, w, b.to(AC), gemm_dtype=AC)
    out, mixed, stats = torch.ops.qbl.forward(x, l, w, b, gemm_dtype=AC)
    g = torch.ones_like(out)
    with pytest.raises(TypeError, match="weight has dtype Half but gemm_dtype is BFloat16"):
        torch.ops.qbl.backward(g, x, l, w.half(), mixed, stats, True, [True] * 4, gemm_dtype=AC)
    with pytest.raises(TypeError, match="grad_out has dtype Float but gemm_dtype is BFloat16"):
        torch.ops.qbl.backward(g.float(), x, l, w, mixed, stats, True, [True] * 4, gemm_dtype=AC)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_autocast_compiles_to_the_same_bits(backend, device):
    """torch.compile(fullgraph=True) of a function that runs the layer under autocast (fp32 x and
    parameters, a bf16 gate as a model's gate Linear gives it): the same out and gradients, bit
    for bit, as the uncompiled function -- the compiled graph calls qbl's kernels with autocast's
    casts around them. (Around the layer only exact ops, so that the comparison is of qbl.) On
    the CPU this is the file's one Inductor test (it compiles C++: seconds)."""
    torch._dynamo.reset()
    torch.manual_seed(204)
    layer = qbl.QuantBlendLinear(64, 48, device=device)

    def fn(x, l):
        with _autocast(device):
            return layer(x, l.to(AC))

    x, l, _, _ = H.make_inputs((6, 40), 64, 48, torch.float32, device, seed=204)
    g = H.make_grad_out((6, 40, 48), AC, device, seed=205)
    runs = {}
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    for name, f in (("eager", fn), ("compiled", compiled)):
        layer.zero_grad(set_to_none=True)
        xx, ll = x.clone().requires_grad_(), l.clone().requires_grad_()
        out = f(xx, ll)
        out.backward(g)
        runs[name] = [out.detach(), xx.grad, ll.grad, layer.weight.grad.clone(),
                      layer.bias.grad.clone()]
    names = ("out", "grad_x", "grad_logits", "grad_weight", "grad_bias")
    for name, a, b_ in zip(names, runs["compiled"], runs["eager"]):
        H.assert_bits_equal(a, b_, f"{backend}: {name} compiled vs eager, under autocast")
    torch._dynamo.reset()


# ---- CUDA's alone: a captured step, two streams, planning threads, host time --------------------


@pytest.mark.cuda
@pytest.mark.parametrize("beside", [False, True], ids=["capture_stream", "warmed_stream"])
def test_captured_autocast_training_step_replays_eager_steps(beside, monkeypatch, cuda_device):
    """A whole mixed-precision step -- forward under autocast(cache_enabled=False), backward, and an
    AdamW step on fp32 parameters -- captured in a CUDA graph and replayed: the parameters after 3
    eager warm-up steps and 5 replays equal those after 8 eager steps, bit for bit. Captured on
    torch's capture stream (no side stream of qbl's exists for it: the weight's cast, wgrad and
    dgrad on one stream), and on the warm-up's stream with wgrad beside dgrad (its side stream
    made while warming up: the float32 weight's cast beside wgrad, captured)."""
    if beside:
        monkeypatch.setenv("QBL_OVERLAP_WGRAD", "1")
    qbl.clear_cache()
    dev = cuda_device

    def make():
        torch.manual_seed(205)
        return torch.nn.ModuleDict({
            "gate": torch.nn.Linear(64, 1, device=dev),
            "layer": qbl.QuantBlendLinear(64, 64, device=dev)})

    xs = [torch.randn(8, 32, 64, device=dev, generator=torch.Generator(
        device=dev).manual_seed(206 + i)) for i in range(8)]

    def loss_of(m, x):
        with _autocast(dev, cache=False):
            logits = m["gate"](x).squeeze(-1)
            return m["layer"](x, logits).float().square().mean()

    ref = make()
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, capturable=True)
    for x in xs:
        opt_ref.zero_grad(set_to_none=True)
        loss_of(ref, x).backward()
        opt_ref.step()

    m = make()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True)
    static_x = xs[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x in xs[:3]:
            static_x.copy_(x)
            opt.zero_grad(set_to_none=True)
            loss_of(m, static_x).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph, stream=side if beside else None):
        loss_of(m, static_x).backward()
        opt.step()
    for x in xs[3:]:
        static_x.copy_(x)
        graph.replay()
    torch.cuda.synchronize()
    for (name, p), q in zip(m.named_parameters(), ref.parameters()):
        H.assert_bits_equal(p.detach(), q.detach(), f"{name} after 3 eager steps and 5 replays")
    monkeypatch.delenv("QBL_OVERLAP_WGRAD", raising=False)
    qbl.clear_cache()



@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_shape_on_two_streams_at_once_equals_serial_runs(dtype, cuda_device):
    """The same (shape, dtype) layer on two streams at once, forward and backward interleaved and
    in flight together (each stream held back by a sleep kernel while the other runs): each
    stream's outputs and gradients equal the serial run of its inputs bit for bit (its workspace
    comes from torch's caching allocator on its own stream)."""
    shape, n_in, n_out = (8, 256), 384, 192
    sets = [H.make_inputs(shape, n_in, n_out, dtype, cuda_device, seed=210 + k) for k in range(2)]
    gs = [H.make_grad_out((*shape, n_out), dtype, cuda_device, seed=212 + k) for k in range(2)]
    serial = [H.run_autograd(H.qbl_fn(), *sets[k], gs[k]) for k in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    results = [None, None]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for rep in range(5):
        pending = []
        for k, s in enumerate(streams):
            with torch.cuda.stream(s):
                torch.cuda._sleep(1_000_000 * (2 - k))  # stream 0 starts later than stream 1
                leaves = [t.detach().clone().requires_grad_() for t in sets[k]]
                out = qbl.quant_blend_linear(*leaves)
                pending.append((k, out, leaves))
        for k, out, leaves in pending:
            with torch.cuda.stream(streams[k]):
                grads = torch.autograd.grad(out, leaves, gs[k])
                results[k] = (out.detach(), grads)
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        for k in range(2):
            out, grads = results[k]
            H.assert_bits_equal(out, serial[k].out, f"rep {rep}, stream {k}: out")
            for name, got, want in zip(("x", "logits", "weight", "bias"), grads,
                                       (serial[k].x, serial[k].logits, serial[k].weight,
                                        serial[k].bias)):
                H.assert_bits_equal(got, want, f"rep {rep}, stream {k}: grad_{name}")


@pytest.mark.cuda
def test_calls_of_a_planned_layer_do_not_wait_for_another_threads_planning(cuda_device):
    """While one thread plans a new layer -- planning first waits for its stream, held back here
    by a sleep kernel of about two seconds -- the forward and backward of a layer planned before,
    on another thread and stream, return at once: looking up a planned layer never waits for the
    planning of another."""
    qbl.clear_cache()
    ready = H.make_inputs((64,), 128, 64, torch.bfloat16, cuda_device, seed=240)
    ready_g = H.make_grad_out((64, 64), torch.bfloat16, cuda_device, seed=241)
    H.run_autograd(H.qbl_fn(), *ready, ready_g)  # planned, forward and backward
    # Another layer: unplanned.
    new = H.make_inputs((64,), 192, 96, torch.bfloat16, cuda_device, seed=242)
    torch.cuda.synchronize()
    about_to_plan, errors = threading.Event(), []

    def planner():
        try:
            s = torch.cuda.Stream()
            with torch.cuda.stream(s):
                # Cached memory for this stream first: the call's outputs, allocated before it
                # looks its layer up, then need no cudaMalloc while the sleep kernel runs.
                torch.empty(1 << 18, dtype=torch.uint8, device=cuda_device)  # freed: cached
                torch.cuda._sleep(4_000_000_000)  # ~2 s of the planning's wait for this stream
                about_to_plan.set()
                qbl.quant_blend_linear(*new)
            s.synchronize()
        except Exception as e:  # noqa: BLE001 -- reported by the test's thread
            errors.append(e)
        finally:
            about_to_plan.set()

    thread = threading.Thread(target=planner)
    thread.start()
    try:
        assert about_to_plan.wait(timeout=30), "the planning thread did not start"
        time.sleep(0.1)  # the planner is inside its call now, waiting for its stream
        t0 = time.perf_counter()
        for _ in range(3):
            H.run_autograd(H.qbl_fn(), *ready, ready_g)
        host_s = time.perf_counter() - t0
    finally:
        thread.join(timeout=60)
    assert not errors, f"the planning thread failed: {errors[0]!r}"
    assert host_s < 0.5, (
        f"three forwards and backwards of a planned layer took {host_s:.3f} s of host time while "
        "another thread planned: they waited for its planning")


@pytest.mark.cuda
def test_backward_on_another_stream_during_a_capture_equals_serial_runs(cuda_device):
    """A training call captured into a CUDA graph on one stream while another thread runs the
    same layer's forward and backward on another stream, after the captured backward and before
    the capture ends. Each calling stream has its own side stream for wgrad (a side stream shared
    by the two would still be part of the open capture, and the other thread's wgrad would be
    captured into the graph or refused). The other thread's results, and the graph's on replay,
    equal the serial runs of their inputs bit for bit."""
    dtype = torch.bfloat16
    shape, n_in, n_out = (8, 256), 384, 192
    sets = [H.make_inputs(shape, n_in, n_out, dtype, cuda_device, seed=230 + k) for k in range(2)]
    gs = [H.make_grad_out((*shape, n_out), dtype, cuda_device, seed=232 + k) for k in range(2)]
    serial = [H.run_autograd(H.qbl_fn(), *sets[k], gs[k]) for k in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]

    def step(k):
        leaves = [t.detach().clone().requires_grad_() for t in sets[k]]
        out = qbl.quant_blend_linear(*leaves)
        return out.detach(), torch.autograd.grad(out, leaves, gs[k])

    # A first call on each stream makes its side stream (none is made during a capture).
    for k, s in enumerate(streams):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step(k)
    torch.cuda.synchronize()

    captured, other_done, other = threading.Event(), threading.Event(), {}

    def other_thread():
        try:
            if not captured.wait(timeout=120):
                raise TimeoutError("the capture did not reach its backward")
            with torch.cuda.stream(streams[1]):
                other["result"] = step(1)
            streams[1].synchronize()
        except Exception as e:  # noqa: BLE001 -- reported by the test's thread
            other["error"] = e
        finally:
            other_done.set()

    thread = threading.Thread(target=other_thread)
    thread.start()
    graph = torch.cuda.CUDAGraph()
    try:
        # thread_local: the other thread's allocations and synchronization stay legal.
        with torch.cuda.graph(graph, stream=streams[0], capture_error_mode="thread_local"):
            captured_out, captured_grads = step(0)
            captured.set()
            assert other_done.wait(timeout=120), "the other stream's call did not finish"
    finally:
        captured.set()
        thread.join(timeout=120)
    assert "error" not in other, f"the other stream's call failed: {other.get('error')!r}"
    graph.replay()
    torch.cuda.synchronize()
    for k, (out, grads) in ((0, (captured_out, captured_grads)), (1, other["result"])):
        what = "replayed capture" if k == 0 else "other stream during the capture"
        H.assert_bits_equal(out, serial[k].out, f"{what}: out")
        for name, got, want in zip(("x", "logits", "weight", "bias"), grads,
                                   (serial[k].x, serial[k].logits, serial[k].weight,
                                    serial[k].bias)):
            H.assert_bits_equal(got, want, f"{what}: grad_{name}")


# ---- host time -----------------------------------------------------------------------------------


def _host_us_per_call(fns, rounds=15, batch=20):
    """The median host time of each fn() over rounds of `batch` calls, the device kept busy so
    that the queue never drains (the calls are timed as a training loop issues them). The fns
    take turns in every round, so that a change in the host's load hits them alike."""
    for fn in fns:
        for _ in range(batch):
            fn()
    torch.cuda.synchronize()
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            torch.cuda._sleep(20_000_000)
            t0 = time.perf_counter()
            for _ in range(batch):
                fn()
            times[i].append((time.perf_counter() - t0) / batch * 1e6)
            torch.cuda.synchronize()
    return [statistics.median(t) for t in times]


@pytest.mark.cuda
def test_host_time_of_forward_and_backward_near_nn_linear(cuda_device):
    """One forward + backward of a training layer (8 x 1024 tokens, 1024 -> 1024, bf16) costs the
    host about what nn.Linear's does (the autograd formula is C++; no Python runs per call):
    measured here within 1.5x, the two timed in alternating rounds (the project's target is
    1.2x; benchmarks/RESULTS.md has the measurement, and this bound leaves room for a busy
    host)."""
    d, tokens = 1024, 8192
    x = torch.randn(tokens, d, device=cuda_device, dtype=torch.bfloat16, requires_grad=True)
    l = torch.randn(tokens, device=cuda_device, dtype=torch.bfloat16, requires_grad=True)
    layer = qbl.QuantBlendLinear(d, d, device=cuda_device, dtype=torch.bfloat16)
    linear = torch.nn.Linear(d, d, device=cuda_device, dtype=torch.bfloat16)
    g = torch.randn(tokens, d, device=cuda_device, dtype=torch.bfloat16)

    def qbl_step():
        layer(x, l).backward(g)

    def linear_step():
        linear(x).backward(g)

    q, n = _host_us_per_call([qbl_step, linear_step])
    print(f"\n[host time] forward + backward per call: qbl {q:.1f} us, nn.Linear {n:.1f} us "
          f"({q / n:.2f}x)")
    assert q <= 1.5 * n, f"qbl's host time per call {q:.1f} us > 1.5 x nn.Linear's {n:.1f} us"


# ---- grad_logits' accuracy -----------------------------------------------------------------------

GRAD_LOGITS_SHAPES = [(4, 1000), (16, 1000), (256, 1024), (64, 2048), (8, 4096)]
#: fp16 on the CPU: the same row lengths, fewer tokens (eager's CPU fp16 mm of g_mixed = g @ W,
#: which qbl's CPU backward calls as eager's autograd does, is about 40 times slower than bf16's).
GRAD_LOGITS_SHAPES_CPU_FP16 = [(4, 1000), (16, 1000), (64, 1024), (16, 2048), (4, 4096)]


@pytest.mark.parametrize("dtype", H.DTYPE_PARAMS)
def test_grad_logits_at_least_as_accurate_as_eagers(dtype, device):
    """grad_logits against its float64 value (W = I, so that g_mixed is grad_out exactly for both
    and only the two row sums differ), qbl's sums (compensated on CUDA, accumulated in double on
    the CPU) against eager's fp32 reduction on the same device; the table is printed. fp32: qbl's
    error no larger than eager's at every shape. bf16 and fp16: both round each sum to the dtype,
    which dominates; they differ only at the few tokens where eager's sum error crosses a
    rounding boundary, which moves the error either way -- within 25 % of eager's here (a plain
    sum of the row would not be: test_quant_blend_backward's compensated-sum test holds the CUDA
    kernel itself to its derived bound). fp16 on the CPU: fewer tokens of the same lengths."""
    rows = []
    slow = device.type == "cpu" and dtype == torch.float16
    for tokens, d in GRAD_LOGITS_SHAPES_CPU_FP16 if slow else GRAD_LOGITS_SHAPES:
        x, l, _, _ = H.make_inputs((tokens,), d, d, dtype, device, seed=220 + d + tokens)
        w, b = H.identity_layer_params(d, dtype, device)
        g = H.make_grad_out((tokens, d), dtype, device, seed=221)
        q = H.run_autograd(H.qbl_fn(), x, l, w, b, g, want=(False, True, False, False)).logits
        e = H.run_autograd(H.eager_fn(), x, l, w, b, g, want=(False, True, False, False)).logits
        with torch.no_grad():
            fwd = H.eager_forward(x, l, w, b)
        ref = H.ref64_grads(x, l, w, fwd, g).logits
        eq, ee = H.rel_fro(q, ref), H.rel_fro(e, ref)
        rows.append((tokens, d, eq, ee))
    print(f"\n[grad_logits {dtype} {device.type}] tokens  D  error vs float64: qbl  eager")
    for tokens, d, eq, ee in rows:
        print(f"  {tokens:5d} {d:5d}  {eq:.3e}  {ee:.3e}")
    slack = 1.0 if dtype == torch.float32 else 1.25
    for tokens, d, eq, ee in rows:
        assert eq <= slack * ee, (f"{dtype} tokens {tokens} D {d}: qbl's grad_logits error "
                                  f"{eq:.3e} > {slack} x eager's {ee:.3e}")

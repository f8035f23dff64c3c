"""The package's API around the math: bad input (on every device: a clear error, nothing written),
tensors on two devices, the module and its state dict (with nn.Linear and the examples' ModelNew),
the layer cache (CUDA's; the CPU kernels keep none), planning during CUDA graph capture, and the
current CUDA stream."""

from __future__ import annotations

import helpers as H

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import qbl
import reference as reference_model

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL_NEW = os.path.normpath(os.path.join(HERE, "..", "..", "examples", "pytorch", "model_new.py"))


def _sync(device):
    """On CUDA, wait for the device, so that an asynchronous error surfaces here."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _check_still_works(x, l, w, b, what):
    """After a raise: no CUDA error left behind (on CUDA), and a normal call still gives eager's
    mixed."""
    _sync(x.device)
    _, mixed, _ = torch.ops.qbl.forward(x, l, w, b)
    H.assert_bits_equal(mixed, H.eager_forward(x, l, w, b).mixed, f"after '{what}': mixed")
    _sync(x.device)


def _snapshot(args):
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def _assert_unchanged(args, before, what):
    for i, (a, s) in enumerate(zip(args, before)):
        if isinstance(a, torch.Tensor) and a.numel():
            H.assert_bits_equal(a, s, f"'{what}': argument {i} changed by the failed call")


def _assert_forward_raises_cleanly(args, exc, pattern, what, **fn_kwargs):
    """torch.ops.qbl.forward(*args) raises `exc` matching `pattern`, its arguments unchanged; then
    qbl.quant_blend_linear(*args, **fn_kwargs) on leaf copies that require grad and already hold a
    .grad raises the same, leaving the leaves and their .grad untouched (no gradient written)."""
    before = _snapshot(args)
    with pytest.raises(exc, match=pattern):
        torch.ops.qbl.forward(*args)
    _assert_unchanged(args, before, what)
    leaves = [a.detach().clone().requires_grad_() if a.is_floating_point() else a for a in args]
    gen = torch.Generator().manual_seed(1)
    for a in leaves:
        if a.requires_grad:
            a.grad = torch.randn(a.shape, generator=gen).to(a.dtype).to(a.device)
    leaves_before = _snapshot(leaves)
    grads_before = [a.grad.clone() if a.requires_grad else None for a in leaves]
    with pytest.raises(exc, match=pattern):
        qbl.quant_blend_linear(*leaves, **fn_kwargs)
    _assert_unchanged([a.detach() for a in leaves], leaves_before, f"{what} (functional form)")
    for i, (a, g) in enumerate(zip(leaves, grads_before)):
        if g is not None:
            H.assert_bits_equal(a.grad, g, f"'{what}' (functional form): .grad of argument {i} "
                                           f"changed by the failed call")


# name -> (args of torch.ops.qbl.forward from the good (x, logits, weight, bias), exception type,
# message pattern). Every case raises on every device, before anything is computed.
FORWARD_CASES = {
    "float64": (lambda x, l, w, b: (x.double(), l.double(), w.double(), b.double()), TypeError,
                "unsupported dtype"),
    "x of another dtype": (lambda x, l, w, b: (x.bfloat16(), l, w, b), TypeError,
                           "logits has dtype Float but x is BFloat16"),
    "logits of another dtype": (lambda x, l, w, b: (x, l.half(), w, b), TypeError,
                                "logits has dtype"),
    "weight of another dtype": (lambda x, l, w, b: (x, l, w.bfloat16(), b), TypeError,
                                "weight has dtype"),
    "bias of another dtype": (lambda x, l, w, b: (x, l, w, b.double()), TypeError,
                              "bias has dtype"),
    "logits flattened": (lambda x, l, w, b: (x, l.reshape(-1), w, b), RuntimeError,
                         "logits must have shape"),
    "logits with a trailing 1": (lambda x, l, w, b: (x, l.unsqueeze(-1), w, b), RuntimeError,
                                 "logits must have shape"),
    "weight in_features mismatch": (lambda x, l, w, b: (x, l, w[:, :-1].contiguous(), b),
                                    RuntimeError, "weight must be"),
    "weight transposed": (lambda x, l, w, b: (x, l, w.t().contiguous(), b), RuntimeError,
                          "weight must be"),
    "1-D weight": (lambda x, l, w, b: (x, l, w[0].contiguous(), b), RuntimeError,
                   "weight must be"),
    "bias shape": (lambda x, l, w, b: (x, l, w, b[:-1].contiguous()), RuntimeError,
                   "bias must be"),
    "2-D bias": (lambda x, l, w, b: (x, l, w, b.unsqueeze(0)), RuntimeError, "bias must be"),
    "0-d x": (lambda x, l, w, b: (x[0, 0, 0], l[0, 0], w, b), RuntimeError,
              "at least one dimension"),
    "zero in_features": (lambda x, l, w, b: (x[..., :0], l, w[:, :0], b), RuntimeError,
                         "must be positive"),
    "zero out_features": (lambda x, l, w, b: (x, l, w[:0], b[:0]), RuntimeError,
                          "must be positive"),
}

_ONE_DEVICE = "all tensors must be on one device"

# The same for tensors on two devices: the CPU and CUDA (x's device named in the message).
MIXED_DEVICE_CASES = {
    "x on CPU": (lambda x, l, w, b: (x.cpu(), l, w, b), RuntimeError,
                 rf"logits is on cuda:\d+ but x is on cpu; {_ONE_DEVICE}"),
    "logits on CPU": (lambda x, l, w, b: (x, l.cpu(), w, b), RuntimeError,
                      rf"logits is on cpu but x is on cuda:\d+; {_ONE_DEVICE}"),
    "weight on CPU": (lambda x, l, w, b: (x, l, w.cpu(), b), RuntimeError,
                      rf"weight is on cpu but x is on cuda:\d+; {_ONE_DEVICE}"),
    "bias on CPU": (lambda x, l, w, b: (x, l, w, b.cpu()), RuntimeError,
                    rf"bias is on cpu but x is on cuda:\d+; {_ONE_DEVICE}"),
    "only x on CUDA": (lambda x, l, w, b: (x, l.cpu(), w.cpu(), b.cpu()), RuntimeError,
                       rf"logits is on cpu but x is on cuda:\d+; {_ONE_DEVICE}"),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_bad_forward_input_raises_and_leaves_no_trace(case, device):
    """Each bad call raises its error type with a clear message, through the operator and through
    the differentiable functional form; the inputs and the .grad they already hold are unchanged;
    a normal call works after it."""
    x, l, w, b = H.make_inputs((4, 6), 32, 16, torch.float32, device, seed=40)
    make, exc, pattern = FORWARD_CASES[case]
    _assert_forward_raises_cleanly(make(x, l, w, b), exc, pattern, case)
    _check_still_works(x, l, w, b, case)


@pytest.mark.cuda
@pytest.mark.parametrize("case", list(MIXED_DEVICE_CASES))
def test_forward_tensors_on_cpu_and_cuda_raise_and_leave_no_trace(case, cuda_device):
    """A tensor on the CPU beside CUDA tensors raises RuntimeError naming both devices (whichever
    kernel the dispatcher picks), through the operator and the functional form, with nothing
    written; a normal call works after it."""
    x, l, w, b = H.make_inputs((4, 6), 32, 16, torch.float32, cuda_device, seed=40)
    make, exc, pattern = MIXED_DEVICE_CASES[case]
    _assert_forward_raises_cleanly(make(x, l, w, b), exc, pattern, case)
    _check_still_works(x, l, w, b, case)


_STATS_RULE = r"stats must be local_amax\(\)'s float32 \[2\] tensor on x's device"


def _assert_bad_stats_raise(x, l, w, b, stats, what):
    """The sharded forward's second step given a bad stats tensor raises, through the operator
    and through the functional form's amax_reduce, the stats unchanged."""
    before = stats.clone()
    with pytest.raises(RuntimeError, match=_STATS_RULE):
        torch.ops.qbl.forward(x, l, w, b, stats)
    H.assert_bits_equal(stats, before, f"'{what}': stats changed by the failed call")
    with pytest.raises(RuntimeError, match=_STATS_RULE):
        qbl.quant_blend_linear(x, l, w, b, amax_reduce=lambda _: stats)
    _check_still_works(x, l, w, b, what)


def test_bad_stats_of_the_sharded_forward_raise(device):
    """stats given to the forward (local_amax's, reduced over the shards) must be a contiguous
    float32 [2] tensor on x's device (the kernels read it through a pointer): float64, three
    elements or a strided view raise RuntimeError with that rule, nothing written."""
    x, l, w, b = H.make_inputs((4, 6), 32, 16, torch.float32, device, seed=39)
    stats = torch.ops.qbl.local_amax(x, "none")
    for what, bad in (("float64 stats", stats.double()),
                      ("stats of 3 elements", torch.cat([stats, stats[:1]])),
                      ("strided stats", torch.stack([stats, stats], 1).reshape(-1)[::2])):
        _assert_bad_stats_raise(x, l, w, b, bad, what)


@pytest.mark.cuda
def test_stats_on_the_cpu_with_cuda_tensors_raise(cuda_device):
    """The sharded forward's stats on the CPU with x on CUDA raises RuntimeError, nothing
    written."""
    x, l, w, b = H.make_inputs((4, 6), 32, 16, torch.float32, cuda_device, seed=39)
    _assert_bad_stats_raise(x, l, w, b, torch.ops.qbl.local_amax(x, "none").cpu(),
                            "stats on the CPU")


def test_one_list_of_activations():
    """The extension lists the activations once (torch.ops.qbl.activations(), the library's
    order); the package's list is that list with None for "none", and the operators' error for an
    unknown name names every entry of it. The suite's eager counterparts cover the same names."""
    names = list(torch.ops.qbl.activations())
    assert names[0] == "none" and len(names) == len(set(names))
    assert qbl._ops.ACTIVATIONS == (None, *names[1:])
    assert set(names) == set(H.ACTIVATIONS)
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError) as e:
        torch.ops.qbl.local_amax(x, "tanh")
    assert str(e.value).splitlines()[0].endswith("one of " + ", ".join(names))


def test_unknown_activation_raises(device):
    """An activation name that is none of none, gelu, gelu_tanh, relu, silu: ValueError naming it
    from the module's constructor, the functional form, and each operator (forward, backward,
    local_amax), with nothing written; a normal call works after it."""
    x, l, w, b = H.make_inputs((4, 6), 32, 16, torch.float32, device, seed=48)
    with pytest.raises(ValueError, match="activation must be one of .* got 'tanh'"):
        qbl.QuantBlendLinear(32, 16, activation="tanh", device=device)
    with pytest.raises(ValueError, match="activation must be one of .* got 'tanh'"):
        qbl.quant_blend_linear(x, l, w, b, activation="tanh")
    args = (x, l, w, b)
    before = _snapshot(args)
    with pytest.raises(ValueError, match="qbl.forward: unknown activation 'tanh'"):
        torch.ops.qbl.forward(x, l, w, b, activation="tanh")
    with pytest.raises(ValueError, match="qbl.local_amax: unknown activation 'tanh'"):
        torch.ops.qbl.local_amax(x, "tanh")
    _, mixed, stats = torch.ops.qbl.forward(x, l, w, b)
    g = H.make_grad_out((4, 6, 16), torch.float32, device)
    bargs = (g, x, l, w, mixed, stats)
    bbefore = _snapshot(bargs)
    with pytest.raises(ValueError, match="qbl.backward: unknown activation 'tanh'"):
        torch.ops.qbl.backward(*bargs, True, [True] * 4, activation="tanh")
    _assert_unchanged(args, before, "unknown activation")
    _assert_unchanged(bargs, bbefore, "unknown activation (backward)")
    _check_still_works(x, l, w, b, "unknown activation")


def _backward_cases(x, l, w, mixed, stats, g):
    mask = [True] * 4
    return {
        "grad_out shape": ((g[..., :-1].contiguous(), x, l, w, mixed, stats, True, mask),
                           RuntimeError, "grad_out must have shape"),
        "grad_out dtype": ((g.double(), x, l, w, mixed, stats, True, mask), TypeError,
                           "grad_out has dtype"),
        "mixed dtype": ((g, x, l, w, mixed.bfloat16(), stats, True, mask), TypeError,
                        "mixed has dtype"),
        "mixed shape": ((g, x, l, w, mixed.reshape(-1, 32), stats, True, mask), RuntimeError,
                        "mixed must have x's shape"),
        "stats float64": ((g, x, l, w, mixed, stats.double(), True, mask), RuntimeError,
                          "stats must be"),
        "stats of 3 elements": ((g, x, l, w, mixed, torch.zeros(3, device=x.device), True,
                                 mask), RuntimeError, "stats must be"),
        # (the kernels read stats through a pointer: a strided one must be refused)
        "strided stats": ((g, x, l, w, mixed, torch.zeros(4, device=x.device)[::2], True, mask),
                          RuntimeError, "stats must be"),
        "weight in_features mismatch": ((g, x, l, w[:, :-1].contiguous(), mixed, stats, True,
                                         mask), RuntimeError, "weight must be"),
        "float64": ((g.double(), x.double(), l.double(), w.double(), mixed.double(), stats, True,
                     mask), TypeError, "unsupported dtype"),
    }


def _backward_mixed_device_cases(x, l, w, mixed, stats, g):
    mask = [True] * 4
    return {
        "stats on CPU": ((g, x, l, w, mixed, stats.cpu(), True, mask), RuntimeError,
                         "stats must be"),
        "grad_out on CPU": ((g.cpu(), x, l, w, mixed, stats, True, mask), RuntimeError,
                            rf"grad_out is on cpu but x is on cuda:\d+; {_ONE_DEVICE}"),
        "mixed on CPU": ((g, x, l, w, mixed.cpu(), stats, True, mask), RuntimeError,
                         rf"mixed is on cpu but x is on cuda:\d+; {_ONE_DEVICE}"),
        "x on CPU": ((g, x.cpu(), l, w, mixed, stats, True, mask), RuntimeError,
                     rf"logits is on cuda:\d+ but x is on cpu; {_ONE_DEVICE}"),
    }


def _check_backward_cases(cases, x, l, w, b):
    for name, (args, exc, pattern) in cases.items():
        before = _snapshot(args)
        with pytest.raises(exc, match=pattern):
            torch.ops.qbl.backward(*args)
        _assert_unchanged(args, before, name)
        _check_still_works(x, l, w, b, name)


def test_bad_backward_input_raises_and_leaves_no_trace(device):
    """Each bad call of torch.ops.qbl.backward raises its error type with a clear message, its
    arguments unchanged; a normal call works after it."""
    x, l, w, b = H.make_inputs((4, 6), 32, 16, torch.float32, device, seed=41)
    _, mixed, stats = torch.ops.qbl.forward(x, l, w, b)
    g = H.make_grad_out((4, 6, 16), torch.float32, device)
    _check_backward_cases(_backward_cases(x, l, w, mixed, stats, g), x, l, w, b)


@pytest.mark.cuda
def test_bad_backward_tensors_on_cpu_and_cuda(cuda_device):
    """The backward with one tensor on the CPU beside CUDA ones raises RuntimeError (naming both
    devices where it is a tensor argument's, the stats' rule for stats), arguments unchanged."""
    x, l, w, b = H.make_inputs((4, 6), 32, 16, torch.float32, cuda_device, seed=41)
    _, mixed, stats = torch.ops.qbl.forward(x, l, w, b)
    g = H.make_grad_out((4, 6, 16), torch.float32, cuda_device)
    _check_backward_cases(_backward_mixed_device_cases(x, l, w, mixed, stats, g), x, l, w, b)


#: Where the layer runs: outside autocast (one dtype), or under autocast(A) with float32 x and
#: parameters and logits in A (the operator then keeps the float32 weight parameter itself).
INPLACE_REGIONS = [pytest.param(None, id="fp32"),
                   pytest.param(torch.bfloat16, id="autocast_bf16"),
                   pytest.param(torch.float16, id="autocast_fp16")]


@pytest.mark.parametrize("keep_mixed", [True, False], ids=["keep_mixed", "recompute"])
@pytest.mark.parametrize("act", [pytest.param(None, id="none"), pytest.param("gelu", id="gelu")])
@pytest.mark.parametrize("ac", INPLACE_REGIONS)
@pytest.mark.parametrize("changed", ["x", "logits", "weight"])
def test_inplace_change_of_a_saved_input_raises_in_backward(changed, ac, act, keep_mixed,
                                                            device):
    """Autograd saves x (the activation's input, where there is one), the logits and the weight
    as given (under autocast the float32 parameter itself, not a cast copy): one of them changed
    in place between the forward and the backward (under no_grad, as an optimizer step changes a
    parameter) bumps its version counter, and the backward raises autograd's RuntimeError "...
    modified by an inplace operation", naming the changed tensor's shape and versions
    (docs/pytorch.md), instead of computing gradients from the changed values -- outside
    autocast and under bf16 and fp16 autocast, with and without an activation, with mixed kept
    and recomputed. (Under autocast eager's F.linear keeps a cast copy of the weight and would
    not raise for the weight: the docs state qbl's behaviour as nn.Linear's outside autocast.)
    The same graph without the change backpropagates (the error is the change's)."""
    x, l, w, b = H.make_inputs((4, 6), 32, 16, torch.float32, device, seed=49)
    if ac is not None:
        l = l.to(ac)
    g = H.make_grad_out((4, 6, 16), ac or torch.float32, device, seed=50)

    def forward():
        leaves = {name: t.detach().clone().requires_grad_()
                  for name, t in (("x", x), ("logits", l), ("weight", w), ("bias", b))}
        with torch.autocast(device.type, dtype=ac or torch.bfloat16, enabled=ac is not None):
            out = qbl.quant_blend_linear(leaves["x"], leaves["logits"], leaves["weight"],
                                         leaves["bias"], activation=act, keep_mixed=keep_mixed)
        return leaves, out

    _, out = forward()
    out.backward(g)  # unchanged: no error
    leaves, out = forward()
    with torch.no_grad():
        leaves[changed].add_(1.0)
    shape = ", ".join(str(n) for n in leaves[changed].shape)
    # autograd names the changed tensor by its type and shape: "[torch.FloatTensor [16, 32]]"
    with pytest.raises(RuntimeError, match=rf"modified by an inplace operation: \[\S+ "
                                           rf"\[{shape}\]\] is at version 1; expected version 0"):
        out.backward(g)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_devices(cuda_device):
    """A tensor on another GPU than x raises; all on the second GPU (while the first is current)
    runs there, forward and backward, as eager does."""
    x, l, w, b = H.make_inputs((4, 6), 32, 16, torch.float32, cuda_device, seed=42)
    other = torch.device("cuda", 1)
    for name, args in {"logits": (x, l.to(other), w, b), "weight": (x, l, w.to(other), b),
                       "bias": (x, l, w, b.to(other))}.items():
        with pytest.raises(RuntimeError, match=rf"{name} is on cuda:1 but x is on cuda:0; "
                                               rf"{_ONE_DEVICE}"):
            torch.ops.qbl.forward(*args)
        _check_still_works(x, l, w, b, f"{name} on cuda:1")
    x1, l1, w1, b1 = (t.to(other) for t in (x, l, w, b))
    g1 = H.make_grad_out((4, 6, 16), torch.float32, other)
    assert torch.cuda.current_device() == 0
    q = H.run_autograd(H.qbl_fn(), x1, l1, w1, b1, g1)
    e = H.run_autograd(H.eager_fn(), x1, l1, w1, b1, g1)
    assert q.out.device == other and q.weight.device == other, f"ran on {q.out.device}"
    _, mixed, _ = torch.ops.qbl.forward(x1, l1, w1, b1)
    H.assert_bits_equal(mixed, H.eager_forward(x1, l1, w1, b1).mixed, "mixed on cuda:1")
    H.check_all_grads(q, e, x1, l1, w1, b1, g1, torch.float32, False, what="on cuda:1: ")


def test_module_parameters_like_nn_linear(device):
    """Same parameter names, shapes, dtype and device as nn.Linear, and the same initialization:
    with one seed, the same values; the module's out within GEMM tolerance of eager's (on the
    CPU bit for bit eager's: the same F.linear on the same mixed)."""
    torch.manual_seed(5)
    lin = nn.Linear(40, 24, device=device)
    torch.manual_seed(5)
    layer = qbl.QuantBlendLinear(40, 24, device=device)
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]
    H.assert_bits_equal(layer.weight.detach(), lin.weight.detach(), "weight init vs nn.Linear's")
    H.assert_bits_equal(layer.bias.detach(), lin.bias.detach(), "bias init vs nn.Linear's")
    assert (layer.in_features, layer.out_features) == (40, 24)
    assert layer.weight.device == device and layer.bias.device == device, layer.weight.device
    no_bias = qbl.QuantBlendLinear(40, 24, bias=False, device=device, dtype=torch.bfloat16)
    assert no_bias.bias is None and list(no_bias.state_dict()) == ["weight"], no_bias.state_dict()
    assert no_bias.weight.dtype == torch.bfloat16 and no_bias.weight.device == device
    r = repr(layer)
    assert "in_features=40" in r and "out_features=24" in r and "bias=True" in r, r
    x, l, _, _ = H.make_inputs((3, 5), 40, 24, torch.bfloat16, device, seed=43)
    out = no_bias(x, l)
    e = H.eager_forward(x, l, no_bias.weight.detach())
    H.assert_gemm_close(out.detach(), e.out, H.ref64_out(e.mixed, no_bias.weight, None)[0],
                        torch.bfloat16, "QuantBlendLinear(bias=False) out")
    if device.type == "cpu":
        H.assert_bits_equal(out.detach(), e.out, "QuantBlendLinear(bias=False) out vs eager's")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_state_dict_round_trip_with_nn_linear(bias, device):
    """QuantBlendLinear -> nn.Linear -> QuantBlendLinear state dicts load strictly and keep every
    bit; the loaded layer computes eager's layer with nn.Linear's parameters (within GEMM
    tolerance; on the CPU bit for bit)."""
    torch.manual_seed(6)
    layer = qbl.QuantBlendLinear(40, 24, bias=bias, device=device)
    torch.manual_seed(7)
    lin = nn.Linear(40, 24, bias=bias, device=device)
    lin.load_state_dict(layer.state_dict())  # strict: same keys and shapes
    torch.manual_seed(8)
    back = qbl.QuantBlendLinear(40, 24, bias=bias, device=device)
    back.load_state_dict(lin.state_dict())
    for name, p in layer.named_parameters():
        H.assert_bits_equal(getattr(lin, name).detach(), p.detach(), f"nn.Linear.{name} after load")
        H.assert_bits_equal(getattr(back, name).detach(), p.detach(), f"round-trip {name}")
    x, l, _, _ = H.make_inputs((6,), 40, 24, torch.float32, device, seed=44)
    with torch.no_grad():
        e = H.eager_forward(x, l, lin.weight, lin.bias)
        out = back(x, l)
    H.assert_gemm_close(out, e.out, H.ref64_out(e.mixed, lin.weight, lin.bias)[0], torch.float32,
                        "loaded layer's out vs eager with nn.Linear's parameters")
    if device.type == "cpu":
        H.assert_bits_equal(out, e.out, "loaded layer's out vs eager's (the same F.linear)")


@pytest.fixture(scope="module")
def model_new():
    """examples/pytorch/model_new.py, imported by path."""
    spec = importlib.util.spec_from_file_location("qbl_examples_model_new", MODEL_NEW)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_new_state_dict_round_trip(model_new, device):
    """Model -> ModelNew -> Model state dicts keep every bit; ModelNew computes Model (within GEMM
    tolerance; on the CPU bit for bit, the same nn.Linear on the same mixed); with W = I, b = 0 its
    out is eager's mixed."""
    d = 64
    torch.manual_seed(0)
    ref = reference_model.Model(d).to(device)
    torch.manual_seed(1)
    new = model_new.ModelNew(d).to(device)
    shapes = {k: tuple(v.shape) for k, v in new.state_dict().items()}
    assert shapes == {k: tuple(v.shape) for k, v in ref.state_dict().items()}, shapes
    new.load_state_dict(ref.state_dict())
    torch.manual_seed(2)
    back = reference_model.Model(d).to(device)
    back.load_state_dict(new.state_dict())
    for k, v in ref.state_dict().items():
        H.assert_bits_equal(back.state_dict()[k], v, f"Model -> ModelNew -> Model: {k}")
    x, l = reference_model.get_inputs(2, 9, d, device=device)
    with torch.no_grad():
        out, want = new(x, l), ref(x, l)
    e = H.eager_forward(x, l, ref.out_proj.weight, ref.out_proj.bias)
    H.assert_gemm_close(out, want, H.ref64_out(e.mixed, ref.out_proj.weight, ref.out_proj.bias)[0],
                        torch.float32, "ModelNew vs Model")
    if device.type == "cpu":
        H.assert_bits_equal(out, want, "ModelNew vs Model (the same F.linear on the same mixed)")
    w, b = H.identity_layer_params(d, torch.float32, device)
    with torch.no_grad():
        new.out_proj.weight.copy_(w)
        new.out_proj.bias.copy_(b)
        H.assert_bits_equal(new(x, l), e.mixed, "ModelNew (W = I, b = 0) vs eager mixed",
                            signed_zeros=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_new_is_trainable(model_new, dtype, device):
    """ModelNew's forward is differentiable: grads reach x, the logits and out_proj, within
    tolerance of the reference Model's autograd (on the CPU, grad_x, grad_weight and grad_bias
    bit for bit: eager's own GEMMs and sums on the same operands)."""
    d = 64
    ref = reference_model.Model(d).to(device=device, dtype=dtype)
    new = model_new.ModelNew(d).to(device=device, dtype=dtype)
    new.load_state_dict(ref.state_dict())
    x, l = reference_model.get_inputs(3, 11, d, dtype=dtype, device=device)
    g = H.make_grad_out((3, 11, d), dtype, device, seed=45)
    grads = {}
    for name, model in (("new", new), ("ref", ref)):
        xx, ll = x.clone().requires_grad_(), l.clone().requires_grad_()
        out = model(xx, ll)
        assert out.requires_grad, f"{name}: output does not require grad"
        out.backward(g)
        p = model.out_proj
        grads[name] = H.Grads(None, xx.grad, ll.grad, p.weight.grad, p.bias.grad)
    q = grads["new"]
    assert None not in (q.x, q.logits, q.weight, q.bias), (
        f"ModelNew: missing gradients (x {q.x is None}, logits {q.logits is None}, weight "
        f"{q.weight is None}, bias {q.bias is None} are None)")
    H.check_all_grads(q, grads["ref"], x, l, ref.out_proj.weight.detach(),
                      ref.out_proj.bias.detach(), g, dtype, False, what="ModelNew vs Model: ")
    if device.type == "cpu":
        for field in ("x", "weight", "bias"):
            H.assert_bits_equal(getattr(q, field), getattr(grads["ref"], field),
                                f"ModelNew vs Model: grad_{field}")


def test_cpu_kernels_keep_no_layer():
    """The CPU kernels plan nothing and cache nothing: after CPU forwards and a backward,
    qbl.cache_info() lists no layer (it lists CUDA layers only), and clear_cache() leaves the
    CPU layer working."""
    qbl.clear_cache()
    x, l, w, b = H.make_inputs((10,), 72, 24, torch.float32, "cpu", seed=47)
    H.run_autograd(H.qbl_fn(), x, l, w, b, H.make_grad_out((10, 24), torch.float32, "cpu"))
    torch.ops.qbl.forward(x.bfloat16(), l.bfloat16(), w.bfloat16(), b.bfloat16())
    assert qbl.cache_info() == [], f"cache_info after CPU calls: {qbl.cache_info()}"
    qbl.clear_cache()
    _check_still_works(x, l, w, b, "clear_cache")


def _cache_rows(n_in, n_out, dtype=torch.float32, tf32=False):
    return [r for r in qbl.cache_info()
            if (r["in_features"], r["out_features"], r["x_dtype"], r["tf32"])
            == (n_in, n_out, dtype, tf32)]


@pytest.mark.cuda
def test_cache_grows_in_powers_of_two_and_clears(cuda_device):
    """The CUDA layer cache: one live layer per (shape, dtypes, tf32), its token capacity a power
    of two that only grows, a backward plan made at the first training call, cleared by
    clear_cache()."""
    n_in, n_out = 72, 24
    qbl.clear_cache()
    assert qbl.cache_info() == [], f"cache_info after clear_cache: {qbl.cache_info()}"
    keys = {"device", "x_dtype", "gemm_dtype", "logits_dtype", "activation", "in_features",
            "out_features", "tf32", "backward", "max_tokens", "forward_workspace_bytes",
            "backward_workspace_bytes"}
    previous = 0
    for tokens in (3, 100, 10, 1000, 1000):
        x, l, w, b = H.make_inputs((tokens,), n_in, n_out, torch.float32, cuda_device,
                                   seed=tokens)
        _, mixed, _ = torch.ops.qbl.forward(x, l, w, b)
        H.assert_bits_equal(mixed, H.eager_forward(x, l, w, b).mixed, f"mixed at {tokens} tokens")
        rows = _cache_rows(n_in, n_out)
        assert len(rows) == 1, (
            f"{tokens} tokens: expected one live layer for {n_in}->{n_out}: {rows}")
        row = rows[0]
        assert set(row) == keys, f"cache_info keys {sorted(row)}"
        assert (row["gemm_dtype"], row["logits_dtype"]) == (torch.float32, torch.float32), row
        assert row["activation"] is None, row
        cap = row["max_tokens"]
        assert cap >= tokens and cap & (cap - 1) == 0, (
            f"{tokens} tokens: max_tokens {cap} is not a power of two >= {tokens}")
        assert cap >= previous, f"{tokens} tokens: capacity shrank from {previous} to {cap}"
        if tokens <= previous:
            assert cap == previous, f"{tokens} tokens: capacity changed from {previous} to {cap}"
        assert not row["backward"] and row["backward_workspace_bytes"] == 0, (
            f"{tokens} tokens: a backward plan exists before any training call: {row}")
        assert row["forward_workspace_bytes"] > 0, row
        assert row["device"] == torch.cuda.current_device(), row
        previous = cap
    g = H.make_grad_out((10, n_out), torch.float32, cuda_device)
    H.run_autograd(H.qbl_fn(), x[:10], l[:10], w, b, g)
    rows = _cache_rows(n_in, n_out)
    assert len(rows) == 1 and rows[0]["backward"] and rows[0]["max_tokens"] == previous, (
        f"training layer after backward: {rows}")
    assert rows[0]["backward_workspace_bytes"] > 0, rows[0]
    torch.ops.qbl.forward(x.bfloat16(), l.bfloat16(), w.bfloat16(), b.bfloat16())
    rows = _cache_rows(n_in, n_out, dtype=torch.bfloat16)
    assert len(rows) == 1 and rows[0]["gemm_dtype"] == torch.bfloat16, f"bf16 layer: {rows}"
    qbl.clear_cache()
    assert qbl.cache_info() == [], f"cache_info after clear_cache: {qbl.cache_info()}"
    _check_still_works(x, l, w, b, "clear_cache")


@pytest.mark.cuda
def test_a_forward_a_backward_follows_plans_the_backward_with_it(cuda_device):
    """plan_backward: a forward that autograd records, or one called with plan_backward=True,
    plans the layer's backward with itself (its backward then plans nothing: no second wait, and
    no planning during a CUDA graph capture); a forward under no_grad or with no input requiring
    grad plans the forward alone. The results are the same bits in every case."""
    n_in, n_out, tokens = 56, 40, 50
    x, l, w, b = H.make_inputs((tokens,), n_in, n_out, torch.float32, cuda_device, seed=3)
    trained = w.detach().clone().requires_grad_()

    def under_no_grad():
        with torch.no_grad():
            return torch.ops.qbl.forward(x, l, trained, b)

    cases = {
        "no input requires grad": (lambda: torch.ops.qbl.forward(x, l, w, b), False),
        "under no_grad": (under_no_grad, False),
        "autograd records": (lambda: torch.ops.qbl.forward(x, l, trained, b), True),
        "plan_backward=True": (lambda: torch.ops.qbl.forward(x, l, w, b, plan_backward=True),
                               True),
    }
    mixed = {}
    try:
        for name, (call, plans_backward) in cases.items():
            qbl.clear_cache()
            _, mixed[name], _ = call()
            rows = _cache_rows(n_in, n_out)
            assert len(rows) == 1 and rows[0]["backward"] == plans_backward, (
                f"{name}: expected a layer planned {'with' if plans_backward else 'without'} "
                f"its backward: {rows}")
            assert (rows[0]["backward_workspace_bytes"] > 0) == plans_backward, f"{name}: {rows}"
        for name in cases:
            H.assert_bits_equal(mixed[name], mixed["no input requires grad"], f"mixed ({name})")
    finally:
        qbl.clear_cache()


@pytest.mark.cuda
def test_overlap_wgrad_from_the_environment(monkeypatch, cuda_device):
    """QBL_OVERLAP_WGRAD=1 and =0 both plan a working backward with the same bits (grad_bias also
    within the column-sum bound of the float64 sum); =0 plans one cuBLASLt workspace instead of
    two; any other value raises ValueError naming the variable."""
    name = "QBL_OVERLAP_WGRAD"
    n_in, n_out, tokens, dtype = 96, 40, 300, torch.bfloat16
    x, l, w, b = H.make_inputs((tokens,), n_in, n_out, dtype, cuda_device, seed=7)
    g = H.make_grad_out((tokens, n_out), dtype, cuda_device)
    grads, ws = {}, {}
    try:
        for value in ("1", "0"):
            monkeypatch.setenv(name, value)
            qbl.clear_cache()
            grads[value] = H.run_autograd(H.qbl_fn(), x, l, w, b, g)
            rows = _cache_rows(n_in, n_out, dtype=dtype)
            assert len(rows) == 1 and rows[0]["backward"], f"{name}={value}: {rows}"
            ws[value] = rows[0]["backward_workspace_bytes"]
        for field in ("out", "x", "logits", "weight", "bias"):
            H.assert_bits_equal(getattr(grads["0"], field), getattr(grads["1"], field),
                                f"{name}=0 against =1: {field}")
        g64 = g.double()
        for value in ("0", "1"):
            H.assert_sum_close(grads[value].bias, g64.sum(0), g64.abs().sum(0), tokens, dtype,
                               f"{name}={value}: grad_bias")
        assert ws["0"] < ws["1"], f"backward workspace bytes: {ws} (=0 should need one less)"
        monkeypatch.setenv(name, "2")
        qbl.clear_cache()
        with pytest.raises(ValueError, match=name):
            H.run_autograd(H.qbl_fn(), x, l, w, b, g)
    finally:
        monkeypatch.delenv(name, raising=False)
        qbl.clear_cache()
    _check_still_works(x, l, w, b, f"{name}=2")


_CAPTURE_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import helpers as H
import qbl

def capture(x, l, w, b):
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            out = qbl.quant_blend_linear(x, l, w, b)
    except Exception as e:
        return None, None, [type(e).__name__, str(e)]
    return graph, out, None

res = {}
x, l, w, b = H.make_inputs((8,), 88, 20, torch.float32, "cuda", seed=1)
torch.cuda.synchronize()
res["unseen"] = capture(x, l, w, b)[2]
torch.cuda.synchronize()
out = qbl.quant_blend_linear(x, l, w, b)
_, mixed, _ = torch.ops.qbl.forward(x, l, w, b)
res["after_mixed_exact"] = bool(torch.equal(mixed.view(torch.int32),
                                            H.eager_forward(x, l, w, b).mixed.view(torch.int32)))
xl, ll, _, _ = H.make_inputs((500,), 88, 20, torch.float32, "cuda", seed=2)
res["larger"] = capture(xl, ll, w, b)[2]
torch.cuda.synchronize()
graph, cap_out, res["planned"] = capture(x, l, w, b)
if graph is not None:
    graph.replay()
    torch.cuda.synchronize()
    res["replay_equal"] = bool(torch.equal(cap_out.view(torch.int32), out.view(torch.int32)))
print("RESULT " + json.dumps(res))
"""


@pytest.mark.cuda
def test_planning_during_graph_capture_raises():
    """In a fresh process: a first call of a size during CUDA graph capture, or one with more
    tokens than the cached layer holds, raises RuntimeError saying why; the capture ends, the
    process keeps working, and a capture of the planned size then runs and replays correctly."""
    proc = subprocess.run([sys.executable, "-c", _CAPTURE_SCRIPT, HERE], capture_output=True,
                          text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"the capture script failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n"
        f"{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    for key in ("unseen", "larger"):
        err = res[key]
        assert err is not None, f"{key} size: capture did not raise"
        assert err[0] == "RuntimeError" and "graph capture" in err[1], (
            f"{key} size: expected RuntimeError about graph capture, got {err}")
    assert res["after_mixed_exact"], "after the failed capture, mixed differs from eager's"
    assert res["planned"] is None, f"capturing a planned size raised {res['planned']}"
    assert res["replay_equal"], "the replayed graph's out differs from the direct call's"


SLEEP_CYCLES = 50_000_000  # some tens of milliseconds of device time


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fresh", [False, True], ids=["cached", "planned_on_side_stream"])
@pytest.mark.cuda
def test_current_stream_is_respected(dtype, fresh, cuda_device):
    """Forward and backward on a side stream that is busy (a sleep kernel) when its inputs are
    produced: had qbl enqueued on another stream, it would read the inputs before they exist.
    Results equal (bitwise) the default stream's and eager's mixed."""
    n_in, n_out = (56, 28) if fresh else (96, 40)
    x, l, w, b = H.make_inputs((16, 24), n_in, n_out, dtype, cuda_device, seed=46)
    g = H.make_grad_out((16, 24, n_out), dtype, cuda_device, seed=47)
    if fresh:
        qbl.clear_cache()  # the side stream's calls plan the layers
    else:
        ref = H.run_autograd(H.qbl_fn(), x, l, w, b, g)  # the default stream plans them
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        xs, ls, ws, bs = (t.clone().requires_grad_() for t in (x, l, w, b))
        out, mixed, stats = torch.ops.qbl.forward(xs, ls, ws, bs)
        torch.cuda._sleep(SLEEP_CYCLES)
        grads = torch.autograd.grad(out, (xs, ls, ws, bs), g)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if fresh:
        ref = H.run_autograd(H.qbl_fn(), x, l, w, b, g)
    e = H.eager_forward(x, l, w, b)
    H.assert_bits_equal(mixed, e.mixed, "side stream: mixed vs eager's")
    H.assert_bits_equal(stats, H.eager_stats(e), "side stream: stats vs eager's")
    H.assert_bits_equal(out.detach(), ref.out, "side stream vs default stream: out")
    for name, got, want in zip(("x", "logits", "weight", "bias"), grads,
                               (ref.x, ref.logits, ref.weight, ref.bias)):
        H.assert_bits_equal(got, want, f"side stream vs default stream: grad_{name}")
    H.check_all_grads(H.Grads(None, *grads), H.run_autograd(H.eager_fn(), x, l, w, b, g),
                      x, l, w, b, g, dtype, False, what="side stream: ")

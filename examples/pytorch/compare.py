#!/usr/bin/env python3
"""Correctness and speed of ModelNew (qbl) against the PyTorch reference Model.

    python3 examples/pytorch/compare.py                       # every BENCH_SHAPE
    python3 examples/pytorch/compare.py --shapes 1x8x1024,4   # a subset (BxTxD or an index)
    python3 examples/pytorch/compare.py --out results.md --csv results.csv

Per shape (B, T, D):
  * allclose: 5 trials, each torch.manual_seed(trial) + fresh get_inputs, Model and ModelNew
    sharing one state dict, torch.allclose(new, ref, atol=1e-2, rtol=1e-2) (what kernel
    benchmarks check);
  * rel err: ||out - ref64||_F / ||ref64||_F against the reference run in float64, for ModelNew
    and (for context) for eager fp32; ModelNew passes if its error is at most
    max(--rel-factor * eager's, --rel-floor);
  * mixed bit-exact: with out_proj = identity and bias = 0, ModelNew's output must equal eager's
    `mixed` in value (the identity GEMM's +0 terms turn -0.0 into +0.0, in eager too);
    Layer.last_mixed(), last_scale() and last_amax() of a directly built Layer must equal eager's
    mixed, scale and amax bit for bit (-0.0 and +0.0 differ, any NaN equals any NaN);
  * NaN/Inf: one NaN in x -> every output NaN, one +Inf in x -> every output NaN, one NaN logit
    -> exactly that row NaN, in both eager and ModelNew;
  * timing (triton.testing.do_bench, median): eager, torch.compile (default), torch.compile
    (reduce-overhead), ModelNew -- all under torch.no_grad, TF32 off unless --tf32.
Once, before the shapes: API checks of the extension (argument errors, empty inputs, 2-D input,
bias=None, cache growth, a side stream, CUDA-graph capture).

Exits non-zero if any correctness check fails (timings never fail the run).
"""

from __future__ import annotations

import argparse
import copy
import csv
import gc
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qbl_ext  # noqa: E402
from model_new import ModelNew  # noqa: E402
from reference import BENCH_SHAPES, Model, _fake_quant_symmetric_int8, get_inputs  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def log(*args):
    print(*args, flush=True)


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------

def eager_mixed(x, logits):
    """The reference formula up to the Linear, op by op, in x's dtype: (mixed, scale, amax)."""
    alpha = torch.sigmoid(logits).unsqueeze(-1)
    amax_raw = x.detach().abs().max()
    amax = amax_raw.clamp(min=1e-8)
    scale = amax / 127.0
    x_q = _fake_quant_symmetric_int8(x, scale)
    mixed = alpha * x_q + (1.0 - alpha) * x
    return mixed, scale, amax_raw


def rel_fro(out, ref64):
    diff = out.double() - ref64
    den = torch.linalg.vector_norm(ref64).item()
    num = torch.linalg.vector_norm(diff).item()
    return num / den if den > 0 else num


def make_pair(d, dtype, device, seed=0, tf32=False):
    """Model and ModelNew with one state dict (ModelNew's GEMM in TF32 if `tf32`)."""
    torch.manual_seed(seed)
    ref = Model(d).to(device=device, dtype=dtype).eval()
    new = ModelNew(d).to(device=device, dtype=dtype).eval()
    new.load_state_dict(ref.state_dict())
    new.allow_tf32 = tf32
    return ref, new


def mismatch_report(a, b, limit=5, signed_zeros=True):
    """Number of elements whose bits differ (any NaN equal to any NaN; -0.0 differs from +0.0
    unless signed_zeros is False) and the first few of them."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    same = (a.view(ints[a.dtype]) == b.view(ints[b.dtype])) if signed_zeros else (a == b)
    ne = ~(same | (torch.isnan(a) & torch.isnan(b)))
    count = int(ne.sum().item())
    lines = []
    if count:
        idx = torch.nonzero(ne)[:limit]
        for row in idx.tolist():
            t = tuple(row)
            lines.append(f"      at {t}: qbl={a[t].item()!r} eager={b[t].item()!r}")
    return count, lines


class Checks:
    def __init__(self):
        self.failures = []

    def check(self, ok, what, detail=""):
        if not ok:
            self.failures.append(what + (f" ({detail})" if detail else ""))
            log(f"    FAIL {what}" + (f": {detail}" if detail else ""))
        return ok


def parse_shapes(spec):
    if not spec or spec == "all":
        return list(BENCH_SHAPES)
    shapes = []
    for tok in spec.replace(";", ",").split(","):
        tok = tok.strip().lower()
        if not tok:
            continue
        if "x" in tok:
            b, t, d = (int(v) for v in tok.split("x"))
            shapes.append((b, t, d))
        else:
            shapes.append(BENCH_SHAPES[int(tok)])
    return shapes


def bench(fn, warmup, rep):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


# ------------------------------------------------------------------------------------------------
# API checks (small sizes, once)
# ------------------------------------------------------------------------------------------------

def raises(fn, *, expect=(RuntimeError, TypeError, ValueError, IndexError)):
    try:
        fn()
    except expect as e:
        return True, type(e).__name__
    except Exception as e:  # noqa: BLE001
        return False, f"unexpected {type(e).__name__}: {e}"
    return False, "no exception"


# Tolerance of the API checks' comparisons of two GEMMs over the same exact `mixed`: they may run
# different algorithms, and in 16-bit dtypes the output is rounded to 8 (bf16) or 11 (fp16)
# significand bits, so a different summation order can move an output by one unit in the last place.
API_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}


def api_checks(ext, checks, dtype):
    log("== API checks")
    tol = API_TOL[dtype]

    def close(a, b):
        return torch.allclose(a, b, atol=tol, rtol=tol)

    dev = torch.device("cuda", torch.cuda.current_device())
    d, dout = 64, 48
    g = torch.Generator(device=dev).manual_seed(7)
    x = torch.randn(2, 5, d, device=dev, dtype=dtype, generator=g)
    lg = torch.randn(2, 5, device=dev, dtype=dtype, generator=g)
    w = torch.randn(dout, d, device=dev, dtype=dtype, generator=g) / math.sqrt(d)
    b = torch.randn(dout, device=dev, dtype=dtype, generator=g)
    mixed, scale, amax = eager_mixed(x, lg)
    ref = F.linear(mixed, w, b)

    layer = ext.Layer(d, dout, 16, False, dtype)
    checks.check(layer.in_features == d and layer.out_features == dout
                 and layer.max_tokens == 16 and layer.dtype == dtype
                 and layer.device == dev and not layer.allow_tf32, "Layer properties", repr(layer))
    log(f"    {layer!r}  workspace {layer.workspace_bytes / 2**20:.1f} MiB")

    y = layer.forward(x, lg, w, b)
    checks.check(y.shape == (2, 5, dout) and y.dtype == dtype and y.device == dev,
                 "Layer.forward output shape/dtype/device", f"{tuple(y.shape)} {y.dtype}")
    checks.check(close(y, ref), "Layer.forward vs eager",
                 f"max abs diff {(y - ref).abs().max().item():.3g}")
    checks.check(same_bits(layer.last_mixed().view_as(mixed), mixed) == 0,
                 "Layer.last_mixed() (default tokens) == eager mixed")
    checks.check(layer.last_tokens == 10, "Layer.last_tokens", str(layer.last_tokens))
    checks.check(same_bits(layer.last_scale(), scale.float()) == 0, "Layer.last_scale() == eager scale",
                 f"{layer.last_scale().item()!r} vs {scale.item()!r}")
    checks.check(same_bits(layer.last_amax(), amax.float()) == 0, "Layer.last_amax() == eager amax")
    checks.check(torch.allclose(layer(x, lg, w, b), y, atol=1e-6, rtol=1e-6), "Layer.__call__")

    # 2-D input, bias=None, module-level forward.
    y2 = ext.forward(x.view(-1, d), lg.view(-1), w, b)
    checks.check(y2.shape == (10, dout) and close(y2.view_as(y), y),
                 "forward with 2-D x")
    y3 = ext.forward(x, lg, w, None)
    checks.check(close(y3, F.linear(mixed, w)), "forward bias=None")
    y4 = layer.forward(x, lg, w)
    checks.check(close(y4, F.linear(mixed, w)),
                 "Layer.forward bias omitted")

    # Weight and bias viewed at an odd element offset (any alignment torch allows) still run.
    w_buf = torch.empty(w.numel() + 1, device=dev, dtype=dtype)
    b_buf = torch.empty(b.numel() + 1, device=dev, dtype=dtype)
    w_odd = w_buf[1:].view_as(w)
    b_odd = b_buf[1:]
    w_odd.copy_(w)
    b_odd.copy_(b)
    y_odd = layer.forward(x, lg, w_odd, b_odd)
    checks.check(close(y_odd, ref), "weight and bias at an odd element offset")

    # Empty inputs return empty outputs without touching the layer.
    e1 = ext.forward(x[:0], lg[:0], w, b)
    e2 = ext.forward(x[:, :0], lg[:, :0], w, b)
    e3 = layer.forward(x.view(-1, d)[:0], lg.view(-1)[:0], w, b)
    checks.check(e1.shape == (0, 5, dout) and e2.shape == (2, 0, dout) and e3.shape == (0, dout),
                 "empty inputs", f"{tuple(e1.shape)} {tuple(e2.shape)} {tuple(e3.shape)}")

    # Argument errors.
    xt = x.transpose(0, 1)  # non-contiguous, [5, 2, d]
    cases = {
        "x on CPU": lambda: ext.forward(x.cpu(), lg.cpu(), w.cpu(), b.cpu()),
        "weight on CPU": lambda: ext.forward(x, lg, w.cpu(), b),
        "float64": lambda: ext.forward(x.double(), lg.double(), w.double(), b.double()),
        "mixed dtypes": lambda: ext.forward(x, lg.double(), w, b),
        "non-contiguous x": lambda: ext.forward(xt, lg.t(), w, b),
        "non-contiguous weight": lambda: ext.forward(x, lg, w.t().contiguous().t(), b),
        "1-D x": lambda: ext.forward(x.view(-1), lg.view(-1), w, b),
        "4-D x": lambda: ext.forward(x.view(1, 2, 5, d), lg.view(1, 2, 5), w, b),
        "logits shape": lambda: ext.forward(x, lg.view(-1), w, b),
        "weight shape": lambda: ext.forward(x, lg, w[:, :-1].contiguous(), b),
        "bias shape": lambda: ext.forward(x, lg, w, b[:-1].contiguous()),
        "Layer: weight of another size": lambda: layer.forward(x, lg, w[:-1].contiguous(),
                                                               b[:-1].contiguous()),
        "Layer: tokens > max_tokens": lambda: layer.forward(
            torch.randn(17, d, device=dev, dtype=dtype), torch.randn(17, device=dev, dtype=dtype),
            w, b),
        "Layer: non-positive size": lambda: ext.Layer(0, dout, 4),
        "Layer: unsupported dtype": lambda: ext.Layer(d, dout, 4, False, torch.float64),
        "last_mixed(tokens > max_tokens)": lambda: layer.last_mixed(17),
    }
    for name, fn in cases.items():
        ok, how = raises(fn)
        checks.check(ok, f"error for {name}", how)
        if ok:
            log(f"    ok   {name}: {how}")
    ok, how = raises(cases["Layer: tokens > max_tokens"], expect=(IndexError,))
    log(f"    note tokens > max_tokens raises IndexError: {ok} ({how})")

    # Cache growth: capacities are powers of two, growing on demand.
    ext.clear_cache()
    for tokens, cap in ((3, 4), (9, 16), (2, 16), (16, 16), (17, 32)):
        xx = torch.randn(tokens, d, device=dev, dtype=dtype)
        ll = torch.randn(tokens, device=dev, dtype=dtype)
        yy = ext.forward(xx, ll, w, b)
        rr = F.linear(eager_mixed(xx, ll)[0], w, b)
        info = [i for i in ext.cache_info() if i["in_features"] == d and i["out_features"] == dout]
        got = info[0]["max_tokens"] if len(info) == 1 else None
        checks.check(got == cap and close(yy, rr),
                     f"cache growth at {tokens} tokens", f"max_tokens {got}, expected {cap}")
    cached = ext.get_cached_layer(dev.index, d, dout, dtype)
    checks.check(cached is not None and cached.max_tokens == 32, "get_cached_layer")
    checks.check(ext.get_cached_layer(dev.index, d + 1, dout, dtype) is None, "get_cached_layer miss")
    ext.clear_cache()
    checks.check(len(ext.cache_info()) == 0, "clear_cache")

    # A side stream (torch's streams are non-blocking w.r.t. the legacy default stream).
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fresh = ext.Layer(d, dout, 16, False, dtype)  # constructed while a side stream is current
        ys = fresh.forward(x, lg, w, b)
        ms = fresh.last_mixed()
        ym = ext.forward(x, lg, w, b)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    checks.check(close(ys, ref) and
                 same_bits(ms.view_as(mixed), mixed) == 0 and
                 close(ym, ref), "forward on a side stream")

    # CUDA graph capture of ModelNew (the cached layer exists before capture).
    try:
        ref_m, new_m = make_pair(d, dtype, dev, seed=3)
        sx = torch.randn(4, 8, d, device=dev, dtype=dtype)
        sl = torch.randn(4, 8, device=dev, dtype=dtype)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(2):
                new_m(sx, sl)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            sy = new_m(sx, sl)
        ok = True
        for trial in range(3):
            sx.copy_(torch.randn_like(sx))
            sl.copy_(torch.randn_like(sl))
            graph.replay()
            with torch.no_grad():
                want = ref_m(sx, sl)
            ok = ok and close(sy, want)
        checks.check(ok, "CUDA graph capture + replay of ModelNew")
        del graph
    except Exception as e:  # noqa: BLE001
        checks.check(False, "CUDA graph capture + replay of ModelNew", f"{type(e).__name__}: {e}")
    ext.clear_cache()
    torch.cuda.synchronize()
    log(f"    API checks: {'ok' if not checks.failures else 'FAILED'}")


def same_bits(a, b):
    """Bitwise equality, any NaN equal to any NaN (as a mismatch count)."""
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    ok = (a.view(ints[a.dtype]) == b.view(ints[b.dtype])) | (torch.isnan(a) & torch.isnan(b))
    return int((~ok).sum().item())


def nonfinite_checks(ext, checks, dtype):
    """Non-finite and edge inputs, one table: qbl's mixed, scale and amax bit for bit as eager's
    (NaN for NaN), and qbl's out NaN exactly where eager's is."""
    log("== non-finite and edge inputs vs eager")
    dev = torch.device("cuda", torch.cuda.current_device())
    b, t, d = 2, 19, 96
    tiny = 1e-5 if dtype == torch.float16 else 1e-39
    nan, inf = float("nan"), float("inf")

    def put(tensor, index, value):
        tensor = tensor.clone()
        tensor.view(-1)[index] = value
        return tensor

    cases = {
        "NaN in x": lambda x, l: (put(x, 100, nan), l),
        "+Inf in x": lambda x, l: (put(x, 3, inf), l),
        "-Inf in x": lambda x, l: (put(x, x.numel() - 1, -inf), l),
        "NaN logit": lambda x, l: (x, put(l, 7, nan)),
        "+Inf logit": lambda x, l: (x, put(l, 7, inf)),
        "-Inf logit": lambda x, l: (x, put(l, 7, -inf)),
        "all-zero x": lambda x, l: (torch.zeros_like(x), l),
        "all -0.0 x": lambda x, l: (torch.full_like(x, -0.0), l),
        "-0.0 among values": lambda x, l: (x.view(-1).index_fill(0, torch.arange(0, x.numel(), 5, device=dev), -0.0).view_as(x), l),
        "denormal x": lambda x, l: ((x.float() * tiny).to(dtype), l),
        "huge x (near max)": lambda x, l: ((x / x.abs().max() * torch.finfo(dtype).max).to(dtype), l),
    }
    ref, new = make_pair(d, dtype, dev, seed=11)
    layer = ext.Layer(d, d, b * t, False, dtype)
    rows = []
    for name, make in cases.items():
        torch.manual_seed(5)
        x0, l0 = get_inputs(b, t, d, dtype=dtype, device=dev)
        x, lg = make(x0, l0)
        mixed, scale, amax = eager_mixed(x, lg)
        layer.forward(x, lg, ref.out_proj.weight, ref.out_proj.bias)
        bad_mixed = same_bits(layer.last_mixed().view_as(mixed), mixed)
        bad_stats = same_bits(layer.last_scale(), scale.float()) + same_bits(layer.last_amax(), amax.float())
        out_ref, out_new = ref(x, lg), new(x, lg)
        # Near the top of the range the GEMM overflows, and where inf - inf turns into NaN depends
        # on the summation order of each library's algorithm: only mixed is compared there.
        nan_pattern = name.startswith("huge") or bool(torch.equal(torch.isnan(out_ref), torch.isnan(out_new)))
        ok = checks.check(bad_mixed == 0 and bad_stats == 0 and nan_pattern, f"non-finite: {name}",
                          f"{bad_mixed} mixed elements differ, stats differ {bad_stats}, "
                          f"out NaN pattern equal {nan_pattern}")
        mixed_nan = int(torch.isnan(mixed).sum().item())
        rows.append(f"    {'ok  ' if ok else 'FAIL'} {name:20s} eager mixed NaN {mixed_nan:5d}/{mixed.numel()}, "
                    f"out NaN {int(torch.isnan(out_ref).sum().item()):5d}/{out_ref.numel()}; "
                    f"qbl: mixed bit-equal {bad_mixed == 0}, scale/amax equal {bad_stats == 0}, "
                    f"out NaN pattern equal {nan_pattern}")
    for r in rows:
        log(r)
    del layer
    ext.clear_cache()


# ------------------------------------------------------------------------------------------------
# per-shape work
# ------------------------------------------------------------------------------------------------

def correctness(shape, dtype, dev, args, ext, checks):
    b, t, d = shape
    tokens = b * t
    res = {}
    ref, new = make_pair(d, dtype, dev, seed=0, tf32=args.tf32)
    ref64 = copy.deepcopy(ref).double()

    # 1. allclose over trials + relative Frobenius errors against float64.
    passes, rel_new, rel_eager = 0, 0.0, 0.0
    for trial in range(args.trials):
        torch.manual_seed(trial)
        x, lg = get_inputs(b, t, d, dtype=dtype, device=dev)
        out_ref = ref(x, lg)
        out_new = new(x, lg)
        ok = (out_new.shape == out_ref.shape and out_new.dtype == out_ref.dtype
              and torch.allclose(out_new, out_ref, atol=args.atol, rtol=args.rtol))
        if not ok:
            diff = (out_new - out_ref).abs().max().item() if out_new.shape == out_ref.shape else "-"
            log(f"    trial {trial}: allclose FAILED (max abs diff {diff})")
        passes += int(ok)
        r64 = ref64(x.double(), lg.double())
        rel_new = max(rel_new, rel_fro(out_new, r64))
        rel_eager = max(rel_eager, rel_fro(out_ref, r64))
        del x, lg, out_ref, out_new, r64
    res["allclose"] = f"{passes}/{args.trials}"
    res["allclose_pass"] = passes
    res["rel_err_qbl"] = rel_new
    res["rel_err_eager"] = rel_eager
    checks.check(passes == args.trials, f"{shape}: allclose", res["allclose"])
    rel_limit = max(args.rel_factor * rel_eager, args.rel_floor)
    checks.check(rel_new <= rel_limit, f"{shape}: rel err vs float64",
                 f"{rel_new:.3e} > limit {rel_limit:.3e} (eager {rel_eager:.3e})")

    # 2. mixed bit-exactness.
    torch.manual_seed(1000)
    x, lg = get_inputs(b, t, d, dtype=dtype, device=dev)
    mixed, scale, amax = eager_mixed(x, lg)
    ident = ModelNew(d).to(device=dev, dtype=dtype).eval()
    ident.out_proj.weight.copy_(torch.eye(d, device=dev, dtype=dtype))
    ident.out_proj.bias.zero_()
    out_id = ident(x, lg)
    # Through the identity GEMM every output is a sum with +0 terms, which turns a -0.0 of mixed
    # into +0.0 (in eager's matmul too): compare values here, bits on last_mixed below.
    n_bad, lines = mismatch_report(out_id, mixed, signed_zeros=False)
    exact_model = checks.check(n_bad == 0, f"{shape}: ModelNew(identity) == eager mixed",
                               f"{n_bad} of {mixed.numel()} elements differ")
    for line in lines:
        log(line)

    layer = ext.Layer(d, d, tokens, False, dtype)
    layer.forward(x, lg, ref.out_proj.weight, ref.out_proj.bias)
    lm = layer.last_mixed(tokens).view(b, t, d)
    n_bad2, lines2 = mismatch_report(lm, mixed)
    exact_layer = checks.check(n_bad2 == 0, f"{shape}: Layer.last_mixed == eager mixed",
                               f"{n_bad2} of {mixed.numel()} elements differ")
    for line in lines2:
        log(line)
    exact_scale = checks.check(same_bits(layer.last_scale(), scale.float()) == 0,
                               f"{shape}: Layer.last_scale == eager scale",
                               f"{layer.last_scale().item()!r} vs {scale.item()!r}")
    exact_amax = checks.check(same_bits(layer.last_amax(), amax.float()) == 0,
                              f"{shape}: Layer.last_amax == eager amax")
    res["mixed_exact"] = exact_model and exact_layer and exact_scale and exact_amax
    res["mixed_mismatches"] = n_bad + n_bad2
    del layer, lm, ident, out_id

    # 3. NaN / Inf propagation (random weights).
    nan_ok = True
    mid = x.numel() // 2
    for label, value in (("NaN in x", float("nan")), ("+Inf in x", float("inf"))):
        xs = x.clone()
        xs.view(-1)[mid] = value
        for who, m in (("eager", ref), ("qbl", new)):
            o = m(xs, lg)
            ok = bool(torch.isnan(o).all().item())
            nan_ok &= checks.check(ok, f"{shape}: {label} -> all NaN ({who})",
                                   f"{int(torch.isnan(o).sum().item())} of {o.numel()} NaN")
    ls = lg.clone()
    rb, rt = b // 2, t // 2
    ls[rb, rt] = float("nan")
    for who, m in (("eager", ref), ("qbl", new)):
        o = m(x, ls)
        row_nan = bool(torch.isnan(o[rb, rt]).all().item())
        others = torch.ones(b, t, dtype=torch.bool, device=dev)
        others[rb, rt] = False
        rest_finite = bool(torch.isfinite(o[others]).all().item())
        nan_ok &= checks.check(row_nan and rest_finite, f"{shape}: NaN logit -> its row NaN ({who})",
                               f"row all NaN {row_nan}, other rows finite {rest_finite}")
    res["nan_ok"] = nan_ok
    del x, lg, mixed, ref64
    return ref, new, res


def timing(shape, dtype, dev, args, ref, new):
    b, t, d = shape
    torch.manual_seed(0)
    x, lg = get_inputs(b, t, d, dtype=dtype, device=dev)
    res = {}
    res["eager_ms"] = bench(lambda: ref(x, lg), args.warmup, args.rep)

    def compiled_ms(mode):
        if args.no_compile:
            return float("nan")
        torch._dynamo.reset()
        try:
            t0 = time.perf_counter()
            fn = torch.compile(ref, dynamic=False, mode=mode)
            for _ in range(3):  # compile + (reduce-overhead) cudagraph warm-up and record
                if mode == "reduce-overhead":
                    torch.compiler.cudagraph_mark_step_begin()
                fn(x, lg)
            torch.cuda.synchronize()
            log(f"    torch.compile(mode={mode}) ready in {time.perf_counter() - t0:.1f} s")
            if mode == "reduce-overhead":
                def call():
                    torch.compiler.cudagraph_mark_step_begin()
                    return fn(x, lg)
            else:
                def call():
                    return fn(x, lg)
            return bench(call, args.warmup, args.rep)
        except Exception as e:  # noqa: BLE001 -- a compile failure is not a qbl failure
            log(f"    torch.compile(mode={mode}) failed: {type(e).__name__}: {e}")
            traceback.print_exc()
            return float("nan")

    res["compile_ms"] = compiled_ms("default")
    res["compile_ro_ms"] = float("nan") if args.no_reduce_overhead else compiled_ms("reduce-overhead")
    torch._dynamo.reset()
    new(x, lg)  # the cached layer is already sized for these tokens
    res["qbl_ms"] = bench(lambda: new(x, lg), args.warmup, args.rep)
    for key, base in (("vs_eager", "eager_ms"), ("vs_compile", "compile_ms"),
                      ("vs_compile_ro", "compile_ro_ms")):
        res[key] = res[base] / res["qbl_ms"] if res["qbl_ms"] > 0 else float("nan")
    del x, lg
    return res


# ------------------------------------------------------------------------------------------------
# output
# ------------------------------------------------------------------------------------------------

COLUMNS = ["shape", "allclose", "rel err qbl", "rel err eager", "mixed bit-exact", "NaN/Inf",
           "eager ms", "compile ms", "compile-ro ms", "qbl ms", "vs eager", "vs compile",
           "vs compile-ro"]


def fmt_ms(v):
    return "n/a" if v is None or math.isnan(v) else f"{v:.4f}"


def fmt_x(v):
    return "n/a" if v is None or math.isnan(v) else f"{v:.2f}x"


def table_row(r):
    return [f"{r['shape'][0]}x{r['shape'][1]}x{r['shape'][2]}", r.get("allclose", "-"),
            f"{r['rel_err_qbl']:.2e}" if "rel_err_qbl" in r else "-",
            f"{r['rel_err_eager']:.2e}" if "rel_err_eager" in r else "-",
            ("yes" if r.get("mixed_exact") else f"NO ({r.get('mixed_mismatches', '?')})")
            if "mixed_exact" in r else "-",
            ("ok" if r.get("nan_ok") else "FAIL") if "nan_ok" in r else "-",
            fmt_ms(r.get("eager_ms")), fmt_ms(r.get("compile_ms")), fmt_ms(r.get("compile_ro_ms")),
            fmt_ms(r.get("qbl_ms")), fmt_x(r.get("vs_eager")), fmt_x(r.get("vs_compile")),
            fmt_x(r.get("vs_compile_ro"))]


def markdown(rows, header_lines):
    out = list(header_lines) + [""]
    out.append("| " + " | ".join(COLUMNS) + " |")
    out.append("|" + "|".join("---" for _ in COLUMNS) + "|")
    for r in rows:
        out.append("| " + " | ".join(table_row(r)) + " |")
    return "\n".join(out) + "\n"


def write_csv(path, rows):
    keys = ["B", "T", "D", "tokens", "allclose_pass", "trials", "rel_err_qbl", "rel_err_eager",
            "mixed_exact", "mixed_mismatches", "nan_ok", "eager_ms", "compile_ms", "compile_ro_ms",
            "qbl_ms", "vs_eager", "vs_compile", "vs_compile_ro", "error"]
    with open(path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        wr.writeheader()
        for r in rows:
            b, t, d = r["shape"]
            wr.writerow({"B": b, "T": t, "D": d, "tokens": b * t, **r})


# ------------------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="all",
                    help="comma-separated BxTxD or indices into BENCH_SHAPES (default: all)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--tf32", action="store_true",
                    help="float32 with TF32 GEMMs: torch.backends.cuda.matmul.allow_tf32 = True for "
                         "eager and torch.compile, ModelNew.allow_tf32 = True for qbl")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--atol", type=float, default=1e-2)
    ap.add_argument("--rtol", type=float, default=1e-2)
    ap.add_argument("--rel-factor", type=float, default=2.0,
                    help="ModelNew's rel err may be at most this times eager's ...")
    ap.add_argument("--rel-floor", type=float, default=1e-5, help="... or this, if larger")
    ap.add_argument("--warmup", type=int, default=25, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile timings")
    ap.add_argument("--no-reduce-overhead", action="store_true",
                    help="time torch.compile's default mode only (each mode compiles anew per shape)")
    ap.add_argument("--no-timing", action="store_true", help="correctness only")
    ap.add_argument("--skip-api-checks", action="store_true")
    ap.add_argument("--out", default=None, help="write the markdown table here")
    ap.add_argument("--csv", default=None, help="write the results as CSV here")
    args = ap.parse_args()

    if not torch.cuda.is_available():
        log("compare.py needs a CUDA device")
        return 2
    dtype = DTYPES[args.dtype]
    dev = torch.device("cuda", torch.cuda.current_device())
    if args.tf32 and dtype != torch.float32:
        ap.error("--tf32 needs --dtype float32")
    if dtype == torch.float32:
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32

    t_start = time.perf_counter()
    t0 = time.perf_counter()
    ext = qbl_ext.load()
    log(f"qbl_torch extension ready in {time.perf_counter() - t0:.1f} s (qbl {ext.qbl_version})")

    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "missing"
        if not args.no_timing:
            log("triton is not installed: timings are skipped (--no-timing)")
            args.no_timing = True

    props = torch.cuda.get_device_properties(dev)
    header = [
        "# qbl vs PyTorch: quantize-blend-linear",
        "",
        f"- device: {props.name} ({dev}), torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"triton {triton_version}, qbl {ext.qbl_version}",
        f"- dtype {args.dtype}; TF32 {'on' if args.tf32 else 'off'} (torch.backends.cuda.matmul.allow_tf32 = "
        f"{torch.backends.cuda.matmul.allow_tf32}, ModelNew.allow_tf32 = {args.tf32}); mixed bit-exact "
        "checks run the exact GEMM; all runs under torch.no_grad",
        f"- allclose: {args.trials} trials, atol={args.atol}, rtol={args.rtol}; rel err: "
        f"||out - ref64||_F / ||ref64||_F (max over trials), limit "
        f"max({args.rel_factor} x eager, {args.rel_floor:g})",
        "- mixed bit-exact: ModelNew with identity weight / zero bias, and Layer.last_mixed / "
        "last_scale / last_amax, bit for bit as eager (mismatching elements in parentheses)",
        "- times: triton.testing.do_bench median (ms), warmup "
        f"{args.warmup} ms, rep {args.rep} ms; speedup = other time / qbl time",
    ]

    checks = Checks()
    with torch.no_grad():
        if not args.skip_api_checks:
            try:
                api_checks(ext, checks, dtype)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                checks.check(False, "API checks raised", f"{type(e).__name__}: {e}")
            try:
                nonfinite_checks(ext, checks, dtype)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                checks.check(False, "non-finite checks raised", f"{type(e).__name__}: {e}")

        rows = []
        for shape in parse_shapes(args.shapes):
            b, t, d = shape
            log(f"== shape B={b} T={t} D={d} ({b * t} tokens)")
            row = {"shape": shape, "trials": args.trials}
            ts = time.perf_counter()
            try:
                ref, new, res = correctness(shape, dtype, dev, args, ext, checks)
                row.update(res)
                log(f"    allclose {res['allclose']}, rel err qbl {res['rel_err_qbl']:.2e} "
                    f"eager {res['rel_err_eager']:.2e}, mixed bit-exact {res['mixed_exact']}, "
                    f"NaN/Inf {'ok' if res['nan_ok'] else 'FAIL'}")
                if not args.no_timing:
                    row.update(timing(shape, dtype, dev, args, ref, new))
                    log(f"    eager {fmt_ms(row['eager_ms'])} ms, compile "
                        f"{fmt_ms(row['compile_ms'])} ms, compile-ro {fmt_ms(row['compile_ro_ms'])} "
                        f"ms, qbl {fmt_ms(row['qbl_ms'])} ms -> {fmt_x(row['vs_eager'])} vs eager, "
                        f"{fmt_x(row['vs_compile'])} vs compile, {fmt_x(row['vs_compile_ro'])} "
                        "vs compile-ro")
                del ref, new
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = f"{type(e).__name__}: {e}"
                checks.check(False, f"{shape}: raised", row["error"])
            rows.append(row)
            log(f"    ({time.perf_counter() - ts:.1f} s)")
            ext.clear_cache()
            torch._dynamo.reset()
            gc.collect()
            torch.cuda.empty_cache()

    text = markdown(rows, header)
    log("")
    log(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
            if checks.failures:
                f.write("\nFailed checks:\n\n" + "".join(f"- {m}\n" for m in checks.failures))
        log(f"wrote {args.out}")
    if args.csv:
        write_csv(args.csv, rows)
        log(f"wrote {args.csv}")
    log(f"total {time.perf_counter() - t_start:.1f} s")
    if checks.failures:
        log(f"{len(checks.failures)} correctness check(s) FAILED:")
        for m in checks.failures:
            log(f"  - {m}")
        return 1
    log("all correctness checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

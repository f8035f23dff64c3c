#!/usr/bin/env python3
"""Training with qbl against the PyTorch reference: time per step and loss curves.

    pip install --no-build-isolation ./python                  # once, from the repository root
    python3 examples/pytorch/train_qat.py                      # D = 1024; bf16 and autocast timed
    python3 examples/pytorch/train_qat.py --d 1024,2048 --quick
    python3 examples/pytorch/train_qat.py --curve-compiled --json train_qat.json

The model: token embedding (vocab 4096, width D) -> 4 blocks -> LayerNorm -> LM head -> cross-
entropy. A block: h = LayerNorm(x); logits = Linear(D, 1)(h), one gate per token; x = x +
QBL(4D, D)(GELU(QBL(D, 4D)(h, logits)), logits), QBL being ReferenceQuantBlendLinear below
("reference": reference.py's Model with nn.Linear's parameters, F.gelu between the layers) or
qbl.QuantBlendLinear, the GELU fused into the second layer (activation="gelu": the layer keeps
the first layer's output, not GELU's), with `mixed` kept for the backward ("qbl": keep_mixed=True,
the default) or recomputed in it ("qbl_recompute": keep_mixed=False); all models have the same
parameter names and start from the same values. The task: each token
id has 4 fixed random successors with fixed odds, the target is one of them (the next token of a
sparse random Markov chain), so the loss falls from about ln(4096) = 8.3 towards the targets'
entropy (about 1.2). The blocks mix nothing across positions, so the tokens are drawn independently.

A step is forward, loss, backward and a fused AdamW step on 8 x 1024 tokens, all batches made on
the GPU beforehand. Precisions: bf16 (parameters and activations in bfloat16), autocast (float32
parameters under torch.autocast(bfloat16)), fp32 (TF32 off). For each D and timed precision, both
variants run eager and torch.compile'd (default mode, dynamic=False): all of them are warmed up
(compiling, qbl planning), then take turns in rounds, each running --round-warmup untimed steps
(1: the switch from another variant stays out of the numbers) and then timing --round-steps
consecutive steps between one pair of CUDA events. Reported: the median ms per step over the
rounds, the host's time per step to enqueue them, and the peak memory of a step:
torch.cuda.max_memory_allocated()
over the round's steps above what was allocated before them (parameters, optimizer state and
data), the median over rounds. Loss curves: reference and qbl from the same parameters on the same
batches, and the reference a second time, for the size of its own run-to-run differences.

Progress goes to stderr; markdown (environment, step and host times, losses and their agreement)
to stdout, the loss curves to a PNG (--plot, with matplotlib), every number to --json. Exits
non-zero if something failed to run.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Dict, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import qbl  # noqa: E402
from compare import exact_fp32_matmul  # noqa: E402
from reference import _fake_quant_symmetric_int8  # noqa: E402

PRECISIONS = ("bf16", "autocast", "fp32")
# The qbl variants: keep_mixed of qbl.QuantBlendLinear.
QBL_VARIANTS = {"qbl": True, "qbl_recompute": False}
VARIANTS = ("reference",) + tuple(QBL_VARIANTS)
MODES = ("eager", "compile")
MODE_NAMES = {"eager": "eager", "compile": "compiled"}
SUCCESSOR_PROBS = (0.5, 0.25, 0.15, 0.1)  # the odds of each token's successors
# (name, variant, mode) of the loss-curve runs; the compiled ones with --curve-compiled.
CURVE_RUNS = [("reference eager", "reference", "eager"), ("qbl eager", "qbl", "eager"),
              ("reference eager, 2nd run", "reference", "eager"),
              ("reference compiled", "reference", "compile"), ("qbl compiled", "qbl", "compile")]
# (a, b) pairs whose loss curves are compared, where both ran.
COMPARISONS = [("qbl eager", "reference eager"), ("reference eager, 2nd run", "reference eager"),
               ("qbl compiled", "reference compiled"), ("reference compiled", "reference eager"),
               ("qbl compiled", "qbl eager")]

Batches = List[Tuple[torch.Tensor, torch.Tensor]]


def log(*parts):
    print(*parts, file=sys.stderr, flush=True)


class ReferenceQuantBlendLinear(nn.Module):
    """reference.py's Model, its linear's parameters held as `weight` and `bias` (nn.Linear's
    names, shapes and initialization, as qbl.QuantBlendLinear's), so state dicts load both ways."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device,
                                               dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))  # nn.Linear's initialization
        nn.init.uniform_(self.bias, -1 / math.sqrt(in_features), 1 / math.sqrt(in_features))

    def forward(self, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        alpha = torch.sigmoid(logits).unsqueeze(-1)
        amax = x.detach().abs().max().clamp(min=1e-8)
        scale = amax / 127.0
        x_q = _fake_quant_symmetric_int8(x, scale)
        mixed = alpha * x_q + (1.0 - alpha) * x
        return F.linear(mixed, self.weight, self.bias)


class Block(nn.Module):
    """h = LayerNorm(x); x + down(GELU(up(h, logits)), logits). `fused`: `down` applies the GELU
    itself (qbl.QuantBlendLinear(..., activation="gelu")); otherwise F.gelu runs between them."""

    def __init__(self, d: int, layer: Callable, device, fused: bool):
        super().__init__()
        self.norm = nn.LayerNorm(d, device=device)
        self.gate = nn.Linear(d, 1, device=device)
        self.up = layer(d, 4 * d, device=device)
        self.fused = fused
        self.down = layer(4 * d, d, device=device, **({"activation": "gelu"} if fused else {}))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        logits = self.gate(h).squeeze(-1)  # one gate per token, shared by both layers
        u = self.up(h, logits)
        return x + self.down(u if self.fused else F.gelu(u), logits)


class TinyLM(nn.Module):
    """forward(tokens, targets) -> the mean cross-entropy loss (the loss inside forward, so that
    torch.compile sees it too)."""

    def __init__(self, vocab: int, d: int, n_blocks: int, layer: Callable, device,
                 fused: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, device=device)
        self.blocks = nn.ModuleList(Block(d, layer, device, fused) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d, device=device)
        self.head = nn.Linear(d, vocab, device=device)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        # The softmax over the vocabulary in float32 in every precision, as usual.
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def make_batches(n: int, args) -> Tuple[Batches, float]:
    """n (tokens, targets) batches of [batch, seq] from --seed, and the targets' entropy (nats),
    the lowest expected loss."""
    g = torch.Generator(device="cuda")
    g.manual_seed(args.seed)
    k = len(SUCCESSOR_PROBS)
    succ = torch.randint(args.vocab, (args.vocab, k), generator=g, device="cuda")
    probs = torch.tensor(SUCCESSOR_PROBS, device="cuda")
    shape = (n, args.batch, args.seq)
    tokens = torch.randint(args.vocab, shape, generator=g, device="cuda")
    pick = torch.multinomial(probs, tokens.numel(), replacement=True, generator=g).view(shape)
    targets = succ[tokens, pick]
    # Entropy of each token's successors, averaged over tokens: q is the odds of successor j with
    # those of its duplicates merged, and sum_j p_j log q_j = sum over distinct successors q log q.
    q = ((succ.unsqueeze(2) == succ.unsqueeze(1)) * probs).sum(2)
    floor = -(probs * q.log()).sum(1).mean().item()
    return list(zip(tokens.unbind(0), targets.unbind(0))), floor


class Models:
    """The reference and qbl models of one D and precision from one set of initial parameters;
    the compiled copies are made on first use and reused (compiling is what costs)."""

    def __init__(self, args, d: int, precision: str):
        torch.manual_seed(args.seed)
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        ref = TinyLM(args.vocab, d, args.blocks, ReferenceQuantBlendLinear, "cuda").to(dtype)
        self.init_state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        self.eager: Dict[str, nn.Module] = {"reference": ref}
        for name, keep in QBL_VARIANTS.items():
            layer = functools.partial(qbl.QuantBlendLinear, keep_mixed=keep)
            new = TinyLM(args.vocab, d, args.blocks, layer, "cuda", fused=True).to(dtype)
            new.load_state_dict(self.init_state)
            self.eager[name] = new
        self.compiled: Dict[str, Tuple[nn.Module, Callable]] = {}
        self.lr = args.lr if args.lr is not None else default_lr(d)

    def get(self, variant: str, mode: str) -> Tuple[nn.Module, Callable]:
        """(the module holding the parameters, what a step calls)."""
        if mode == "eager":
            return self.eager[variant], self.eager[variant]
        if variant not in self.compiled:
            module = copy.deepcopy(self.eager[variant])
            module.load_state_dict(self.init_state)
            self.compiled[variant] = (module, torch.compile(module, dynamic=False))
        return self.compiled[variant]


def make_step(module: nn.Module, fn: Callable, precision: str, lr: float) -> Callable:
    """One training step with a fresh fused AdamW; returns the loss as a tensor (no sync)."""
    opt = torch.optim.AdamW(module.parameters(), lr=lr, fused=True)
    autocast = precision == "autocast"

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = fn(tokens, targets)
        loss.backward()  # outside autocast, as the recipe has it
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()
    return step


class Progress:
    """One bar over all the work on stderr: tqdm where installed, else a line redrawn with \\r."""

    def __init__(self, total: int):
        try:
            from tqdm import tqdm
            self.bar = tqdm(total=total, file=sys.stderr, dynamic_ncols=True)
        except ImportError:
            self.bar = None
        self.total, self.done, self.desc, self.width, self.t0 = total, 0, "", 0, time.perf_counter()

    def update(self, n: int = 1, desc: Optional[str] = None) -> None:
        self.done, self.desc = self.done + n, self.desc if desc is None else desc
        if self.bar is None:
            line = f"{self.desc}  {self.done}/{self.total}  {time.perf_counter() - self.t0:.0f} s"
            sys.stderr.write("\r" + line.ljust(self.width))
            sys.stderr.flush()
            self.width = len(line)
            return
        if desc is not None:
            self.bar.set_description_str(desc, refresh=False)
        self.bar.update(n)

    def write(self, msg: str) -> None:
        if self.bar is None:
            sys.stderr.write("\r" + msg.ljust(self.width) + "\n")
            self.update(0)
        else:
            self.bar.write(msg, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            sys.stderr.write("\n")


def timed_steps(step: Callable, batches: Batches, k: int,
                first: int) -> Tuple[float, float, float]:
    """k consecutive steps between one pair of CUDA events: (GPU ms, host enqueue ms) per step,
    and the peak memory of the steps (MiB above what was allocated before them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    start.record()
    t0 = time.perf_counter()
    for i in range(first, first + k):
        step(*batches[i % len(batches)])
    host_s = time.perf_counter() - t0
    end.record()
    end.synchronize()
    peak_mib = (torch.cuda.max_memory_allocated() - base) / 2 ** 20
    return start.elapsed_time(end) / k, host_s * 1e3 / k, peak_mib


def time_precision(models: Models, precision: str, batches: Batches, args, bar: Progress,
                   failures: List[str], label: str) -> Dict[Tuple[str, str], Dict[str, list]]:
    """Warms up every (variant, mode), then times them in interleaved rounds."""
    steps = {}
    for variant in args.variants:
        for mode in args.modes:
            name = f"{variant} {MODE_NAMES[mode]}"
            bar.update(0, f"{label}: warm-up {name}")
            t0 = time.perf_counter()
            try:
                step = make_step(*models.get(variant, mode), precision, models.lr)
                for i in range(args.warmup):
                    step(*batches[i % len(batches)])
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                bar.write(traceback.format_exc())
                failures.append(f"{label} {name} warm-up: {type(e).__name__}: {e}")
                bar.update(1 + args.rounds)
                continue
            bar.write(f"{label} {name}: warm-up {time.perf_counter() - t0:.1f} s")
            bar.update(1)
            steps[(variant, mode)] = step
    times = {key: {"gpu_ms": [], "host_ms": [], "peak_mib": []} for key in steps}
    keys = list(steps)
    for r in range(args.rounds):
        bar.update(0, f"{label}: timing round {r + 1}/{args.rounds}")
        for j in range(len(keys)):
            key = keys[(r + j) % len(keys)]  # the order rotates: none always goes first
            # Untimed steps first: the switch from the previous variant (its freed blocks, the
            # caches it left) stays out of the numbers, as a training loop never switches.
            for i in range(args.round_warmup):
                steps[key](*batches[(r * args.round_steps + i) % len(batches)])
            gpu_ms, host_ms, peak_mib = timed_steps(steps[key], batches, args.round_steps,
                                                    r * args.round_steps)
            times[key]["gpu_ms"].append(gpu_ms)
            times[key]["host_ms"].append(host_ms)
            times[key]["peak_mib"].append(peak_mib)
            bar.update(1)
    for key, t in times.items():
        bar.write(f"{label} {key[0]} {MODE_NAMES[key[1]]}: {statistics.median(t['gpu_ms']):.3f} "
                  f"ms per step, host {statistics.median(t['host_ms']):.3f} ms, peak "
                  f"{statistics.median(t['peak_mib']):.0f} MiB")
    return times


def default_lr(d: int) -> float:
    """1e-3 at D = 1024, scaled by 1 / D: Adam moves every weight by about lr per step, so a
    layer's output moves by about lr x its fan-in; at a fixed lr, D = 2048 diverges."""
    return 1e-3 * 1024 / d


def curve_runs(args) -> List[Tuple[str, str, str]]:
    """The eager runs and the compiled reference (the yardstick: the same model rounded
    differently); qbl compiled too with --curve-compiled."""
    return [run for run in CURVE_RUNS
            if run[2] == "eager" or run[0] == "reference compiled" or args.curve_compiled]


def train_curves(models: Models, precision: str, batches: Batches, args, bar: Progress,
                 failures: List[str], label: str) -> Dict[str, List[float]]:
    curves = {}
    for name, variant, mode in curve_runs(args):
        bar.update(0, f"{label}: loss curve, {name}")
        losses: List[torch.Tensor] = []
        try:
            module, fn = models.get(variant, mode)
            module.load_state_dict(models.init_state)  # in place: compiled code keeps them
            torch.manual_seed(args.seed)
            step = make_step(module, fn, precision, models.lr)
            for i in range(args.steps):
                losses.append(step(*batches[i % len(batches)]))
                bar.update(1)
            # One transfer at the end: no step waits for the GPU.
            curves[name] = torch.stack(losses).float().cpu().tolist()
            del step
            if not all(math.isfinite(v) for v in curves[name]):
                failures.append(f"{label} loss curve {name}: the loss is not finite")
        except Exception as e:  # noqa: BLE001
            bar.write(traceback.format_exc())
            failures.append(f"{label} loss curve {name}: {type(e).__name__}: {e}")
            bar.update(args.steps - len(losses))
    return curves


def max_rel_diff(a: List[float], b: List[float]) -> Tuple[float, int]:
    """max over steps of |a - b| / |b|, and the step (1-based) where it is."""
    diffs = [abs(x - y) / abs(y) if y else math.inf for x, y in zip(a, b)]
    bad = [i for i, v in enumerate(diffs) if math.isnan(v)]  # a NaN loss: no max to take
    i = bad[0] if bad else max(range(len(diffs)), key=diffs.__getitem__)
    return diffs[i], i + 1


def fmt(v: Optional[float], spec: str = "{:.3f}") -> str:
    return "n/a" if v is None or math.isnan(v) else spec.format(v)


def median_of(times, key, field) -> float:
    return statistics.median(times[key][field]) if key in times else float("nan")


def step_tables(timings) -> str:
    cols = [(v, m) for v in VARIANTS for m in MODES]
    names = [f"{v} {MODE_NAMES[m]}" for v, m in cols]
    qbl_cols = [(v, m) for v in QBL_VARIANTS for m in ("compile", "eager")]
    head = ["D", "precision"] + names + [f"{v} {MODE_NAMES[m]} vs reference compiled"
                                         for v, m in qbl_cols]
    lines = ["## Time per training step (ms, median over rounds)", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    mem = ["## Peak memory of a step (MiB above what was allocated before it, median over rounds)",
           "", "| " + " | ".join(head[:2 + len(names)] + [f"{v} {MODE_NAMES[m]} / reference "
                                                         "compiled" for v, m in qbl_cols]) + " |",
           "|" + "---|" * len(head)]
    host = ["## Host time per step to enqueue it (ms, median over rounds)", "",
            "Close to the step time above: the host sets the pace, or waited for a full launch "
            "queue.", "", "| " + " | ".join(head[:2 + len(names)]) + " |",
            "|" + "---|" * (2 + len(names))]
    for (d, precision), times in timings.items():
        ms = {c: median_of(times, c, "gpu_ms") for c in cols}
        mib = {c: median_of(times, c, "peak_mib") for c in cols}
        base = ms[("reference", "compile")]
        speed = [fmt(base / ms[c], "{:.3f}x") for c in qbl_cols]
        lines.append(f"| {d} | {precision} | " + " | ".join(fmt(ms[c]) for c in cols) + " | "
                     + " | ".join(speed) + " |")
        base_mib = mib[("reference", "compile")]
        ratio = [fmt(mib[c] / base_mib, "{:.3f}") for c in qbl_cols]
        mem.append(f"| {d} | {precision} | " + " | ".join(fmt(mib[c], "{:.0f}") for c in cols)
                   + " | " + " | ".join(ratio) + " |")
        host.append(f"| {d} | {precision} | "
                    + " | ".join(fmt(median_of(times, c, "host_ms")) for c in cols) + " |")
    return "\n".join(lines + [""] + mem + [""] + host) + "\n"


def curve_tables(curves, diffs, steps: int, floor: float) -> str:
    lines = [f"## Loss over {steps} steps (targets' entropy: {floor:.3f})", "",
             "| D | precision | run | first | min | last |", "|---|---|---|---|---|---|"]
    for (d, precision), runs in curves.items():
        for name, losses in runs.items():
            lines.append(f"| {d} | {precision} | {name} | {losses[0]:.4f} | {min(losses):.4f} | "
                         f"{losses[-1]:.4f} |")
    lines += ["", "## Loss agreement: max over steps of |a - b| / |b|", "",
              "The reference against itself (a 2nd run; compiled vs eager) is the yardstick: how "
              "far the same computation moves between runs and compilations.", "",
              "| D | precision | a | b | max relative difference | at step |",
              "|---|---|---|---|---|---|"]
    for row in diffs:
        lines.append(f"| {row['d']} | {row['precision']} | {row['a']} | {row['b']} | "
                     f"{row['max_rel_diff']:.3g} | {row['step']} |")
    return "\n".join(lines) + "\n"


def plot_curves(path: str, curves, floor: float) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"matplotlib is not installed: no plot written to {path} (pip install matplotlib)")
        return
    ds = sorted({d for d, _ in curves})
    precs = [p for p in PRECISIONS if any(q == p for _, q in curves)]
    fig, axes = plt.subplots(len(ds), len(precs), squeeze=False,
                             figsize=(6.4 * len(precs), 4.2 * len(ds)))
    colors = {"reference eager": "C0", "qbl eager": "C1", "reference compiled": "C2",
              "qbl compiled": "C3"}
    for i, d in enumerate(ds):
        for j, precision in enumerate(precs):
            ax = axes[i][j]
            for name, losses in curves.get((d, precision), {}).items():
                if name in colors:  # the reference's 2nd run lies on its first
                    ax.plot(range(1, len(losses) + 1), losses, color=colors[name], label=name,
                            linestyle="--" if name.startswith("qbl") else "-", linewidth=1.5)
            ax.axhline(floor, color="gray", linestyle=":", linewidth=1, label="targets' entropy")
            ax.set_title(f"D = {d}, {precision}")
            ax.set_xlabel("step")
            ax.set_ylabel("cross-entropy loss")
            ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"loss curves written to {path}")


def environment(args, fp32_setting: str, floor: float) -> Dict[str, str]:
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "fp32 matmul": fp32_setting}
    try:
        from importlib.metadata import version
        env["qbl"] = getattr(qbl, "__version__", None) or version("qbl")
    except Exception:  # noqa: BLE001  (no version to show)
        pass
    lr = args.lr if args.lr is not None else "1e-3 x 1024 / D"
    env["task"] = (f"vocab {args.vocab}, {args.blocks} blocks, {args.batch} x {args.seq} tokens "
                   f"per step, AdamW(lr={lr}, fused=True), targets' entropy {floor:.3f}")
    return env


def parse_list(text: str, allowed: Optional[Tuple[str, ...]], what: str, ap) -> List[str]:
    items = [t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"]
    bad = [t for t in items if allowed is not None and t not in allowed]
    if bad:
        ap.error(f"{what}: {', '.join(bad)} not among {', '.join(allowed)}")
    return items


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", default="1024", help="model widths D, comma-separated")
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8, help="sequences per step")
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--precision", default="bf16,autocast",
                    help="precisions to time, of " + ", ".join(PRECISIONS))
    ap.add_argument("--modes", default="eager,compile", help="of eager, compile")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="models to time, of " + ", ".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=None, help="loss-curve steps (100; --quick 50)")
    ap.add_argument("--rounds", type=int, default=None, help="timing rounds (10; --quick 3)")
    ap.add_argument("--round-steps", type=int, default=None,
                    help="steps per timing round, between one pair of events (10; --quick 5)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant and mode")
    ap.add_argument("--round-warmup", type=int, default=1,
                    help="untimed steps before each timed round (0: none)")
    ap.add_argument("--lr", type=float, default=None,
                    help="AdamW's learning rate (default: 1e-3 x 1024 / D, as wide layers need)")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and loss-curve steps")
    ap.add_argument("--seed", type=int, default=0, help="for the data and the parameters")
    ap.add_argument("--plot", default="train_qat_loss.png", help="PNG of the loss curves ('' none)")
    ap.add_argument("--curve-precisions", default="fp32,autocast",
                    help="precisions of the loss curves ('none' for none)")
    ap.add_argument("--curve-compiled", action="store_true",
                    help="also loss curves of the compiled models")
    ap.add_argument("--json", metavar="PATH", help="write every number here")
    return ap


def model_args(lr=None) -> argparse.Namespace:
    """The model and data at this script's defaults (blocks, batch, seq, vocab, seed) and AdamW's
    learning rate `lr` (None: the default for the width): what make_batches and Models read, for
    the scripts that profile this model."""
    d = parser().parse_args([])
    return argparse.Namespace(vocab=d.vocab, blocks=d.blocks, batch=d.batch, seq=d.seq,
                              seed=d.seed, lr=lr)


def profiling_args(doc: str, precision: str, batches: int, **arguments):
    """The command line of the scripts that profile this model at one width (described by their
    `doc`): --d (2048), --precision (default `precision`) and one option per keyword (--name,
    given add_argument's keywords). Returns the parsed arguments, model_args() and `batches`
    batches of make_batches."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=2048, help="model width D")
    ap.add_argument("--precision", default=precision, help="comma-separated, of bf16, autocast")
    for name, keywords in arguments.items():
        ap.add_argument("--" + name, **keywords)
    args = ap.parse_args()
    ns = model_args()
    return args, ns, make_batches(batches, ns)[0]


def parse_args():
    ap = parser()
    args = ap.parse_args()
    try:
        args.d = [int(v) for v in parse_list(args.d, None, "--d", ap)]
    except ValueError:
        ap.error(f"--d: {args.d!r} is not a comma-separated list of integers")
    args.precision = parse_list(args.precision, PRECISIONS, "--precision", ap)
    args.modes = [m for m in MODES if m in parse_list(args.modes, MODES, "--modes", ap)]
    args.variants = [v for v in VARIANTS
                     if v in parse_list(args.variants, VARIANTS, "--variants", ap)]
    args.curve_precisions = parse_list(args.curve_precisions, PRECISIONS, "--curve-precisions", ap)
    for name, full, quick in (("steps", 100, 50), ("rounds", 10, 3), ("round_steps", 10, 5)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.steps < 1 or args.rounds < 1 or args.round_steps < 1 or args.warmup < 1:
        ap.error("--steps, --rounds, --round-steps and --warmup must be positive")
    if args.round_warmup < 0:
        ap.error("--round-warmup must not be negative")
    return args


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        log("train_qat.py needs a CUDA device")
        return 2
    fp32_setting = exact_fp32_matmul()
    t_start = time.perf_counter()
    batches, floor = make_batches(max(args.steps, args.rounds * args.round_steps, args.warmup),
                                  args)
    env = environment(args, fp32_setting, floor)
    print("# qbl vs the PyTorch reference: training a small model\n")
    print("\n".join(f"- {k}: {v}" for k, v in env.items()) + "\n", flush=True)

    precisions = [p for p in PRECISIONS if p in args.precision or p in args.curve_precisions]
    runners = len(args.variants) * len(args.modes)
    total = sum((runners * (1 + args.rounds) if p in args.precision else 0)
                + (args.steps * len(curve_runs(args)) if p in args.curve_precisions else 0)
                for p in precisions) * len(args.d)
    bar = Progress(total)
    failures: List[str] = []
    timings, curves, diffs = {}, {}, []
    for d in args.d:
        for precision in precisions:
            label = f"D={d} {precision}"
            models = None
            try:
                models = Models(args, d, precision)
                if precision in args.precision and args.modes:
                    timings[(d, precision)] = time_precision(models, precision, batches, args, bar,
                                                             failures, label)
                if precision in args.curve_precisions:
                    runs = train_curves(models, precision, batches, args, bar, failures, label)
                    curves[(d, precision)] = runs
                    for a, b in COMPARISONS:
                        if a in runs and b in runs:
                            diff, at = max_rel_diff(runs[a], runs[b])
                            diffs.append({"d": d, "precision": precision, "a": a, "b": b,
                                          "max_rel_diff": diff, "step": at})
            except Exception as e:  # noqa: BLE001
                bar.write(traceback.format_exc())
                failures.append(f"{label}: {type(e).__name__}: {e}")
            # Free this precision's models, optimizers, compiled code and qbl's workspaces.
            del models
            gc.collect()
            torch._dynamo.reset()
            qbl.clear_cache()
            torch.cuda.empty_cache()
    bar.close()

    if curves and args.plot:
        try:
            plot_curves(args.plot, curves, floor)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            failures.append(f"plot: {type(e).__name__}: {e}")
    text = step_tables(timings) if timings else ""
    if curves:
        text += "\n" + curve_tables(curves, diffs, args.steps, floor)
    if failures:
        text += "\nDid not run:\n\n" + "".join(f"- {f}\n" for f in failures)
    print(text, flush=True)
    if args.json:
        out = {"environment": env, "args": vars(args), "loss_floor": floor,
               "timings": [{"d": d, "precision": p, "variant": v, "mode": m, **t,
                            "gpu_ms_median": statistics.median(t["gpu_ms"]),
                            "host_ms_median": statistics.median(t["host_ms"]),
                            "peak_mib_median": statistics.median(t["peak_mib"])}
                           for (d, p), times in timings.items() for (v, m), t in times.items()],
               "curves": [{"d": d, "precision": p, "run": name, "losses": losses}
                          for (d, p), runs in curves.items() for name, losses in runs.items()],
               "diffs": diffs, "failures": failures}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    log(f"total {time.perf_counter() - t_start:.0f} s, {len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

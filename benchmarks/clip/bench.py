"""Unscale + clip + step: DynamicLossScaler's one pass against torch's three, side by side.

What is measured
----------------
The BERT-base-shaped FP32 parameters of the ``scaler`` benchmark (201 tensors, ~110M elements,
or the same tensors scaled to ``--size``) with gradients that carry a loss scale of 2**16 and a
norm well above ``--max-norm`` (so clipping really multiplies). For each optimizer (SGD with
momentum, AdamW foreach, AdamW fused) one timed sample is one optimizer step of:

* ``bare``  - ``optimizer.step()`` alone: no scaler, no clipping;
* ``torch`` - ``torch.amp.GradScaler``: ``unscale_(opt)``, ``torch.nn.utils.clip_grad_norm_``,
  ``step(opt)``, ``update()`` (the Trainer/Accelerate flow with ``max_grad_norm`` set);
* ``two-pass`` - ``DynamicLossScaler`` the same way (``unscale_`` then torch's clip): the
  two-pass path, for comparison;
* ``ours``  - ``DynamicLossScaler.clip_grad_norm_(opt, max_norm)``, ``step(opt)``, ``update()``:
  the norm of the scaled gradients (one read), then one multiply by ``min(1, c) / S``.

The variants run interleaved and rotated within each repeat (A/B/C/D, then B/C/D/A, ...), the
gradients refilled (untimed) before every sample, so slow drift of the machine's load cancels
in paired differences. ``extra`` is a variant's time minus ``bare`` of the same repeat: the cost
of unscaling and clipping on top of the optimizer step (the goal was ours/torch <= 0.6);
it subtracts two samples of a long optimizer step, so on a loaded machine it is noisy.
``unscale+clip`` times that part of each scaler sample alone (the step itself is the same work
in every variant), the steadier figure. Ratios are taken per repeat, median [p25/p75].

The script first checks what it times: after one step of each variant from the same state,
``ours`` and ``torch`` leave bit-identical parameters (on the same tensors scaled to 1e5 elements).

Usage::

    python -m benchmarks run clip --threads 1                # bert-base size
    python -m benchmarks run clip --size 2e7 --repeats 5     # a documented smaller size
    python -m benchmarks run clip --quick                    # smoke run, seconds
"""

from __future__ import annotations

import datetime as _dt
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from amp_trainer.scaler import DynamicLossScaler
from benchmarks import cli
from benchmarks.machine import describe_machine, format_machine
from benchmarks.scaler.bench import LOSS_SCALE, make_optimizer, numel, quartiles, shapes_for_size

OPTIMIZERS = ("sgd", "adamw-foreach", "adamw-fused")
VARIANTS = ("bare", "torch", "two-pass", "ours")


class Gradients:
    """Parameters and the scaled reference gradients copied into ``.grad`` before each sample."""

    def __init__(self, shapes: list[tuple[int, ...]], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in shapes]
        # ~1e-3 per element times the scale: a true norm of ~1e-3 * sqrt(n) >> max_norm.
        self.reference = [torch.randn(s, generator=gen) * (1e-3 * LOSS_SCALE) for s in shapes]
        for param, ref in zip(self.params, self.reference):
            param.grad = torch.empty_like(ref)
        self.grads = [p.grad for p in self.params]

    def refill(self) -> None:
        torch._foreach_copy_(self.grads, self.reference)


def step_functions(
    grads: Gradients,
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    clip_seconds: dict[str, float] | None = None,
) -> dict[str, Callable[[], None]]:
    """One optimizer step of each variant (see the module doc), on ``optimizer``.

    ``clip_seconds[variant]`` receives the time of the unscale + clip part of the last call.
    """
    params = grads.params
    reference = torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE)
    two_pass = DynamicLossScaler("cpu", init_scale=LOSS_SCALE)
    ours = DynamicLossScaler("cpu", init_scale=LOSS_SCALE)
    loss = torch.ones(())
    clip_seconds = {} if clip_seconds is None else clip_seconds

    def unscale_then_clip(scaler: Any, name: str) -> Callable[[], None]:
        """The Trainer/Accelerate flow: ``unscale_`` + torch's clip, then step and update."""

        def run() -> None:
            scaler.scale(loss)
            start = time.perf_counter()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, max_norm)
            clip_seconds[name] = time.perf_counter() - start
            scaler.step(optimizer)
            scaler.update()

        return run

    run_torch = unscale_then_clip(reference, "torch")
    run_two_pass = unscale_then_clip(two_pass, "two-pass")

    def run_ours() -> None:
        ours.scale(loss)
        start = time.perf_counter()
        ours.clip_grad_norm_(optimizer, max_norm)
        clip_seconds["ours"] = time.perf_counter() - start
        ours.step(optimizer)
        ours.update()

    return {"bare": optimizer.step, "torch": run_torch, "two-pass": run_two_pass, "ours": run_ours}


def check_identical(shapes: list[tuple[int, ...]], kind: str, max_norm: float) -> None:
    """One step of ``torch`` and of ``ours`` from the same state leaves the same parameters."""
    after = {}
    for variant in ("torch", "ours"):
        grads = Gradients(shapes, seed=1)
        optimizer = make_optimizer(kind, grads.params)
        grads.refill()
        step_functions(grads, optimizer, max_norm)[variant]()
        after[variant] = [p.detach().clone() for p in grads.params]
    if not all(torch.equal(a, b) for a, b in zip(after["torch"], after["ours"])):
        raise RuntimeError(f"{kind}: one-pass unscale+clip differs from torch's GradScaler")


def time_optimizer(
    grads: Gradients, kind: str, max_norm: float, *, warmup: int, repeats: int
) -> dict[str, list[float]]:
    """Seconds per sample of each variant, aligned by repeat (for pairing).

    Also ``"<variant> clip"``: the unscale + clip part of the scaler variants' samples.
    """
    optimizer = make_optimizer(kind, grads.params)
    clip_seconds: dict[str, float] = {}
    functions = step_functions(grads, optimizer, max_norm, clip_seconds)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    times.update({f"{name} clip": [] for name in names if name != "bare"})
    for round_ in range(warmup + repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            grads.refill()
            start = time.perf_counter()
            functions[name]()
            seconds = time.perf_counter() - start
            if round_ >= warmup:
                times[name].append(seconds)
                if name != "bare":
                    times[f"{name} clip"].append(clip_seconds[name])
    return times


def fmt(values: list[float], scale: float = 1e3, digits: int = 1) -> str:
    lo, mid, hi = quartiles([v * scale for v in values])
    if math.isnan(mid):
        return "n/a"
    return f"{mid:.{digits}f} [{lo:.{digits}f}/{hi:.{digits}f}]"


def table(results: dict[str, dict[str, list[float]]]) -> list[str]:
    """The Markdown table: medians [p25/p75] in ms; extras and ratios paired per repeat."""
    lines = [
        "| optimizer | bare step ms | unscale+clip ms: torch | two-pass | ours "
        "| ours/torch unscale+clip | extra over bare ms: torch | ours | ours/torch extra "
        "| ours/torch total |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, t in results.items():
        extra = {
            name: [x - b for x, b in zip(t[name], t["bare"])] for name in VARIANTS if name != "bare"
        }
        ratio = [o / r if r > 0 else math.nan for o, r in zip(extra["ours"], extra["torch"])]
        clip = [o / r for o, r in zip(t["ours clip"], t["torch clip"])]
        total = [o / r for o, r in zip(t["ours"], t["torch"])]
        lines.append(
            f"| {kind} | {fmt(t['bare'])} | {fmt(t['torch clip'])} | {fmt(t['two-pass clip'])} "
            f"| {fmt(t['ours clip'])} | {fmt(clip, 1.0, 2)} | {fmt(extra['torch'])} "
            f"| {fmt(extra['ours'])} | {fmt(ratio, 1.0, 2)} | {fmt(total, 1.0, 2)} |"
        )
    return lines


def time_passes(grads: Gradients, repeats: int) -> dict[str, list[float]]:
    """The three gradient passes unscale + clip is made of, each alone, interleaved.

    Why: the one-pass fold keeps torch's norm (to stay bit-identical it must compute the same
    total norm the same way) and one multiply, and drops the unscale. Its floor against torch is
    therefore ``(norm + multiply) / (unscale + norm + multiply)``, which these times predict.
    """
    factor = torch.tensor(0.5)
    found_inf, inv_scale = torch.zeros(1), torch.ones(1)
    passes: dict[str, Callable[[], object]] = {
        "unscale (read + write, inf check)": lambda: (
            torch._amp_foreach_non_finite_check_and_unscale_(grads.grads, found_inf, inv_scale)
        ),
        "norm (read)": lambda: torch.nn.utils.get_total_norm(grads.grads, 2.0, foreach=True),
        "multiply (read + write)": lambda: torch._foreach_mul_(grads.grads, factor),
    }
    seconds: dict[str, list[float]] = {name: [] for name in passes}
    for repeat in range(repeats + 1):
        for name, run in passes.items():
            grads.refill()
            start = time.perf_counter()
            run()
            if repeat:  # the first round warms up
                seconds[name].append(time.perf_counter() - start)
    return seconds


def passes_table(seconds: dict[str, list[float]]) -> list[str]:
    unscale, norm, multiply = (statistics.median(v) for v in seconds.values())
    floor = (norm + multiply) / (unscale + norm + multiply)
    lines = ["| pass over every gradient | ms |", "|---|---|"]
    lines += [f"| {name} | {fmt(values)} |" for name, values in seconds.items()]
    lines += [
        "",
        f"Floor of the exact one-pass fold against torch's unscale + clip: (norm + multiply) / "
        f"(unscale + norm + multiply) = {floor:.2f}. A fold below it needs the multiply folded "
        "into the optimizer's own arithmetic, which rounds differently (not bit-identical).",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.topic_parser("clip", __doc__)
    parser.add_argument("--size", type=float, default=None, help="gradient elements (bert-base)")
    parser.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    parser.add_argument("--max-norm", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds per optimizer")
    cli.add_repeats(parser, 5, "timed rounds per optimizer (>= 1)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    cli.add_output(parser)
    cli.add_quick(parser, {"size": "2e4", "repeats": "2", "warmup": "0"})
    args = cli.parse(parser, argv)
    kinds = [k.strip() for k in args.optimizers.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in OPTIMIZERS]
    if unknown or not kinds:
        parser.error(f"--optimizers must be a comma list of {OPTIMIZERS}, got {args.optimizers!r}")
    if args.repeats < 1 or args.warmup < 0:
        parser.error(f"--repeats must be >= 1 and --warmup >= 0, got {args.repeats}/{args.warmup}")
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    shapes = shapes_for_size(None if args.size is None else int(args.size))

    started = time.perf_counter()
    machine_before = describe_machine()
    for kind in kinds:  # on the same tensor mix at 1e5 elements: cheap, and as telling
        check_identical(shapes_for_size(100_000), kind, args.max_norm)
    grads = Gradients(shapes, seed=0)
    results = {
        kind: time_optimizer(grads, kind, args.max_norm, warmup=args.warmup, repeats=args.repeats)
        for kind in kinds
    }
    passes = time_passes(grads, args.repeats)
    machine_after = describe_machine()

    report = [
        f"# Unscale + clip + step cost ({_dt.date.today().isoformat()})",
        "",
        f"Command: `{cli.command('clip', argv)}`",
        "",
        f"Machine (before): {format_machine(machine_before)}",
        "",
        f"Load average after: {' '.join(f'{v:.2f}' for v in machine_after['load_average'] or [])}",
        "",
        f"Gradients: {len(shapes)} tensors, {numel(shapes) / 1e6:.1f}M FP32 elements, loss scale "
        f"2**16, max_norm {args.max_norm:g} (clipping bites); torch threads "
        f"{torch.get_num_threads()}; {args.warmup} warm-up + {args.repeats} timed repeats per "
        f"optimizer, variants interleaved; {time.perf_counter() - started:.0f} s in all.",
        "",
        *table(results),
        "",
        "Medians [p25/p75] over repeats; ratios paired per repeat. unscale+clip: that part of "
        "each sample alone (torch and two-pass: unscale_ + clip_grad_norm_; ours: "
        "clip_grad_norm_). extra = variant - bare of the same repeat (unscale, clip and scaler "
        "bookkeeping on top of the optimizer step; noisy when the optimizer step is long). "
        "torch: GradScaler unscale_ + clip_grad_norm_ + step + update; two-pass: "
        "DynamicLossScaler the same way; ours: DynamicLossScaler.clip_grad_norm_ (one pass) + "
        "step + update. ours and torch leave bit-identical parameters (checked first).",
        "",
        "## The passes, each alone",
        "",
        *passes_table(passes),
    ]
    text = "\n".join(report)
    cli.emit(text, args.output)
    return 0

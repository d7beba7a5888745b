"""Per-step cost of DynamicLossScaler vs torch.amp.GradScaler on ~100M gradients, side by side.

What is measured
----------------
A BERT-base-shaped set of FP32 parameters (the real tensor shapes: a 30522x768 embedding, 12
layers of 4 x 768x768 attention matrices, 768x3072 and 3072x768 feed-forward matrices, biases and
LayerNorm vectors; 201 tensors, ~110M elements) with gradients that carry a loss scale of 2**16.
For each optimizer (SGD with momentum, AdamW foreach, AdamW fused) and for clean and overflow
steps, one timed sample is one optimizer step of:

* ``bare``  - ``optimizer.step()`` alone, no scaler (clean rows only: with inf grads it would
  write inf into the weights);
* ``torch`` - ``torch.amp.GradScaler``: ``scaler.step(optimizer); scaler.update()``;
* ``ours``  - ``DynamicLossScaler``: the same two calls.

``step()`` unscales internally when ``unscale_()`` was not called first; that is the protocol
that lets torch's scaler hand ``grad_scale``/``found_inf`` to the fused AdamW kernel instead of
unscaling in a separate pass, so it is the protocol fair to torch. ``--explicit-unscale`` times
``unscale_(); step(); update()`` instead (the gradient-clipping flow of Trainer/Accelerate).

Why "overhead" is a difference of paired samples
-------------------------------------------------
The optimizer's own arithmetic (~0.1-1 s per step at this size on a CPU) dwarfs and drowns the
scaler's cost, so the scaler is isolated as ``overhead = total - bare`` where ``bare`` is measured
in the same repeat, interleaved with the scaler runs (A/B/C, then B/C/A, ...; gradients are
refilled, untimed, before every sample so each one starts from the same state). On a shared
machine the noise is mostly slow drift (other processes come and go); pairing samples taken
seconds apart cancels the drift, and the median over repeats discards the outliers. The table
shows medians with the interquartile range [p25/p75].

The verdict does not divide noisy overheads (a 2 ms overhead measured as 0.1 ms would make any
ratio meaningless): it is taken on ``ours - torch``, the per-repeat paired difference of the two
scalers' total step times, in which the bare optimizer step cancels exactly. ``ok`` when its
median is <= 0, ``~`` when its p25 is (a tie within noise), ``MISS`` otherwise. The ratio column,
ours/torch of the medians, is there for reading, not for the verdict.

The ratio compares TOTAL time instead of overhead on two kinds of rows:

* fused AdamW: torch folds the unscale into the optimizer kernel, ours unscales in its own pass
  and then calls the same kernel, so "overhead" does not mean the same work on both sides; the
  user-visible cost is the total;
* overflow steps: no optimizer arithmetic should run at all, so the whole step is overhead
  (torch's fused path still launches the optimizer kernel with ``found_inf`` set: the weights
  are left untouched, but the launch is not free; see the fused overflow row).

The physical floor is also printed: one ``torch._foreach_mul_`` of every gradient by a scalar,
i.e. one read and one write of all gradients, which is the least an unscale can cost. A scaler
whose clean-step overhead is ~1 floor pass does nothing but the fused check-and-unscale.

Usage::

    python -m benchmarks run scaler --threads 1              # full size, CPU, ~5 min on 2 cores
    python -m benchmarks run scaler --quick                  # smoke run, seconds
    python -m benchmarks run scaler --device cuda --output benchmarks/scaler/gpu-scaler.md

On a CPU shared with other processes use ``--threads 1``: OpenMP workers that spin-wait for a
descheduled sibling turn 2-thread timings into scheduler noise.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from amp_trainer.scaler import DynamicLossScaler
from benchmarks import cli
from benchmarks.machine import describe_machine, format_machine

# bert-base-uncased
BERT_BASE = {"hidden": 768, "layers": 12, "vocab": 30522, "max_positions": 512}
LOSS_SCALE = 2.0**16
OPTIMIZERS = ("sgd", "adamw-foreach", "adamw-fused")


# ------------------------------------------------------------------------------------------------
# the gradients
# ------------------------------------------------------------------------------------------------
def bert_shapes(
    hidden: int, layers: int, vocab: int, max_positions: int, num_labels: int = 2
) -> list[tuple[int, ...]]:
    """The parameter shapes of BertForSequenceClassification, in model order."""
    h, ff = hidden, 4 * hidden
    shapes: list[tuple[int, ...]] = [(vocab, h), (max_positions, h), (2, h), (h,), (h,)]
    for _ in range(layers):
        shapes += [(h, h), (h,)] * 4  # query, key, value, attention output
        shapes += [(h,), (h,)]  # attention LayerNorm
        shapes += [(ff, h), (ff,), (h, ff), (h,)]  # feed-forward
        shapes += [(h,), (h,)]  # output LayerNorm
    shapes += [(h, h), (h,), (num_labels, h), (num_labels,)]  # pooler, classifier
    return shapes


def numel(shapes: Sequence[tuple[int, ...]]) -> int:
    return sum(math.prod(s) for s in shapes)


def shapes_for_size(size: int | None) -> list[tuple[int, ...]]:
    """bert-base's shapes, or the same 201 tensors with width and vocabulary scaled to ~``size``.

    Scaling width and vocabulary by one factor keeps the mix (one huge embedding, many mid-size
    matrices, many tiny vectors) and the tensor count, which is what the per-tensor Python and
    kernel-launch costs depend on.
    """
    base = bert_shapes(**BERT_BASE)
    if size is None:
        return base
    if size < 1000:
        raise ValueError(f"--size must be >= 1000 gradient elements, got {size}")
    factor = math.sqrt(size / numel(base))
    return bert_shapes(
        hidden=max(1, round(BERT_BASE["hidden"] * factor)),
        layers=BERT_BASE["layers"],
        vocab=max(1, round(BERT_BASE["vocab"] * factor)),
        max_positions=max(1, round(BERT_BASE["max_positions"] * factor)),
    )


def make_optimizer(kind: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    # Tiny learning rates: the weights barely move over the run, so every sample does the same
    # arithmetic on the same magnitudes (no drift into denormals or inf).
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-9, momentum=0.9, foreach=True)
    if kind == "adamw-foreach":
        return torch.optim.AdamW(params, lr=1e-9, foreach=True)
    if kind == "adamw-fused":
        return torch.optim.AdamW(params, lr=1e-9, fused=True)
    raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {kind!r}")


# ------------------------------------------------------------------------------------------------
# timing
# ------------------------------------------------------------------------------------------------
@dataclass
class Samples:
    """Per-repeat seconds of each variant, aligned by repeat index (for pairing)."""

    times: dict[str, list[float]] = field(default_factory=dict)

    def add(self, variant: str, seconds: float) -> None:
        self.times.setdefault(variant, []).append(seconds)


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(p25, median, p75); with fewer than 2 values all three are the value itself."""
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return (math.nan, math.nan, math.nan)
    if len(values) < 2:
        return (values[0], values[0], values[0])
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q1, q2, q3)


def fmt_ms(values: Sequence[float]) -> str:
    """'median [p25/p75]' in milliseconds ('/', since either bound may be negative)."""
    lo, mid, hi = quartiles([v * 1e3 for v in values])
    if math.isnan(mid):
        return "n/a"
    return f"{mid:.1f} [{lo:.1f}/{hi:.1f}]"


class Bench:
    """Owns the parameters, the scaled reference gradients and the two scalers."""

    def __init__(self, shapes: list[tuple[int, ...]], device: torch.device, seed: int) -> None:
        self.device = device
        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.params = [
            torch.nn.Parameter(torch.randn(s, generator=gen).mul_(0.02).to(device)) for s in shapes
        ]
        # Gradients of a realistic magnitude (~1e-3) already multiplied by the loss scale, as
        # backward() of a scaled loss leaves them. Copied into .grad before every sample.
        self.reference = [
            torch.randn(s, generator=gen).mul_(1e-3 * LOSS_SCALE).to(device) for s in shapes
        ]
        for p, r in zip(self.params, self.reference):
            p.grad = torch.empty_like(r)
        self.grads = [p.grad for p in self.params]
        # Where an overflow is injected: a mid-size matrix in the middle of the model, so a scan
        # that stopped at the first inf would not get away with reading little.
        self.inject_at = len(self.params) // 2

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def refill(self, overflow: bool) -> None:
        torch._foreach_copy_(self.grads, self.reference)
        if overflow:
            self.grads[self.inject_at].view(-1)[0] = math.inf
        self.sync()

    def time(self, fn: Callable[[], object]) -> float:
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - start


def run_row(
    bench: Bench,
    optimizer_kind: str,
    overflow: bool,
    *,
    warmup: int,
    repeats: int,
    explicit_unscale: bool,
) -> Samples:
    """Time every variant of one table row, interleaved and rotated, for warmup + repeats rounds."""
    device_type = bench.device.type
    optimizer = make_optimizer(optimizer_kind, bench.params)
    torch_scaler = torch.amp.GradScaler(device_type, init_scale=LOSS_SCALE)
    ours = DynamicLossScaler(device_type, init_scale=LOSS_SCALE)
    # A training loop calls scale(loss) every step (one scalar multiply each, for both scalers;
    # torch's creates its scale tensor in the first). It is done before each sample, untimed:
    # ours refuses to unscale gradients that no scale() call produced.
    loss = torch.ones((), device=bench.device)

    def scaler_step(scaler: torch.amp.GradScaler | DynamicLossScaler) -> Callable[[], None]:
        def run() -> None:
            if explicit_unscale:
                scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()

        return run

    variants: dict[str, Callable[[], object]] = {
        "torch": scaler_step(torch_scaler),
        "ours": scaler_step(ours),
    }
    if not overflow:
        variants["bare"] = optimizer.step
        variants["floor"] = lambda: torch._foreach_mul_(bench.grads, 0.5)
    names = list(variants)

    samples = Samples()
    for round_ in range(warmup + repeats):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            bench.refill(overflow)
            torch_scaler.scale(loss)
            ours.scale(loss)
            seconds = bench.time(variants[name])
            if overflow:
                # Undo the backoff, untimed, so every overflow sample starts from the same scale
                # (a long overflow streak would otherwise walk ours into min_scale).
                (torch_scaler if name == "torch" else ours).update(new_scale=LOSS_SCALE)
            if round_ >= warmup:
                samples.add(name, seconds)
    if overflow:
        # The benchmark itself checks the behaviour it times: both scalers really skipped.
        if ours.stats.skipped != warmup + repeats or not ours.step_was_skipped:
            raise RuntimeError(f"DynamicLossScaler did not skip every overflow step: {ours.stats}")
        if not all(
            torch.isfinite(p).all() for p in bench.params[bench.inject_at : bench.inject_at + 1]
        ):
            raise RuntimeError("an overflow step wrote inf/NaN into the weights")
    return samples


# ------------------------------------------------------------------------------------------------
# the table
# ------------------------------------------------------------------------------------------------
def paired(
    a: Sequence[float], b: Sequence[float], op: Callable[[float, float], float]
) -> list[float]:
    return [op(x, y) for x, y in zip(a, b)]


def ratio(x: float, y: float) -> float:
    return x / y if y > 0 else math.nan


def _minus(x: float, y: float) -> float:
    return x - y


@dataclass
class Row:
    optimizer: str
    overflow: bool
    samples: Samples

    @property
    def metric(self) -> str:
        """What the bar compares: the scaler's overhead, or the whole step (see module doc)."""
        return "total" if self.overflow or self.optimizer == "adamw-fused" else "overhead"

    def cells(self) -> list[str]:
        t = self.samples.times
        if self.overflow:
            overheads = {"torch": t["torch"], "ours": t["ours"]}  # no optimizer step runs
        else:
            overheads = {k: paired(t[k], t["bare"], _minus) for k in ("torch", "ours")}
        cost = overheads if self.metric == "overhead" else {k: t[k] for k in ("torch", "ours")}
        ratio_of_medians = ratio(statistics.median(cost["ours"]), statistics.median(cost["torch"]))
        # ours - torch, paired per repeat: the bare step cancels out, drift mostly too. Its
        # quartiles decide the verdict, so a tiny, noisy overhead cannot fake a big ratio.
        lo, mid, hi = quartiles([d * 1e3 for d in paired(t["ours"], t["torch"], _minus)])
        verdict = "ok" if mid <= 0.0 else ("~" if lo <= 0.0 else "MISS")
        return [
            self.optimizer,
            "overflow" if self.overflow else "clean",
            fmt_ms(t["bare"]) if "bare" in t else "(not run)",
            fmt_ms(t["torch"]),
            fmt_ms(t["ours"]),
            "= total" if self.overflow else fmt_ms(overheads["torch"]),
            "= total" if self.overflow else fmt_ms(overheads["ours"]),
            f"{mid:+.1f} [{lo:+.1f}/{hi:+.1f}]",
            f"{ratio_of_medians:.2f} ({self.metric})",
            verdict,
        ]


HEADER = [
    "optimizer",
    "step",
    "bare step ms",
    "torch total ms",
    "ours total ms",
    "torch overhead ms",
    "ours overhead ms",
    "ours - torch ms",
    "ours/torch",
    "bar",
]


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def environment_lines(
    args: argparse.Namespace, bench: Bench, shapes: list[tuple[int, ...]]
) -> list[str]:
    device = str(bench.device)
    if bench.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(bench.device)})"
    return [
        f"- date: {_dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- command: `{args.command}`",
        f"- machine at start: {format_machine(describe_machine())}",
        f"- device: {device}; torch threads: {torch.get_num_threads()}",
        f"- gradients: {numel(shapes):,} FP32 elements in {len(shapes)} tensors "
        f"(largest {math.prod(max(shapes, key=math.prod)):,}), loss scale {LOSS_SCALE:g}",
        f"- protocol: {'unscale_() + ' if args.explicit_unscale else ''}step() + update(); "
        f"{args.warmup} warm-up + {args.repeats} timed rounds per row, variants interleaved and "
        "rotated, gradients refilled (untimed) before each sample",
    ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = cli.topic_parser("scaler", __doc__)
    parser.add_argument(
        "--size",
        type=float,
        default=None,
        help="approximate gradient elements (default: exactly bert-base's ~110M); e.g. 1e6",
    )
    cli.add_repeats(parser, 15, "timed rounds per row (>= 1)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds per row (>= 0)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument(
        "--optimizers",
        default=",".join(OPTIMIZERS),
        help=f"comma-separated subset of {','.join(OPTIMIZERS)}",
    )
    parser.add_argument(
        "--explicit-unscale",
        action="store_true",
        help="time unscale_() + step() + update() (the clip-grad flow), not step() + update()",
    )
    parser.add_argument("--seed", type=int, default=0)
    cli.add_output(parser)
    cli.add_quick(parser, {"size": "2e4", "repeats": "2", "warmup": "0"})
    args = cli.parse(parser, argv)
    args.command = cli.command("scaler", argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    bad = [o for o in optimizers if o not in OPTIMIZERS]
    if bad or not optimizers:
        parser.error(
            f"--optimizers must be a subset of {','.join(OPTIMIZERS)}, got {args.optimizers!r}"
        )
    args.optimizers = optimizers
    if args.size is not None:
        args.size = int(args.size)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(f"--device {args.device}: no CUDA device available", file=sys.stderr)
        return 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    shapes = shapes_for_size(args.size)
    bench = Bench(shapes, device, args.seed)
    header = environment_lines(args, bench, shapes)

    rows: list[Row] = []
    floor: list[float] = []
    for optimizer_kind in args.optimizers:
        for overflow in (False, True):
            samples = run_row(
                bench,
                optimizer_kind,
                overflow,
                warmup=args.warmup,
                repeats=args.repeats,
                explicit_unscale=args.explicit_unscale,
            )
            floor += samples.times.get("floor", [])
            rows.append(Row(optimizer_kind, overflow, samples))

    table = markdown_table(HEADER, [r.cells() for r in rows])
    floor_ms = quartiles([f * 1e3 for f in floor])
    report = "\n".join(
        [
            "# Loss scaler step cost: DynamicLossScaler vs torch.amp.GradScaler",
            "",
            *header,
            "",
            table,
            "",
            f"Physical floor, one `torch._foreach_mul_` pass over all gradients: "
            f"{floor_ms[1]:.1f} ms [{floor_ms[0]:.1f}/{floor_ms[2]:.1f}].",
            "",
            "Cells: median [p25/p75] over repeats; overhead = total - bare, paired per repeat. "
            "ours - torch: paired per-repeat difference of the total step time (the bare step "
            "cancels), median [p25/p75]. ours/torch: ratio of the medians of the bar metric: "
            "the overhead, or the total for fused AdamW (torch unscales inside the kernel) and "
            "for overflow steps (no optimizer step should run). bar: ok = median difference "
            "<= 0; ~ = a tie within noise (p25 <= 0); MISS otherwise.",
        ]
    )
    cli.emit(report, args.output)
    if args.output is not None:
        print(f"\nwritten to {args.output}")
    return 0

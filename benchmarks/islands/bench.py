"""Host cost of an FP32 island: one module called plain and as an island, side by side.

An FP32 island (:func:`amp_trainer.keep_in_fp32`, and every norm layer under AmpTrainer) wraps a
module's forward in Python: check its weights are FP32, upcast the input, switch autocast off,
cast the output back. On a GPU the kernels run asynchronously and that Python time is what the
host spends per call, so it is measured here on the host, with an input small enough (1 x width)
that the kernel time is a small part of each call. Both variants run in the same process,
interleaved round by round (plain, island, island, plain, ...), so drift in machine load hits
both alike; the overhead column is the paired per-round difference, median [p25/p75]. Times are
this thread's CPU time (``time.thread_time``), so other processes on a shared machine do not
count; with ``--threads 1`` that is all the work a call does.

Regimes (the module is ``LayerNorm(width)`` by default, the figure in this folder's README.md):

* ``fp32 eager``: FP32 input, no autocast (the wrapper's bare cost: nothing to cast);
* ``autocast, fp32 in``: FP32 input under FP16 autocast, what a transformer's residual stream
  feeds its norms (autocast switched off and on again around the call);
* ``autocast, fp16 in``: FP16 input under FP16 autocast (an upcast and a cast back, two more
  kernel launches, included in the overhead).

Usage::

    python -m benchmarks run islands                 # LayerNorm(768), ~20 s
    python -m benchmarks run islands --module linear --width 768 --repeats 30
    python -m benchmarks run islands --quick         # smoke run, seconds
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn

from amp_trainer.islands import keep_norms_in_fp32
from benchmarks import cli
from benchmarks.machine import describe_machine, format_machine

REGIMES = ("fp32 eager", "autocast, fp32 in", "autocast, fp16 in")


def _build(kind: str, width: int) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    if kind == "layernorm":
        plain: nn.Module = nn.LayerNorm(width)
        island = copy.deepcopy(plain)
        keep_norms_in_fp32(island)
    elif kind == "linear":
        from amp_trainer.islands import keep_in_fp32

        plain = nn.Linear(width, width)
        island = copy.deepcopy(plain)
        keep_in_fp32(island, "")
    else:
        raise ValueError(f"--module must be 'layernorm' or 'linear', got {kind!r}")
    return plain.eval(), island.eval()


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    # CPU time of this thread, not wall time: on a shared machine the wall clock also counts the
    # time other processes held the core, which is noise here (one torch thread does the work).
    start = time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - start) / calls * 1e6


def measure(kind: str, width: int, calls: int, rounds: int) -> list[dict[str, object]]:
    """One row per regime: plain and island median us per call, paired overhead quartiles."""
    plain, island = _build(kind, width)
    rows = []
    for regime in REGIMES:
        x = torch.randn(1, width)
        if regime.endswith("fp16 in"):
            x = x.half()
        context = (
            torch.autocast("cpu", dtype=torch.float16)
            if regime.startswith("autocast")
            else contextlib.nullcontext()
        )
        plain_t, island_t, diffs = [], [], []
        with context, torch.no_grad():
            for module in (plain, island):  # warm-up
                _per_call_us(lambda m=module, x=x: m(x), calls)
            for r in range(rounds):
                order = [(plain, plain_t), (island, island_t)]
                if r % 2:
                    order.reverse()
                for module, store in order:
                    store.append(_per_call_us(lambda m=module, x=x: m(x), calls))
                diffs.append(island_t[-1] - plain_t[-1])
        if regime.endswith("fp16 in"):
            # What the two casts an island must do here (up to FP32, back to FP16) cost alone.
            casts = [_per_call_us(lambda x=x: x.float().half(), calls) for _ in range(rounds)]
            cast_us = statistics.median(casts)
        else:
            cast_us = 0.0
        q = statistics.quantiles(diffs, n=4)
        rows.append(
            {
                "regime": regime,
                "plain_us": statistics.median(plain_t),
                "island_us": statistics.median(island_t),
                "overhead_us": statistics.median(diffs),
                "p25": q[0],
                "p75": q[2],
                "casts_us": cast_us,
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.topic_parser("islands", __doc__)
    parser.add_argument("--module", default="layernorm", choices=("layernorm", "linear"))
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed round")
    cli.add_repeats(parser, 21, "interleaved timed rounds per regime (>= 4)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    cli.add_output(parser)
    cli.add_quick(parser, {"calls": "20", "repeats": "4"})
    args = cli.parse(parser, argv)
    if args.width < 1 or args.calls < 1 or args.repeats < 4:
        parser.error(
            f"--width and --calls must be >= 1 and --repeats >= 4, got "
            f"{args.width}, {args.calls} and {args.repeats}"
        )
    torch.set_num_threads(args.threads)
    rows = measure(args.module, args.width, args.calls, args.repeats)
    name = {"layernorm": "LayerNorm", "linear": "Linear"}[args.module]
    lines = [
        f"## FP32 island host cost: {name}({args.width}), input 1 x {args.width}, CPU eager",
        "",
        f"Command: `{cli.command('islands', argv)}`",
        "",
        f"Machine: {format_machine(describe_machine())}.",
        "",
        f"{args.threads} torch thread(s); {args.repeats} interleaved rounds x {args.calls} calls; "
        "us of thread CPU time per call",
        "",
        "| regime | plain | island | island - plain [p25/p75] | of which input/output casts |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        casts = f"{row['casts_us']:.2f}" if row["casts_us"] else "none"
        lines.append(
            f"| {row['regime']} | {row['plain_us']:.2f} | {row['island_us']:.2f} "
            f"| {row['overhead_us']:+.2f} [{row['p25']:+.2f}/{row['p75']:+.2f}] | {casts} |"
        )
    text = "\n".join(lines)
    cli.emit(text, args.output)
    return 0

"""What the precision guard costs a training step: the same FP16 loop with it on and off.

A tiny BERT classifier (from a config, nothing downloaded) trains in a plain loop with
:class:`~amp_trainer.DynamicLossScaler` and AdamW under FP16 autocast, twice in the same process,
interleaved round by round: once with the guard ``DynamicLossScaler.watch(model)`` builds (mode
``"raise"``), once with it closed. Per round: thread CPU time per optimizer step of each, and
the guard's own work timed alone (its check before the step, over the parameters, their
gradients and optimizer state, and the forward pre-hook). The share column is that work over
the step without the guard: the figure the default-on claim (at most 0.5 %) is about. The
paired step-time difference is printed too; on a CPU it is within the noise of a step.

Usage::

    python -m benchmarks run precision_guard                  # a few minutes on 2 cores
    python -m benchmarks run precision_guard --layers 12 --hidden 768 --seq 128
    python -m benchmarks run precision_guard --quick          # smoke run, seconds
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from amp_trainer import DynamicLossScaler
from benchmarks import cli
from benchmarks.machine import describe_machine, format_machine


def _model(layers: int, hidden: int, seed: int = 0) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=1024,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        intermediate_size=4 * hidden,
        max_position_embeddings=512,
        num_labels=2,
    )
    return BertForSequenceClassification(config).train()


class _Loop:
    """One model, its optimizer and scaler; ``guarded`` keeps or closes the scaler's guard."""

    def __init__(self, layers: int, hidden: int, guarded: bool) -> None:
        self.model = _model(layers, hidden)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-5)
        self.scaler = DynamicLossScaler("cpu", init_scale=2.0**10).watch(self.model)
        self.guard = self.scaler.precision_guard
        if not guarded:
            self.guard.close()
            self.scaler.precision_guard = None

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = self.model(**batch).loss
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)


def _batch(size: int, seq: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, 1024, (size, seq), generator=generator),
        "labels": torch.randint(0, 2, (size,), generator=generator),
    }


def _ms_per_step(loop: _Loop, batch: dict[str, torch.Tensor], steps: int) -> float:
    start = time.thread_time()
    for _ in range(steps):
        loop.step(batch)
    return (time.thread_time() - start) / steps * 1e3


def _guard_us(loop: _Loop, batch: dict[str, torch.Tensor], calls: int) -> tuple[float, float]:
    """The guard's work alone, per step: its check (with gradients and optimizer state as at a
    real step) and its forward pre-hook, in us of thread CPU time."""
    guard = loop.guard
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loop.model(**batch).loss
    loop.scaler.scale(loss).backward()
    start = time.thread_time()
    for _ in range(calls):
        guard.check(loop.optimizer)
    check = (time.thread_time() - start) / calls * 1e6
    watched = next(m for m in loop.model.modules() if m._parameters)
    with torch.autocast("cpu", dtype=torch.float16):  # as in the training forward
        start = time.thread_time()
        for _ in range(calls):
            guard.before_forward(watched)
        hook = (time.thread_time() - start) / calls * 1e6
    loop.scaler.step(loop.optimizer)  # the step those gradients were for (not timed)
    loop.scaler.update()
    loop.optimizer.zero_grad(set_to_none=True)
    return check, hook


def measure(args) -> dict[str, float]:
    batch = _batch(args.batch, args.seq)
    on, off = _Loop(args.layers, args.hidden, True), _Loop(args.layers, args.hidden, False)
    for loop in (on, off):
        _ms_per_step(loop, batch, 1)  # warm-up: optimizer state exists from here on
    steps_on, steps_off, diffs, checks, hooks = [], [], [], [], []
    for r in range(args.repeats):
        order = [(on, steps_on), (off, steps_off)]
        if r % 2:
            order.reverse()
        for loop, store in order:
            store.append(_ms_per_step(loop, batch, args.steps))
        diffs.append(steps_on[-1] - steps_off[-1])
        check, hook = _guard_us(on, batch, args.calls)
        checks.append(check)
        hooks.append(hook)
    assert on.guard.drifts_seen == [], on.guard.drifts_seen  # a clean run: nothing flagged
    params = sum(1 for _ in on.model.parameters())
    step_off = statistics.median(steps_off)
    guard_us = statistics.median(checks) + statistics.median(hooks)
    return {
        "params": params,
        "step_on": statistics.median(steps_on),
        "step_off": step_off,
        "diff": statistics.median(diffs),
        "check_us": statistics.median(checks),
        "hook_us": statistics.median(hooks),
        "share": guard_us / (step_off * 1e3) * 100,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.topic_parser("precision_guard", __doc__)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per timed round")
    parser.add_argument("--calls", type=int, default=200, help="guard calls timed per round")
    cli.add_repeats(parser, 5, "interleaved timed rounds (>= 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    cli.add_output(parser)
    cli.add_quick(
        parser,
        {"layers": "1", "hidden": "64", "seq": "16", "steps": "1", "calls": "10", "repeats": "2"},
    )
    args = cli.parse(parser, argv)
    if min(args.layers, args.hidden, args.seq, args.batch, args.steps, args.calls) < 1:
        parser.error("--layers, --hidden, --seq, --batch, --steps and --calls must be >= 1")
    if args.repeats < 2:
        parser.error(f"--repeats must be >= 2, got {args.repeats}")
    torch.set_num_threads(args.threads)
    row = measure(args)
    lines = [
        f"## Precision guard cost: BERT {args.layers} layers x {args.hidden}, batch "
        f"{args.batch} x {args.seq} tokens, FP16 autocast + DynamicLossScaler + AdamW, CPU",
        "",
        f"Command: `{cli.command('precision_guard', argv)}`",
        "",
        f"Machine: {format_machine(describe_machine())}.",
        "",
        f"{args.threads} torch thread(s); {args.repeats} interleaved rounds x {args.steps} "
        f"steps; {row['params']} parameter tensors; thread CPU time",
        "",
        "| step, guard off (ms) | step, guard on (ms) | on - off (ms) | guard check (us) "
        "| forward pre-hook (us) | guard work / step |",
        "|---|---|---|---|---|---|",
        f"| {row['step_off']:.1f} | {row['step_on']:.1f} | {row['diff']:+.2f} "
        f"| {row['check_us']:.1f} | {row['hook_us']:.2f} | {row['share']:.3f} % |",
    ]
    cli.emit("\n".join(lines), args.output)
    return 0

"""The skip-streak replay: what one incident costs, in seconds and in training steps.

A replay runs only after a streak of skipped updates; this measures what it costs when it does,
on a tiny BERT (2 layers, hidden 64, batch 8 x 16, fp16 autocast on CPU, one torch thread):

* **step**: one training step (FP16 forward, scaled backward, unscale, AdamW step), the unit;
* **scale_warmup**: the incident of start-up skips (an FP32 and an FP16 replay);
* **fp16_backward_range**: the classifier's input gradient overflows FP16 at every scale (its
  output is amplified by ``2**24`` and taken away again, exact in the forward): the FP32 replay,
  the FP16 replay with backward hooks that names the module, the island, and the replays that
  find the scale to restore.

Each incident on a fresh model, ``--repeats`` times interleaved; medians of wall time.

Usage::

    python -m benchmarks run replay                 # ~1 min on 2 cores
    python -m benchmarks run replay --quick         # smoke run, seconds
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch
from torch import nn

from amp_trainer import DynamicLossScaler
from amp_trainer.skip_streak_replay import SkipStreakReplay
from benchmarks import cli
from benchmarks.machine import describe_machine, format_machine

AMPLIFICATION = 2.0**24


class _AmplifiedGradient(nn.Module):
    """``module``'s output, plus ``2**24 * (h - h.detach())`` taken away again: an exact forward,
    an FP16 backward that is ``inf - inf`` at any loss scale."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.module(x)
        branch = h - h.detach()
        return h + branch * AMPLIFICATION - branch * AMPLIFICATION


def _bert(amplified: bool) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    model = BertForSequenceClassification(config)
    if amplified:
        model.classifier = _AmplifiedGradient(model.classifier)
    return model.train()


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(5, 1000, (8, 16), generator=g),
        "labels": torch.randint(0, 2, (8,), generator=g),
    }


def _forward(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def time_step(model: nn.Module, scaler: DynamicLossScaler, optimizer, seed: int) -> float:
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**_batch(seed)).loss
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def time_incident(amplified: bool) -> tuple[float, str]:
    """Seconds of one replay on a fresh model, and the verdict it reached."""
    model = _bert(amplified)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**16)
    replay = SkipStreakReplay(model, scaler, streak=1, forward=_forward)
    for seed in range(3):  # recent batches, as a run has them
        replay.observe(_batch(seed))
        replay.after_step(False, seed + 1)
    batch = _batch(3)
    replay.observe(batch)
    start = time.perf_counter()
    entry = replay.after_step(True, 4)
    elapsed = time.perf_counter() - start
    return elapsed, (entry or {}).get("verdict", "none")


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.topic_parser("replay", __doc__)
    cli.add_repeats(parser, 7, "interleaved repetitions of each incident (>= 1)")
    parser.add_argument("--steps", type=int, default=20, help="timed training steps per repeat")
    cli.add_output(parser)
    cli.add_quick(parser, {"repeats": "1", "steps": "2"})
    args = cli.parse(parser, argv)
    if min(args.repeats, args.steps) < 1:
        parser.error("--repeats and --steps must be >= 1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        machine = format_machine(describe_machine())
        model = _bert(False)
        scaler = DynamicLossScaler("cpu", init_scale=2.0**8)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        time_step(model, scaler, optimizer, 0)  # warm-up: first kernels
        time_incident(False)
        steps: list[float] = []
        incidents: dict[str, list[float]] = {}
        for r in range(args.repeats):
            steps += [
                time_step(model, scaler, optimizer, r * args.steps + i) for i in range(args.steps)
            ]
            for amplified in (False, True) if r % 2 == 0 else (True, False):
                seconds, verdict = time_incident(amplified)
                incidents.setdefault(verdict, []).append(seconds)
    finally:
        torch.set_num_threads(threads)
    step_s = statistics.median(steps)
    lines = [
        "## The skip-streak replay: cost per incident",
        "",
        f"Command: `{cli.command('replay', argv)}`",
        "",
        f"Machine: {machine}.",
        "",
        f"Tiny BERT (2 layers, hidden 64), batch 8 x 16, fp16 autocast on CPU, one torch thread; "
        f"medians of {args.repeats} incident(s) each, the step over {len(steps)} steps.",
        "",
        "| incident | seconds | training steps |",
        "|---|---|---|",
        f"| one training step | {step_s:.4f} | 1 |",
    ]
    for verdict, times in incidents.items():
        seconds = statistics.median(times)
        lines.append(f"| replay: {verdict} | {seconds:.4f} | {seconds / step_s:.1f} |")
    cli.emit("\n".join(lines), args.output)
    return 0

"""What PrecisionMismatchCallback costs a GRPO run: step time with it against without it.

The same fp16 GRPO run (TRL's GRPOTrainer under AmpTrainerMixin, transformers' own generation,
a rule-based reward; the policy a GPT-2 built from a config with one seed, a byte-level BPE
tokenizer trained here: nothing downloaded) is trained without the callback and with it every
``N`` steps, for each ``N`` of ``--every``, and once more without it (an A/A control: its ratio
to the first is this machine's noise floor). A run's step time is the mean over its steps after
``--warmup`` (not the median: with ``N > 1`` the meter's cost falls on one step in ``N``), each
step timed from ``on_step_begin`` to ``on_step_end`` of a timing callback placed last, so it
includes generation, the training forward and backward, the optimizer step and the meter's own
work at the end of a sampled step. Modes run in rotating order within each repeat so that drift
in machine load hits all alike; the ratio column is the paired per-repeat ratio to the run
without the callback, median [min-max].

Two clocks: process CPU time (all threads of this process; other processes on a shared machine
do not count) and wall time. With ``--threads 1`` the CPU time is all the work a step does. The
meter's own CPU time at each sampled step is timed too, within the same runs: on a loaded
machine the ratio that implies (``1 + own / (N x step)``) is steadier than the difference
between two runs.

Usage::

    python -m benchmarks run mismatch                       # ~3 min on 2 cores
    python -m benchmarks run mismatch --quick               # smoke run, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import cli
from benchmarks.machine import describe_machine, format_machine

_COLOURS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple"]
_THINGS = ["apple", "car", "house", "bird", "river", "stone", "cloud", "book"]


def _says_a_colour(completions: list[str], **kwargs: Any) -> list[float]:
    return [sum(c in text for c in _COLOURS) - 0.01 * len(text) for text in completions]


def _timed_run(tokenizer: Any, args: argparse.Namespace, every: int | None, out: Path) -> dict:
    """One GRPO run; ``every=None`` without the callback. Per-step CPU and wall seconds."""
    import torch
    from datasets import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from amp_trainer import AmpTrainerMixin, AmpTrainingArguments, PrecisionMismatchCallback

    @dataclasses.dataclass
    class AmpGRPOConfig(AmpTrainingArguments, GRPOConfig):
        pass

    class AmpGRPOTrainer(AmpTrainerMixin, GRPOTrainer):
        pass

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.cpu: list[float] = []
            self.wall: list[float] = []

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = (time.process_time(), time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            cpu, wall = self._start
            self.cpu.append(time.process_time() - cpu)
            self.wall.append(time.perf_counter() - wall)

    torch.manual_seed(0)
    eos = tokenizer.eos_token_id
    model = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=len(tokenizer),
            n_embd=args.width,
            n_layer=args.layers,
            n_head=4,
            n_positions=128,
            bos_token_id=eos,
            eos_token_id=eos,
            pad_token_id=eos,
        )
    )
    model.generation_config.pad_token_id = eos
    clock = StepClock()

    class TimedMeter(PrecisionMismatchCallback):
        """The meter, with the CPU time of its own work at each sampled step's end."""

        def __init__(self, every_n_steps: int) -> None:
            super().__init__(every_n_steps=every_n_steps)
            self.own: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            start = time.process_time()
            sampled = self._recording
            super().on_step_end(args, state, control, **kwargs)
            if sampled:
                self.own.append(time.process_time() - start)

    callbacks: list[Any] = [clock]
    meter = None
    if every is not None:
        meter = TimedMeter(every_n_steps=every)
        callbacks.insert(0, meter)
    trainer = AmpGRPOTrainer(
        model=model,
        reward_funcs=_says_a_colour,
        args=AmpGRPOConfig(
            output_dir=str(out),
            precision="fp16",
            use_cpu=True,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            num_generations=4,
            max_completion_length=args.completion_length,
            learning_rate=1e-5,
            logging_steps=args.steps,
            save_strategy="no",
            report_to="none",
            disable_tqdm=True,
            seed=0,
        ),
        train_dataset=Dataset.from_dict({"prompt": [f"Which {t} is it?" for t in _THINGS] * 8}),
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    trainer.remove_callback(PrinterCallback)  # the table is the output
    trainer.train()
    return {
        "cpu": statistics.fmean(clock.cpu[args.warmup :]),
        "wall": statistics.fmean(clock.wall[args.warmup :]),
        "meter_cpu": statistics.fmean(meter.own) if meter is not None and meter.own else None,
    }


def _every(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give steps >= 1, comma-separated")
    return values


def main(argv: list[str] | None = None) -> int:
    parser = cli.topic_parser("mismatch", __doc__)
    parser.add_argument("--every", type=_every, default=[1, 10], help="N values (default 1,10)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out")
    cli.add_repeats(parser, 3, "interleaved repeats per mode (>= 1)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8, help="completions per step")
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    cli.add_output(parser)
    cli.add_quick(
        parser,
        {"steps": "2", "warmup": "1", "repeats": "1", "every": "1", "layers": "1", "width": "32",
         "batch_size": "4", "completion_length": "4"},
    )  # fmt: skip
    args = cli.parse(parser, argv)
    if args.steps <= args.warmup or args.repeats < 1:
        parser.error("--steps must exceed --warmup, and --repeats be >= 1")
    import datasets
    import torch
    from transformers.utils import logging as hf_logging

    from amp_trainer.recipes import train_byte_level_bpe_tokenizer

    # Quiet for the timing, and put back afterwards: a caller in the same process (a test run)
    # keeps its own transformers verbosity, progress bars and threads.
    threads, verbosity = torch.get_num_threads(), hf_logging.get_verbosity()
    bars = datasets.is_progress_bar_enabled()
    torch.set_num_threads(args.threads)
    datasets.disable_progress_bars()
    hf_logging.set_verbosity_error()
    try:
        _measure_and_report(args, argv, train_byte_level_bpe_tokenizer)
    finally:
        torch.set_num_threads(threads)
        hf_logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()
    return 0


def _measure_and_report(
    args: argparse.Namespace, argv: list[str] | None, train_byte_level_bpe_tokenizer: Any
) -> None:
    """Time every mode, then print (and with --output write) the report."""
    modes: list[int | str | None] = [None, "again", *args.every]
    times: dict[int | str | None, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        sentences = [
            f"The {_COLOURS[i % 8]} {_THINGS[(i * 3) % 8]} is next to the {_THINGS[(i * 5) % 8]}."
            for i in range(64)
        ]
        tokenizer = train_byte_level_bpe_tokenizer(sentences, vocab_size=300, model_max_length=64)
        for repeat in range(args.repeats):
            order = modes[repeat % len(modes) :] + modes[: repeat % len(modes)]
            for mode in order:
                every = mode if isinstance(mode, int) else None
                times[mode].append(_timed_run(tokenizer, args, every, Path(tmp) / "run"))
    lines: list[str] = []
    lines.append(
        f"## PrecisionMismatchCallback cost: fp16 GRPO step, GPT-2 {args.layers} layers x "
        f"{args.width}, {args.batch_size} completions x {args.completion_length} tokens, CPU"
    )
    lines.append("")
    lines.append(f"Command: `{cli.command('mismatch', argv)}`")
    lines.append("")
    lines.append(f"Machine: {format_machine(describe_machine())}.")
    lines.append("")
    lines.append(
        f"{args.threads} torch thread(s); {args.repeats} repeat(s) of {args.steps} steps per "
        f"mode, mean step after {args.warmup} warm-up step(s); ratio: paired per repeat to "
        "the run without the callback, median [min-max]"
    )
    lines.append("")
    lines.append("| callback | CPU s/step | ratio (CPU) | wall s/step | ratio (wall) |")
    lines.append("|---|---|---|---|---|")
    base = times[None]
    for mode in modes:
        row = times[mode]
        cells = []
        for clock in ("cpu", "wall"):
            ratios = [r[clock] / b[clock] for r, b in zip(row, base, strict=True)]
            median = statistics.median(r[clock] for r in row)
            span = f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]"
            cells += [f"{median:.3f}", span]
        name = {None: "none", "again": "none, again (A/A)"}.get(mode, f"every {mode} step(s)")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    own = [r["meter_cpu"] for mode in args.every for r in times[mode] if r["meter_cpu"]]
    if own:
        step = statistics.median(r["cpu"] for r in base)
        meter = statistics.median(own)
        implied = ", ".join(f"every {n}: {1 + meter / (n * step):.3f}x" for n in (1, 10, 100))
        lines.append("")
        lines.append(
            f"The meter's own work at a sampled step's end: {meter:.3f} CPU s (median of "
            f"{len(own)} measured steps), {meter / step:.1%} of a step without it; the ratio "
            f"that implies: {implied}."
        )
    text = "\n".join(lines)
    cli.emit(text, args.output)

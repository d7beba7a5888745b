"""The underflow meter: its cost in a Trainer step, and the two-sided rule against torch's.

Two measurements, in one run:

* **cost**: AmpTrainer runs of ``--steps`` optimizer steps on a tiny BERT (2 layers, hidden 64),
  with the meter on every step (``loss_scale_underflow_check_interval=1``) and off (``0``),
  interleaved ``--repeats`` times; process CPU time with one torch thread, so the other processes
  of a shared machine do not count. The per-check cost is the paired difference per step; the
  cost at an interval N is that divided by N steps (the first step of a run is checked too);
* **policy**: a plain loop on the same BERT with its loss multiplied by 1e-4 (gradients far
  below FP16's range), from loss scale 1: with ``grow_on_underflow=True`` (a check every 10
  steps, and right after each growth) and with torch's rule (growth_interval 2000): the scale,
  the meter's reading and the skips, step by step;
* **jump**: the same loop, then the loss factor jumps from 1e-4 to 1 (gradients 10**4 times
  larger): the skips each rule takes to back off from the scale it had reached (the price of a
  scale grown for tiny gradients), against torch's rule from scale 1 and from its default 65536.

Usage::

    python -m benchmarks run underflow                     # ~3 min on 2 cores
    python -m benchmarks run underflow --quick             # smoke run, seconds
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
from transformers import PrinterCallback

import amp_trainer.underflow as underflow_module
from amp_trainer import AmpTrainer, AmpTrainingArguments, DynamicLossScaler
from amp_trainer.underflow import measure_underflow
from benchmarks import cli
from benchmarks.machine import describe_machine, format_machine

DEFAULT_INTERVAL = AmpTrainingArguments.__dataclass_fields__[
    "loss_scale_underflow_check_interval"
].default


def _bert(factor: float = 1.0, seed: int = 0) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )
    model = BertForSequenceClassification(config)
    if factor != 1.0:  # the Trainer reads the forward's signature: a model it runs stays as is
        model.loss_factor = factor  # read at every forward: run_jump changes it mid-run
        forward = model.forward

        def scaled(*args: Any, **kwargs: Any) -> Any:
            out = forward(*args, **kwargs)
            out.loss = out.loss * model.loss_factor
            return out

        model.forward = scaled  # type: ignore[method-assign]
    return model


def _batch(seed: int, n: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(5, 1000, (n, 16), generator=g),
        "labels": torch.randint(0, 2, (n,), generator=g),
    }


def _trainer_run(steps: int, interval: int, output_dir: str) -> float:
    """Process CPU seconds of one AmpTrainer.train() of ``steps`` steps."""
    from datasets import Dataset

    rows = [_batch(seed=i, n=1) for i in range(8 * steps)]
    data = Dataset.from_list(
        [{"input_ids": r["input_ids"][0].tolist(), "labels": int(r["labels"][0])} for r in rows]
    )
    args = AmpTrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        precision="fp16",
        max_steps=steps,
        per_device_train_batch_size=8,
        logging_steps=steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        loss_scale_underflow_check_interval=interval,
    )
    trainer = AmpTrainer(model=_bert(), args=args, train_dataset=data)
    trainer.remove_callback(PrinterCallback)  # the report is the output, not each step's logs
    start = time.process_time()
    trainer.train()
    return time.process_time() - start


class _BackwardCount:
    """Counts the meter's backward passes (calls of ``amp_trainer.underflow._grads``), per check:
    the cost of a check is set by how many it runs, which the gradients decide."""

    def __init__(self) -> None:
        self.per_check: list[int] = []
        self._original = underflow_module._grads
        self._measure = underflow_module.measure_underflow

    def __enter__(self) -> _BackwardCount:
        def counted_grads(*args: Any, **kwargs: Any) -> Any:
            self.per_check[-1] += 1
            return self._original(*args, **kwargs)

        def counted_measure(*args: Any, **kwargs: Any) -> Any:
            self.per_check.append(0)
            return self._measure(*args, **kwargs)

        underflow_module._grads = counted_grads
        underflow_module.measure_underflow = counted_measure
        return self

    def __exit__(self, *exc: object) -> None:
        underflow_module._grads = self._original
        underflow_module.measure_underflow = self._measure


def measure_cost(steps: int, repeats: int, output_dir: str) -> dict[str, Any]:
    on, off = [], []
    _trainer_run(2, 0, output_dir)  # warm-up: imports, first kernels
    counts = _BackwardCount()
    for r in range(repeats):
        order = ((1, on), (0, off)) if r % 2 == 0 else ((0, off), (1, on))
        for interval, times in order:
            if interval:
                with counts:
                    times.append(_trainer_run(steps, interval, output_dir) / steps)
            else:
                times.append(_trainer_run(steps, interval, output_dir) / steps)
    per_step = statistics.median(off)
    per_check = statistics.median(a - b for a, b in zip(on, off))
    return {
        "backward_passes": counts.per_check,
        "step_s": per_step,
        "metered_step_s": statistics.median(on),
        "check_s": per_check,
        "ratio_every_step": statistics.median(a / b for a, b in zip(on, off)),
        "ratio_default": 1.0 + per_check / (DEFAULT_INTERVAL * per_step),
    }


def run_policy(scaler: DynamicLossScaler, steps: int, check_every: int) -> list[dict[str, Any]]:
    """The plain loop; one row per step: scale, the meter's reading (when checked), skipped."""
    model = _bert(factor=1e-4).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = []
    for step in range(steps):
        batch = _batch(seed=step % 16)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        reading = measured_at = None
        if (check_every and step % check_every == 0) or scaler.underflow_recheck_due:
            measured = scaler.check_underflow(loss, model)
            reading, measured_at = measured.underflow, measured.scale
        scale = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        rows.append(
            {
                "step": step,
                "scale": scale,
                "measured_at": measured_at,
                "underflow": reading,
                "skipped": scaler.step_was_skipped,
            }
        )
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**_batch(seed=0)).loss
    final = measure_underflow(loss, model, scaler.get_scale())
    rows.append(
        {
            "step": steps,
            "scale": final.scale,
            "measured_at": final.scale,
            "underflow": final.underflow,
            "skipped": False,
        }
    )
    return rows


def run_jump(
    scaler: DynamicLossScaler, before: int, after: int, check_every: int
) -> dict[str, Any]:
    """What a scale grown for tiny gradients costs when they stop being tiny.

    ``before`` steps of the 1e-4 loop (checked every ``check_every`` steps, 0: never), then the
    loss factor jumps to 1 (every gradient 10**4 times larger, about 2**13.3) for ``after`` steps:
    the skips the scaler takes to back off to a scale the new gradients fit, and the scales
    before and after. A rule that grew far above what the gradients needed pays for it here.
    """
    model = _bert(factor=1e-4).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    skipped_after, scale_at_jump = 0, None
    for step in range(before + after):
        if step == before:
            model.loss_factor, scale_at_jump = 1.0, scaler.get_scale()
        batch = _batch(seed=step % 16)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch).loss
        if step < before and (
            (check_every and step % check_every == 0) or scaler.underflow_recheck_due
        ):
            scaler.check_underflow(loss, model)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if step >= before and scaler.step_was_skipped:
            skipped_after += 1
    return {
        "scale_at_jump": scale_at_jump,
        "skipped_after": skipped_after,
        "scale_after": scaler.get_scale(),
    }


def _passes_line(passes: list[int]) -> str:
    """The backward passes the timed checks ran: mean, range, and how many checks ran how many."""
    if not passes:
        return "No check ran."
    spread = ", ".join(f"{n}: {passes.count(n)}" for n in sorted(set(passes)))
    return (
        f"The {len(passes)} timed checks ran {statistics.mean(passes):.2f} backward passes each "
        f"on average ({min(passes)}-{max(passes)}; passes: checks = {spread}); the step's own "
        "backward is one."
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = cli.topic_parser("underflow", __doc__)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed run")
    cli.add_repeats(parser, 6, "interleaved timed runs per variant (>= 1)")
    parser.add_argument("--policy-steps", type=int, default=60, help="steps of the two-sided loop")
    parser.add_argument(
        "--torch-steps", type=int, default=2000, help="steps of the loop under torch's rule"
    )
    parser.add_argument(
        "--jump-steps", type=int, default=20, help="steps after the gradients grow 10**4 times"
    )
    cli.add_output(parser)
    cli.add_quick(
        parser,
        {"steps": "3", "repeats": "1", "policy_steps": "20", "torch_steps": "5", "jump_steps": "5"},
    )
    args = cli.parse(parser, argv)
    if min(args.steps, args.repeats, args.policy_steps, args.torch_steps, args.jump_steps) < 1:
        parser.error(
            "--steps, --repeats, --policy-steps, --torch-steps and --jump-steps must be >= 1"
        )
    import tempfile

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # for the timing; put back for a caller in the same process
    try:
        machine = format_machine(describe_machine())
        with tempfile.TemporaryDirectory() as tmp:
            cost = measure_cost(args.steps, args.repeats, os.path.join(tmp, "run"))
        two_sided = run_policy(
            DynamicLossScaler("cpu", init_scale=1.0, grow_on_underflow=True), args.policy_steps, 10
        )
        torch_rule = run_policy(DynamicLossScaler("cpu", init_scale=1.0), args.torch_steps, 0)
        jumps = {
            "grow_on_underflow=True, from scale 1": run_jump(
                DynamicLossScaler("cpu", init_scale=1.0, grow_on_underflow=True),
                args.policy_steps,
                args.jump_steps,
                10,
            ),
            "torch's rule, from scale 1": run_jump(
                DynamicLossScaler("cpu", init_scale=1.0), args.policy_steps, args.jump_steps, 0
            ),
            "torch's rule, from its default 65536": run_jump(
                DynamicLossScaler("cpu"), args.policy_steps, args.jump_steps, 0
            ),
        }
    finally:
        torch.set_num_threads(threads)
    reached = next(
        (r["step"] for r in two_sided if r["underflow"] is not None and r["underflow"] < 1e-3),
        None,
    )
    lines = [
        "## The underflow meter: cost and the two-sided rule",
        "",
        f"Command: `{cli.command('underflow', argv)}`",
        "",
        f"Machine: {machine}.",
        "",
        f"### Cost (AmpTrainer, tiny BERT, batch 8 x 16, fp16 on CPU; {args.repeats} interleaved "
        f"runs of {args.steps} steps per variant; process CPU time, 1 torch thread)",
        "",
        "| | seconds per step | ratio to no meter |",
        "|---|---|---|",
        f"| no meter | {cost['step_s']:.4f} | 1.000 |",
        f"| meter on every step | {cost['metered_step_s']:.4f} | {cost['ratio_every_step']:.3f} |",
        f"| meter every {DEFAULT_INTERVAL} steps (the default) | "
        f"{cost['step_s'] + cost['check_s'] / DEFAULT_INTERVAL:.4f} | "
        f"{cost['ratio_default']:.4f} |",
        "",
        f"One check costs {cost['check_s'] / cost['step_s']:.2f} steps. "
        + _passes_line(cost["backward_passes"]),
        "",
        "### Two-sided rule vs torch's, from loss scale 1 (loss x 1e-4)",
        "",
        "| rule | steps | skipped | final scale | share flushed at the end |",
        "|---|---|---|---|---|",
        f"| grow_on_underflow=True | {args.policy_steps} | "
        f"{sum(r['skipped'] for r in two_sided)} | {two_sided[-1]['scale']:g} | "
        f"{100 * two_sided[-1]['underflow']:.2f}% |",
        f"| torch's (growth_interval 2000) | {args.torch_steps} | "
        f"{sum(r['skipped'] for r in torch_rule)} | {torch_rule[-1]['scale']:g} | "
        f"{100 * torch_rule[-1]['underflow']:.2f}% |",
        "",
        f"The two-sided rule's meter first read below 0.1% at step {reached}. Its checks:",
        "",
        "| step | measured at scale | share flushed | the step ran with | skipped |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['step']} | {r['measured_at'] or '-'} | "
        + ("-" if r["underflow"] is None else f"{100 * r['underflow']:.2f}%")
        + f" | {r['scale']:g} | {r['skipped']} |"
        for r in two_sided
        if r["underflow"] is not None or r["skipped"]
    ]
    lines += [
        "",
        f"### When the gradients stop being tiny: the loss factor jumps from 1e-4 to 1 after "
        f"{args.policy_steps} steps",
        "",
        f"Skipped steps in the {args.jump_steps} steps after the jump, while the scale backs off "
        "to one the 10**4 times larger gradients fit:",
        "",
        "| rule | scale at the jump | skipped after it | scale at the end |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | {j['scale_at_jump']:g} | {j['skipped_after']} | {j['scale_after']:g} |"
        for name, j in jumps.items()
    ]
    text = "\n".join(lines)
    cli.emit(text, args.output)
    return 0

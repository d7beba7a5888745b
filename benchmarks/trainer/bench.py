"""AmpTrainer vs stock transformers.Trainer: train speed, peak memory and loss, side by side.

Every run trains the same model (built from a config with one seed, nothing downloaded) on the
same random token batches for the same number of optimizer steps. Each run is its own
subprocess: Accelerate keeps process-wide singletons (``AcceleratorState``, ``PartialState``)
that the first Trainer of a process configures, so a second Trainer with another precision in
the same process would inherit the first one's settings; a fresh process per run also gives each
run its own peak-memory reading. Runs are interleaved (see :func:`run_order`) so that drift in
machine load hits every mode alike; the table shows medians over repeats and the speed relative
to stock fp16 paired per repeat.

Modes:

* ``amp-fp16``   - :class:`amp_trainer.AmpTrainer`, ``precision="fp16"``: autocast to float16,
  DynamicLossScaler, FP32 norms (the default ``keep_norms_fp32=True``).
* ``stock-fp16`` - ``transformers.Trainer`` with ``fp16=True``. On a GPU that is all. On a CPU
  stock Trainer silently trains in FP32: accelerate 1.15 (``Accelerator.__init__``) enables
  native AMP for fp16 only when ``device.type != "cpu"``, and otherwise leaves ``native_amp=False``
  and ``scaler=None`` without a word. To benchmark the real stock FP16 path on a CPU, this script
  does after Trainer has built its Accelerator (before ``prepare()``) exactly what accelerate does
  on a GPU: ``accelerator.native_amp = True`` (so ``prepare_model`` wraps the forward in
  ``torch.autocast(dtype=float16)``) and ``accelerator.scaler = torch.amp.GradScaler("cpu")``. The
  rest (backward, unscale, clipping, ``scaler.step``/``update`` in ``AcceleratedOptimizer``) is
  stock code.
* ``amp-bf16``   - AmpTrainer, ``precision="bf16"`` (no scaler).
* ``fp32``       - stock Trainer, no mixed precision: the baseline.
* ``amp-fp16-no-norm-hooks`` (only when asked for in ``--modes``) - ``amp-fp16`` with
  ``keep_norms_fp32=False``: what the FP32-norm forward hooks cost.
* ``stock-fp16-again`` (only when asked for) - stock-fp16 once more in every repeat: an A/A
  control whose paired ratio to stock-fp16 shows this machine's noise floor (the same code
  compared with itself).

``--profile DIR`` records the timed steps with ``torch.profiler`` and prints, per mode against
stock-fp16, the GEMM time against everything else, whether the GEMM calls are the same (operator,
shapes, dtypes, count) and the operators whose time differs most.

Speed is measured on the steady state: the wall time from the end of the warm-up steps to the end
of the last step, taken in a TrainerCallback (with a CUDA synchronize at both ends on a GPU), so
model building, the first-step allocations and Trainer's set-up are excluded. tokens/s counts
batch x sequence length (no padding in this data). Peak memory is the worker process's peak RSS
on a CPU (``resource.getrusage``: includes the Python, torch and transformers baseline, the same
for every mode) and ``torch.cuda.max_memory_allocated`` on a GPU.

Usage::

    python -m benchmarks run trainer                             # CPU, ~5 min on 2 cores
    python -m benchmarks run trainer --quick --modes amp-fp16,stock-fp16     # smoke run
    python -m benchmarks run trainer --device cuda --model bert-base --batch-size 32 --seq-len 128
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from amp_trainer.atomic_files import write_text_atomic
from benchmarks import cli
from benchmarks.child import repo_env
from benchmarks.machine import describe_machine, format_machine

MODES = ("amp-fp16", "stock-fp16", "amp-bf16", "fp32")
# Not run by default: AmpTrainer fp16 without the FP32-norm forward hooks (keep_norms_fp32=False),
# to measure what those hooks cost per step (Python work on every norm call; visible on a GPU).
EXTRA_MODES = ("amp-fp16-no-norm-hooks", "stock-fp16-again")
RESULT_PREFIX = "BENCH_TRAINER_RESULT "
# The model sizes: "small" is the CPU default (4 layers, 128 wide: FP16 matmuls on a CPU without
# FP16 units are ~7x slower than FP32, so this is what trains 30 steps in ~10-20 s), "tiny" is
# for smoke tests, "bert-base" is bert-base-uncased's shape (for GPUs).
MODELS = {
    "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "vocab": 512},
    "small": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "vocab": 8192},
    "bert-base": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "vocab": 30522,
    },
}


# ------------------------------------------------------------------------------------------------
# the worker: one training run, in its own process
# ------------------------------------------------------------------------------------------------
def _build_model(size: str, seq_len: int) -> Any:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    spec = MODELS[size]
    config = BertConfig(
        vocab_size=spec["vocab"],
        hidden_size=spec["hidden_size"],
        num_hidden_layers=spec["num_hidden_layers"],
        num_attention_heads=spec["num_attention_heads"],
        intermediate_size=4 * spec["hidden_size"],
        max_position_embeddings=max(512, seq_len),
        num_labels=2,
    )
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


class _RandomTokens:
    """A map-style dataset of fixed random token sequences and labels (seeded, no padding)."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int = 0) -> None:
        import torch

        gen = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=gen)
        self.labels = torch.randint(0, 2, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": self.ids.new_ones(self.ids.shape[1]),
            "labels": self.labels[i],
        }


def _peak_memory_mib(device_type: str) -> float:
    if device_type == "cuda":
        import torch

        return torch.cuda.max_memory_allocated() / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


def run_worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from amp_trainer import AmpTrainer, AmpTrainingArguments

    on_cpu = args.device == "cpu"
    if on_cpu and args.threads:
        torch.set_num_threads(args.threads)

    class StepClock(TrainerCallback):
        """Wall and CPU time at the end of the warm-up and at the end of the run; with
        ``--profile``, a torch.profiler recording of exactly the timed steps."""

        def __init__(self) -> None:
            self.start: float | None = None
            self.end: float | None = None
            self.cpu_start: float | None = None
            self.cpu_end: float | None = None
            self.profiler: Any = None

        def on_step_end(self, targs, state, control, **kwargs):
            if state.global_step in (args.warmup, args.steps):
                if not on_cpu:
                    torch.cuda.synchronize()
                now, cpu_now = time.perf_counter(), time.process_time()
                if state.global_step == args.steps:
                    self.end, self.cpu_end = now, cpu_now
                    if self.profiler is not None:
                        self.profiler.stop()
                if state.global_step == args.warmup:
                    self.start, self.cpu_start = now, cpu_now
                    if args.profile is not None:
                        self.profiler = torch.profiler.profile(
                            record_shapes=True,
                            activities=[torch.profiler.ProfilerActivity.CPU]
                            + ([] if on_cpu else [torch.profiler.ProfilerActivity.CUDA]),
                        )
                        self.profiler.start()

    class StockTrainerRealCpuFp16(Trainer):
        """Stock Trainer, with accelerate's GPU fp16 set-up applied on a CPU (see module doc)."""

        def create_accelerator_and_postprocess(self) -> None:
            super().create_accelerator_and_postprocess()
            if self.args.fp16 and self.accelerator.device.type == "cpu":
                self.accelerator.native_amp = True
                self.accelerator.scaler = torch.amp.GradScaler("cpu")

    common = {
        "output_dir": args.workdir,
        "max_steps": args.steps,
        "per_device_train_batch_size": args.batch_size,
        "learning_rate": 5e-5,
        "warmup_steps": 0,
        "logging_steps": args.steps,  # one log entry: the mean loss of the run
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "seed": 0,
        "data_seed": 0,
        "dataloader_num_workers": 0,
        "use_cpu": on_cpu,
    }
    mode = args.worker
    if mode == "amp-fp16":
        targs, cls = AmpTrainingArguments(precision="fp16", **common), AmpTrainer
    elif mode == "amp-fp16-no-norm-hooks":
        targs = AmpTrainingArguments(precision="fp16", keep_norms_fp32=False, **common)
        cls = AmpTrainer
    elif mode == "amp-bf16":
        targs, cls = AmpTrainingArguments(precision="bf16", **common), AmpTrainer
    elif mode in ("stock-fp16", "stock-fp16-again"):
        targs, cls = TrainingArguments(fp16=True, **common), StockTrainerRealCpuFp16
    elif mode == "fp32":
        targs, cls = TrainingArguments(**common), Trainer
    else:
        raise ValueError(f"mode must be one of {MODES + EXTRA_MODES}, got {mode!r}")

    model = _build_model(args.model, args.seq_len)
    dataset = _RandomTokens(args.steps * args.batch_size, args.seq_len, model.config.vocab_size)
    clock = StepClock()
    if not on_cpu:
        torch.cuda.reset_peak_memory_stats()
    trainer = cls(model=model, args=targs, train_dataset=dataset, callbacks=[clock])
    output = trainer.train()
    if clock.start is None or clock.end is None:
        raise RuntimeError(
            f"the step clock did not fire (warmup={args.warmup}, steps={args.steps})"
        )

    scaler = trainer.accelerator.scaler
    ours = getattr(trainer, "loss_scaler", None)  # AmpTrainer's DynamicLossScaler
    autocast_on = bool(trainer.accelerator.native_amp)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    timed = args.steps - args.warmup
    seconds = clock.end - clock.start
    if clock.profiler is not None:
        _write_profile(args, clock.profiler, timed)
    return {
        "mode": mode,
        "steps_per_s": timed / seconds,
        # CPU time of the whole process (every thread) per timed step: other processes on the
        # machine lengthen the wall time of a step but much less the CPU time it takes.
        "cpu_ms_per_step": 1000 * (clock.cpu_end - clock.cpu_start) / timed,
        "tokens_per_s": timed * args.batch_size * args.seq_len / seconds,
        "peak_mem_mib": _peak_memory_mib(args.device),
        "mean_loss": losses[-1] if losses else output.training_loss,
        "scaler": type(scaler).__name__ if scaler is not None else "none",
        "final_scale": scaler.get_scale() if scaler is not None and scaler.is_enabled() else None,
        "skipped": ours.stats.skipped if ours is not None else None,
        "autocast": autocast_on,
        "mixed_precision": trainer.accelerator.mixed_precision,
        "optimizer": type(trainer.optimizer.optimizer).__name__
        + (" (fused)" if trainer.optimizer.optimizer.defaults.get("fused") else ""),
    }


#: The matrix products: on a CPU without FP16 units, FP16 GEMMs are emulated and take almost all
#: of an fp16 step, so the profile compares them call by call (shape and dtype).
GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _write_profile(args: argparse.Namespace, profiler: Any, steps: int) -> None:
    """Write the timed steps' profile into ``--profile DIR``: ``<mode>.txt`` (torch's table, by
    self CPU time) and ``<mode>.json`` (per step: each operator's self CPU microseconds and calls,
    and each GEMM signature's, name + shapes + dtypes, for :func:`diff_profiles`)."""
    averages = profiler.key_averages()
    out = Path(args.profile)
    out.mkdir(parents=True, exist_ok=True)
    table = averages.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
    (out / f"{args.worker}.txt").write_text(table + "\n")
    ops = {
        event.key: {"self_cpu_us": event.self_cpu_time_total / steps, "calls": event.count / steps}
        for event in averages
    }
    gemms: dict[str, dict[str, float]] = {}
    for event in profiler.events():
        if event.name in GEMM_OPS:
            dtypes = ",".join(str(d).replace("c10::", "") for d in event.input_dtypes if d)
            shapes = "x".join(str(list(s)) for s in event.input_shapes if s)
            entry = gemms.setdefault(f"{event.name} {shapes} {dtypes}", {"self_cpu_us": 0.0})
            entry["self_cpu_us"] += event.self_cpu_time_total / steps
            entry["calls"] = entry.get("calls", 0.0) + 1 / steps
    payload = {"ops": ops, "gemm": gemms}
    (out / f"{args.worker}.json").write_text(json.dumps(payload, indent=1, sort_keys=True))


def diff_profiles(profile_dir: Path, base: str, other: str, top: int = 12) -> str:
    """What differs between two modes' profiled steps: GEMM versus the rest, whether the GEMMs are
    the same calls (name, shapes, dtypes, count), and the operators whose time differs most."""
    a = json.loads((profile_dir / f"{base}.json").read_text())
    b = json.loads((profile_dir / f"{other}.json").read_text())

    def split(profile: dict[str, Any]) -> tuple[float, float]:
        """GEMM ms and everything-else ms per step."""
        gemm = sum(v["self_cpu_us"] for k, v in profile["ops"].items() if k in GEMM_OPS)
        total = sum(v["self_cpu_us"] for v in profile["ops"].values())
        return gemm / 1000, (total - gemm) / 1000

    def calls(profile: dict[str, Any]) -> dict[str, int]:
        return {k: round(v["calls"]) for k, v in profile["gemm"].items()}

    gemm_a, rest_a = split(a)
    gemm_b, rest_b = split(b)
    same = calls(a) == calls(b)
    rows = []
    for name in set(a["ops"]) | set(b["ops"]):
        ea, eb = a["ops"].get(name, {}), b["ops"].get(name, {})
        ta, tb = ea.get("self_cpu_us", 0.0), eb.get("self_cpu_us", 0.0)
        rows.append((tb - ta, name, ta, tb, ea.get("calls", 0.0), eb.get("calls", 0.0)))
    rows.sort(key=lambda r: -abs(r[0]))
    share_a = 100 * rest_a / (gemm_a + rest_a)
    share_b = 100 * rest_b / (gemm_b + rest_b)
    lines = [
        f"### {other} vs {base}: self CPU time per profiled step",
        "",
        f"- GEMM ({', '.join(GEMM_OPS)}): {base} {gemm_a:.1f} ms, {other} {gemm_b:.1f} ms",
        f"- everything else: {base} {rest_a:.1f} ms ({share_a:.1f} % of its step), {other} "
        f"{rest_b:.1f} ms ({share_b:.1f} %)",
        "- the GEMM calls (operator, shapes, dtypes, calls per step) are "
        + ("identical" if same else "DIFFERENT")
        + f" ({sum(calls(a).values())} vs {sum(calls(b).values())} per step)",
        "",
        f"| operator | {base} ms | {other} ms | difference ms | calls/step {base} | {other} |",
        "|---|---|---|---|---|---|",
    ]
    for diff, name, ta, tb, ca, cb in rows[:top]:
        lines.append(
            f"| `{name}` | {ta / 1000:.2f} | {tb / 1000:.2f} | {diff / 1000:+.2f} "
            f"| {ca:g} | {cb:g} |"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# the parent: interleaved subprocess runs and the table
# ------------------------------------------------------------------------------------------------
def _spawn(args: argparse.Namespace, mode: str, workdir: str) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "benchmarks",
        "run",
        "trainer",
        "--worker",
        mode,
        "--workdir",
        workdir,
        "--device",
        args.device,
        "--model",
        args.model,
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
    ]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if args.profile is not None:
        command += ["--profile", str(args.profile)]
    env = repo_env()
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        env.setdefault(key, "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    raise RuntimeError(f"{mode} run failed (exit status {done.returncode}):\n{done.stderr[-3000:]}")


def _median_range(values: Sequence[float], fmt: str) -> str:
    mid = statistics.median(values)
    if len(values) == 1:
        return format(mid, fmt)
    return f"{format(mid, fmt)} [{format(min(values), fmt)}-{format(max(values), fmt)}]"


def _vs_stock(
    results: list[dict[str, Any]],
    stock: list[dict[str, Any]] | None,
    key: str = "steps_per_s",
    faster: str = "higher",
) -> str:
    """Speed relative to stock fp16, paired per repeat (runs of one repeat are minutes apart at
    most, so load drift largely cancels): median [min-max] of the per-repeat ratios, > 1 meaning
    faster than stock whether ``key`` is a rate (``faster="higher"``) or a time per step."""
    if not stock:
        return "n/a"
    if faster == "higher":
        ratios = [r[key] / s[key] for r, s in zip(results, stock)]
    else:
        ratios = [s[key] / r[key] for r, s in zip(results, stock)]
    mid = statistics.median(ratios)
    if len(ratios) == 1:
        return f"{mid:.3f}x"
    return f"{mid:.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]"


def build_report(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> str:
    import torch

    stock = runs.get("stock-fp16")
    stock_mem = statistics.median(r["peak_mem_mib"] for r in stock) if stock else None
    header = [
        "mode",
        "steps/s",
        "tokens/s",
        "vs stock fp16 (paired)",
        "CPU ms/step",
        "vs stock, CPU time (paired)",
        "peak mem MiB",
        "mem vs stock",
        "mean loss",
        "scaler (final scale)",
        "autocast",
    ]
    rows = []
    for mode, results in runs.items():
        if not results:
            continue
        speed = [r["steps_per_s"] for r in results]
        mem = statistics.median(r["peak_mem_mib"] for r in results)
        scale = results[-1]["final_scale"]
        rows.append(
            [
                mode,
                _median_range(speed, ".2f"),
                _median_range([r["tokens_per_s"] for r in results], ".0f"),
                _vs_stock(results, stock),
                _median_range([r["cpu_ms_per_step"] for r in results], ".0f"),
                _vs_stock(results, stock, key="cpu_ms_per_step", faster="lower"),
                f"{mem:.0f}",
                f"{mem - stock_mem:+.0f}" if stock_mem is not None else "n/a",
                f"{statistics.median(r['mean_loss'] for r in results):.4f}",
                results[-1]["scaler"] + (f" ({scale:g})" if scale is not None else ""),
                # What really ran: Accelerate's mixed_precision, if autocast is actually on.
                results[-1]["mixed_precision"] if results[-1]["autocast"] else "off",
            ]
        )
    table = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    table += ["| " + " | ".join(r) + " |" for r in rows]
    first = next(r for results in runs.values() for r in results)
    spec = MODELS[args.model]
    lines = [
        "# AmpTrainer vs stock Trainer",
        "",
        f"- date: {_dt.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"- command: `{args.command}`",
        f"- machine at the end: {format_machine(describe_machine())}",
        f"- device {args.device}; torch threads per run: {args.threads or torch.get_num_threads()}",
        f"- model: BertForSequenceClassification, {spec['num_hidden_layers']} layers x "
        f"{spec['hidden_size']} wide, vocab {spec['vocab']}; batch {args.batch_size} x seq "
        f"{args.seq_len}; optimizer {first['optimizer']}, max_grad_norm 1.0",
        f"- {args.steps} optimizer steps per run, speed timed over the last "
        f"{args.steps - args.warmup}; {args.repeats} interleaved run(s) per mode, one subprocess "
        "each; cells: median [min-max]",
        "- stock-fp16 on a CPU: Trainer's accelerator forced onto accelerate's own fp16 path "
        "(native_amp=True, torch.amp.GradScaler('cpu')), since stock silently runs FP32 there",
        "",
        *table,
    ]
    return "\n".join(lines)


def run_order(modes: Sequence[str], repeat: int) -> list[str]:
    """The order of the runs of one repeat.

    amp-fp16 and stock-fp16, the comparison the bar is about, always run back to back, in
    alternating order (A B, then B A, ...), so a burst of load from other processes hits both
    alike; the other modes rotate around them.
    """
    pair = [m for m in ("amp-fp16", "stock-fp16") if m in modes]
    if repeat % 2:
        pair.reverse()
    others = [m for m in modes if m not in pair]
    at = repeat % (len(others) + 1)
    rotated = others[at:] + others[:at]
    return rotated[:at] + pair + rotated[at:]


def _write(path: Path, report: str) -> None:
    write_text_atomic(path, report + "\n")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = cli.topic_parser("trainer", __doc__)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default="small", choices=tuple(MODELS))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default steps/5)")
    cli.add_repeats(parser, None, "runs per mode (>= 1; default 3, 1 with --profile)")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"subset of {','.join(MODES + EXTRA_MODES)}"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per run (default: 1 on CPU, torch's default on CUDA; 0: torch's)",
    )
    cli.add_output(parser)
    parser.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="record the timed steps of each mode with torch.profiler into DIR (one repeat: "
        "profiling slows the steps, so its speeds are not comparable with unprofiled runs) "
        "and print which operators' time differs from stock-fp16",
    )
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    quick = {"model": "tiny", "steps": "3", "warmup": "1", "batch_size": "2", "seq_len": "8"}
    cli.add_quick(parser, {**quick, "repeats": "1"})
    args = cli.parse(parser, argv)
    args.command = cli.command("trainer", argv)
    if args.profile is not None and args.repeats not in (None, 1):
        parser.error(f"--profile records one run per mode: use --repeats 1, got {args.repeats}")
    if args.repeats is None:
        args.repeats = 1 if args.profile is not None else 3
    for name in ("batch_size", "seq_len", "steps", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads is None:
        # On a CPU shared with other processes, OpenMP workers that spin-wait for a descheduled
        # sibling make a 2-thread run up to ~30x slower than a 1-thread one (measured here):
        # one thread per run measures the code, not the scheduler.
        args.threads = 1 if args.device == "cpu" else 0
    if args.warmup is None:
        args.warmup = max(1, args.steps // 5)
    if not 1 <= args.warmup < args.steps:
        parser.error(
            f"--warmup must be in [1, steps - 1] = [1, {args.steps - 1}], got {args.warmup}"
        )
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES + EXTRA_MODES]
    if bad or not modes:
        parser.error(
            f"--modes must be a subset of {','.join(MODES + EXTRA_MODES)}, got {args.modes!r}"
        )
    args.modes = modes
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        result = run_worker(args)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return 0

    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in args.modes}
    with tempfile.TemporaryDirectory(prefix="bench_trainer_") as workdir:
        for repeat in range(args.repeats):
            for mode in run_order(args.modes, repeat):
                result = _spawn(args, mode, os.path.join(workdir, f"{mode}-{repeat}"))
                print(
                    f"[trainer] run {repeat + 1}/{args.repeats} {mode}: "
                    f"{result['steps_per_s']:.2f} steps/s, peak {result['peak_mem_mib']:.0f} MiB, "
                    f"loss {result['mean_loss']:.4f}",
                    file=sys.stderr,
                    flush=True,
                )
                runs[mode].append(result)
                if args.output is not None:  # after every run: a cut-short benchmark keeps them
                    _write(args.output, build_report(args, runs))
    report = build_report(args, runs)
    if args.profile is not None and "stock-fp16" in runs:
        diffs = "\n\n".join(
            diff_profiles(args.profile, "stock-fp16", mode) for mode in runs if mode != "stock-fp16"
        )
        _write(args.profile / "diff.md", diffs)
        report += "\n\n" + diffs
    print(report)
    if args.output is not None:
        _write(args.output, report)
        print(f"\nwritten to {args.output}")
    return 0 if all(math.isfinite(r["mean_loss"]) for rs in runs.values() for r in rs) else 1

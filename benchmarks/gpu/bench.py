"""GPU throughput, memory, scaler cost, export latency and scale trajectory: one part per call.

``bash scripts/gpu_check.sh`` runs every part on a machine lent a GPU, each under its own
``timeout``, and keeps going when one fails: that is why each part is a subcommand
(``python -m benchmarks run gpu PART``). Every part rewrites the results JSON (and the Markdown
rendered from it) atomically as soon as it finishes, so a run that is cut short keeps everything
measured so far.

Parts (all on ``--device``, CUDA by default; ``--quick`` shrinks everything for a CPU smoke test):

* ``loop``       - train throughput and peak memory of bert-base- and gpt2-sized models (built
  from configs, nothing downloaded) at batch 32 x seq 128: fp32, fp16 with DynamicLossScaler,
  fp16 with torch.amp.GradScaler ("stock"), bf16. A plain PyTorch loop (autocast, scaled
  backward, unscale, clip 1.0, fused AdamW), so it measures precision and scaler, not a trainer.
* ``scaler``     - the ``scaler`` benchmark on the device.
* ``trajectory`` - the loss scale, step by step, of a short gpt2-sized fp16 run with
  DynamicLossScaler (growth_interval 25, so growth and backoff both show up).
* ``export``     - FP16 inference latency vs FP32 of a bert-base-sized classifier (``model.half()``,
  and ``amp_trainer.export.export_fp16`` when that module exists).
* ``attach``     - store a Markdown file another benchmark wrote (the ``trainer`` table).
* ``fail``       - record that a part failed or timed out (called by the shell script).
* ``cuda-ok``    - exit 0 when a CUDA device is usable, 10 when not (prints why).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import importlib.util
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from amp_trainer.atomic_files import write_text_atomic
from benchmarks import cli
from benchmarks.child import repo_env
from benchmarks.machine import REPO, describe_machine, format_machine

MODES = ("fp32", "fp16-ours", "fp16-stock", "bf16")


# ------------------------------------------------------------------------------------------------
# the results file
# ------------------------------------------------------------------------------------------------
def load_results(path: Path) -> dict[str, Any]:
    if path.exists():
        return json.loads(path.read_text())
    return {"meta": environment(), "parts": {}}


def save_part(path: Path, part: str, record: dict[str, Any]) -> None:
    results = load_results(path)
    results["parts"][part] = record
    write_text_atomic(path, json.dumps(results, indent=2, sort_keys=False) + "\n")
    write_text_atomic(path.with_suffix(".md"), render_markdown(results))


def environment() -> dict[str, Any]:
    meta: dict[str, Any] = {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": describe_machine(),
        "cuda_available": torch.cuda.is_available(),
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
    }
    if torch.cuda.is_available():
        meta["cuda"] = torch.version.cuda
    return meta


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]


def render_markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = ["# amp-trainer GPU check", ""]
    lines += [
        f"- {key}: {format_machine(value) if key == 'machine' else value}"
        for key, value in meta.items()
    ]
    for part, record in results["parts"].items():
        lines += ["", f"## {part} ({record.get('status')}, {record.get('seconds', 0):.0f} s)", ""]
        if record.get("status") != "ok":
            lines.append(f"Incomplete: {record.get('reason', 'unknown')}")
            lines.append("")
        result = record.get("result")
        if not result:
            continue
        if part == "loop":
            rows = [
                [
                    r["model"],
                    r["mode"],
                    f"{r['steps_per_s']:.2f}",
                    f"{r['tokens_per_s']:.0f}",
                    f"{r['peak_mem_gib']:.2f}",
                    f"{r['final_loss']:.4f}",
                    r["skipped"],
                ]
                for r in result["runs"]
            ]
            lines.append(f"batch {result['batch']} x seq {result['seq']}, {result['steps']} steps")
            lines.append("")
            lines += _table(
                ["model", "mode", "steps/s", "tokens/s", "peak GiB", "final loss", "skipped"], rows
            )
        elif part == "trajectory":
            traj = result["trajectory"]
            lines.append(
                f"{len(traj)} steps, growth_interval {result['growth_interval']}: {result['stats']}"
            )
            lines.append("")
            changes = [
                t for i, t in enumerate(traj) if i == 0 or t["scale"] != traj[i - 1]["scale"]
            ]
            lines += _table(
                ["step", "scale", "skipped", "loss"],
                [[t["step"], f"{t['scale']:g}", t["skipped"], f"{t['loss']:.4f}"] for t in changes],
            )
        elif part == "export":
            rows = [
                [r["variant"], r["batch"], f"{r['median_ms']:.2f}", f"{r['speedup']:.2f}"]
                for r in result["latency"]
            ]
            lines += _table(["variant", "batch", "median ms", "speedup vs fp32"], rows)
            if "export_fp16" in result:
                lines += ["", "export_fp16 report:", "", "```", str(result["export_fp16"]), "```"]
        elif "markdown" in result:
            lines.append(result["markdown"])
        else:
            lines += ["```", json.dumps(result, indent=2), "```"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# models and loops
# ------------------------------------------------------------------------------------------------
def build_model(name: str, tiny: bool) -> torch.nn.Module:
    """bert-base / gpt2 (124M) from their default configs: nothing is downloaded."""
    if name == "bert-base":
        from transformers import BertConfig, BertForSequenceClassification

        cfg = BertConfig(num_labels=2)
        if tiny:
            cfg = BertConfig(
                vocab_size=256,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=64,
                num_labels=2,
            )
        return BertForSequenceClassification(cfg)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config()
        if tiny:
            cfg = GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=128)
        return GPT2LMHeadModel(cfg)
    raise ValueError(f"model must be 'bert-base' or 'gpt2', got {name!r}")


def make_batch(
    model: torch.nn.Module, name: str, batch: int, seq: int, device: torch.device, seed: int
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, seq), generator=gen)
    if name == "bert-base":
        labels = torch.randint(0, 2, (batch,), generator=gen)
    else:
        labels = ids.clone()
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        "labels": labels.to(device),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def make_scaler(mode: str, device: torch.device, **kwargs: Any) -> Any:
    from amp_trainer.scaler import DynamicLossScaler

    if mode == "fp16-ours":
        return DynamicLossScaler(device.type, **kwargs)
    if mode == "fp16-stock":
        return torch.amp.GradScaler(device.type, **kwargs)
    return None


def train(
    model_name: str,
    mode: str,
    *,
    device: torch.device,
    tiny: bool,
    batch: int,
    seq: int,
    warmup: int,
    steps: int,
    lr: float,
    scaler_kwargs: dict[str, Any] | None = None,
    on_step: Callable[[int, float, Any], None] | None = None,
) -> dict[str, Any]:
    """One training run; times the steps after ``warmup``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    _reset_memory(device)
    torch.manual_seed(0)
    model = build_model(model_name, tiny).to(device)  # FP32 master weights in every mode
    model.train()
    fused = device.type in ("cuda", "cpu")
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)
    scaler = make_scaler(mode, device, **(scaler_kwargs or {}))
    dtype = {"fp16-ours": torch.float16, "fp16-stock": torch.float16, "bf16": torch.bfloat16}.get(
        mode
    )
    data = [make_batch(model, model_name, batch, seq, device, seed) for seed in range(4)]
    skipped = 0
    loss_value = math.nan
    start = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(**data[step % len(data)]).loss
        if scaler is None:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            if mode == "fp16-ours":
                # A host bool: costs nothing. torch's scaler only shows a skip through
                # get_scale(), a device sync per step that would slow the stock run down.
                skipped += int(scaler.step_was_skipped)
        if on_step is not None:
            on_step(step, loss.item(), scaler)
    _sync(device)
    elapsed = time.perf_counter() - start
    loss_value = float(loss.item())
    result = {
        "model": model_name,
        "mode": mode,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "steps_per_s": steps / elapsed,
        "tokens_per_s": steps * batch * seq / elapsed,
        "peak_mem_gib": _peak_gib(device),
        "final_loss": loss_value,
        "skipped": skipped if mode == "fp16-ours" else "n/a",
    }
    del model, optimizer, scaler, data
    _reset_memory(device)
    return result


@contextlib.contextmanager
def timed_part(output: Path, part: str) -> Iterator[dict[str, Any]]:
    """Run a part, then record its result, or its error, into the results file."""
    record: dict[str, Any] = {"status": "ok"}
    start = time.perf_counter()
    try:
        yield record
    except Exception as exc:
        # Whatever the part had put in record["result"] before failing is kept.
        record.update(status="error", reason=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        record["seconds"] = time.perf_counter() - start
        save_part(output, part, record)
        print(f"[gpu_check] {part}: {record['status']} ({record['seconds']:.0f} s) -> {output}")


def part_loop(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    batch, seq = (4, 32) if args.quick else (32, 128)
    warmup, steps = (1, 3) if args.quick else (5, 30)
    with timed_part(args.output, "loop") as record:
        runs: list[dict[str, Any]] = []
        record["result"] = {"batch": batch, "seq": seq, "steps": steps, "runs": runs}
        for model_name in ("bert-base", "gpt2"):
            for mode in MODES:
                if mode == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
                    continue
                runs.append(
                    train(
                        model_name,
                        mode,
                        device=device,
                        tiny=args.quick,
                        batch=batch,
                        seq=seq,
                        warmup=warmup,
                        steps=steps,
                        lr=1e-5,
                    )
                )
                print(f"[gpu_check] loop {runs[-1]}")
                # Write after every run: a timeout keeps what was measured.
                save_part(args.output, "loop", {**record, "status": "partial", "seconds": 0.0})


def part_trajectory(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    steps = 10 if args.quick else 150
    batch, seq = (4, 32) if args.quick else (32, 128)
    trajectory: list[dict[str, Any]] = []

    def on_step(step: int, loss: float, scaler: Any) -> None:
        trajectory.append(
            {
                "step": step,
                "scale": scaler.get_scale(),
                "skipped": scaler.step_was_skipped,
                "loss": loss,
            }
        )

    with timed_part(args.output, "trajectory") as record:
        growth_interval = 25
        train(
            "gpt2",
            "fp16-ours",
            device=device,
            tiny=args.quick,
            batch=batch,
            seq=seq,
            warmup=0,
            steps=steps,
            lr=3e-4,
            scaler_kwargs={"growth_interval": growth_interval, "on_min_scale": "warn"},
            on_step=on_step,
        )
        record["result"] = {
            "growth_interval": growth_interval,
            "trajectory": trajectory,
            "stats": {
                "steps": len(trajectory),
                "skipped": sum(t["skipped"] for t in trajectory),
                "final_scale": trajectory[-1]["scale"] if trajectory else None,
            },
        }


def _median_ms(fn: Callable[[], object], device: torch.device, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def part_export(args: argparse.Namespace) -> None:
    device = torch.device(args.device)
    iters = 5 if args.quick else 50
    seq = 32 if args.quick else 128
    with timed_part(args.output, "export") as record:
        torch.manual_seed(0)
        model = build_model("bert-base", args.quick).eval().to(device)
        latency = []
        for batch in (1, 32):
            inputs = make_batch(model, "bert-base", batch, seq, device, seed=0)
            inputs.pop("labels")
            with torch.inference_mode():
                fp32 = _median_ms(lambda: model(**inputs), device, iters)  # noqa: B023
                with torch.autocast(device.type, dtype=torch.float16):
                    autocast = _median_ms(lambda: model(**inputs), device, iters)  # noqa: B023
                half = copy.deepcopy(model).half()  # the FP32 model stays exact for export
                fp16 = _median_ms(lambda: half(**inputs), device, iters)  # noqa: B023
            for variant, ms in (
                ("fp32", fp32),
                ("fp16 autocast", autocast),
                ("fp16 .half()", fp16),
            ):
                latency.append(
                    {"variant": variant, "batch": batch, "median_ms": ms, "speedup": fp32 / ms}
                )
        result: dict[str, Any] = {"seq": seq, "latency": latency}
        if importlib.util.find_spec("amp_trainer.export") is not None:
            result["export_fp16"] = _try_export_fp16(model)  # parity on the GPU too
        record["result"] = result


def _try_export_fp16(model: torch.nn.Module) -> str:
    """The FP16 exporter's parity report on this device, or the error it raised."""
    try:
        from amp_trainer.export import export_fp16

        with tempfile.TemporaryDirectory() as tmp:
            report = export_fp16(model, tmp)
        for name in ("to_markdown", "to_dict"):
            if hasattr(report, name):
                return str(getattr(report, name)())
        return str(report)
    except Exception as exc:  # a blind run must keep going: record and move on
        return f"export_fp16 failed: {type(exc).__name__}: {exc}"


def part_scaler(args: argparse.Namespace) -> None:
    with timed_part(args.output, "scaler") as record, tempfile.TemporaryDirectory() as tmp:
        md = Path(tmp) / "scaler.md"
        command = [sys.executable, "-m", "benchmarks", "run", "scaler", "--device", args.device]
        if args.quick:
            command += ["--size", "2e5", "--repeats", "2", "--warmup", "1"]
        else:
            command += ["--repeats", "20", "--warmup", "3"]
        subprocess.run([*command, "--output", str(md)], check=True, cwd=REPO, env=repo_env())
        record["result"] = {"markdown": md.read_text()}


def part_attach(args: argparse.Namespace) -> None:
    with timed_part(args.output, args.name) as record:
        record["result"] = {"markdown": Path(args.file).read_text()}


def part_fail(args: argparse.Namespace) -> None:
    reason = "timed out" if args.rc in (124, 137) else f"exit status {args.rc}"
    existing = load_results(args.output)["parts"].get(args.name, {})
    if existing.get("status") == "partial":
        # Keep what a cut-short part had written, marked as such.
        existing.update(status="partial", reason=f"{reason}; partial results kept")
        save_part(args.output, args.name, existing)
        return
    if existing.get("status") == "error":
        return  # the part recorded its own exception, which says more than an exit status
    save_part(args.output, args.name, {"status": "failed", "reason": reason, "seconds": 0.0})


NO_CUDA = 10  # cuda-ok's exit status for "no usable CUDA device" (1 is any other failure)


def cuda_ok(_: argparse.Namespace) -> int:
    if not torch.cuda.is_available():
        print("torch.cuda.is_available() is False")
        return NO_CUDA
    torch.ones(1, device="cuda").add_(1)
    print(f"CUDA device: {torch.cuda.get_device_name(0)}")
    return 0


PARTS = {
    "loop": "train throughput and peak memory, bert-base and gpt2 sizes, every precision",
    "trajectory": "the loss scale, step by step, of a short gpt2-sized fp16 run",
    "export": "FP16 inference latency against FP32, and the FP16 export's parity report",
    "scaler": "the scaler benchmark on the device",
    "attach": "store a Markdown file another benchmark wrote",
    "fail": "record that a part failed or timed out",
    "cuda-ok": f"exit 0 when a CUDA device is usable, {NO_CUDA} when not",
}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.topic_parser("gpu", __doc__)
    sub = parser.add_subparsers(dest="part", required=True)
    for name, what in PARTS.items():
        p = sub.add_parser(name, help=what, description=what)
        if name == "cuda-ok":
            continue
        p.add_argument(
            "--output",
            type=Path,
            required=True,
            metavar="PATH",
            help="the results JSON (its Markdown goes next to it)",
        )
        p.add_argument("--device", default="cuda")
        p.add_argument(
            "--quick", action="store_true", help="tiny models and steps: a smoke test in seconds"
        )
        if name in ("attach", "fail"):
            p.add_argument("--name", required=True, help="the part's name in the results")
        if name == "attach":
            p.add_argument("--file", required=True, help="Markdown file to store")
        if name == "fail":
            p.add_argument("--rc", type=int, required=True, help="the part's exit status")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.part == "cuda-ok":
        return cuda_ok(args)
    parts = {
        "loop": part_loop,
        "trajectory": part_trajectory,
        "export": part_export,
        "scaler": part_scaler,
        "attach": part_attach,
        "fail": part_fail,
    }
    parts[args.part](args)
    return 0

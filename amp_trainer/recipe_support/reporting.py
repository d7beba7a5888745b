"""What a finished run reports: metrics.json, a loss/loss-scale plot and a summary table.

The recipes share these so that every run leaves the same artifacts behind: ``metrics.json``
(machine-readable, written atomically so a crashed run never leaves a torn file), ``training.png``
(loss and loss scale against the optimizer step, skipped steps marked) and a plain-text table on
stdout with the figures one compares between runs: the task metric, the loss-scale history, the
throughput, the wall time and the peak memory.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from amp_trainer.atomic_files import atomic_path

__all__ = [
    "LossScaleSummary",
    "format_table",
    "peak_memory",
    "plot_training",
    "summarize_loss_scale",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossScaleSummary:
    """The loss scale over a run: where it ended, how low it went, how many steps were skipped."""

    final: float
    minimum: float
    maximum: float
    steps: int
    skipped: int


def summarize_loss_scale(scale_history: Sequence[Mapping[str, Any]]) -> LossScaleSummary | None:
    """Summarise ``AmpTrainer.scale_history`` (``None`` when empty: no FP16, no scaler).

    The history is compact (events, logging steps and the latest step; every scale change is an
    entry), so the steps are counted from the first and last entries' step numbers, not the
    entries.
    """
    if not scale_history:
        return None
    scales = [float(entry["scale"]) for entry in scale_history]
    return LossScaleSummary(
        final=scales[-1],
        minimum=min(scales),
        maximum=max(scales),
        steps=int(scale_history[-1]["step"]) - int(scale_history[0]["step"]) + 1,
        skipped=sum(bool(entry["skipped"]) for entry in scale_history),
    )


def peak_memory(device: torch.device | str) -> dict[str, float | None]:
    """Peak memory of this process in MiB: CUDA allocator peak on CUDA, peak RSS on CPU.

    Peak RSS comes from :func:`resource.getrusage` (kilobytes on Linux, bytes on macOS); it is
    ``None`` where the ``resource`` module does not exist (Windows).
    """
    device = torch.device(device)
    result: dict[str, float | None] = {"peak_rss_mib": None}
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        result["peak_rss_mib"] = peak / (2**20 if sys.platform == "darwin" else 2**10)
    except ImportError:  # pragma: no cover - Windows
        pass
    if device.type == "cuda" and torch.cuda.is_available():
        result["cuda_max_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return result


def plot_training(
    log_history: Iterable[Mapping[str, Any]],
    scale_history: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    title: str = "",
) -> Path | None:
    """Plot training (and eval) loss and the loss scale against the optimizer step.

    Skipped (overflow) steps are marked with red crosses on the loss-scale panel, which uses a
    log2 axis: the scale moves in powers of two. Returns the path, or ``None`` (with a warning)
    when matplotlib is not installed (it is the ``recipes`` extra). Uses the Agg canvas directly,
    so no GUI backend is touched and pyplot's global state is left alone.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'amp-trainer[recipes]'): no plot")
        return None

    logs = list(log_history)
    train = [(e["step"], e["loss"]) for e in logs if "loss" in e and "step" in e]
    evals = [(e["step"], e["eval_loss"]) for e in logs if "eval_loss" in e and "step" in e]

    figure = Figure(figsize=(8, 6), layout="constrained")
    FigureCanvasAgg(figure)
    loss_ax, scale_ax = figure.subplots(2, 1, sharex=True)
    if train:
        loss_ax.plot(*zip(*train), marker=".", label="train loss")
    if evals:
        loss_ax.plot(*zip(*evals), marker="o", linestyle="--", label="eval loss")
    loss_ax.set_ylabel("loss")
    loss_ax.grid(alpha=0.3)
    if train or evals:
        loss_ax.legend()
    if title:
        loss_ax.set_title(title)

    if scale_history:
        steps = [e["step"] for e in scale_history]
        scales = [e["scale"] for e in scale_history]
        scale_ax.step(steps, scales, where="post", label="loss scale")
        skipped = [(e["step"], e["scale"]) for e in scale_history if e["skipped"]]
        if skipped:
            scale_ax.scatter(
                *zip(*skipped), marker="x", color="red", zorder=3, label="skipped (overflow)"
            )
        scale_ax.set_yscale("log", base=2)
        scale_ax.legend()
    else:
        scale_ax.text(0.5, 0.5, "no loss scaler (bf16/fp32)", ha="center", va="center")
    scale_ax.set_xlabel("optimizer step")
    scale_ax.set_ylabel("loss scale")
    scale_ax.grid(alpha=0.3)

    path = Path(path)
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=100)
    return path


def format_table(rows: Sequence[tuple[str, Any]], title: str = "") -> str:
    """A two-column text table; floats get 4 significant digits, ``None`` shows as ``n/a``."""

    def fmt(value: Any) -> str:
        if value is None:
            return "n/a"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    cells = [(str(name), fmt(value)) for name, value in rows]
    left = max([len(name) for name, _ in cells] + [len("metric")])
    right = max([len(value) for _, value in cells] + [len("value")])
    rule = f"+-{'-' * left}-+-{'-' * right}-+"
    lines = [title] if title else []
    lines += [rule, f"| {'metric':<{left}} | {'value':>{right}} |", rule]
    lines += [f"| {name:<{left}} | {value:>{right}} |" for name, value in cells]
    lines.append(rule)
    return "\n".join(lines)

"""What a finished run reports: metrics.json, a loss/loss-scale plot and a summary table.

The recipes share these so that every run leaves the same artifacts behind: ``metrics.json``
(machine-readable, written atomically so a crashed run never leaves a torn file), ``training.png``
(loss and loss scale against the optimizer step, skipped steps and FP32 islands marked) and a
plain-text table on stdout with the figures one compares between runs: the task metric, the
loss-scale history, the throughput, the wall time and the peak memory. Before the table come the
hints a run's own figures call for (a validation set too small to measure anything, LoRA on a
base that was never trained, an accuracy no better than always answering the commonest label):
the numbers alone look like results.
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
    "FORWARD_OVERFLOW_LABEL",
    "HEADROOM_LABEL",
    "SKIPPED_STEP_LABEL",
    "UNDERFLOW_LABEL",
    "LossScaleSummary",
    "accuracy_against_majority",
    "activation_memory",
    "describe_activation_memory",
    "describe_export_parity",
    "describe_optimizer_steps",
    "describe_underflow",
    "first_batch",
    "format_table",
    "lora_base_hint",
    "optimizer_updates",
    "peak_memory",
    "plot_training",
    "summarize_loss_scale",
    "training_figure",
    "training_length_hint",
    "validation_size_hint",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LossScaleSummary:
    """The loss scale over a run: where it ended, how low it went, how many steps were skipped.

    ``final`` is the scale after the last update: what the last log line's ``loss_scale`` and the
    checkpoint's ``scaler.pt`` hold, and what a resume starts from. ``last_step_ran_with`` is the
    scale the last optimizer step ran with (``scale_history``'s last entry): the two differ when
    that step grew or backed off the scale. ``minimum``/``maximum`` cover the scales the steps
    ran with and the final one. ``scaler_updates`` counts the scaler's updates, one per optimizer
    step attempt, applied or skipped (the scaler's own ``stats.steps``; a Trainer run's
    ``optimizer_step_attempts``). ``skipped`` counts every skipped attempt; ``forward_overflows``
    those of them that were forward overflows (the guard's, whose fix is an FP32 island, not the
    scale), and ``fp32_islands`` the modules made islands for them, in order.
    """

    final: float
    last_step_ran_with: float
    minimum: float
    maximum: float
    scaler_updates: int
    skipped: int
    forward_overflows: int = 0
    fp32_islands: tuple[str, ...] = ()


def summarize_loss_scale(
    scale_history: Sequence[Mapping[str, Any]], final_scale: float | None
) -> LossScaleSummary | None:
    """Summarise ``AmpTrainer.scale_history`` (``None`` when empty: no FP16, no scaler).

    ``final_scale`` is the scaler's scale now, after the last update
    (``trainer.loss_scaler.get_scale()``): the history records the scale each step *ran with*,
    which is one update behind. The history is compact (events, logging steps and the latest
    step; every scale change and every skipped attempt is an entry), so the updates are counted
    from the first and last entries' step numbers and the skipped entries, not the entries: each
    step number between them had one applied attempt (the last one too, unless its entry is a
    skip: a skipped attempt leaves its number to the next) and each skipped entry one more.
    """
    if not scale_history:
        return None
    if final_scale is None:
        raise ValueError(
            "final_scale is needed with a non-empty scale_history: pass the scaler's "
            "get_scale() (the scale after the last update)"
        )
    scales = [float(entry["scale"]) for entry in scale_history]
    final = float(final_scale)
    forward = [entry for entry in scale_history if "fp32_islands" in entry]
    skipped = sum(bool(entry["skipped"]) for entry in scale_history)
    numbers = int(scale_history[-1]["step"]) - int(scale_history[0]["step"]) + 1
    applied = numbers - bool(scale_history[-1]["skipped"])
    return LossScaleSummary(
        final=final,
        last_step_ran_with=scales[-1],
        minimum=min(*scales, final),
        maximum=max(*scales, final),
        scaler_updates=applied + skipped,
        skipped=skipped,
        forward_overflows=len(forward),
        fp32_islands=tuple(name for entry in forward for name in entry["fp32_islands"]),
    )


def optimizer_updates(state: Any) -> dict[str, int]:
    """``metrics.json``'s ``optimizer_updates``: the updates applied (``global_step``), skipped,
    and attempted (``optimizer_step_attempts``; a state without the counter counts every
    attempt as applied)."""
    applied = int(state.global_step)
    attempts = int(getattr(state, "optimizer_step_attempts", applied))
    return {"applied": applied, "skipped": attempts - applied, "attempts": attempts}


def describe_optimizer_steps(state: Any) -> str:
    """The summary's "optimizer steps": applied updates of attempts, e.g. "applied 23 of 24
    attempts".

    ``state`` is the trainer's ``TrainerState``: ``global_step`` counts applied updates and
    ``optimizer_step_attempts`` every attempt, skipped ones too (a state without the counter, a
    stock Trainer's on a transformers that lacks it, counts every attempt as a step).
    """
    applied = int(state.global_step)
    attempts = int(getattr(state, "optimizer_step_attempts", applied))
    return f"applied {applied} of {attempts} attempts"


def describe_export_parity(report: Any) -> str:
    """The summary's "fp16 export parity": the verdict with the evidence it rests on.

    ``report`` is the :class:`~amp_trainer.ExportReport`. A bare "passed" on four sentences reads
    like a proof; the positions compared go beside it, and when the report finds the evidence thin
    (a stand-in sample, or too few positions for the top-1 threshold) the row says so and points
    at the report, which says why.
    """
    verdict = "passed" if report.passed else "FAILED"
    if not report.parity:
        return verdict
    positions = min(result.positions for result in report.parity.values())
    if report.thin_evidence:
        return f"{verdict} on thin evidence ({positions} positions; fp16_export/report.md says why)"
    return f"{verdict} ({positions} positions)"


def activation_memory(
    model: torch.nn.Module, batch: Mapping[str, Any], device_type: str
) -> dict[str, float] | None:
    """Bytes saved for backward by one training forward in FP32 and under FP16 autocast.

    What AMP saves in memory is activations, and peak RSS hides it on a CPU (weights, optimizer
    state and the allocator dominate it). This counts what autograd keeps for the backward pass
    (``torch.autograd.graph.saved_tensors_hooks``), each storage once, leaving out the
    parameters themselves (they exist in both precisions; the FP16 copies autocast makes of them
    are counted, they are real extra memory). One forward per precision on ``batch``, in train
    mode (dropout masks count), with the RNG restored; no backward, nothing updated. Returns
    ``None`` when the model's output has no loss to build a graph from.
    """
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    # Accelerate's prepare() wraps the model's forward in an FP16 autocast: the FP32 pass must
    # run the forward underneath it.
    wrapped = model.__dict__.get("forward")
    original = model.__dict__.get("_original_forward")
    was_training = model.training
    sizes: dict[str, int] = {}
    try:
        if wrapped is not None and original is not None:
            model.forward = original
        model.train()
        for name, fp16 in (("fp32", False), ("fp16", True)):
            seen: dict[int, int] = {}

            def pack(tensor: torch.Tensor, seen: dict[int, int] = seen) -> torch.Tensor:
                storage = tensor.untyped_storage()
                pointer = storage.data_ptr()
                if pointer not in parameters:
                    seen[pointer] = max(seen.get(pointer, 0), storage.nbytes())
                return tensor

            with (
                torch.random.fork_rng(
                    devices=[torch.cuda.current_device()] if device_type == "cuda" else []
                ),
                torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
                torch.autocast(device_type, dtype=torch.float16, enabled=fp16),
            ):
                output = model(**batch)
            loss = output.get("loss") if isinstance(output, Mapping) else None
            if loss is None:
                loss = getattr(output, "loss", None)
            if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
                return None
            del output, loss  # frees the graph: nothing is kept past the measurement
            sizes[name] = sum(seen.values())
    finally:
        if wrapped is not None:
            model.forward = wrapped
        model.train(was_training)
    if not sizes.get("fp32"):
        return None
    return {
        "fp32_bytes": sizes["fp32"],
        "fp16_bytes": sizes["fp16"],
        "fp16_over_fp32": sizes["fp16"] / sizes["fp32"],
        "saved_mib": (sizes["fp32"] - sizes["fp16"]) / 2**20,
    }


def describe_activation_memory(measured: Mapping[str, float] | None) -> str | None:
    """``0.78x (1.2 MiB less than FP32's 5.4 MiB)``: the summary's cell for
    :func:`activation_memory`."""
    if not measured:
        return None
    return (
        f"{measured['fp16_over_fp32']:.2f}x ({measured['saved_mib']:.3g} MiB less than FP32's "
        f"{measured['fp32_bytes'] / 2**20:.3g} MiB, one batch)"
    )


def first_batch(trainer: Any) -> dict[str, Any]:
    """The first training batch as the trainer builds it (columns, collator), on its device:
    what :func:`activation_memory` measures."""
    batch = next(iter(trainer.get_train_dataloader()))
    device = trainer.args.device
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


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


#: The legend entries of the loss-scale panel's two kinds of skipped step. A gradient overflow is
#: the loss scale's business (it backs off); a forward overflow is not (the scale is put back and
#: the module that overflowed computes in FP32 from then on), so they are drawn apart.
SKIPPED_STEP_LABEL = "skipped step (gradient overflow: scale backed off)"
FORWARD_OVERFLOW_LABEL = "forward overflow (FP32 island added)"
UNDERFLOW_LABEL = "gradient flushed to zero by FP16 (grad_underflow)"
HEADROOM_LABEL = "doublings of scale left (grad_headroom)"
_FORWARD_OVERFLOW_NO_ISLAND_LABEL = "forward overflow (no island added)"


def describe_underflow(log_history: Iterable[Mapping[str, Any]]) -> str | None:
    """The summary's underflow cell: the last logged check's share of the gradient flushed to
    zero by FP16 and its headroom, the step it was logged at (a check's figures go into the next
    log) and how many logs carried one (``None``: none)."""
    checks = [e for e in log_history if "grad_underflow" in e or "grad_headroom" in e]
    if not checks:
        return None
    last = checks[-1]
    share = last.get("grad_underflow")
    headroom = last.get("grad_headroom")
    parts = ["not measured (the step overflowed)" if share is None else f"{100 * share:.2f}%"]
    if headroom is not None:
        parts.append(f"headroom {headroom:.1f} doublings")
    return f"{', '.join(parts)} (logged at step {last.get('step')}; {len(checks)} check(s))"


def training_figure(
    log_history: Iterable[Mapping[str, Any]],
    scale_history: Sequence[Mapping[str, Any]],
    title: str = "",
    precision: str | None = None,
) -> Any:
    """The figure :func:`plot_training` saves (a matplotlib ``Figure`` on an Agg canvas).

    With a loss-scale history: two panels, the loss above and the loss scale below (log2 axis:
    the scale moves in powers of two), with gradient-overflow skips as red crosses and forward
    overflows (``"fp32_islands"`` entries, see ``AmpTrainer.scale_history``) as orange diamonds,
    each kind with its own legend entry. Without one (bf16/fp32 have no loss scaler), one loss
    panel whose title says why there is no loss-scale panel: an empty panel read as a broken plot.
    Raises ``ImportError`` without matplotlib.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    logs = list(log_history)
    train = [(e["step"], e["loss"]) for e in logs if "loss" in e and "step" in e]
    evals = [(e["step"], e["eval_loss"]) for e in logs if "eval_loss" in e and "step" in e]
    underflow = [(e["step"], e["grad_underflow"]) for e in logs if "grad_underflow" in e]
    headroom = [(e["step"], e["grad_headroom"]) for e in logs if "grad_headroom" in e]

    meter_ax = None
    if scale_history and (underflow or headroom):
        figure = Figure(figsize=(8, 8), layout="constrained")
        loss_ax, scale_ax, meter_ax = figure.subplots(3, 1, sharex=True)
    elif scale_history:
        figure = Figure(figsize=(8, 6), layout="constrained")
        loss_ax, scale_ax = figure.subplots(2, 1, sharex=True)
    else:
        figure = Figure(figsize=(8, 4), layout="constrained")
        loss_ax, scale_ax = figure.subplots(1, 1), None
    FigureCanvasAgg(figure)
    if train:
        loss_ax.plot(*zip(*train), marker=".", label="train loss")
    if evals:
        loss_ax.plot(*zip(*evals), marker="o", linestyle="--", label="eval loss")
    loss_ax.set_ylabel("loss")
    loss_ax.grid(alpha=0.3)
    if train or evals:
        loss_ax.legend()

    if scale_ax is None:
        if precision in ("bf16", "fp32"):
            why = f"{precision} trains without a loss scaler: no loss-scale panel"
        else:
            why = "no loss scale was recorded (no amp-trainer loss scaler): no loss-scale panel"
        loss_ax.set_title(f"{title}\n{why}" if title else why)
        loss_ax.set_xlabel("optimizer step")
        return figure

    if title:
        loss_ax.set_title(title)
    steps = [e["step"] for e in scale_history]
    scales = [e["scale"] for e in scale_history]
    scale_ax.step(steps, scales, where="post", label="loss scale")
    events = (
        (
            [e for e in scale_history if e["skipped"] and "fp32_islands" not in e],
            dict(marker="x", color="red", label=SKIPPED_STEP_LABEL),
        ),
        (
            [e for e in scale_history if e.get("fp32_islands")],
            dict(marker="D", color="tab:orange", label=FORWARD_OVERFLOW_LABEL),
        ),
        (
            [e for e in scale_history if "fp32_islands" in e and not e["fp32_islands"]],
            dict(
                marker="D",
                facecolors="none",
                edgecolors="tab:orange",
                label=(_FORWARD_OVERFLOW_NO_ISLAND_LABEL),
            ),
        ),
    )
    for entries, style in events:
        if entries:
            points = [(e["step"], e["scale"]) for e in entries]
            scale_ax.scatter(*zip(*points), zorder=3, **style)
    scale_ax.set_yscale("log", base=2)
    scale_ax.legend(fontsize="small")
    scale_ax.set_ylabel("loss scale")
    scale_ax.grid(alpha=0.3)
    if meter_ax is None:
        scale_ax.set_xlabel("optimizer step")
        return figure
    if underflow:
        meter_ax.plot(
            [s for s, _ in underflow], [100 * v for _, v in underflow], marker="o",
            label=UNDERFLOW_LABEL,
        )  # fmt: skip
    meter_ax.set_ylabel("% flushed to zero")
    meter_ax.set_xlabel("optimizer step")
    meter_ax.grid(alpha=0.3)
    handles, labels = meter_ax.get_legend_handles_labels()
    if headroom:
        room_ax = meter_ax.twinx()
        room_ax.plot(*zip(*headroom), marker="s", color="tab:green", label=HEADROOM_LABEL)
        room_ax.set_ylabel("headroom (doublings)")
        more = room_ax.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
    meter_ax.legend(handles, labels, fontsize="small")
    return figure


def plot_training(
    log_history: Iterable[Mapping[str, Any]],
    scale_history: Sequence[Mapping[str, Any]],
    path: str | os.PathLike[str],
    title: str = "",
    precision: str | None = None,
) -> Path | None:
    """Write :func:`training_figure` to ``path`` (the format from its suffix, PNG by default).

    Returns the path, or ``None`` (with a warning) when matplotlib is not installed: it is the
    ``recipes`` extra, and a run without it still trains, exports and reports (the summary's
    ``plot`` row says why there is none). Uses the Agg canvas directly, so no GUI backend is
    touched and pyplot's global state is left alone.
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        logger.warning("matplotlib is not installed (pip install 'amp-trainer[recipes]'): no plot")
        return None
    figure = training_figure(log_history, scale_history, title=title, precision=precision)
    path = Path(path)
    with atomic_path(path) as tmp:
        figure.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=100)
    return path


# --------------------------------------------------------------------------------------------
# Hints: what a run's own figures call for, one line each, printed before the summary table
# --------------------------------------------------------------------------------------------

#: Below these, a validation set measures noise: 100 examples put the standard error of an
#: accuracy near 0.5 at 5 points; a few thousand tokens are the least an eval loss averages over.
MIN_VALIDATION_EXAMPLES = 100
MIN_VALIDATION_TOKENS = 2048


def validation_size_hint(count: int, block_size: int | None = None) -> str | None:
    """The hint for a validation set too small to measure anything, or ``None``.

    ``count`` is the number of validation examples (classification) or, with ``block_size``, of
    blocks of that many tokens (language modelling).
    """
    if block_size is not None:
        tokens = count * block_size
        if tokens >= MIN_VALIDATION_TOKENS:
            return None
        blocks = f"{count} block{'' if count == 1 else 's'} of {block_size} tokens"
        return (
            f"hint: validation has {blocks}: eval loss and perplexity are noise at this size; "
            f"hold out at least {MIN_VALIDATION_TOKENS} tokens (more text in --validation_file, "
            "or a larger --max_eval_samples)"
        )
    if count >= MIN_VALIDATION_EXAMPLES:
        return None
    step = 100 / count if count else 100
    return (
        f"hint: validation has {count} example{'' if count == 1 else 's'}: accuracy moves in "
        f"steps of {step:.3g} points and is noise at this size; hold out at least "
        f"{MIN_VALIDATION_EXAMPLES} examples (--validation_file, or a larger --max_eval_samples)"
    )


#: Fewer optimizer updates than this cannot train a recipe's from-scratch model: it still
#: predicts little more than the commonest tokens (greedy samples like "the the the", or none).
MIN_FROM_SCRATCH_UPDATES = 100


def training_length_hint(
    updates: int, from_scratch: bool, model: str, updates_per_epoch: int, max_steps: int
) -> str | None:
    """The hint for a from-scratch model trained far too briefly, or ``None``.

    ``updates`` are the optimizer updates applied (the run's ``global_step``; skipped steps are
    none), ``updates_per_epoch`` what one pass over the training data gives, ``max_steps`` the
    run's (``> 0``: it, not the epochs, set the length). A randomly initialised model first
    learns which tokens are common: after a few dozen updates its greedy continuation repeats
    the commonest one. The recipes' offline defaults apply about 150; a 4,000-word file trained
    for the GPT-2 config's two epochs gave 16 (eval perplexity 454, untrained 1009; 101 updates
    on the same file: 183). 100 is the floor, not a promise: on so little text the greedy
    sample still repeats, hence "more text". A pretrained model is not held to this:
    fine-tuning takes few updates.
    """
    if not from_scratch or updates >= MIN_FROM_SCRATCH_UPDATES:
        return None
    if max_steps > 0:
        longer = f"--max_steps {MIN_FROM_SCRATCH_UPDATES}"
    else:
        per_epoch = max(1, updates_per_epoch)
        epochs = -(-MIN_FROM_SCRATCH_UPDATES // per_epoch)
        longer = (
            f"--num_train_epochs {epochs}: this data gives {per_epoch} "
            f"update{'' if per_epoch == 1 else 's'} an epoch"
        )
    return (
        f"hint: {updates} optimizer update{' is' if updates == 1 else 's are'} far too few to "
        f"train {model} from scratch: it still predicts little more than the commonest tokens "
        "(greedy samples that repeat one word, or stop at once); train for at least "
        f"{MIN_FROM_SCRATCH_UPDATES} updates ({longer}), on more text if there is more, or "
        "fine-tune a pretrained --model_name_or_path"
    )


def lora_base_hint(lora: bool, from_scratch: bool, model: str) -> str | None:
    """The hint for LoRA on a randomly initialised model, or ``None``.

    LoRA freezes the base weights and trains small adapters beside them: on a pretrained base
    that is the point, on a random one the frozen base never learns anything, and the run's
    loss stays far above what full training of the same model reaches.
    """
    if not (lora and from_scratch):
        return None
    return (
        f"hint: LoRA trains adapters on a randomly initialised base ({model} is built from "
        "scratch): the base never learns; use a pretrained --model_name_or_path or --lora false"
    )


def accuracy_against_majority(
    accuracy: float | None, majority: float, majority_label: Any
) -> tuple[str | None, str | None]:
    """The summary's accuracy cell with the majority-class baseline beside it, and the comment
    line when the accuracy is not above that baseline (``None`` when it is).

    Why: an accuracy of 0.52 reads as a result until one knows that always answering the
    commonest label scores 0.52 too.
    """
    if accuracy is None:
        return None, None
    cell = f"{accuracy:.4g} (majority class: {majority:.4g})"
    if majority >= 1.0:
        return cell, (
            f"hint: validation holds one label only ({majority_label!r}): accuracy cannot tell a "
            "model from one that always answers it; hold out examples of every label"
        )
    if accuracy > majority:
        return cell, None
    return cell, (
        f"note: eval accuracy {accuracy:.4g} is not above the majority-class baseline "
        f"{majority:.4g} (always answering {majority_label!r}): the model has not learned to "
        "tell the classes apart; train longer, or check the learning rate and the labels"
    )


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

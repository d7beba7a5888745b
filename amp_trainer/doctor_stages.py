"""One stage of the NaN doctor: a few optimizer steps on a copy of the model, and what they showed.

:func:`amp_trainer.doctor.diagnose` runs the stages of its triage with :func:`run_stage` (pure
FP32, FP16 autocast, full AMP with :class:`~amp_trainer.scaler.DynamicLossScaler`, a smaller
learning rate) on deep copies, so the caller's model is never touched, and reads the verdict off
their :class:`StageResult`. For an FP16-unfriendly layer, :func:`islands_until_finite` finds
every module that must compute in FP32 (the training guard's way: make an island, re-run, name
the next module to overflow) so that the suggested fix is whole, and a stage rerun with those
islands is the evidence that it works.
"""

from __future__ import annotations

import copy
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amp_trainer.forward_overflow.detection import OverflowLocator
from amp_trainer.forward_overflow.divergence import loss_diverged
from amp_trainer.islands import keep_in_fp32
from amp_trainer.numerics import FP16_MAX, OverflowProbe

__all__ = [
    "LossFn",
    "OptimizerFactory",
    "StageResult",
    "default_loss",
    "default_optimizer",
    "exactly",
    "islands_until_finite",
    "run_stage",
    "to_device",
]

# A first cross-entropy loss this many times a uniform guess's ln(C) (and 10 above it) is only
# reachable with confidently wrong logits: weights that already diverged.
_DIVERGED_OVER_UNIFORM = 10.0
_DIVERGED_MARGIN = 10.0
# FP32 islands the doctor adds while looking for a finite forward, as the training guard allows
# per step: a deep stack of identical blocks can overflow one after another.
_MAX_FP32_ISLANDS = 8

OptimizerFactory = Callable[[Iterable[nn.Parameter], float], torch.optim.Optimizer]
LossFn = Callable[[Any, Mapping[str, Any]], torch.Tensor]


# --------------------------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StageResult:
    """One triage run: ``steps`` optimizer steps on copies of the model and batch.

    ``first_bad_step`` is the 0-based step whose loss or (unscaled, for the stages without a
    scaler) gradients were non-finite, ``None`` if none was. ``overflow_module`` is the first
    module the :class:`OverflowProbe` caught (FP16 range in the FP16 stages, inf/NaN in FP32),
    ``overflow_step`` the step it happened in. ``nonfinite_grads`` names the parameters whose
    gradients were non-finite (from the scaler's attribution in the AMP stage).
    ``skipped_steps`` counts every skipped attempt, the warm-down's too: until the scaler's first
    applied update a skip only backs the scale off and the same step is tried again, as a training
    run's first steps do, so a scale that starts too high is not read as a failure.
    """

    name: str
    precision: str
    lr: float
    steps: int
    losses: tuple[float, ...]
    first_bad_step: int | None
    overflow_module: str | None
    overflow_step: int | None
    nonfinite_grads: tuple[str, ...]
    skipped_steps: int = 0
    final_scale: float | None = None
    uniform_loss: float | None = None

    @property
    def ok(self) -> bool:
        return self.first_bad_step is None

    @property
    def diverged(self) -> bool:
        """Finite, but the loss rose far above its first value (the guard's rule,
        :func:`~amp_trainer.forward_overflow.divergence.loss_diverged`): a learning-rate problem."""
        later = [loss for loss in self.losses[1:] if math.isfinite(loss)]
        return bool(later) and loss_diverged(self.losses[0], max(later))

    @property
    def improving(self) -> bool:
        """Finite and the loss went down over the steps: what a suggested fix must show
        (staying finite is not enough: lr 1 on a tiny BERT stays finite while its loss climbs
        from 0.69 to 15)."""
        return self.ok and (len(self.losses) < 2 or self.losses[-1] < self.losses[0])

    @property
    def already_diverged(self) -> bool:
        """The first loss is far above what a uniform guess over the output's classes scores."""
        if self.uniform_loss is None or not self.losses or not math.isfinite(self.losses[0]):
            return False
        limit = max(
            _DIVERGED_OVER_UNIFORM * self.uniform_loss, self.uniform_loss + _DIVERGED_MARGIN
        )
        return self.losses[0] > limit

    def summary(self) -> str:
        losses = ", ".join(f"{loss:.4g}" for loss in self.losses)
        line = f"{self.name} (lr={self.lr:g}): "
        line += "ok" if self.ok else f"non-finite at step {self.first_bad_step}"
        line += f"; losses [{losses}]"
        if self.overflow_module is not None:
            line += f"; first overflow: {self.overflow_module!r} (step {self.overflow_step})"
        if self.final_scale is not None:
            line += f"; loss scale {self.final_scale:g}, {self.skipped_steps} skipped"
        if self.nonfinite_grads:
            shown = ", ".join(self.nonfinite_grads[:5])
            more = len(self.nonfinite_grads) - 5
            line += f"; non-finite grads: {shown}" + (f" and {more} more" if more > 0 else "")
        return line


# --------------------------------------------------------------------------------------------
# running one stage
# --------------------------------------------------------------------------------------------
def default_optimizer(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr)


def default_loss(output: Any, batch: Mapping[str, Any]) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None and isinstance(output, torch.Tensor) and output.dim() == 0:
        loss = output
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "the model's output has no loss: put labels in the batch (transformers models then "
            "return .loss) or pass loss_fn=lambda output, batch: ..."
        )
    return loss


def to_device(batch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def _nonfinite_grads(model: nn.Module) -> tuple[str, ...]:
    return tuple(
        name
        for name, p in model.named_parameters()
        if p.grad is not None and not bool(torch.isfinite(p.grad).all())
    )


def run_stage(
    name: str,
    model: nn.Module,
    batch: Mapping[str, Any],
    *,
    precision: str,
    use_scaler: bool,
    lr: float,
    steps: int,
    device: torch.device,
    optimizer_factory: OptimizerFactory,
    loss_fn: LossFn,
    loss_scale: float = 2.0**16,
    probe_limit: float | None = None,
) -> StageResult:
    """``probe_limit``: the magnitude the overflow probe flags (default FP16's range under FP16,
    inf/NaN in FP32); inf/NaN only for a model with FP32 islands, whose outputs may rightly
    exceed FP16's range."""
    from amp_trainer.scaler import DynamicLossScaler

    work = copy.deepcopy(model).to(device).float().train()
    optimizer = optimizer_factory(work.parameters(), lr)
    scaler = (
        DynamicLossScaler(
            device.type, init_scale=loss_scale, min_scale=min(1.0, loss_scale), on_min_scale="clamp"
        ).watch(work)
        if use_scaler
        else None
    )
    fp16 = precision == "fp16"
    limit = probe_limit if probe_limit is not None else (FP16_MAX if fp16 else math.inf)
    losses: list[float] = []
    first_bad: int | None = None
    overflow_module: str | None = None
    overflow_step: int | None = None
    bad_grads: tuple[str, ...] = ()
    skipped = 0
    uniform: float | None = None
    # The scaler's warm-down: until its first applied update, a skipped step that backs the scale
    # off is the scaler finding its scale (what a training run does in its first steps), not a
    # failure, so it does not use up one of the stage's steps. Bounded by the halvings from
    # ``loss_scale`` to the minimum; below that a skip counts as before.
    warm_down_left = (
        int(math.log2(loss_scale / scaler.policy.min_scale)) if scaler is not None else 0
    )
    applied = 0
    step = 0
    while step < steps:
        optimizer.zero_grad(set_to_none=True)
        with (
            OverflowProbe(work, limit=limit) as probe,
            torch.autocast(device.type, dtype=torch.float16, enabled=fp16),
        ):
            output = work(**batch)
            loss = loss_fn(output, batch)
        if step == 0 and loss_fn is default_loss and _loss_is_a_mean(work):
            uniform = _uniform_guess_loss(output)
        if probe.first is not None and overflow_module is None:
            overflow_module, overflow_step = probe.first, step
        loss_value = float(loss.detach().float())
        losses.append(loss_value)
        if not math.isfinite(loss_value):
            first_bad = step
            break
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            if scaler.step_was_skipped:
                skipped += 1
                bad_grads = bad_grads or scaler.stats.last_overflow_params
                if applied == 0 and warm_down_left > 0:
                    warm_down_left -= 1
                    losses.pop()  # the same step again, from the same weights
                    continue
            else:
                applied += 1
        else:
            loss.backward()
            found = _nonfinite_grads(work)
            if found:
                bad_grads, first_bad = found, step
                break
            optimizer.step()
        step += 1
    if scaler is not None and applied == 0 and first_bad is None:
        first_bad = 0  # every step overflowed, down to the minimum scale: nothing was applied
    return StageResult(
        name=name,
        precision=precision,
        lr=lr,
        steps=steps,
        losses=tuple(losses),
        first_bad_step=first_bad,
        overflow_module=overflow_module,
        overflow_step=overflow_step,
        nonfinite_grads=bad_grads,
        skipped_steps=skipped,
        final_scale=scaler.get_scale() if scaler is not None else None,
        uniform_loss=uniform,
    )


def _loss_is_a_mean(model: nn.Module) -> bool:
    """Whether the model's own loss is a per-token mean, which ln(C) can be compared with. A
    CTC head summing over the batch (Wav2Vec2's default ``ctc_loss_reduction="sum"``) scores
    hundreds on a fresh model: no sign of divergence."""
    config = getattr(model, "config", None)
    return getattr(config, "ctc_loss_reduction", "mean") != "sum"


def _uniform_guess_loss(output: Any) -> float | None:
    """ln(C) for an output with ``logits`` over C >= 2 classes (what the model's own
    cross-entropy loss scores for a uniform guess), else None."""
    logits = (
        output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    )
    if isinstance(logits, torch.Tensor) and logits.dim() >= 2 and logits.shape[-1] >= 2:
        return math.log(logits.shape[-1])
    return None


def exactly(names: Iterable[str]) -> list[re.Pattern[str]]:
    """Patterns that match exactly these qualified names (a plain string would also match every
    module whose name ends the same way)."""
    return [re.compile(re.escape(name)) for name in names]


def islands_until_finite(
    model: nn.Module, batch: Mapping[str, Any], first: str, device: torch.device
) -> tuple[str, ...]:
    """Every module to keep in FP32 for an FP16 forward of ``batch`` to be finite, ``first`` first.

    On a copy: make the modules found so far FP32 islands (:func:`keep_in_fp32`, what
    ``fp32_modules`` does), re-run the forward under FP16 autocast, and name the next module
    whose output goes inf/NaN from finite inputs, with the training guard's locator (a
    parameter-free module's overflow is blamed on the module that produced its input). An
    island's output is FP32 and may be far beyond FP16's range, so the next FP16 layer that reads
    it overflows too: that is the module the first fix was short of. Stops when the forward is
    finite, when the overflow is inside an island already (no island can fix it), or after
    :data:`_MAX_FP32_ISLANDS` modules.
    """
    work = copy.deepcopy(model).to(device).float().train()
    names = [first]
    while len(names) < _MAX_FP32_ISLANDS:
        keep_in_fp32(work, exactly(names))
        with (
            torch.no_grad(),
            OverflowLocator(work, census=False) as locator,
            torch.autocast(device.type, dtype=torch.float16),
        ):
            output = work(**batch)
        culprit = locator.located(output).culprit
        if culprit is None or any(culprit == n or culprit.startswith(n + ".") for n in names):
            break
        names.append(culprit)
    return tuple(names)

"""The training loss a forward-overflow step logs: what the batch's loss really was.

Stock ``Trainer`` adds each micro-batch's loss (``training_step``'s return value) to an
on-device accumulator and logs its mean over the logging window. A forward-overflow step's loss
is inf/NaN; with ``logging_nan_inf_filter`` (the default) stock adds the window's running mean in
its place, which is 0.0 on the window's first step: on a curve, a perfect step. The
:class:`~amp_trainer.forward_overflow.ForwardOverflowGuard` re-runs that batch in pure FP32, where
FP16 cannot overflow, to name the module; that re-run's loss
(:attr:`~amp_trainer.forward_overflow.ForwardOverflow.loss`) is what the step's loss was.

:class:`OverflowStepLoss` gives the step that share of the accumulator and marks the window's log
with :data:`LOG_KEY` (the FP32 re-run's loss); NaN, in both, when there was no finite FP32
re-run. With one micro-batch per optimizer step the logged figure is the re-run's loss exactly.
With gradient accumulation each overflowing micro-batch counts as the re-run batch's loss
divided by the step's micro-batch count, as stock divides each micro-batch's loss (for a loss
normalised by ``num_items_in_batch`` that is its per-micro-batch mean, an approximation).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from amp_trainer.forward_overflow import ForwardOverflow

__all__ = ["LOG_KEY", "OverflowStepLoss"]

#: The training-log key that marks a window holding forward-overflow steps: their FP32 re-run's
#: loss (the mean of them; NaN when one had no finite re-run).
LOG_KEY = "loss_fp32_rerun"


class OverflowStepLoss:
    """Makes a forward-overflow step's share of the Trainer's logged loss true (module doc).

    The trainer calls :meth:`start` when a training loop begins, :meth:`record` with the guard's
    event of a forward-overflow step, :meth:`correct` and :meth:`remember` around stock's
    ``_maybe_log_save_evaluate`` (which receives the accumulator) and :meth:`add_to` on each
    training log. Costs one on-device copy of the accumulator per optimizer step (no sync); the
    correction itself runs on forward-overflow steps only.
    """

    def __init__(self) -> None:
        self._before: torch.Tensor | None = None  # the accumulator before this step
        self._event: ForwardOverflow | None = None
        self._reruns: list[float] = []  # this logging window's FP32 re-run losses

    def start(self) -> None:
        """A training loop begins: its accumulator starts at 0, nothing is pending."""
        self._before = None
        self._event = None
        self._reruns.clear()

    def record(self, event: ForwardOverflow) -> None:
        """The step being trained was a forward overflow, handled as ``event`` says."""
        self._event = event

    def correct(self, accumulated: torch.Tensor) -> None:
        """Give the recorded step its true share of ``accumulated`` (stock's on-device sum of
        the window's losses), in place, before stock logs it."""
        event, self._event = self._event, None
        losses = () if event is None else event.step_losses
        overflowed = sum(not math.isfinite(v) for v in losses)
        if event is None or not overflowed:
            return  # no forward overflow here (or on another rank only: this one's sum is true)
        rerun = event.loss if event.loss is not None and math.isfinite(event.loss) else math.nan
        self._reruns.append(rerun)
        share = sum(v for v in losses if math.isfinite(v)) + overflowed * rerun / len(losses)
        before = self._before if self._before is not None else torch.zeros_like(accumulated)
        accumulated.copy_(before + share)

    def remember(self, accumulated: torch.Tensor) -> None:
        """Keep ``accumulated`` as the next step finds it (after stock logged or reset it)."""
        self._before = accumulated.detach().clone()

    def add_to(self, logs: dict[str, Any]) -> None:
        """Mark a training log whose window holds forward-overflow steps with :data:`LOG_KEY`."""
        if self._reruns:
            logs[LOG_KEY] = sum(self._reruns) / len(self._reruns)
            self._reruns.clear()

"""The re-run of an overflowing batch, and what the policy does with what it shows.

:class:`ForwardRerun` re-runs the batch of a forward overflow (no gradients, the training RNG
untouched) under FP16 autocast to name the module (located by
:class:`~amp_trainer.forward_overflow.detection.OverflowLocator`) and once in pure FP32 to
check that FP16 is the cause: non-finite there too is the model or the data
(:class:`NonFiniteForwardError`). Then it applies the policy: ``"fp32"`` makes the module an FP32
island (:func:`~amp_trainer.islands.keep_in_fp32`) and re-probes until the batch is clean (a
deeper layer may overflow next), ``"raise"`` raises :class:`~amp_trainer.scaler.LossScaleError`
naming it. Before either, the :class:`~amp_trainer.forward_overflow.divergence.DivergenceJudge`
is asked whether the run is diverging instead: then no island is added.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amp_trainer.forward_overflow.detection import Located, OverflowLocator
from amp_trainer.forward_overflow.divergence import DivergenceJudge
from amp_trainer.islands import (
    is_fp32_island,
    keep_in_fp32,
    record_fp32_islands,
    restore_fp32_islands,
)
from amp_trainer.numerics import describe_module, iter_tensors, nonfinite_inputs
from amp_trainer.precision import without_autocast_wrapper
from amp_trainer.scaler import LossScaleError

__all__ = [
    "POLICIES",
    "ForwardFn",
    "ForwardOverflow",
    "ForwardRerun",
    "NonFiniteForwardError",
    "check_policy",
    "default_forward",
]

logger = logging.getLogger(__name__)

#: What a forward overflow does: make the module an FP32 island, raise, or skip as before.
POLICIES = ("fp32", "raise", "skip")
# Islands one overflow step may add before the guard gives up on that step (a deep stack of
# identical blocks can overflow one after another once the first is fixed).
_MAX_ISLANDS_PER_STEP = 8

ForwardFn = Callable[[nn.Module, Any], Any]


class NonFiniteForwardError(FloatingPointError):
    """The forward pass is inf/NaN in pure FP32 too, or the batch holds inf/NaN: the data or the
    model, not FP16. A ``FloatingPointError``, like :class:`~amp_trainer.scaler.LossScaleError`."""


def check_policy(policy: Any) -> str:
    """``policy`` if it is one of :data:`POLICIES`, else a ``ValueError`` naming the choices."""
    if policy not in POLICIES:
        raise ValueError(f"on_forward_overflow must be one of {POLICIES}, got {policy!r}")
    return policy


@dataclass(frozen=True)
class ForwardOverflow:
    """One forward overflow the guard handled.

    ``module`` is the first module whose FP16 output went non-finite from finite inputs (``None``
    when no module did: the loss computation itself, or an overflow the re-run did not
    reproduce); a module without parameters (Dropout, an activation) cannot overflow on its own,
    so the module that produced its input is named instead. ``islands`` are the modules made FP32
    islands for it (policy ``"fp32"``), ``step`` the guard's count of optimizer steps when it
    happened (1-based). ``diverging`` says the overflow was judged divergence
    (``on_divergence="warn"``; no islands then), ``evidence`` why.

    ``loss`` is the loss of the batch's pure-FP32 re-run (what the step's loss was, computed
    where FP16 could not overflow), ``None`` when there was no FP32 re-run or it had no loss;
    ``step_losses`` the step's micro-batch losses as observed (this rank's; inf/NaN included).
    """

    step: int
    module: str | None
    islands: tuple[str, ...]
    policy: str
    diverging: bool = False
    evidence: tuple[str, ...] = ()
    loss: float | None = None
    step_losses: tuple[float, ...] = ()


def _exactly(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(name))


def default_forward(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)``, ``model(*inputs)`` or ``model(inputs)``, as the batch is shaped."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


class ForwardRerun:
    """Re-runs an overflowing batch and applies the policy to what it shows (see the module doc).

    Args:
        model: the model being trained, unwrapped: its module names are reported and made
            islands.
        judge: tells a diverging run from an FP16 layer before any island is added.
        policy: ``"fp32"`` or ``"raise"`` (``"skip"`` never re-runs anything).
        forward: ``(model, inputs) -> output`` for the re-run; default ``model(**inputs)`` for a
            mapping, ``model(*inputs)`` for a sequence, ``model(inputs)`` otherwise.
        dtype: the autocast dtype of the training forward (FP16).

    Attributes:
        islands: the modules made FP32 islands, in order.
    """

    def __init__(
        self,
        model: nn.Module,
        judge: DivergenceJudge,
        *,
        policy: str = "fp32",
        forward: ForwardFn | None = None,
        dtype: torch.dtype = torch.float16,
    ) -> None:
        self.model = model
        self.judge = judge
        self.policy = check_policy(policy)
        self.forward = forward or default_forward
        self.dtype = dtype
        self.islands: list[str] = []

    def handle(self, step: int, inputs: Any) -> ForwardOverflow:
        """Find and fix the forward overflow of ``inputs`` at optimizer step ``step``.

        Raises:
            NonFiniteForwardError: the batch holds inf/NaN, or FP32 is non-finite too.
            DivergenceError: the run is diverging (``on_divergence="raise"``).
            LossScaleError: policy ``"raise"``, naming the module.
        """
        if inputs is None:
            logger.warning(
                "Step %d: the loss was non-finite before scaling (a forward overflow; the loss "
                "scale was left alone), but no batch was given to find the module: pass it to "
                "observe()/after_step().",
                step,
            )
            return ForwardOverflow(step, None, (), self.policy)
        if isinstance(inputs, Mapping):
            bad_inputs = nonfinite_inputs(inputs)
            if bad_inputs:
                raise NonFiniteForwardError(
                    f"Step {step}: the loss is non-finite because the batch itself holds "
                    f"inf/NaN: {', '.join(bad_inputs)}. This is the data, not FP16: fix the data "
                    "pipeline (division by zero, log(0), missing values read as NaN) or filter "
                    "those rows."
                )
        added: list[str] = []
        first: str | None = None
        at_once: list[str] = []
        loss: float | None = None  # the FP32 re-run's
        for _ in range(_MAX_ISLANDS_PER_STEP):
            found = self.run(inputs, fp16=True)
            culprit = found.culprit
            if culprit is None:
                fp32_loss = self._no_culprit(step, inputs, found, first)
                if first is None:
                    loss = fp32_loss
                break
            if first is None:
                first = culprit
                fp32 = self.run(inputs, fp16=False)
                at_once, loss = fp32.over_range, fp32.loss
                evidence = self.judge.evidence(culprit, at_once)
                if evidence:
                    return self._diverging(step, culprit, evidence, (), loss)
                self._raise_if_fp32_fails(step, fp32, culprit)
            else:
                evidence = self.judge.evidence(culprit, at_once)
                if evidence:
                    return self._diverging(step, culprit, evidence, tuple(added), loss)
            if self.policy == "raise":
                raise LossScaleError(
                    f"Step {step}: forward overflow in "
                    f"{describe_module(self.model, culprit)}: its FP16 output is inf/NaN from "
                    "finite inputs (|x| > 65504), while the same batch is finite in FP32. Loss "
                    f"scaling cannot fix this. Keep it in FP32: fp32_modules=[{culprit!r}] "
                    "(AmpTrainingArguments / AmpAccelerator) or amp_trainer.keep_in_fp32(model, "
                    f"[{culprit!r}]), or on_forward_overflow='fp32' to do it automatically; or "
                    "train in bf16."
                )
            if culprit in self.islands or is_fp32_island(dict(self.model.named_modules())[culprit]):
                logger.warning(
                    "Step %d: FP32 island %r still overflows FP16 downstream; giving up on this "
                    "step.",
                    step,
                    culprit,
                )
                break
            added += self.make_islands([culprit])
            logger.warning(
                "Forward overflow at step %d: %s produces inf/NaN in FP16 (finite in FP32); it "
                "now computes in FP32 (an FP32 island) and training continues. To start with it: "
                "fp32_modules=[%r].",
                step,
                describe_module(self.model, culprit),
                culprit,
            )
        else:
            logger.warning(
                "Step %d: still overflowing after %d new FP32 islands; giving up on this step.",
                step,
                _MAX_ISLANDS_PER_STEP,
            )
        return ForwardOverflow(step, first, tuple(added), self.policy, loss=loss)

    def _no_culprit(
        self, step: int, inputs: Any, found: Located, first: str | None
    ) -> float | None:
        """The FP16 re-run names no module with parameters: say why, never a silent skip.
        Returns the loss of the FP32 re-run this makes, if it makes one."""
        if found.first is not None:
            logger.warning(
                "Step %d: %s overflows FP16 but has no parameters, and no module with "
                "parameters produced its input: no module to keep in FP32; giving up "
                "on this step.",
                step,
                describe_module(self.model, found.first),
            )
            return None
        if first is not None:
            return None  # the islands added for this step made the batch clean
        if found.output_finite:
            logger.warning(
                "Step %d: the loss was non-finite, but the guard's re-run of the batch is "
                "finite: the loss is computed outside what it re-runs (give the guard "
                "forward=, a function returning the loss), or is not a function of the "
                "batch alone. The step was skipped, the loss scale left alone.",
                step,
            )
            return None
        fp32 = self.run(inputs, fp16=False)
        self._raise_if_fp32_fails(step, fp32, None)
        if self.policy == "raise":
            raise LossScaleError(
                f"Step {step}: the loss overflows FP16 while every module's "
                "output is finite (the loss computation; finite in FP32). Loss "
                "scaling cannot fix this: compute the loss in FP32 (outside "
                "autocast, on .float() logits), or train in bf16."
            )
        logger.warning(
            "Step %d: the loss was non-finite in FP16 but no module's output was: "
            "the overflow is in the loss computation. Compute the loss in FP32 "
            "(outside autocast, on .float() logits).",
            step,
        )
        return fp32.loss

    def _diverging(
        self,
        step: int,
        culprit: str,
        evidence: tuple[str, ...],
        added: tuple[str, ...],
        loss: float | None,
    ) -> ForwardOverflow:
        self.judge.report(step, culprit, evidence)  # raises with on_divergence="raise"
        return ForwardOverflow(step, culprit, added, self.policy, True, evidence, loss)

    def make_islands(self, names: list[str]) -> list[str]:
        """Make the named modules FP32 islands, record them in ``model.config``; the names newly
        added to :attr:`islands` (a name's submodules are covered by it)."""
        covered = keep_in_fp32(self.model, [_exactly(name) for name in names])
        record_fp32_islands(self.model)
        added = [name for name in dict.fromkeys(covered) if name not in self.islands]
        self.islands.extend(added)
        return added

    def restore_islands(self, names: list[str]) -> None:
        """Re-make islands recorded earlier (a resumed checkpoint's) on this model."""
        restore_fp32_islands(self.model, names)
        self.islands = list(dict.fromkeys([*self.islands, *names]))

    # -- the re-runs ---------------------------------------------------------------------------
    def _device_type(self, inputs: Any) -> str:
        for tensor in iter_tensors(inputs):
            return tensor.device.type
        for param in self.model.parameters():
            return param.device.type
        return "cpu"

    def run(self, inputs: Any, *, fp16: bool) -> Located:
        """Re-run ``inputs`` (no grad, RNG preserved) under FP16 autocast (``fp16``) or in pure
        FP32, and say which module overflowed (see :class:`OverflowLocator`)."""
        device_type = self._device_type(inputs)
        # The re-run must not move the training run's RNG (dropout masks of later steps).
        devices = [torch.cuda.current_device()] if device_type == "cuda" else []
        # Accelerate's prepare() wraps the model's own forward in an FP16 autocast: the FP32
        # run must bypass that wrapper.
        with (
            without_autocast_wrapper(self.model) if not fp16 else contextlib.nullcontext(),
            torch.random.fork_rng(devices=devices),
            torch.no_grad(),
            OverflowLocator(self.model, census=not fp16) as locator,
            torch.autocast(device_type, dtype=self.dtype, enabled=fp16),
        ):
            output = self.forward(self.model, inputs)
        return locator.located(output)

    def _raise_if_fp32_fails(self, step: int, fp32: Located, culprit: str | None) -> None:
        if fp32.first is None and fp32.output_finite:
            return
        where = fp32.first or culprit
        if where is None:  # every module's output finite: the loss computed from them is not
            raise NonFiniteForwardError(
                f"Step {step}: the loss is non-finite in pure FP32 too while every "
                "module's output is finite, so this is the loss computation, not FP16 nor the "
                "model: a custom compute_loss or compute_loss_func, label_smoothing_factor, or "
                "the loss function's inputs (labels out of range, log(0), division by zero)."
            )
        named = describe_module(self.model, where)
        raise NonFiniteForwardError(
            f"Step {step}: the forward pass is non-finite in pure FP32 too, so this is "
            f"the model or the data, not FP16: the first module to produce inf/NaN in FP32 is "
            f"{named}. Check that module's arithmetic (eps > 0 in norms, guarded log/sqrt/"
            "division) and its weights, and the batch's values."
        )

"""Forward overflow during training: tell it from a gradient overflow, name the module, fix it.

A skipped FP16 step has two possible causes, and only one of them is the loss scale's business:

* a *gradient* overflow: the loss is finite, some scaled gradients are not. The scale is too
  high; backing it off is the fix (:class:`~amp_trainer.scaler.DynamicLossScaler` does).
* a *forward* overflow: the unscaled loss is already inf/NaN, because a module's FP16 output left
  FP16's range (``|x| > 65504``). No loss scale can fix that; backing off for it only walks the
  scale down to its minimum (16 halvings from 2**16) and ends in a ``LossScaleError`` that lists
  every parameter.

:class:`ForwardOverflowGuard` watches the losses of each optimizer step at no cost on clean steps
(it keeps references; nothing is read back). On a skipped step it reads them back once; if one
was non-finite it is a forward overflow, and the guard:

1. checks the batch itself: inf/NaN in its floating inputs is the data
   (:class:`NonFiniteForwardError`);
2. re-runs that batch under FP16 autocast with :class:`~amp_trainer.doctor.OverflowProbe` (no
   gradients, RNG state preserved) to name the first module whose output went non-finite from
   finite inputs, and runs it once in pure FP32: non-finite there too is the model or the data,
   never FP16 (:class:`NonFiniteForwardError`, naming the module);
3. applies the policy: ``"fp32"`` (the default) makes that module an FP32 island
   (:func:`~amp_trainer.islands.keep_in_fp32`), warns once naming it, re-probes until the
   batch is clean (a deeper layer may overflow next) and keeps training; ``"raise"`` raises
   :class:`~amp_trainer.scaler.LossScaleError` naming it; ``"skip"`` does none of this (the
   step is skipped and the scale backs off, as before).

Under ``"fp32"`` and ``"raise"`` a forward overflow does not back the scale off: the guard puts
back the scale the step ran with (``scaler.update(new_scale=...)``). The step itself stays skipped
(its gradients are inf) and is counted as such. With ``hysteresis > 1`` the forward overflow
still uses up one tolerated overflow.

In a plain Accelerate loop,
:meth:`amp_trainer.accelerate_hooks.AmpAccelerator.check_forward_overflow` is the entry
point; :class:`~amp_trainer.trainer.AmpTrainer` does all of it by itself and records the islands
in ``model.config`` (so they travel with every checkpoint and saved model, come back on resume
and are kept FP32 by :func:`~amp_trainer.export.export_fp16`).

Example (any loop)::

    guard = ForwardOverflowGuard(model, scaler)          # policy="fp32"
    for batch in loader:
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(**batch).loss
        guard.observe(loss, batch)                       # no sync
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        guard.after_step()                               # work only on skipped steps
        optimizer.zero_grad()
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amp_trainer.islands import (
    is_fp32_island,
    keep_in_fp32,
    record_fp32_islands,
    restore_fp32_islands,
)
from amp_trainer.numerics import (
    OverflowProbe,
    all_finite,
    describe_module,
    iter_tensors,
    nonfinite_inputs,
)
from amp_trainer.scaler import DynamicLossScaler, LossScaleError

__all__ = [
    "POLICIES",
    "ForwardOverflow",
    "ForwardOverflowGuard",
    "NonFiniteForwardError",
    "check_policy",
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


@dataclass(frozen=True)
class ForwardOverflow:
    """One forward overflow the guard handled.

    ``module`` is the first module whose FP16 output went non-finite from finite inputs (``None``
    when no module did: the loss computation itself, or an overflow the re-run did not
    reproduce), ``islands`` the modules made FP32 islands for it (policy ``"fp32"``), ``step``
    the guard's count of optimizer steps when it happened (1-based).
    """

    step: int
    module: str | None
    islands: tuple[str, ...]
    policy: str


def _exactly(name: str) -> re.Pattern[str]:
    return re.compile(re.escape(name))


def _default_forward(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, (list, tuple)):
        return model(*inputs)
    return model(inputs)


def check_policy(policy: Any) -> str:
    """``policy`` if it is one of :data:`POLICIES`, else a ``ValueError`` naming the choices."""
    if policy not in POLICIES:
        raise ValueError(f"on_forward_overflow must be one of {POLICIES}, got {policy!r}")
    return policy


class ForwardOverflowGuard:
    """Detects forward overflows on skipped FP16 steps and handles them (see the module doc).

    Args:
        model: the model being trained, unwrapped (not the DDP wrapper): its module names are
            the ones reported and made islands.
        scaler: the :class:`DynamicLossScaler` stepping the optimizer(s).
        policy: ``"fp32"``, ``"raise"`` or ``"skip"``.
        forward: ``(model, inputs) -> output`` for the re-run; default ``model(**inputs)`` for a
            mapping, ``model(*inputs)`` for a sequence, ``model(inputs)`` otherwise.
        dtype: the autocast dtype of the training forward (FP16).

    Attributes:
        events: every :class:`ForwardOverflow` handled, in order.
        islands: the modules this guard made FP32 islands, in order.
    """

    def __init__(
        self,
        model: nn.Module,
        scaler: DynamicLossScaler,
        *,
        policy: str = "fp32",
        forward: ForwardFn | None = None,
        dtype: torch.dtype = torch.float16,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(scaler, DynamicLossScaler):
            raise TypeError(f"scaler must be a DynamicLossScaler, got {type(scaler).__name__}")
        self.model = model
        self.scaler = scaler
        self.policy = check_policy(policy)
        self.forward = forward or _default_forward
        self.dtype = dtype
        self.events: list[ForwardOverflow] = []
        self.islands: list[str] = []
        self._pending: list[tuple[torch.Tensor, Any]] = []
        self._scale = scaler.get_scale()  # the scale the next step runs with
        self._steps = 0

    def observe(self, loss: torch.Tensor, inputs: Any = None) -> None:
        """Remember one micro-batch's loss (and inputs, for the re-run). No device sync."""
        if self.policy != "skip" and isinstance(loss, torch.Tensor):
            self._pending.append((loss.detach(), inputs))

    def after_step(
        self, loss: torch.Tensor | None = None, inputs: Any = None
    ) -> ForwardOverflow | None:
        """Call once per optimizer step, after ``scaler.update()`` (Accelerate: after
        ``optimizer.step()``). On a clean step it only forgets the step's losses. On a skipped
        step whose loss was non-finite it handles the forward overflow and returns what it did.
        ``loss``/``inputs`` add the step's last micro-batch when :meth:`observe` was not used.

        Raises:
            NonFiniteForwardError: the batch holds inf/NaN, or FP32 is non-finite too.
            LossScaleError: policy ``"raise"``, naming the module.
        """
        self._steps += 1
        if loss is not None:
            self.observe(loss, inputs)
        pending, self._pending = self._pending, []
        scale_before, self._scale = self._scale, self.scaler.get_scale()
        if self.policy == "skip" or not self.scaler.step_was_skipped:
            return None
        bad: list[Any] = []
        if pending:
            # The one read-back, on skipped steps only.
            finite = torch.stack([torch.isfinite(v.float()).all() for v, _ in pending]).cpu()
            bad = [inputs for (_, inputs), ok in zip(pending, finite.tolist()) if not ok]
        group = self._group()
        if group is not False:
            # Every rank must agree (same scale, same islands): one flag, MAX over the ranks.
            if not _any_rank(bool(bad), group):
                return None
        elif not bad:
            return None  # a gradient overflow: the scaler's backoff was right
        if self.scaler.get_scale() < scale_before:
            # Loss scaling cannot fix a forward overflow: undo the backoff it caused.
            self.scaler.update(new_scale=scale_before)
            self._scale = scale_before
        if group is False:
            event = self._handle(bad[0])
        else:
            event = self._handle_on_every_rank(bad[0] if bad else None, group)
        self.events.append(event)
        return event

    def _group(self) -> Any:
        """The process group to agree over, ``None`` for the default one; False when alone."""
        import torch.distributed as dist

        group = self.scaler.process_group
        if not dist.is_available() or not dist.is_initialized():
            return False
        return group if dist.get_world_size(group) > 1 else False

    def _handle_on_every_rank(self, inputs: Any, group: Any) -> ForwardOverflow:
        """Ranks whose batch overflowed find the module; all ranks then make the same islands
        (or raise the same error), so the replicas stay identical."""
        import torch.distributed as dist

        local: tuple[str | None, list[str], str | None, str | None] = (None, [], None, None)
        if inputs is not None:
            try:
                found = self._handle(inputs)
                local = (found.module, list(found.islands), None, None)
            except (NonFiniteForwardError, LossScaleError) as err:
                local = (None, [], type(err).__name__, str(err))
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        for _, _, kind, message in gathered:
            if kind is not None:
                raise (LossScaleError if kind == "LossScaleError" else NonFiniteForwardError)(
                    message
                )
        module = next((m for m, _, _, _ in gathered if m is not None), None)
        union = list(dict.fromkeys(name for _, names, _, _ in gathered for name in names))
        missing = [name for name in union if name not in self.islands]
        if missing:
            keep_in_fp32(self.model, [_exactly(name) for name in missing])
            record_fp32_islands(self.model)
            self.islands.extend(missing)
        return ForwardOverflow(self._steps, module, tuple(union), self.policy)

    # ----------------------------------------------------------------------------------------
    def _handle(self, inputs: Any) -> ForwardOverflow:
        if inputs is None:
            logger.warning(
                "Step %d: the loss was non-finite before scaling (a forward overflow; the loss "
                "scale was left alone), but no batch was given to find the module: pass it to "
                "observe()/after_step().",
                self._steps,
            )
            return ForwardOverflow(self._steps, None, (), self.policy)
        if isinstance(inputs, Mapping):
            bad_inputs = nonfinite_inputs(inputs)
            if bad_inputs:
                raise NonFiniteForwardError(
                    f"Step {self._steps}: the loss is non-finite because the batch itself holds "
                    f"inf/NaN: {', '.join(bad_inputs)}. This is the data, not FP16: fix the data "
                    "pipeline (division by zero, log(0), missing values read as NaN) or filter "
                    "those rows."
                )
        added: list[str] = []
        first: str | None = None
        for _ in range(_MAX_ISLANDS_PER_STEP):
            culprit, output_finite = self._probe(inputs, fp16=True)
            if culprit is None:
                if not output_finite and first is None:
                    self._check_fp32(inputs, None)
                    logger.warning(
                        "Step %d: the loss was non-finite in FP16 but no module's output was: "
                        "the overflow is in the loss computation. Compute the loss in FP32 "
                        "(outside autocast, on .float() logits).",
                        self._steps,
                    )
                break
            if first is None:
                first = culprit
                self._check_fp32(inputs, culprit)
            if self.policy == "raise":
                raise LossScaleError(
                    f"Step {self._steps}: forward overflow in "
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
                    self._steps,
                    culprit,
                )
                break
            covered = keep_in_fp32(self.model, _exactly(culprit))
            record_fp32_islands(self.model)
            for name in covered:
                if name not in self.islands:
                    self.islands.append(name)
                    added.append(name)
            logger.warning(
                "Forward overflow at step %d: %s produces inf/NaN in FP16 (finite in FP32); it "
                "now computes in FP32 (an FP32 island) and training continues. To start with it: "
                "fp32_modules=[%r].",
                self._steps,
                describe_module(self.model, culprit),
                culprit,
            )
        else:
            logger.warning(
                "Step %d: still overflowing after %d new FP32 islands; giving up on this step.",
                self._steps,
                _MAX_ISLANDS_PER_STEP,
            )
        return ForwardOverflow(self._steps, first, tuple(added), self.policy)

    def _device_type(self, inputs: Any) -> str:
        for tensor in iter_tensors(inputs):
            return tensor.device.type
        for param in self.model.parameters():
            return param.device.type
        return "cpu"

    def _probe(self, inputs: Any, *, fp16: bool) -> tuple[str | None, bool]:
        """Re-run ``inputs`` (no grad, RNG preserved); the first module whose output went
        non-finite from finite inputs, and whether the whole output is finite."""
        device_type = self._device_type(inputs)
        # The re-run must not move the training run's RNG (dropout masks of later steps).
        devices = [torch.cuda.current_device()] if device_type == "cuda" else []
        # Accelerate's prepare() wraps the model's own forward in an FP16 autocast (and keeps
        # the original as _original_forward): the FP32 run must bypass that wrapper.
        wrapped = self.model.__dict__.get("forward")
        original = self.model.__dict__.get("_original_forward")
        try:
            if not fp16 and wrapped is not None and original is not None:
                self.model.forward = original
            with (
                torch.random.fork_rng(devices=devices),
                torch.no_grad(),
                OverflowProbe(self.model, limit=math.inf) as probe,
                torch.autocast(device_type, dtype=self.dtype, enabled=fp16),
            ):
                output = self.forward(self.model, inputs)
        finally:
            if wrapped is not None:
                self.model.forward = wrapped
        return probe.first, all_finite(output)

    def _check_fp32(self, inputs: Any, culprit: str | None) -> None:
        first, finite = self._probe(inputs, fp16=False)
        if first is None and finite:
            return
        where = first or culprit
        named = describe_module(self.model, where) if where is not None else "the loss"
        raise NonFiniteForwardError(
            f"Step {self._steps}: the forward pass is non-finite in pure FP32 too, so this is "
            f"the model or the data, not FP16: the first module to produce inf/NaN in FP32 is "
            f"{named}. Check that module's arithmetic (eps > 0 in norms, guarded log/sqrt/"
            "division) and its weights, and the batch's values."
        )

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "islands": list(self.islands)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Re-make the recorded islands on this guard's model (resume)."""
        names = [n for n in state.get("islands", []) if isinstance(n, str)]
        restore_fp32_islands(self.model, names)
        self.islands = list(dict.fromkeys([*self.islands, *names]))


def _any_rank(flag: bool, group: Any) -> bool:
    import torch.distributed as dist

    device = "cpu" if dist.get_backend(group) == "gloo" else torch.cuda.current_device()
    value = torch.tensor(float(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())

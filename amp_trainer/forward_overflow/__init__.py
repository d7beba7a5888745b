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
2. re-runs that batch under FP16 autocast with :class:`~amp_trainer.numerics.OverflowProbe` (no
   gradients, RNG state preserved) to name the first module whose output went non-finite from
   finite inputs, and runs it once in pure FP32: non-finite there too (with no sign of
   divergence, step 3) is the model or the data, never FP16 (:class:`NonFiniteForwardError`,
   naming the module);
3. tells divergence from an FP16-unfriendly layer: a run whose learning rate is far too high
   overflows FP16 too, and an island would only hide it. The culprit's weights far beyond their
   norm at the first step, the loss far above its first values, several modules out of FP16's
   range at once (the rule: docs/guides/nan-triage.md, "Divergence"): then no island is
   added, and :class:`DivergenceError` names the learning rate and the evidence
   (``on_divergence="warn"``: one warning, training goes on). A module without parameters
   (Dropout, an activation) cannot overflow on its own: the module that produced its input is
   the culprit;
4. applies the policy: ``"fp32"`` (the default) makes that module an FP32 island
   (:func:`~amp_trainer.islands.keep_in_fp32`), warns once naming it, re-probes until the
   batch is clean (a deeper layer may overflow next) and keeps training; ``"raise"`` raises
   :class:`~amp_trainer.scaler.LossScaleError` naming it; ``"skip"`` does none of this (the
   step is skipped and the scale backs off, as before).

Under ``"fp32"`` and ``"raise"`` a forward overflow does not back the scale off: the guard puts
back the scale the step ran with and the backoff is not counted
(:meth:`~amp_trainer.scaler.DynamicLossScaler.undo_backoff`). The step itself stays skipped (its
gradients are inf) and is counted as such. With ``hysteresis > 1`` the forward overflow still
uses up one tolerated overflow. Its gradients name no parameter (every one is non-finite):
``scaler.stats.last_overflow_params`` is emptied and ``last_forward_overflow_modules`` names the
module(s) found (:meth:`~amp_trainer.scaler.DynamicLossScaler.record_forward_overflow`).

In a plain Accelerate loop,
:meth:`amp_trainer.accelerate_hooks.AmpAccelerator.check_forward_overflow` is the entry
point; :class:`~amp_trainer.trainer.AmpTrainer` does all of it by itself and records the islands
in ``model.config`` (so they travel with every checkpoint and saved model, come back on resume
and are kept FP32 by :func:`~amp_trainer.export.export_fp16`).

This package holds :class:`ForwardOverflowGuard` (the flow above, one optimizer step at a time);
each idea lives in its own module:

- :mod:`~amp_trainer.forward_overflow.detection`: was a skipped step a forward overflow (the
  step's losses, read back once; the ranks agree), and which module produced it (the hooks of a
  re-run: :class:`~amp_trainer.numerics.OverflowProbe` and the producer of a parameter-free
  module's input);
- :mod:`~amp_trainer.forward_overflow.divergence`: step 3, the divergence judgement
  (:func:`loss_diverged`, weight-norm growth, :class:`DivergenceError`);
- :mod:`~amp_trainer.forward_overflow.rerun`: steps 1, 2 and 4, the re-runs in FP16 and FP32,
  the FP32 islands and the ``"fp32"``/``"raise"`` policies (:class:`NonFiniteForwardError`).

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

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from amp_trainer.forward_overflow.detection import ForwardOverflowDetector
from amp_trainer.forward_overflow.divergence import (
    DIVERGENCE_POLICIES,
    DivergenceError,
    DivergenceJudge,
    check_divergence_policy,
    loss_diverged,
)
from amp_trainer.forward_overflow.rerun import (
    POLICIES,
    ForwardFn,
    ForwardOverflow,
    ForwardRerun,
    NonFiniteForwardError,
    check_policy,
)
from amp_trainer.scaler import DynamicLossScaler, LossScaleError

__all__ = [
    "DIVERGENCE_POLICIES",
    "POLICIES",
    "DivergenceError",
    "ForwardOverflow",
    "ForwardOverflowGuard",
    "NonFiniteForwardError",
    "check_divergence_policy",
    "check_policy",
    "loss_diverged",
]

# What a rank's handling is sent to the others as: the error's class by name.
_ERRORS: dict[str, type[FloatingPointError]] = {
    "LossScaleError": LossScaleError,
    "DivergenceError": DivergenceError,
    "NonFiniteForwardError": NonFiniteForwardError,
}


class ForwardOverflowGuard:
    """Detects forward overflows on skipped FP16 steps and handles them (see the package doc).

    It composes the three parts, each its own module's: ``detector`` (a
    :class:`~amp_trainer.forward_overflow.detection.ForwardOverflowDetector`), ``judge`` (a
    :class:`~amp_trainer.forward_overflow.divergence.DivergenceJudge`) and ``rerun`` (a
    :class:`~amp_trainer.forward_overflow.rerun.ForwardRerun`).

    Args:
        model: the model being trained, unwrapped (not the DDP wrapper): its module names are
            the ones reported and made islands.
        scaler: the :class:`DynamicLossScaler` stepping the optimizer(s).
        policy: ``"fp32"``, ``"raise"`` or ``"skip"``.
        forward: ``(model, inputs) -> output`` for the re-run; default ``model(**inputs)`` for a
            mapping, ``model(*inputs)`` for a sequence, ``model(inputs)`` otherwise.
        dtype: the autocast dtype of the training forward (FP16).
        on_divergence: ``"raise"`` (default) or ``"warn"``: what an overflow that is really
            divergence does (see :meth:`after_step`). Either way it adds no FP32 island.
        optimizer: the optimizer, to name its learning rate in the divergence message (may be
            set later as the ``optimizer`` attribute).

    Attributes:
        events: every :class:`ForwardOverflow` handled, in order.
        islands: the modules this guard made FP32 islands, in order (the re-run's list).
    """

    def __init__(
        self,
        model: nn.Module,
        scaler: DynamicLossScaler,
        *,
        policy: str = "fp32",
        forward: ForwardFn | None = None,
        dtype: torch.dtype = torch.float16,
        on_divergence: str = "raise",
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(scaler, DynamicLossScaler):
            raise TypeError(f"scaler must be a DynamicLossScaler, got {type(scaler).__name__}")
        self.model = model
        self.scaler = scaler
        self.detector = ForwardOverflowDetector(scaler)
        self.judge = DivergenceJudge(model, on_divergence=on_divergence, optimizer=optimizer)
        self.rerun = ForwardRerun(model, self.judge, policy=policy, forward=forward, dtype=dtype)
        self.events: list[ForwardOverflow] = []
        self._scale = scaler.get_scale()  # the scale the next step runs with
        self._steps = 0

    @property
    def policy(self) -> str:
        return self.rerun.policy

    @property
    def islands(self) -> list[str]:
        return self.rerun.islands

    @islands.setter
    def islands(self, names: list[str]) -> None:
        self.rerun.islands = list(names)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.judge.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer | None) -> None:
        self.judge.optimizer = optimizer

    @property
    def on_divergence(self) -> str:
        return self.judge.on_divergence

    def observe(self, loss: torch.Tensor, inputs: Any = None) -> None:
        """Remember one micro-batch's loss (and inputs, for the re-run). No device sync, except
        once, at the first call: the parameter norms divergence is measured against."""
        if self.policy != "skip" and isinstance(loss, torch.Tensor):
            detached = loss.detach()
            self.detector.observe(detached, inputs)
            self.judge.observe(detached)

    def remember_start(self) -> None:
        """Record the parameter norms divergence is measured against: "when training started".

        :meth:`observe` does it by itself at its first call, which in a Trainer comes before the
        first optimizer step. Where the first observe() comes after that step (an Accelerate
        loop calling :meth:`after_step` with the loss), call this before training:
        :class:`~amp_trainer.accelerate_hooks.AmpAccelerator` does, in ``prepare()``. One pass
        over the parameters and one device-to-host transfer.
        """
        self.judge.remember_start()

    def after_step(
        self, loss: torch.Tensor | None = None, inputs: Any = None
    ) -> ForwardOverflow | None:
        """Call once per optimizer step, after ``scaler.update()`` (Accelerate: after
        ``optimizer.step()``). On a clean step it only forgets the step's losses. On a skipped
        step whose loss was non-finite it handles the forward overflow and returns what it did.
        ``loss``/``inputs`` add the step's last micro-batch when :meth:`observe` was not used.

        An overflow with the marks of divergence (the module's weights grew far beyond their
        norm at the first step, the loss rose far above its first values, several modules left
        FP16's range at once) is not an FP16 problem: it adds no island, and raises
        :class:`DivergenceError` (``on_divergence="warn"``: warns once and goes on).

        Raises:
            NonFiniteForwardError: the batch holds inf/NaN, or FP32 is non-finite too.
            DivergenceError: the run is diverging (``on_divergence="raise"``).
            LossScaleError: policy ``"raise"``, naming the module.
        """
        self._steps += 1
        if loss is not None:
            self.observe(loss, inputs)
        scale_before, self._scale = self._scale, self.scaler.get_scale()
        if self.policy == "skip" or not self.scaler.step_was_skipped:
            self.detector.forget()
            return None
        bad = self.detector.overflowing_inputs()  # the one read-back, on skipped steps only
        group = self.detector.group()
        if group is not False:
            # Every rank must agree (same scale, same islands): one flag, MAX over the ranks.
            if not self.detector.on_any_rank(bool(bad), group):
                return None
        elif not bad:
            return None  # a gradient overflow: the scaler's backoff was right
        # Loss scaling cannot fix a forward overflow: undo the backoff it caused.
        self.scaler.undo_backoff(scale_before)
        self._scale = self.scaler.get_scale()
        found: tuple[str, ...] = ()
        try:
            if group is False:
                event = self.rerun.handle(self._steps, bad[0])
            else:
                event = self._handle_on_every_rank(bad[0] if bad else None, group)
            found = event.islands or ((event.module,) if event.module else ())
        finally:
            # Every gradient was non-finite because the loss was: the module(s) say more.
            self.scaler.record_forward_overflow(found)
        event = dataclasses.replace(event, step_losses=self.detector.losses)
        self.events.append(event)
        return event

    def _handle_on_every_rank(self, inputs: Any, group: Any) -> ForwardOverflow:
        """Ranks whose batch overflowed find the module; all ranks then make the same islands
        (or raise the same error), so the replicas stay identical."""
        import torch.distributed as dist

        local: tuple[str | None, list[str], str | None, str | None, list[str]] = (
            None,
            [],
            None,
            None,
            [],
        )
        loss: float | None = None  # this rank's FP32 re-run's
        if inputs is not None:
            try:
                found = self.rerun.handle(self._steps, inputs)
                local = (found.module, list(found.islands), None, None, list(found.evidence))
                loss = found.loss
            except (NonFiniteForwardError, LossScaleError, DivergenceError) as err:
                local = (None, [], type(err).__name__, str(err), [])
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        for _, _, kind, message, _ in gathered:
            if kind is not None:
                raise _ERRORS.get(kind, NonFiniteForwardError)(message)
        evidence = next((tuple(e) for _, _, _, _, e in gathered if e), ())
        module = next((m for m, _, _, _, _ in gathered if m is not None), None)
        # Islands one rank made (before another rank saw divergence, on_divergence="warn") are
        # made on every rank: the replicas stay identical.
        union = list(dict.fromkeys(name for _, names, _, _, _ in gathered for name in names))
        missing = [name for name in union if name not in self.islands]
        if missing:
            self.rerun.make_islands(missing)
        return ForwardOverflow(
            self._steps, module, tuple(union), self.policy, bool(evidence), evidence, loss
        )

    def state_dict(self) -> dict[str, Any]:
        return {"policy": self.policy, "islands": list(self.islands)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Re-make the recorded islands on this guard's model (resume)."""
        names = [n for n in state.get("islands", []) if isinstance(n, str)]
        self.rerun.restore_islands(names)

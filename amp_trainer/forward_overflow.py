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

import contextlib
import logging
import math
import re
import statistics
import weakref
from collections import deque
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
    FP16_MAX,
    OverflowProbe,
    all_finite,
    describe_module,
    describe_names,
    iter_tensors,
    nonfinite_inputs,
)
from amp_trainer.precision import without_autocast_wrapper
from amp_trainer.scaler import DynamicLossScaler, LossScaleError

try:  # a sharding engine's parameters (FSDP2, tensor parallel) are DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None  # type: ignore[assignment,misc]

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

logger = logging.getLogger(__name__)

#: What a forward overflow does: make the module an FP32 island, raise, or skip as before.
POLICIES = ("fp32", "raise", "skip")
# Islands one overflow step may add before the guard gives up on that step (a deep stack of
# identical blocks can overflow one after another once the first is fixed).
_MAX_ISLANDS_PER_STEP = 8

#: What a forward overflow that is really divergence does: stop the run, or warn once and go on.
DIVERGENCE_POLICIES = ("raise", "warn")
# The evidence that an overflow is divergence, not an FP16-unfriendly layer. One strong sign is
# enough, two weak ones too. A healthy run moves a layer's weight norm by a few percent, at most
# a few-fold over a long from-scratch run; one AdamW step at lr 10 moves it ~500-fold.
_WEIGHT_GROWTH = 10.0  # strong: the culprit's weight norm over its norm at the first step
_WEAK_WEIGHT_GROWTH = 3.0
_LOSS_RISE = 4.0  # strong: the loss above this multiple of its first values (see loss_diverged)
_WEAK_LOSS_RISE = 2.0
_LOSS_MARGIN = 1.0  # absolute margin, so a loss that starts near 0 may still wobble
_AT_ONCE = 3  # weak: modules with parameters leaving FP16's range at once, in FP32
_FIRST_LOSSES = 4  # micro-batch losses whose median is "the first values"
_RECENT_LOSSES = 16  # micro-batch losses remembered before an overflow (references, no sync)

ForwardFn = Callable[[nn.Module, Any], Any]


class NonFiniteForwardError(FloatingPointError):
    """The forward pass is inf/NaN in pure FP32 too, or the batch holds inf/NaN: the data or the
    model, not FP16. A ``FloatingPointError``, like :class:`~amp_trainer.scaler.LossScaleError`."""


class DivergenceError(FloatingPointError):
    """The run is diverging (weights or loss far beyond their values when training started):
    the forward overflow is a symptom of the learning rate, not of FP16, and an FP32 island would
    only hide it. A ``FloatingPointError``, like :class:`NonFiniteForwardError`."""


def loss_diverged(first: float, later: float, rise: float = _LOSS_RISE) -> bool:
    """Whether a loss of ``later`` is far above a first value of ``first``: more than ``rise``
    times it (by ``|first|``, so a negative objective works too) plus an absolute margin of 1.

    The one rule the guard and the doctor share: 0.69 -> 3.8 is divergence, 0.69 -> 2.1 is not;
    a language model starting at 10.8 diverges above 44.
    """
    return later - first > (rise - 1.0) * abs(first) + _LOSS_MARGIN


def check_divergence_policy(value: Any) -> str:
    """``value`` if it is one of :data:`DIVERGENCE_POLICIES`, else a ``ValueError`` naming them."""
    if value not in DIVERGENCE_POLICIES:
        raise ValueError(f"on_divergence must be one of {DIVERGENCE_POLICIES}, got {value!r}")
    return value


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
    """

    step: int
    module: str | None
    islands: tuple[str, ...]
    policy: str
    diverging: bool = False
    evidence: tuple[str, ...] = ()


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
        on_divergence: ``"raise"`` (default) or ``"warn"``: what an overflow that is really
            divergence does (see :meth:`after_step`). Either way it adds no FP32 island.
        optimizer: the optimizer, to name its learning rate in the divergence message (may be
            set later as the ``optimizer`` attribute).

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
        on_divergence: str = "raise",
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if not isinstance(scaler, DynamicLossScaler):
            raise TypeError(f"scaler must be a DynamicLossScaler, got {type(scaler).__name__}")
        self.model = model
        self.scaler = scaler
        self.policy = check_policy(policy)
        self.on_divergence = check_divergence_policy(on_divergence)
        self.optimizer = optimizer
        self.forward = forward or _default_forward
        self.dtype = dtype
        self.events: list[ForwardOverflow] = []
        self.islands: list[str] = []
        self._pending: list[tuple[torch.Tensor, Any]] = []
        self._scale = scaler.get_scale()  # the scale the next step runs with
        self._steps = 0
        # What "when training started" was, for telling divergence from an FP16 layer: the
        # parameter norms at the first observed forward (before any update of this run) and the
        # first and latest micro-batch losses (references: read back on overflow steps only).
        self._reference_norms: dict[str, float] | None = None
        self._first_losses: list[torch.Tensor] = []
        self._recent_losses: deque[torch.Tensor] = deque(maxlen=_RECENT_LOSSES)
        self._warned_divergence = False

    def observe(self, loss: torch.Tensor, inputs: Any = None) -> None:
        """Remember one micro-batch's loss (and inputs, for the re-run). No device sync, except
        once, at the first call: the parameter norms divergence is measured against."""
        if self.policy != "skip" and isinstance(loss, torch.Tensor):
            detached = loss.detach()
            self._pending.append((detached, inputs))
            if self._reference_norms is None:
                self.remember_start()
            if len(self._first_losses) < _FIRST_LOSSES:
                self._first_losses.append(detached)
            self._recent_losses.append(detached)

    def remember_start(self) -> None:
        """Record the parameter norms divergence is measured against: "when training started".

        :meth:`observe` does it by itself at its first call, which in a Trainer comes before the
        first optimizer step. Where the first observe() comes after that step (an Accelerate
        loop calling :meth:`after_step` with the loss), call this before training:
        :class:`~amp_trainer.accelerate_hooks.AmpAccelerator` does, in ``prepare()``. One pass
        over the parameters and one device-to-host transfer.
        """
        self._reference_norms = _parameter_norms(self.model.named_parameters())

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

        local: tuple[str | None, list[str], str | None, str | None, list[str]] = (
            None,
            [],
            None,
            None,
            [],
        )
        if inputs is not None:
            try:
                found = self._handle(inputs)
                local = (found.module, list(found.islands), None, None, list(found.evidence))
            except (NonFiniteForwardError, LossScaleError, DivergenceError) as err:
                local = (None, [], type(err).__name__, str(err), [])
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        errors = {
            "LossScaleError": LossScaleError,
            "DivergenceError": DivergenceError,
            "NonFiniteForwardError": NonFiniteForwardError,
        }
        for _, _, kind, message, _ in gathered:
            if kind is not None:
                raise errors.get(kind, NonFiniteForwardError)(message)
        evidence = next((tuple(e) for _, _, _, _, e in gathered if e), ())
        module = next((m for m, _, _, _, _ in gathered if m is not None), None)
        # Islands one rank made (before another rank saw divergence, on_divergence="warn") are
        # made on every rank: the replicas stay identical.
        union = list(dict.fromkeys(name for _, names, _, _, _ in gathered for name in names))
        missing = [name for name in union if name not in self.islands]
        if missing:
            keep_in_fp32(self.model, [_exactly(name) for name in missing])
            record_fp32_islands(self.model)
            self.islands.extend(missing)
        return ForwardOverflow(
            self._steps, module, tuple(union), self.policy, bool(evidence), evidence
        )

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
        at_once: list[str] = []
        for _ in range(_MAX_ISLANDS_PER_STEP):
            found = self._probe(inputs, fp16=True)
            culprit = found.culprit
            if culprit is None:
                if found.first is not None:
                    logger.warning(
                        "Step %d: %s overflows FP16 but has no parameters, and no module with "
                        "parameters produced its input: no module to keep in FP32; giving up "
                        "on this step.",
                        self._steps,
                        describe_module(self.model, found.first),
                    )
                    break
                if found.output_finite and first is None:
                    # Nothing to name, but never a silent skip: the loss was non-finite.
                    logger.warning(
                        "Step %d: the loss was non-finite, but the guard's re-run of the batch is "
                        "finite: the loss is computed outside what it re-runs (give the guard "
                        "forward=, a function returning the loss), or is not a function of the "
                        "batch alone. The step was skipped, the loss scale left alone.",
                        self._steps,
                    )
                if not found.output_finite and first is None:
                    fp32 = self._probe(inputs, fp16=False)
                    self._raise_if_fp32_fails(fp32, None)
                    if self.policy == "raise":
                        raise LossScaleError(
                            f"Step {self._steps}: the loss overflows FP16 while every module's "
                            "output is finite (the loss computation; finite in FP32). Loss "
                            "scaling cannot fix this: compute the loss in FP32 (outside "
                            "autocast, on .float() logits), or train in bf16."
                        )
                    logger.warning(
                        "Step %d: the loss was non-finite in FP16 but no module's output was: "
                        "the overflow is in the loss computation. Compute the loss in FP32 "
                        "(outside autocast, on .float() logits).",
                        self._steps,
                    )
                break
            if first is None:
                first = culprit
                fp32 = self._probe(inputs, fp16=False)
                at_once = fp32.over_range
                evidence = self._divergence_evidence(culprit, at_once)
                if evidence:
                    return self._diverging(culprit, evidence)
                self._raise_if_fp32_fails(fp32, culprit)
            else:
                evidence = self._divergence_evidence(culprit, at_once)
                if evidence:
                    return self._diverging(culprit, evidence, tuple(added))
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

    # -- divergence ----------------------------------------------------------------------------
    def _divergence_evidence(self, culprit: str, at_once: list[str]) -> tuple[str, ...]:
        """Why this overflow is divergence, not an FP16 layer; empty when it is not.

        One strong sign (the culprit's weights grew >= 10x since the first step, or the loss
        rose past :func:`loss_diverged`) or two weak ones (>= 3x growth, a loss twice its first
        values, >= 3 modules out of FP16's range at once in FP32) make it divergence.
        """
        strong: list[str] = []
        weak: list[str] = []
        growth = self._weight_growth(culprit)
        if growth is not None:
            ratio, before, now = growth
            text = (
                f"the weights of {culprit!r} grew {ratio:.3g}x since the first step (norm "
                f"{before:.3g} -> {now:.3g})"
            )
            if ratio >= _WEIGHT_GROWTH:
                strong.append(text)
            elif ratio >= _WEAK_WEIGHT_GROWTH:
                weak.append(text)
        trend = self._loss_trend()
        if trend is not None:
            first, latest = trend
            text = f"the loss rose from {first:.3g} to {latest:.3g}"
            if loss_diverged(first, latest):
                strong.append(text)
            elif loss_diverged(first, latest, _WEAK_LOSS_RISE):
                weak.append(text)
        if len(at_once) >= _AT_ONCE:
            weak.append(
                f"{len(at_once)} modules leave FP16's range at once even in FP32 "
                f"({describe_names(at_once)})"
            )
        if strong or len(weak) >= 2:
            return tuple(strong + weak)
        return ()

    def _weight_growth(self, culprit: str) -> tuple[float, float, float] | None:
        """(now / first, first, now) for the culprit's parameter norm; None without a
        reference or parameters. Computed for this one module, on overflow steps only."""
        reference = self._reference_norms
        if not reference:
            return None
        module = dict(self.model.named_modules()).get(culprit)
        if module is None:
            return None
        prefix = f"{culprit}." if culprit else ""
        named = [(prefix + n, p) for n, p in module.named_parameters()]
        named = [(n, p) for n, p in named if n in reference]
        if DTensor is not None:  # sharded since the reference was taken (FSDP2 after prepare)
            named = [(n, p) for n, p in named if not isinstance(p, DTensor)]
        if not named:
            return None
        before = math.sqrt(sum(reference[n] ** 2 for n, _ in named))
        now_norms = _parameter_norms(named)
        now = math.sqrt(sum(v**2 for v in now_norms.values()))
        if not math.isfinite(now):
            return math.inf, before, now
        if before == 0.0:
            return None  # a zero-initialised module: no scale to compare against
        return now / before, before, now

    def _loss_trend(self) -> tuple[float, float] | None:
        """(median of the first finite losses, largest finite recent loss), one read-back."""
        if not self._first_losses:
            return None
        values = torch.stack(
            [v.float().mean() for v in [*self._first_losses, *self._recent_losses]]
        ).tolist()
        first = [v for v in values[: len(self._first_losses)] if math.isfinite(v)]
        recent = [v for v in values[len(self._first_losses) :] if math.isfinite(v)]
        if not first or not recent:
            return None
        return statistics.median(first), max(recent)

    def _learning_rate(self) -> str:
        """``learning rate 10`` (the configured one; the scheduled value too when it differs)."""
        optimizer = self.optimizer
        groups = getattr(optimizer, "param_groups", None) if optimizer is not None else None
        if not groups:
            return "the current learning rate (unknown to the guard: give it optimizer=)"
        configured = list(dict.fromkeys(float(g.get("initial_lr", g["lr"])) for g in groups))
        current = list(dict.fromkeys(float(g["lr"]) for g in groups))
        text = "learning rate" + ("s " if len(configured) > 1 else " ")
        text += ", ".join(f"{lr:g}" for lr in configured)
        if current != configured:
            text += f" (now {', '.join(f'{lr:g}' for lr in current)} on its schedule)"
        return text

    def _diverging(
        self, culprit: str, evidence: tuple[str, ...], added: tuple[str, ...] = ()
    ) -> ForwardOverflow:
        message = (
            f"Step {self._steps}: training is diverging at {self._learning_rate()}; this is not "
            f"an FP16 problem. {describe_module(self.model, culprit)} overflows FP16 because the "
            f"run is blowing up: {'; '.join(evidence)}. An FP32 island would only hide the "
            "divergence, so none was added. Lower the learning rate (or add warmup and gradient "
            "clipping, max_grad_norm) and restart from a checkpoint saved before the loss rose."
        )
        if self.on_divergence == "raise":
            raise DivergenceError(
                message + " To go on anyway (no islands, the overflowing steps skipped): "
                "on_divergence='warn'."
            )
        if not self._warned_divergence:
            self._warned_divergence = True
            logger.warning(
                "%s Going on (on_divergence='warn'): overflowing steps are skipped; this warning "
                "is not repeated.",
                message,
            )
        else:
            logger.info("Step %d: still diverging (%s).", self._steps, "; ".join(evidence))
        return ForwardOverflow(self._steps, culprit, added, self.policy, True, evidence)

    # -- the re-runs ---------------------------------------------------------------------------
    def _device_type(self, inputs: Any) -> str:
        for tensor in iter_tensors(inputs):
            return tensor.device.type
        for param in self.model.parameters():
            return param.device.type
        return "cpu"

    def _probe(self, inputs: Any, *, fp16: bool) -> _Rerun:
        """Re-run ``inputs`` (no grad, RNG preserved): the first module whose output went
        non-finite from finite inputs, the module to blame for it, whether the whole output is
        finite, and (FP32) the modules with parameters whose output left FP16's range."""
        device_type = self._device_type(inputs)
        # The re-run must not move the training run's RNG (dropout masks of later steps).
        devices = [torch.cuda.current_device()] if device_type == "cuda" else []
        # Accelerate's prepare() wraps the model's own forward in an FP16 autocast: the FP32
        # run must bypass that wrapper.
        with (
            without_autocast_wrapper(self.model) if not fp16 else contextlib.nullcontext(),
            torch.random.fork_rng(devices=devices),
            torch.no_grad(),
            OverflowProbe(self.model, limit=math.inf) as probe,
            _Producers(self.model, census=not fp16) as producers,
            torch.autocast(device_type, dtype=self.dtype, enabled=fp16),
        ):
            output = self.forward(self.model, inputs)
        culprit = probe.first
        if culprit is not None and not _has_parameters(self.model.get_submodule(culprit)):
            culprit = producers.producer_of.get(culprit) or _enclosing_with_parameters(
                self.model, culprit
            )
        return _Rerun(probe.first, culprit, all_finite(output), producers.over_range)

    def _raise_if_fp32_fails(self, fp32: _Rerun, culprit: str | None) -> None:
        if fp32.first is None and fp32.output_finite:
            return
        where = fp32.first or culprit
        if where is None:  # every module's output finite: the loss computed from them is not
            raise NonFiniteForwardError(
                f"Step {self._steps}: the loss is non-finite in pure FP32 too while every "
                "module's output is finite, so this is the loss computation, not FP16 nor the "
                "model: a custom compute_loss or compute_loss_func, label_smoothing_factor, or "
                "the loss function's inputs (labels out of range, log(0), division by zero)."
            )
        named = describe_module(self.model, where)
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


@dataclass(frozen=True)
class _Rerun:
    """What one re-run of the overflowing batch showed (see ``ForwardOverflowGuard._probe``)."""

    first: str | None  # the first module whose output went non-finite from finite inputs
    culprit: str | None  # the module to blame: ``first``, or its input's producer
    output_finite: bool
    over_range: list[str]  # modules with parameters out of FP16's range (FP32 run only)


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _enclosing_with_parameters(model: nn.Module, name: str) -> str | None:
    """The innermost module above ``name`` that holds parameters, never the model itself: where
    a parameter-free module's input was computed when no module's output was it."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        outer = ".".join(parts[:end])
        if _has_parameters(model.get_submodule(outer)):
            return outer
    return None


def _parameter_norms(named: Any) -> dict[str, float]:
    """The L2 norm of each parameter, read back in one transfer.

    Sharded (DTensor) parameters are left out: their norm is a collective, and the guard may
    run on the overflowing ranks only; their growth is simply not part of the evidence.
    """
    names: list[str] = []
    norms: list[torch.Tensor] = []
    for name, param in named:
        if DTensor is not None and isinstance(param, DTensor):
            continue
        names.append(name)
        norms.append(torch.linalg.vector_norm(param.detach(), dtype=torch.float32).cpu())
    if not norms:
        return {}
    return dict(zip(names, torch.stack(norms).tolist()))


class _Producers:
    """Forward hooks for the guard's re-run: which module with parameters produced each tensor,
    so an overflow first seen in a parameter-free module (Dropout scaling 60000 by 1/(1-p), an
    activation) is blamed on the module that made the large values; and, in the FP32 re-run,
    which modules with parameters of their own put out values beyond FP16's range from in-range
    inputs (several at once is a mark of divergence). A context manager; hooks removed on exit.
    """

    def __init__(self, model: nn.Module, *, census: bool) -> None:
        self.producer_of: dict[str, str | None] = {}
        self.over_range: list[str] = []
        self._census = census
        self._owners: dict[int, tuple[weakref.ref[torch.Tensor], str]] = {}
        self._handles = [
            module.register_forward_hook(self._make_hook(name, module), with_kwargs=True)
            for name, module in model.named_modules()
        ]

    def _owner(self, tensor: torch.Tensor) -> str | None:
        entry = self._owners.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None

    def _make_hook(self, name: str, module: nn.Module) -> Callable[..., None]:
        has_parameters = _has_parameters(module)
        own_parameters = bool(module._parameters)

        def hook(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            inputs = [t for t in iter_tensors((args, kwargs)) if t.is_floating_point()]
            if has_parameters:
                owner: str | None = name
            else:  # a parameter-free module passes its input's producer on
                owner = self._owner(inputs[0]) if inputs else None
                if name not in self.producer_of and not all_finite(output):
                    self.producer_of[name] = owner
            if (
                self._census
                and own_parameters
                and name not in self.over_range
                and not all_finite(output, FP16_MAX)
                and all_finite((args, kwargs), FP16_MAX)
            ):
                self.over_range.append(name)
            if owner is not None:
                for tensor in iter_tensors(output):
                    self._owners[id(tensor)] = (weakref.ref(tensor), owner)

        return hook

    def __enter__(self) -> _Producers:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._owners.clear()


def _any_rank(flag: bool, group: Any) -> bool:
    import torch.distributed as dist

    device = "cpu" if dist.get_backend(group) == "gloo" else torch.cuda.current_device()
    value = torch.tensor(float(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())

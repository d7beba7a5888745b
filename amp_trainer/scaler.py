"""DynamicLossScaler: the FP16 loss scaler at the heart of amp-trainer.

A drop-in for :class:`torch.amp.GradScaler` (same first arguments, same method names) that adds
what long FP16 fine-tuning runs need and torch's scaler does not have:

* hysteresis (tolerate ``hysteresis - 1`` overflows before backing off, Megatron/DeepSpeed style);
* ``min_scale``/``max_scale`` bounds and a clear, configurable failure when the scale collapses;
* a skip that really is a skip for *every* optimizer kind: torch's scaler hands fused optimizers
  its ``found_inf`` tensor and calls ``optimizer.step()`` anyway, so wrappers that detect skips by
  watching ``step()`` (Accelerate, and through it Trainer's LR scheduler) never see one;
* the same skip decision on every rank (found-inf is all-reduced with MAX);
* telemetry (:attr:`stats`) and overflow attribution by parameter name (:meth:`watch`);
* a checkpointable state that is plain numbers (``torch.load(weights_only=True)``-safe).

Where torch's behaviour is right we match it exactly: with the default arguments the scale after
every :meth:`update` and every skip decision equal ``torch.amp.GradScaler``'s, for any run length
(the scale is kept as the float32 value torch's 1-element tensor would hold, and never grows into
inf), until an overflow at ``min_scale`` (default 1.0), where torch silently keeps halving and we
raise :class:`LossScaleError`. Bounds (``min_scale``/``max_scale``) are compared in float32, so
every state the scaler writes loads back into a scaler built with the same arguments.

What the scaler refuses, loudly, where torch would silently do the wrong thing: unscaling
gradients when no :meth:`scale` call happened since the optimizer's last step (a plain
``loss.backward()``: the update would be S times too small; all-zero gradients excepted, which
are the same scaled or not: ``torch.distributed.checkpoint`` steps once on them to create the
optimizer state, and that step passes through without touching the scaler's state), and pickling
mid-iteration.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from torch import nn

from amp_trainer.grad_unscale import (
    GradientGroups,
    all_zero,
    check_and_unscale,
    distributed,
    group_gradients,
    one_pass_clip_factor,
    one_pass_is_exact,
    reduce_found_inf,
)
from amp_trainer.numerics import describe_names
from amp_trainer.overflow_attribution import (
    ParameterNames,
    non_finite_parameters,
)
from amp_trainer.scale_policy import Decision, ScalePolicy
from amp_trainer.underflow import UnderflowReading, measure_underflow, setup_pitfall

__all__ = ["DynamicLossScaler", "LossScaleError", "ScalerStats"]

logger = logging.getLogger(__name__)

_STATE_VERSION = 2


class LossScaleError(FloatingPointError, RuntimeError):
    """Gradients kept overflowing at the minimum loss scale: FP16 cannot represent this run.

    A ``FloatingPointError`` so that code catching the stdlib's numeric failures catches it too.
    """


class _Stage(Enum):
    """Where one optimizer is in the current iteration (torch's ``OptState``)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass(frozen=True)
class ScalerStats:
    """A snapshot of everything the scaler knows; cheap to take, safe to keep.

    ``steps`` counts :meth:`DynamicLossScaler.update` calls (optimizer steps attempted), ``skipped``
    those whose gradients were non-finite, ``overflow_streak`` the current run of consecutive
    overflowing steps. ``backoffs`` counts the times the scale really went down: a forward
    overflow's backoff, undone by the guard, is not one. ``last_overflow_params`` names the
    parameters with non-finite gradients on the most recent overflow step (names when
    :meth:`~DynamicLossScaler.watch` was called, positional labels otherwise; empty when nothing
    was attributed, and on a forward overflow, whose gradients are all non-finite because the
    loss was). ``last_forward_overflow_modules`` names the module(s) whose FP16 forward
    overflowed on the most recent forward overflow: the ones the forward-overflow guard made FP32
    islands, or named (see :meth:`~DynamicLossScaler.record_forward_overflow`).
    ``grad_underflow`` (0..1) and ``grad_headroom`` are the last
    :meth:`~DynamicLossScaler.check_underflow` reading's share flushed to zero and doublings left
    (``None`` before any), ``underflow_by_param`` its share per parameter, ``underflow_growths``
    the growths the two-sided rule made.
    """

    scale: float
    steps: int
    skipped: int
    growths: int
    backoffs: int
    overflow_streak: int
    last_overflow_params: tuple[str, ...]
    last_forward_overflow_modules: tuple[str, ...] = ()
    grad_underflow: float | None = None
    grad_headroom: float | None = None
    underflow_growths: int = 0
    underflow_by_param: Mapping[str, float] = field(default_factory=dict)


class DynamicLossScaler:
    """Dynamic loss scaling for FP16 training, a drop-in for :class:`torch.amp.GradScaler`.

    The whole step protocol, unscale-then-clip included::

        model = MyModel().cuda()                       # master weights stay FP32
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        scaler = DynamicLossScaler("cuda").watch(model)

        for batch in loader:
            optimizer.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch).loss
            scaler.scale(loss).backward()              # grads carry the scale S
            scaler.clip_grad_norm_(optimizer, 1.0)     # unscale once, then clip true grads
            scaler.step(optimizer)                     # skipped entirely if any grad is inf/NaN
            scaler.update()                            # grow / back off / hysteresis
            if not scaler.step_was_skipped:
                lr_scheduler.step()

    Args:
        device: ``"cuda"``, ``"cpu"``, ... Kept for signature compatibility with
            ``torch.amp.GradScaler``; the scaler works on whatever device the loss and gradients
            live on (its small tensors are created lazily there).
        init_scale: starting scale S (rounded to float32, like torch).
        growth_factor: S is multiplied by this after ``growth_interval`` consecutive clean steps.
        backoff_factor: S is multiplied by this when an overflow is not tolerated.
        growth_interval: clean steps between growths.
        enabled: ``False`` makes every method an exact pass-through (FP32 or BF16 training).
        hysteresis: back off on the N-th overflow; ``N - 1`` overflows are tolerated (the step is
            still skipped). The tolerance refills when the scale grows (Megatron).
            ``1`` is torch's behaviour.
        consecutive_hysteresis: refill the tolerance on every clean step instead (DeepSpeed's
            option), so only N overflows *in a row* back off.
        min_scale: the scale never goes below this; an overflow there is handled by
            ``on_min_scale``. ``None`` (default): 1.0, or ``init_scale`` if that is lower (a scale
            set below it by ``update(new_scale)`` lowers it too), so every ``init_scale`` torch
            accepts works. torch has no floor: it keeps halving, silently, towards 0.
        max_scale: the scale never grows above this. ``None`` (default): unbounded, like torch
            (growth stops only where the next scale would be float32's inf).
        on_min_scale: what an overflow at ``min_scale`` does once hysteresis is spent:
            ``"raise"`` a :class:`LossScaleError` naming the offending parameters, ``"warn"`` once
            per overflow streak and keep skipping, ``"clamp"`` keep skipping silently.
        process_group: when ``torch.distributed`` is initialised with more than one rank, the
            found-inf flag is all-reduced (MAX) over this group (default: the world) so that every
            rank skips the same steps and keeps the same scale.
        grow_on_underflow: the two-sided rule: when :meth:`check_underflow` finds more than
            0.1 % of the gradient flushed to zero and the headroom allows, grow at once to the
            scale that fixes it (one doubling inside the headroom, never back to a scale that
            overflowed after such a growth). ``False`` (default): torch's rule, step for step.
    """

    def __init__(
        self,
        device: str | torch.device = "cuda",
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        *,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = None,
        max_scale: float | None = None,
        on_min_scale: str = "raise",
        process_group: Any = None,
        grow_on_underflow: bool = False,
    ) -> None:
        self._device_type = torch.device(device).type
        self._enabled = bool(enabled)
        # The grow/back-off rule and its numbers; the protocol below never touches its fields
        # except through record() / set_scale().
        self.policy = ScalePolicy(
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis=hysteresis,
            consecutive_hysteresis=consecutive_hysteresis,
            min_scale=min_scale,
            max_scale=max_scale,
            on_min_scale=on_min_scale,
            grow_on_underflow=grow_on_underflow,
        )
        self.process_group = process_group
        self._underflow: UnderflowReading | None = None
        self._underflow_request: Any = None  # parameters to measure at the next scale() call
        self._pitfalls_said: set[str] = set()
        self._param_names = ParameterNames()
        # scale() calls so far, and their count when each optimizer last unscaled: gradients
        # that appear with no scale() call since then came from a plain backward (see unscale_).
        # One integer increment per scale() and one compare per unscale_(): free on clean steps.
        self._scale_calls = 0
        self._scale_calls_at_unscale: dict[int, int] = {}
        self._carried = False  # per-optimizer states kept across update() (see update())
        self._reset_counters()
        self._per_optimizer: dict[int, dict[str, Any]] = defaultdict(self._fresh_optimizer_state)
        # Device tensors (scale and its reciprocal) are created lazily on first use, per device,
        # and refreshed only when the scale changes: scale() and unscale_() then cost no
        # host-to-device copy on the steady-state path.
        self._device_cache: dict[torch.device, tuple[float, torch.Tensor, torch.Tensor]] = {}

    def _reset_counters(self) -> None:
        self._warned_this_streak = False
        self._last_overflow_params: tuple[str, ...] = ()
        self._last_forward_overflow_modules: tuple[str, ...] = ()
        self._step_was_skipped = False

    @staticmethod
    def _fresh_optimizer_state() -> dict[str, Any]:
        # A staticmethod rather than a lambda: lambdas don't pickle, and neither would the scaler.
        # "counted": whether an update() has already acted on this verdict (see update()).
        # "passthrough": the step DCP runs on all-zero, never-scaled gradients (see unscale_()).
        return {"stage": _Stage.READY, "found_inf": None, "counted": False, "passthrough": False}

    # ----------------------------------------------------------------------------------------
    # torch.amp.GradScaler-compatible accessors
    # ----------------------------------------------------------------------------------------
    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def _scale(self) -> float:
        return self.policy.scale

    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled, like torch). Never syncs."""
        return self.policy.scale if self._enabled else 1.0

    def get_growth_factor(self) -> float:
        return self.policy.growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        self.policy.set_growth_factor(new_factor)

    def get_backoff_factor(self) -> float:
        return self.policy.backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        self.policy.set_backoff_factor(new_factor)

    def get_growth_interval(self) -> int:
        return self.policy.growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        self.policy.set_growth_interval(new_interval)

    @property
    def step_was_skipped(self) -> bool:
        """Whether the most recent optimizer step was skipped because of inf/NaN gradients."""
        return self._step_was_skipped

    @property
    def stats(self) -> ScalerStats:
        policy = self.policy
        return ScalerStats(
            scale=self.get_scale(),
            steps=policy.steps,
            skipped=policy.skipped,
            growths=policy.growths,
            backoffs=policy.backoffs,
            overflow_streak=policy.overflow_streak,
            last_overflow_params=self._last_overflow_params,
            last_forward_overflow_modules=self._last_forward_overflow_modules,
            grad_underflow=None if self._underflow is None else self._underflow.underflow,
            grad_headroom=None if self._underflow is None else self._underflow.headroom,
            underflow_growths=policy.underflow_growths,
            underflow_by_param=dict(self._underflow.by_param) if self._underflow else {},
        )

    @property
    def last_underflow(self) -> UnderflowReading | None:
        """The last :meth:`check_underflow` reading, whole (``None`` before any)."""
        return self._underflow

    def check_underflow(
        self, loss: torch.Tensor, params: nn.Module | Iterable[Any]
    ) -> UnderflowReading:
        """Measure how much of this step's gradient FP16 flushes to zero at the current scale.

        Call it with the step's (unscaled) loss *before* its backward, on the steps you want
        sampled; the backward then runs as usual::

            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(**batch).loss
            if step % 500 == 0:
                reading = scaler.check_underflow(loss, model)   # .underflow, .headroom
            scaler.scale(loss).backward()

        Two extra backward passes on the kept graph (:func:`amp_trainer.underflow.measure_underflow`
        says what is compared); no gradient, RNG stream, buffer or scale is changed, except by
        ``grow_on_underflow=True``, which may grow the scale at once. The figures go into
        :attr:`stats`. Disabled (``enabled=False``), it measures at scale 1: FP16 compute with no
        loss scaling. Under several processes each rank measures its own loss; keep the model
        out of DDP's gradient hooks (``with model.no_sync():``) as no gradient is accumulated.
        """
        reading = measure_underflow(loss, params, self.get_scale())
        self._underflow = reading
        self._say_pitfalls(reading)
        if self._enabled:
            self.policy.on_underflow(reading.underflow, reading.fixing_scale, reading.headroom)
        return reading

    def request_underflow_check(self, params: nn.Module | Iterable[Any]) -> None:
        """Measure :meth:`check_underflow` on the next :meth:`scale` call's loss (for callers
        that do not hold the loss, such as a Trainer callback: Accelerate's ``backward`` hands
        the step's exact loss, gradient-accumulation division included, to ``scale``)."""
        self._underflow_request = params

    @property
    def underflow_recheck_due(self) -> bool:
        """Whether the last reading grew the scale (``grow_on_underflow``): measure again soon."""
        return self.policy.grew_on_underflow_lately

    def _say_pitfalls(self, reading: UnderflowReading) -> None:
        """The seed's two setup mistakes, said once each per scaler, where the meter shows them."""
        found = setup_pitfall(reading, self._enabled)
        if found is not None and found[0] not in self._pitfalls_said:
            self._pitfalls_said.add(found[0])
            logger.warning("%s", found[1])

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """This iteration's overflow verdict for ``optimizer``; ``None`` before :meth:`unscale_`."""
        state = self._per_optimizer.get(id(optimizer))
        return None if state is None else state["found_inf"]

    # ----------------------------------------------------------------------------------------
    # overflow attribution
    # ----------------------------------------------------------------------------------------
    def watch(
        self, model_or_named_parameters: nn.Module | Iterable[tuple[str, torch.Tensor]]
    ) -> DynamicLossScaler:
        """Remember parameter names so overflows can be attributed to them.

        Costs nothing on clean steps: the per-parameter finiteness check runs only on steps whose
        fused check already found an inf/NaN. Returns ``self`` so it chains off the constructor.

        Sharded gradients (FSDP2's DTensors) are checked where they live: each rank looks at its
        own local shards only (no full gradient is gathered). Under ``torch.distributed`` with more
        than one rank, the names found are then gathered (``all_gather_object`` over the scaler's
        ``process_group``, on overflow steps only), so every rank reports the same list in
        :attr:`stats` and in errors, whichever rank's shard held the inf.
        """
        self._param_names.watch(model_or_named_parameters)
        return self

    # ----------------------------------------------------------------------------------------
    # the step protocol
    # ----------------------------------------------------------------------------------------
    def _device_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._device_cache.get(device)
        if cached is None or cached[0] != self._scale:
            scale = torch.full((), self._scale, dtype=torch.float32, device=device)
            # The reciprocal is taken in float64, then rounded, as torch does: an FP32
            # division can be imprecise under some compile options.
            inv_scale = torch.full((), 1.0 / self._scale, dtype=torch.float64).to(torch.float32)
            cached = (self._scale, scale, inv_scale.to(device))
            self._device_cache[device] = cached
        return cached[1], cached[2]

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor (or a list/tuple/iterable of them) by the scale.

        Disabled: returns ``outputs`` itself. The multiplication is by a float32 tensor so that a
        half-precision loss is promoted (``loss * 65536`` in FP16 would already be inf).
        """
        if not self._enabled:
            return outputs
        self._scale_calls += 1
        if self._carried:
            self._drop_carried()
        request, self._underflow_request = self._underflow_request, None
        if request is not None and isinstance(outputs, torch.Tensor) and outputs.requires_grad:
            self.check_underflow(outputs, request)
        if isinstance(outputs, torch.Tensor):
            return outputs * self._device_tensors(outputs.device)[0]
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable):
            return map(self.scale, outputs)
        raise ValueError(
            f"scale() expects a Tensor or an iterable of Tensors, got {type(outputs).__name__}"
        )

    def _drop_carried(self) -> None:
        """A new backward begins: unscaled-but-never-stepped states from before are stale."""
        for key in [k for k, s in self._per_optimizer.items() if s["counted"]]:
            del self._per_optimizer[key]
        self._carried = False

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale and decide whether this step overflowed.

        One fused check-and-divide pass per (device, dtype) group, then the found-inf flags of all
        devices are summed on one device, all-reduced (MAX) across ranks when distributed, and read
        back once: the only device-to-host sync of the step. Call it once per optimizer per step,
        before clipping or inspecting gradients; :meth:`step` calls it if you did not.

        Gradients no :meth:`scale` call produced are refused, unless every one is exactly zero
        (``torch.distributed.checkpoint``'s optimizer-state initialisation): that step passes
        through, and :meth:`update` leaves the scale and every counter as they were.
        """
        if not self._enabled:
            return
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(); "
                "gradients would be divided by the scale twice. Call it once per step, before "
                "step()."
            )
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(); call update() to finish the "
                "iteration first."
            )

        groups, never_scaled = self._gradients(optimizer)
        if never_scaled:
            # All-zero gradients no scale() produced: torch.distributed.checkpoint's
            # _init_optim_state (Accelerate's FSDP2 load_state) steps once with zero grads
            # and lr 0 to create the optimizer state. Zero is the same scaled or not, so the
            # step runs as asked; it is no training step, so update() will not count it and
            # no rank joins a collective for it (every rank runs the same dummy step).
            state.update(found_inf=False, stage=_Stage.UNSCALED, passthrough=True)
            return
        self._unscale_groups(optimizer, state, groups)

    def _gradients(self, optimizer: torch.optim.Optimizer) -> tuple[GradientGroups, bool]:
        """``optimizer``'s gradients by device and dtype, and whether no :meth:`scale` produced
        them (then they must be all zero, :meth:`unscale_` says why); FP16 ones are refused."""
        groups, half_grads = group_gradients(optimizer, self._param_names)
        never_scaled = bool(groups) and self._scale_calls == self._scale_calls_at_unscale.get(
            id(optimizer), 0
        )
        if never_scaled and not all_zero(groups):
            self._raise_unscaled_gradients(optimizer)
        if half_grads:
            raise ValueError(
                "Attempting to unscale FP16 gradients of "
                f"{len(half_grads)} parameter(s): {describe_names(half_grads)}. "
                "Mixed-precision training needs FP32 master weights: keep trainable "
                "parameters in float32 (autocast runs the maths in FP16) - e.g. "
                "amp_trainer.precision.cast_trainable_params_to_fp32(model) - and load "
                "models without dtype=torch.float16 for training."
            )
        return groups, never_scaled

    def _unscale_groups(
        self,
        optimizer: torch.optim.Optimizer,
        state: dict[str, Any],
        groups: GradientGroups,
    ) -> bool:
        """Check and divide ``groups`` (from :meth:`_gradients`) in one fused pass; the verdict."""
        found = check_and_unscale(groups, lambda device: self._device_tensors(device)[1])
        overflow = self._reduce_found_inf(found)
        self._mark_unscaled(optimizer, state, overflow)
        return overflow

    def _mark_unscaled(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any], overflow: bool
    ) -> None:
        state["found_inf"] = overflow
        state["stage"] = _Stage.UNSCALED
        self._scale_calls_at_unscale[id(optimizer)] = self._scale_calls
        is_distributed = distributed(self.process_group)
        if overflow and (self._param_names or self.policy.at_min_scale() or is_distributed):
            # Attribution runs only here, on overflow steps: clean steps pay nothing for it.
            # Distributed, every rank attributes (the verdict is the all-reduced one, so all of
            # them get here together) and joins the gather of the names.
            self._last_overflow_params = non_finite_parameters(
                optimizer, self._param_names, self.process_group if is_distributed else False
            )

    def _raise_unscaled_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """The gradients came from a backward that bypassed :meth:`scale`: refuse to divide them.

        What we can see: no ``scale()`` call at all since this optimizer last unscaled (or ever).
        What we cannot: a plain ``loss.backward()`` in an iteration that also scaled another loss,
        or stale gradients left from an earlier step without ``zero_grad()``.
        """
        raise RuntimeError(
            "The optimizer holds gradients but scaler.scale() was not called since they were "
            "last unscaled (or ever): they were never multiplied by the loss scale "
            f"{self._scale:g} (a plain loss.backward()?), and dividing them by it would apply an "
            "update "
            f"{self._scale:g}x too small. Use scaler.scale(loss).backward() "
            "(accelerator.backward(loss) under Accelerate), or DynamicLossScaler(enabled=False) "
            "for unscaled training."
        )

    def _reduce_found_inf(self, found: list[torch.Tensor]) -> bool:
        return reduce_found_inf(found, self.process_group, self._fallback_device())

    def _fallback_device(self) -> torch.device:
        if self._device_cache:
            return next(iter(self._device_cache))
        if self._device_type == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        *,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """Unscale (unless already done this step), then clip the true gradients.

        Returns the total norm of the unscaled gradients. On an overflow step nothing is clipped
        (the step will be skipped anyway) and the returned norm is ``inf``.

        When this step's gradients are still scaled, both happen in one pass where that is
        exact (:meth:`clip_grad_norm_in_one_pass`), with bit-identical results.
        """
        params = [
            p for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        if self._enabled:
            state = self._per_optimizer[id(optimizer)]
            if state["stage"] is _Stage.READY:
                norm = self.clip_grad_norm_in_one_pass(
                    optimizer, params, max_norm, norm_type, foreach=foreach
                )
                if norm is not None:
                    return norm
                self.unscale_(optimizer)
            elif state["stage"] is _Stage.STEPPED:
                raise RuntimeError(
                    "clip_grad_norm_() is being called after step(); clip before it."
                )
            if state["found_inf"]:
                device = params[0].device if params else torch.device("cpu")
                return torch.full((), math.inf, device=device)
        return nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=foreach)

    def clip_grad_norm_in_one_pass(
        self,
        optimizer: torch.optim.Optimizer,
        params: list[torch.Tensor],
        max_norm: float,
        norm_type: float = 2.0,
        *,
        foreach: bool | None = None,
    ) -> torch.Tensor | None:
        """Unscale ``optimizer``'s still-scaled gradients and clip ``params``' in one pass.

        The gradients are read twice and written once instead of three reads and two writes
        (:func:`~amp_trainer.grad_unscale.one_pass_clip_factor` says why that is exact); with a
        power-of-two scale the result is bit-identical to unscale-then-clip (and to
        ``torch.amp.GradScaler.unscale_`` + ``clip_grad_norm_``), the returned norm included.

        ``params`` are the parameters with gradients, in the order the norm sums them; they
        must be ``optimizer``'s. Returns the norm (``inf`` on an overflow step, nothing
        clipped), or ``None`` without touching anything when the fold would not be exact here
        (:func:`~amp_trainer.grad_unscale.one_pass_is_exact`), or the optimizer was already
        unscaled this step: the caller then unscales and clips as usual. One device-to-host
        read, as for :meth:`unscale_`, all-reduced like the found-inf flag so every rank takes
        the same path; a non-finite scaled norm takes the two-pass path, which tells an inf
        gradient from finite ones whose scaled norm overflows.
        """
        norm_type = float(norm_type)
        state = self._per_optimizer[id(optimizer)]
        if (
            not self._enabled
            or state["stage"] is not _Stage.READY
            or not one_pass_is_exact(self._scale, params, norm_type)
        ):
            return None
        groups, never_scaled = self._gradients(optimizer)
        if never_scaled:  # DCP's all-zero dummy step: unscale_() passes it through
            return None
        grads = [p.grad for p in params]
        inv_scale = self._device_tensors(grads[0].device)[1] if grads else None
        if inv_scale is None:
            return None
        total_norm, factor, unusual = one_pass_clip_factor(
            grads, inv_scale, max_norm, norm_type, foreach
        )
        if self._reduce_found_inf([unusual.float()]):
            if self._unscale_groups(optimizer, state, groups):
                return torch.full((), math.inf, device=total_norm.device)
            return nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=foreach)
        self._mark_unscaled(optimizer, state, False)
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for grad in grads:
            by_device[grad.device].append(grad)
        with torch.no_grad():
            for device, device_grads in by_device.items():
                torch._foreach_mul_(device_grads, factor.to(device))
        return total_norm

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then run ``optimizer.step()`` unless the gradients overflowed.

        On overflow ``optimizer.step()`` is not called at all, for every optimizer kind (fused
        and foreach included): parameters and optimizer state (moments, step counters) stay
        bit-identical, and wrappers that watch ``step()`` see the skip.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs or (args and callable(args[0])):
            raise RuntimeError(
                "step() with a closure is not supported when loss scaling is enabled: the closure "
                "would re-run backward on an unscaled loss."
            )
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        result = None
        if not state["found_inf"]:
            result = optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        if state["passthrough"]:
            return result  # DCP's dummy step: no training step, nothing to report
        # With several optimizers, "skipped" means any of them skipped in this iteration.
        self._step_was_skipped = any(
            s["found_inf"] for s in self._per_optimizer.values() if s["stage"] is _Stage.STEPPED
        )
        return result

    # ----------------------------------------------------------------------------------------
    # the scale policy
    # ----------------------------------------------------------------------------------------
    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Grow, back off or hold the scale after this iteration's steps; then start the next.

        ``new_scale`` sets the scale by hand, as in torch: any positive value float32 can hold;
        explicit ``min_scale``/``max_scale`` refuse values outside them, the default floor moves
        down to a lower ``new_scale``.
        Must come after :meth:`step` for every optimizer used this iteration, or backoff lags a
        step behind the overflow that caused it.
        """
        if not self._enabled:
            return
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if new_scale.numel() != 1:
                    raise ValueError(
                        f"new_scale must hold one element, got shape {tuple(new_scale.shape)}"
                    )
                new_scale = float(new_scale.item())
            self.policy.set_scale(new_scale)
            self._per_optimizer.clear()
            self._carried = False
            return

        states = self._per_optimizer
        dummies = [key for key, s in states.items() if s["passthrough"]]
        for key in dummies:
            del states[key]
        if dummies and not any(s["found_inf"] is not None for s in states.values()):
            # Only torch.distributed.checkpoint's zero-gradient step (see unscale_()) ran since
            # the last update(): no training step happened, so the scale policy has nothing to
            # act on. torch's GradScaler counts it as a clean step (accelerate#4289).
            return
        if not any(s["found_inf"] is not None for s in states.values()):
            raise RuntimeError(
                "update() found no inf checks recorded since the last update(): call "
                "scaler.step(optimizer) (or unscale_) for each optimizer before update()."
            )
        verdicts = [s["found_inf"] for s in states.values() if s["found_inf"] is not None]
        fresh = [
            v for s in states.values() if (v := s["found_inf"]) is not None and not s["counted"]
        ]
        # Accelerate steps and updates one optimizer at a time. An optimizer unscaled (to clip)
        # but not stepped yet keeps its unscaled gradients and verdict for its own step(), so
        # they are not divided twice; its verdict counts in this update only (as in torch, the
        # scale backs off once). A new backward (the next scale() call) drops what is left.
        carried = {
            key: {**s, "counted": True}
            for key, s in states.items()
            if s["stage"] is _Stage.UNSCALED
        }
        states.clear()
        states.update(carried)
        self._carried = bool(carried)
        if not fresh and verdicts:
            # Only verdicts an earlier update() already acted on: nothing new to decide.
            self._step_was_skipped = any(verdicts)
            return
        overflow = any(fresh)
        self._step_was_skipped = overflow
        decision = self.policy.record(overflow)
        if not overflow:
            self._warned_this_streak = False
        elif decision is Decision.TOLERATED:
            logger.debug(
                "Overflow tolerated by hysteresis (%d more allowed) at loss scale %g",
                self.policy.hysteresis_tracker,
                self.policy.scale,
            )
        elif decision is Decision.AT_MIN:
            self._overflow_at_min_scale()

    def _overflow_at_min_scale(self) -> None:
        """An overflow at ``min_scale`` with hysteresis spent: what ``on_min_scale`` says."""
        policy = self.policy
        if policy.on_min_scale == "clamp":
            return
        where = (
            "Parameters with non-finite gradients: "
            f"{describe_names(list(self._last_overflow_params))}."
            if self._last_overflow_params
            else "No gradient was attributed (call scaler.watch(model) to name them)."
        )
        message = (
            f"Gradients overflowed at the minimum loss scale {policy.min_scale:g} "
            f"({policy.overflow_streak} overflowing step(s) in a row). {where} Loss scaling "
            "cannot fix this: the values are inf/NaN before scaling. Next triage step: rerun the "
            "same batch in pure FP32 (`amp-trainer doctor`): if it is NaN there too, the bug is in "
            "the model, data or learning rate; if not, keep the overflowing module in FP32 or "
            "switch to bf16 (or, to let the scale go lower, pass a smaller min_scale)."
        )
        if policy.on_min_scale == "raise":
            raise LossScaleError(message)
        if not self._warned_this_streak:
            logger.warning("%s Skipping steps until the gradients are finite again.", message)
            self._warned_this_streak = True

    def undo_backoff(self, scale: float) -> None:
        """Put back ``scale``, the scale the last step ran with, if :meth:`update` backed off for
        an overflow no loss scale can fix (a forward overflow: the loss was inf/NaN before
        scaling), and take that backoff out of ``stats.backoffs``. The step stays skipped and
        counted as such. Does nothing when the scale did not go down."""
        if self._enabled and self.policy.undo_backoff(scale):
            # As update(new_scale=...): a scale set between iterations starts the next afresh.
            self._per_optimizer.clear()
            self._carried = False

    def record_forward_overflow(self, modules: Iterable[str]) -> None:
        """The step just skipped was a forward overflow in ``modules`` (what
        :class:`~amp_trainer.forward_overflow.ForwardOverflowGuard` found): they become
        ``stats.last_forward_overflow_modules`` (kept when ``modules`` is empty: none found),
        and ``stats.last_overflow_params``, which would list every parameter, is emptied."""
        names = tuple(modules)
        if names:
            self._last_forward_overflow_modules = names
        self._last_overflow_params = ()

    # ----------------------------------------------------------------------------------------
    # checkpointing
    # ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every piece of state as plain Python numbers/strings (``weights_only=True``-safe).

        The first five keys are torch.amp.GradScaler's, with the same meaning, so checkpoints
        move between the two scalers. Empty when disabled, as torch's.
        """
        if not self._enabled:
            return {}
        return {
            **self.policy.state_dict(),
            "last_overflow_params": list(self._last_overflow_params),
            "last_forward_overflow_modules": list(self._last_forward_overflow_modules),
            "version": _STATE_VERSION,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (ours or torch.amp.GradScaler's).

        Everything is validated before anything is assigned: a malformed dict raises and leaves
        the scaler exactly as it was.
        """
        if not self._enabled:
            return
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"load_state_dict() expects a mapping, got {type(state_dict).__name__}")
        if len(state_dict) == 0:
            raise RuntimeError(
                "The source state dict is empty, possibly because it was saved from a disabled "
                "scaler (enabled=False)."
            )
        version = state_dict.get("version", _STATE_VERSION)
        if isinstance(version, bool) or not isinstance(version, int) or version > _STATE_VERSION:
            raise ValueError(
                f"scaler state 'version' {version!r} is newer than this amp-trainer reads "
                f"(versions up to {_STATE_VERSION}): upgrade amp-trainer to resume it"
            )
        # torch's state dict may hold 1-element tensors where ours holds numbers.
        plain = {
            key: value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            for key, value in state_dict.items()
        }
        names = {
            key: plain.get(key, [])
            for key in ("last_overflow_params", "last_forward_overflow_modules")
        }
        for key, value in names.items():
            if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
                raise TypeError(f"scaler state {key!r} must be a list of str, got {value!r}")
        self.policy = self.policy.restored(plain)  # validates everything, raises before this
        self._last_overflow_params = tuple(names["last_overflow_params"])
        self._last_forward_overflow_modules = tuple(names["last_forward_overflow_modules"])
        self._per_optimizer.clear()
        self._carried = False
        self._device_cache.clear()

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Create the scale tensors on ``dev`` now (torch's private name for it).

        Accelerate's FSDP2 ``load_state`` calls this torch-private method right after
        ``load_state_dict`` (accelerate 1.15, ``Accelerator.load_state``); without it, resuming
        an FSDP2 run with our scaler would raise ``AttributeError``.
        """
        if self._enabled:
            self._device_tensors(torch.device(dev))

    @property
    def _device(self) -> str:  # read by the same Accelerate code path
        return self._device_type

    def __getstate__(self) -> dict[str, Any]:
        # Mid-iteration (after unscale_/step, before update) the copy could not know which
        # gradients are already unscaled and would divide them again: refuse, as torch does.
        if self._enabled and any(
            s["stage"] is not _Stage.READY for s in self._per_optimizer.values()
        ):
            raise RuntimeError(
                "A DynamicLossScaler may only be pickled or deep-copied at the beginning of an "
                "iteration or after scaler.update(), not between unscale_()/step() and update() "
                "(nor while an optimizer unscaled before another's update() awaits its step())."
            )
        # Device tensors, the process group and everything keyed by object id are runtime-only:
        # a pickled scaler (e.g. sent to a worker) starts its next iteration fresh.
        state = self.__dict__.copy()
        state["_device_cache"] = {}
        state["_per_optimizer"] = defaultdict(self._fresh_optimizer_state)
        state["process_group"] = None
        state["_param_names"] = ParameterNames()
        state["_scale_calls_at_unscale"] = {}
        state["_carried"] = False
        return state

    def __repr__(self) -> str:
        if not self._enabled:
            return f"{type(self).__name__}(enabled=False)"
        return f"{type(self).__name__}({repr(self.policy).partition('(')[2]}"

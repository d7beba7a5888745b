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
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from amp_trainer.amp_scaling_optimizers import declares_amp_scaling, step_declaring_amp_scaling
from amp_trainer.grad_unscale import (
    GradientGroups,
    ScaleTensors,
    all_zero,
    check_and_unscale,
    distributed,
    group_gradients,
    half_gradients_error,
    one_pass_is_exact,
    reduce_found_inf,
    unscale_and_clip_,
)
from amp_trainer.numerics import describe_names
from amp_trainer.optimizer_stages import (
    OptimizerStage,
    OptimizerStages,
    Stage,
    refuse_closure,
    unscaled_gradients_error,
)
from amp_trainer.overflow_attribution import OverflowAttribution
from amp_trainer.precision_guard import PrecisionGuard, guard_for
from amp_trainer.scale_policy import Decision, ScalePolicy
from amp_trainer.scaler_state import STATE_VERSION, ScalerStats, read_state
from amp_trainer.underflow import UnderflowChecks, UnderflowReading

__all__ = ["DynamicLossScaler", "LossScaleError", "ScalerStats"]

logger = logging.getLogger(__name__)


class LossScaleError(FloatingPointError, RuntimeError):
    """Gradients kept overflowing at the minimum loss scale: FP16 cannot represent this run.

    A ``FloatingPointError`` so that code catching the stdlib's numeric failures catches it too.
    """


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
        self._underflow = UnderflowChecks(logger)
        self._attribution = OverflowAttribution()
        self._warned_this_streak = False
        self._step_was_skipped = False
        # The step protocol's per-optimizer stages (READY/UNSCALED/STEPPED) and verdicts.
        self._stages = OptimizerStages()
        self._device_cache = ScaleTensors()  # the scale as device tensors, made lazily
        self.precision_guard: PrecisionGuard | None = None  # set by watch(model)

    # ----------------------------------------------------------------------------------------
    # torch.amp.GradScaler-compatible accessors; telemetry; attribution by name
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
        """A snapshot of the counters, the last overflow's names and the last underflow reading."""
        return ScalerStats.of(self.get_scale(), self.policy, self._attribution, self.last_underflow)

    @property
    def last_underflow(self) -> UnderflowReading | None:
        """The last :meth:`check_underflow` reading, whole (``None`` before any)."""
        return self._underflow.last

    def check_underflow(
        self, loss: torch.Tensor, params: nn.Module | Iterable[Any]
    ) -> UnderflowReading:
        """Measure how much of this step's gradient FP16 flushes to zero at the current scale:
        call it with the step's (unscaled) loss *before* its backward, on the steps you want
        sampled (:class:`~amp_trainer.underflow.UnderflowChecks` shows how, and what it costs).
        The figures go into :attr:`stats`; ``grow_on_underflow=True`` may grow the scale at once.
        Distributed, a collective (every rank, same step): counts combined, one decision."""
        scale, group = self.get_scale(), self.process_group
        reading = self._underflow.measure(loss, params, scale, self._enabled, group)
        if self._enabled:
            self._underflow.grow_if_flushed(reading, self.policy)
        return reading

    def request_underflow_check(self, params: nn.Module | Iterable[Any]) -> None:
        """Measure :meth:`check_underflow` on the next :meth:`scale` call's loss: for callers
        without the loss (a Trainer callback); ``scale`` gets the step's exact loss."""
        self._underflow.requested = params

    @property
    def underflow_recheck_due(self) -> bool:
        """Whether the last reading grew the scale (``grow_on_underflow``): measure again soon."""
        return self.policy.grew_on_underflow_lately

    def found_inf(self, optimizer: torch.optim.Optimizer) -> bool | None:
        """This iteration's overflow verdict for ``optimizer``; ``None`` before :meth:`unscale_`."""
        return self._stages.found_inf(optimizer)

    def watch(
        self, model_or_named_parameters: nn.Module | Iterable[tuple[str, torch.Tensor]]
    ) -> DynamicLossScaler:
        """Name parameters in overflow reports (:attr:`stats`, errors; free on clean steps, the
        same on every rank: :class:`~amp_trainer.overflow_attribution.OverflowAttribution`);
        given a model, also guard its dtypes (:attr:`precision_guard`). Returns ``self``."""
        self._attribution.names.watch(model_or_named_parameters)
        self.precision_guard = guard_for(model_or_named_parameters, self)
        return self

    # ----------------------------------------------------------------------------------------
    # the step protocol
    # ----------------------------------------------------------------------------------------
    def _device_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self._device_cache.on(device, self._scale)

    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor (or a list/tuple/iterable of them) by the scale.

        Disabled: returns ``outputs`` itself. The multiplication is by a float32 tensor so that a
        half-precision loss is promoted (``loss * 65536`` in FP16 would already be inf).
        """
        if not self._enabled:
            return outputs
        self._stages.scaled()
        request = self._underflow.take_request()
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
        state = self._stages.of(optimizer)
        self._stages.check_unscale(state)
        groups, never_scaled = self._gradients(optimizer)
        if never_scaled:  # all zero, so DCP's dummy step (OptimizerStages.passed_through)
            self._stages.passed_through(state)
            return
        self._unscale_groups(optimizer, state, groups)

    def _gradients(self, optimizer: torch.optim.Optimizer) -> tuple[GradientGroups, bool]:
        """``optimizer``'s gradients by device and dtype, and whether no :meth:`scale` produced
        them (then they must be all zero, :meth:`unscale_` says why); FP16 ones are refused."""
        if self.precision_guard is not None:  # a cast's cause named before FP16 grads are refused
            self.precision_guard.check_before_unscale(optimizer)
        groups, half_grads = group_gradients(optimizer, self._attribution.names)
        never_scaled = bool(groups) and self._stages.never_scaled(optimizer)
        if never_scaled and not all_zero(groups):
            raise unscaled_gradients_error(self._scale)
        if half_grads:
            raise half_gradients_error(half_grads)
        return groups, never_scaled

    def _unscale_groups(
        self,
        optimizer: torch.optim.Optimizer,
        state: OptimizerStage,
        groups: GradientGroups,
    ) -> bool:
        """Check and divide ``groups`` (from :meth:`_gradients`) in one fused pass; the verdict."""
        found = check_and_unscale(groups, lambda device: self._device_tensors(device)[1])
        overflow = self._reduce_found_inf(found)
        self._mark_unscaled(optimizer, state, overflow)
        return overflow

    def _mark_unscaled(
        self, optimizer: torch.optim.Optimizer, state: OptimizerStage, overflow: bool
    ) -> None:
        self._stages.unscaled(optimizer, state, overflow)
        if overflow:  # attribution runs only here: clean steps pay nothing for it
            self._attribution.attribute(
                optimizer,
                self.process_group,
                distributed=distributed(self.process_group),
                needed=self.policy.at_min_scale(),
            )

    def _reduce_found_inf(self, found: list[torch.Tensor]) -> bool:
        fallback = self._device_cache.any_device(self._device_type)
        return reduce_found_inf(found, self.process_group, fallback)

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
            state = self._stages.of(optimizer)
            if state.stage is Stage.READY:
                norm = self.clip_grad_norm_in_one_pass(
                    optimizer, params, max_norm, norm_type, foreach=foreach
                )
                if norm is not None:
                    return norm
                self.unscale_(optimizer)
            elif state.stage is Stage.STEPPED:
                raise RuntimeError(
                    "clip_grad_norm_() is being called after step(); clip before it."
                )
            if state.found_inf:
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
        """Unscale ``optimizer``'s still-scaled gradients and clip ``params``' in one pass,
        bit-identical to unscale-then-clip (:func:`~amp_trainer.grad_unscale.unscale_and_clip_`
        says how and why).

        ``params`` are the parameters with gradients, in the order the norm sums them; they
        must be ``optimizer``'s. Returns the norm (``inf`` on an overflow step, nothing
        clipped), or ``None`` without touching anything when the fold would not be exact here
        (:func:`~amp_trainer.grad_unscale.one_pass_is_exact`), or the optimizer was already
        unscaled this step: the caller then unscales and clips as usual.
        """
        norm_type = float(norm_type)
        state = self._stages.of(optimizer)
        if (
            not self._enabled
            or state.stage is not Stage.READY
            or not one_pass_is_exact(self._scale, params, norm_type)
        ):
            return None
        groups, never_scaled = self._gradients(optimizer)
        if never_scaled:  # DCP's all-zero dummy step: unscale_() passes it through
            return None
        if not params:
            return None
        inv_scale = self._device_tensors(params[0].grad.device)[1]
        clip = (max_norm, norm_type, foreach)
        total_norm = unscale_and_clip_(params, inv_scale, *clip, self._reduce_found_inf)
        if total_norm is None:  # an inf/NaN, or a scaled norm that overflows: two passes tell
            if self._unscale_groups(optimizer, state, groups):
                return torch.full((), math.inf, device=params[0].grad.device)
            return nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, foreach=foreach)
        self._mark_unscaled(optimizer, state, False)
        return total_norm

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale if needed, then run ``optimizer.step()`` unless the gradients overflowed.

        On overflow ``optimizer.step()`` is not called at all, for every optimizer kind (fused
        and foreach included): parameters and optimizer state (moments, step counters) stay
        bit-identical, and wrappers that watch ``step()`` see the skip. An optimizer that skips
        itself (torch's ``_step_supports_amp_scaling``) is stepped as it asks
        (:mod:`~amp_trainer.amp_scaling_optimizers`).
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        refuse_closure(args, kwargs)
        state = self._stages.of(optimizer)
        if state.stage is Stage.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        if state.stage is Stage.READY:
            self.unscale_(optimizer)
        if declares_amp_scaling(optimizer):  # it skips itself: called on every iteration
            result = step_declaring_amp_scaling(optimizer, bool(state.found_inf), *args, **kwargs)
        else:
            result = None if state.found_inf else optimizer.step(*args, **kwargs)
        skipped = self._stages.stepped(state)
        if not state.passthrough:  # DCP's dummy step: no training step, nothing to report
            self._step_was_skipped = skipped
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
            self.policy.set_scale(_plain_scale(new_scale))
            self._stages.reset()
            return
        settled = self._stages.settle()
        if settled is None:
            return
        self._step_was_skipped = overflow = settled.overflow
        if not settled.fresh:  # only verdicts an earlier update() already acted on
            return
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
        if self.policy.on_min_scale == "clamp":
            return
        message = _min_scale_message(self.policy, self._attribution.last_params)
        if self.policy.on_min_scale == "raise":
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
            self._stages.reset()  # as update(new_scale=...): the next iteration starts afresh

    def record_forward_overflow(self, modules: Iterable[str]) -> None:
        """The step just skipped was a forward overflow in ``modules`` (what
        :class:`~amp_trainer.forward_overflow.ForwardOverflowGuard` found): they become
        ``stats.last_forward_overflow_modules`` (kept when ``modules`` is empty: none found),
        and ``stats.last_overflow_params``, which would list every parameter, is emptied."""
        self._attribution.forward_overflow(modules)

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
            **self._attribution.state_dict(),
            "version": STATE_VERSION,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output (ours or torch.amp.GradScaler's).

        Everything is validated before anything is assigned: a malformed dict raises and leaves
        the scaler exactly as it was.
        """
        if not self._enabled:
            return
        plain, names = read_state(state_dict)
        self.policy = self.policy.restored(plain)  # validates everything, raises before this
        self._attribution.load_state_dict(names)
        self._stages.reset()
        self._device_cache.clear()

    def _lazy_init_scale_growth_tracker(self, dev: torch.device | str) -> None:
        """Create the scale tensors on ``dev`` now (torch's private name for it).

        Accelerate's FSDP2 ``load_state`` calls this torch-private method right after
        ``load_state_dict`` (accelerate 1.10 to 1.15, ``Accelerator.load_state``; 1.16 no
        longer does); without it, resuming an FSDP2 run with our scaler there would raise
        ``AttributeError``.
        """
        if self._enabled:
            self._device_tensors(torch.device(dev))

    @property
    def _device(self) -> str:  # read by the same Accelerate code path
        return self._device_type

    def __getstate__(self) -> dict[str, Any]:
        if self._enabled:
            self._stages.check_copyable()
        # Device tensors, the process group and everything keyed by object id are runtime-only:
        # a pickled scaler (e.g. sent to a worker) starts its next iteration fresh.
        state = self.__dict__.copy()
        state["_device_cache"] = ScaleTensors()
        state["_stages"] = self._stages.for_copy()
        state["process_group"] = state["precision_guard"] = None  # runtime-only, like the group
        state["_attribution"] = self._attribution.for_copy()
        return state

    def __repr__(self) -> str:
        if not self._enabled:
            return f"{type(self).__name__}(enabled=False)"
        return f"{type(self).__name__}({repr(self.policy).partition('(')[2]}"


def _plain_scale(new_scale: float | torch.Tensor) -> float:
    """``update(new_scale)``'s value as a float; a tensor must hold one element (as torch's)."""
    if isinstance(new_scale, torch.Tensor):
        if new_scale.numel() != 1:
            raise ValueError(f"new_scale must hold one element, got shape {tuple(new_scale.shape)}")
        return float(new_scale.item())
    return new_scale


def _min_scale_message(policy: ScalePolicy, params: tuple[str, ...]) -> str:
    """Why the scale cannot go lower, which parameters overflowed, and the next triage step."""
    where = (
        f"Parameters with non-finite gradients: {describe_names(list(params))}."
        if params
        else "No gradient was attributed (call scaler.watch(model) to name them)."
    )
    return (
        f"Gradients overflowed at the minimum loss scale {policy.min_scale:g} "
        f"({policy.overflow_streak} overflowing step(s) in a row). {where} Loss scaling "
        "cannot fix this: the values are inf/NaN before scaling. Next triage step: rerun the "
        "same batch in pure FP32 (`amp-trainer doctor`): if it is NaN there too, the bug is in "
        "the model, data or learning rate; if not, keep the overflowing module in FP32 or "
        "switch to bf16 (or, to let the scale go lower, pass a smaller min_scale)."
    )

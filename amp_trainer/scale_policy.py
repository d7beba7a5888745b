"""ScalePolicy: when the loss scale grows, backs off or holds, as plain numbers.

torch's ``grad_scaler.py`` keeps the per-optimizer protocol (unscale, step) in the class and the
whole grow/back-off rule in one call that nothing else touches (``_amp_update_scale_``). Ours is
richer (hysteresis, bounds, what an overflow at the floor does), so it gets a small object of its
own: no tensors, no device, no optimizer; each :class:`~amp_trainer.scaler.DynamicLossScaler`
``update()`` hands it one verdict (did this iteration overflow?) and reads back the scale. It is
testable with plain numbers, checkpointed as plain numbers, and validated in one place.

The scale is kept as the float32 value torch's 1-element scale tensor would hold, so that with
the default arguments every decision and every scale equals ``torch.amp.GradScaler``'s.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from enum import Enum
from typing import Any

__all__ = ["UNDERFLOW_TARGET", "Decision", "ScalePolicy"]

#: The share of a gradient flushed to zero that counts as "about none" (0.1 %): the two-sided
#: rule grows above it, and the underflow meter's fixing scale aims below it.
UNDERFLOW_TARGET = 1e-3

ON_MIN_SCALE = ("raise", "warn", "clamp")
# The floor when min_scale is not given (lowered to init_scale when that is smaller).
_DEFAULT_MIN_SCALE = 1.0
_F32_MAX = struct.unpack("f", struct.pack("I", 0x7F7FFFFF))[0]
_F32_TINY = struct.unpack("f", struct.pack("I", 0x00000001))[0]  # smallest subnormal
# What a policy's state_dict holds: the keys of torch.amp.GradScaler's first, then ours.
_CONFIG_KEYS = (
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "hysteresis",
    "consecutive_hysteresis",
    "min_scale",
    "max_scale",
    "on_min_scale",
    "grow_on_underflow",
)
_COUNTER_KEYS = (
    "_growth_tracker",
    "steps",
    "skipped",
    "growths",
    "backoffs",
    "overflow_streak",
    "underflow_growths",
)


def f32(value: float) -> float:
    """Round a Python float to the nearest float32, as torch's 1-element scale tensor stores it."""
    return struct.unpack("f", struct.pack("f", value))[0]


def positive_finite(name: str, value: Any) -> float:
    """``value`` as a float, if it is a finite number > 0; else an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {value!r} ({type(value).__name__})")
    value = float(value)
    if not math.isfinite(value) or value <= 0.0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def scale_value(name: str, value: Any) -> float:
    """A positive finite number that stays positive and finite once stored as float32."""
    value = positive_finite(name, value)
    if not 0.0 < f32(value) < math.inf:
        raise ValueError(
            f"{name} must be representable in float32, where the scale is stored: between "
            f"{_F32_TINY!r} and {_F32_MAX!r}, got {value!r}"
        )
    return value


def _growth_factor(value: Any) -> float:
    value = positive_finite("growth_factor", value)
    if value <= 1.0:
        raise ValueError(f"growth_factor must be > 1.0, got {value!r}")
    return value


def _backoff_factor(value: Any) -> float:
    value = positive_finite("backoff_factor", value)
    if not value < 1.0:
        raise ValueError(f"backoff_factor must be in the open interval (0, 1), got {value!r}")
    return value


def int_at_least_one(name: str, value: Any) -> int:
    """``value`` if it is an int >= 1; else an error naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= 1, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


class Decision(Enum):
    """What one :meth:`ScalePolicy.record` did with the scale."""

    HELD = "held"  # a clean step, not yet growth_interval of them
    GREW = "grew"
    TOLERATED = "tolerated"  # an overflow hysteresis absorbed: skipped, scale kept
    BACKED_OFF = "backed_off"
    AT_MIN = "at_min"  # an overflow at min_scale: the caller applies on_min_scale


class ScalePolicy:
    """The dynamic loss-scale rule: grow after ``growth_interval`` clean steps, back off on the
    ``hysteresis``-th overflow, stay within ``[min_scale, max_scale]``.

    Arguments are :class:`~amp_trainer.scaler.DynamicLossScaler`'s (which documents each). Every
    knob is validated before any attribute is set, so a bad value changes nothing; bounds are
    compared in float32, as the scale is stored (a scale clamped to ``min_scale=0.7`` is the
    float32 0.699999988..., and must still count as inside).

    >>> policy = ScalePolicy(init_scale=8.0, growth_interval=2)
    >>> [policy.record(overflow).value for overflow in (False, False, True)], policy.scale
    (['held', 'grew', 'backed_off'], 8.0)
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: float | None = None,
        max_scale: float | None = None,
        on_min_scale: str = "raise",
        grow_on_underflow: bool = False,
    ) -> None:
        if not isinstance(grow_on_underflow, bool):
            raise TypeError(f"grow_on_underflow must be a bool, got {grow_on_underflow!r}")
        init_scale = scale_value("init_scale", init_scale)
        growth_factor = _growth_factor(growth_factor)
        backoff_factor = _backoff_factor(backoff_factor)
        growth_interval = int_at_least_one("growth_interval", growth_interval)
        hysteresis = int_at_least_one("hysteresis", hysteresis)
        min_is_default = min_scale is None
        if min_scale is None:
            # torch accepts any positive init_scale (1e-4 included); a default floor above it
            # would refuse that. The floor is 1.0, or where the user started if lower.
            min_scale = min(_DEFAULT_MIN_SCALE, init_scale)
        min_scale = scale_value("min_scale", min_scale)
        if max_scale is not None:
            max_scale = scale_value("max_scale", max_scale)
            if f32(min_scale) > f32(max_scale):
                raise ValueError(
                    f"min_scale must be <= max_scale, got min_scale={min_scale!r} > "
                    f"max_scale={max_scale!r}"
                )
        upper = _F32_MAX if max_scale is None else max_scale
        if not f32(min_scale) <= f32(init_scale) <= f32(upper):
            raise ValueError(
                f"init_scale must lie in [min_scale, max_scale] = [{min_scale!r}, {max_scale!r}] "
                f"(compared in float32), got {init_scale!r}"
            )
        if on_min_scale not in ON_MIN_SCALE:
            raise ValueError(f"on_min_scale must be one of {ON_MIN_SCALE}, got {on_min_scale!r}")

        self.init_scale = init_scale
        self.scale = f32(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.min_scale = min_scale
        self.min_scale_is_default = min_is_default
        self.max_scale = max_scale
        self.on_min_scale = on_min_scale
        self.grow_on_underflow = grow_on_underflow
        # The lowest scale that overflowed soon after an underflow growth: growth for
        # underflow stays below it, so underflow is never traded for a run of overflows.
        self.underflow_ceiling: float | None = None
        self._underflow_grown_at: int | None = None  # ``steps`` at the last underflow growth
        self.growth_tracker = 0
        self.hysteresis_tracker = hysteresis
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero what the policy counts (``steps`` ... ``overflow_streak``); the scale stays."""
        self.steps = 0
        self.skipped = 0
        self.growths = 0
        self.backoffs = 0
        self.overflow_streak = 0
        self.underflow_growths = 0

    # ----------------------------------------------------------------------------------------
    # the rule
    # ----------------------------------------------------------------------------------------
    @property
    def upper(self) -> float:
        """``max_scale`` as a number; no bound is float32's largest value."""
        return _F32_MAX if self.max_scale is None else self.max_scale

    def at_min_scale(self) -> bool:
        return self.scale <= f32(self.min_scale)

    def record(self, overflow: bool) -> Decision:
        """Act on one iteration's verdict: a clean step or an overflowing (skipped) one."""
        self.steps += 1
        if not overflow:
            return self._on_clean_step()
        self.skipped += 1
        self.overflow_streak += 1
        grown = self._underflow_grown_at
        if grown is not None and self.steps - grown <= self.growth_interval:
            # This scale came from underflow growth and overflowed: never grow back to it.
            ceiling = self.underflow_ceiling
            self.underflow_ceiling = self.scale if ceiling is None else min(ceiling, self.scale)
            self._underflow_grown_at = None
        self.growth_tracker = 0
        self.hysteresis_tracker = max(self.hysteresis_tracker - 1, 0)
        if self.hysteresis_tracker > 0:
            return Decision.TOLERATED
        if self.at_min_scale():
            return Decision.AT_MIN
        self.scale = max(f32(self.scale * self.backoff_factor), f32(self.min_scale))
        self.backoffs += 1
        return Decision.BACKED_OFF

    def _on_clean_step(self) -> Decision:
        self.overflow_streak = 0
        if self.consecutive_hysteresis:
            self.hysteresis_tracker = self.hysteresis
        self.growth_tracker += 1
        if self.growth_tracker < self.growth_interval:
            return Decision.HELD
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis
        grown = f32(self.scale * self.growth_factor)
        if self.max_scale is not None:
            grown = min(grown, f32(self.max_scale))
        # Like torch, never grow into float32's inf; at max_scale there is nothing to grow.
        if not (math.isfinite(grown) and grown > self.scale):
            return Decision.HELD
        self.scale = grown
        self.growths += 1
        return Decision.GREW

    @property
    def grew_on_underflow_lately(self) -> bool:
        """Whether the two-sided rule grew the scale during the last or the current step."""
        grown = self._underflow_grown_at
        return grown is not None and self.steps - grown <= 1

    def on_underflow(
        self, underflow: float | None, fixing_scale: float | None, headroom: float | None
    ) -> bool:
        """The two-sided rule (``grow_on_underflow``): grow now, not after ``growth_interval``
        clean steps, when a share above :data:`UNDERFLOW_TARGET` of the
        gradient is flushed to zero and the headroom leaves room. Returns whether it grew.

        The new scale is the meter's ``fixing_scale``, kept one doubling inside the headroom,
        below ``max_scale`` and below any scale that overflowed after an earlier underflow
        growth. Off (the default), the rule is torch's, step for step.
        """
        if not self.grow_on_underflow or underflow is None or fixing_scale is None:
            return False
        if underflow <= UNDERFLOW_TARGET:
            return False
        target = fixing_scale
        if headroom is not None:
            target = min(target, self.scale * 2.0 ** (math.floor(headroom) - 1))
        if self.underflow_ceiling is not None:
            target = min(target, self.underflow_ceiling / self.growth_factor)
        target = f32(min(target, self.upper))
        if not (math.isfinite(target) and target > self.scale):
            return False
        self.scale = target
        self.growth_tracker = 0
        self.underflow_growths += 1
        self._underflow_grown_at = self.steps
        return True

    # ----------------------------------------------------------------------------------------
    # setting knobs by hand (torch's set_* and update(new_scale))
    # ----------------------------------------------------------------------------------------
    def set_scale(self, value: Any) -> None:
        """``update(new_scale)``: any positive value float32 holds; explicit bounds refuse values
        outside them, the default floor moves down to a lower value (as for ``init_scale``)."""
        value = scale_value("new_scale", value)
        if self.min_scale_is_default and f32(value) < f32(self.min_scale):
            self.min_scale = value
        if not f32(self.min_scale) <= f32(value) <= f32(self.upper):
            raise ValueError(
                f"new_scale must lie in [min_scale, max_scale] = [{self.min_scale!r}, "
                f"{self.max_scale!r}] (the bounds this scaler was built with), got {value!r}"
            )
        self.scale = f32(value)

    def undo_backoff(self, scale: float) -> bool:
        """Put back ``scale``, the scale before the last :meth:`record` backed off, and take that
        backoff out of :attr:`backoffs`: for an overflow no loss scale can fix (the loss was
        already inf/NaN before scaling). The step stays counted in :attr:`skipped` and
        :attr:`overflow_streak`, and a tolerated overflow (hysteresis) stays used up.

        Does nothing when the scale is not below ``scale`` (nothing was backed off: hysteresis
        tolerated the overflow, or the scale was at its floor); returns whether it undid one.
        """
        if f32(self.scale) >= f32(scale):
            return False
        self.set_scale(scale)
        self.backoffs = max(self.backoffs - 1, 0)  # 0: a scale lowered by hand, not backed off
        return True

    def set_growth_factor(self, value: float) -> None:
        self.growth_factor = _growth_factor(value)

    def set_backoff_factor(self, value: float) -> None:
        self.backoff_factor = _backoff_factor(value)

    def set_growth_interval(self, value: int) -> None:
        self.growth_interval = int_at_least_one("growth_interval", value)

    # ----------------------------------------------------------------------------------------
    # checkpointing
    # ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The policy as plain numbers; the first five keys are torch.amp.GradScaler's."""
        return {
            "scale": self.scale,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "_growth_tracker": self.growth_tracker,
            "hysteresis": self.hysteresis,
            "consecutive_hysteresis": self.consecutive_hysteresis,
            "_hysteresis_tracker": self.hysteresis_tracker,
            "min_scale": self.min_scale,
            "min_scale_is_default": self.min_scale_is_default,
            "max_scale": self.max_scale,
            "on_min_scale": self.on_min_scale,
            "steps": self.steps,
            "skipped": self.skipped,
            "growths": self.growths,
            "backoffs": self.backoffs,
            "overflow_streak": self.overflow_streak,
            "grow_on_underflow": self.grow_on_underflow,
            "underflow_ceiling": self.underflow_ceiling,
            "underflow_growths": self.underflow_growths,
        }

    def restored(self, state: Mapping[str, Any]) -> ScalePolicy:
        """A new policy from :meth:`state_dict` output (ours or torch.amp.GradScaler's), with
        this policy's knobs for the keys ``state`` lacks; ``self`` is not changed, so a bad state
        (which raises, naming the key) leaves the caller's policy as it was.

        torch's state dicts carry no bounds: this policy's are kept, widened to hold the scale.
        """
        missing = [k for k in ("scale", "_growth_tracker") if k not in state]
        if missing:
            raise KeyError(
                f"scaler state dict lacks {missing}; it holds {sorted(state)}. Expected the "
                "output of DynamicLossScaler.state_dict() or torch.amp.GradScaler.state_dict()."
            )
        scale = state["scale"]
        knobs = {key: state.get(key, getattr(self, key)) for key in _CONFIG_KEYS}
        if "min_scale" not in state:
            knobs["min_scale"] = min(self.min_scale, positive_finite("scale", scale))
        if "max_scale" not in state and self.max_scale is not None:
            knobs["max_scale"] = max(self.max_scale, positive_finite("scale", scale))
        policy = ScalePolicy(init_scale=scale, **knobs)

        counters = {k: state.get(k, 0) for k in _COUNTER_KEYS}
        counters["_hysteresis_tracker"] = state.get("_hysteresis_tracker", policy.hysteresis)
        for key, value in counters.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"scaler state {key!r} must be an int, got {value!r}")
            if value < 0:
                raise ValueError(f"scaler state {key!r} must be >= 0, got {value!r}")
        if counters["skipped"] > counters["steps"]:
            # Every skipped step is a step: a state saying otherwise was edited or damaged.
            raise ValueError(
                f"scaler state 'skipped' must be <= 'steps' ({counters['steps']}), got "
                f"{counters['skipped']}"
            )
        if counters["_hysteresis_tracker"] > policy.hysteresis:
            raise ValueError(
                f"scaler state '_hysteresis_tracker' must be <= hysteresis ({policy.hysteresis}), "
                f"got {counters['_hysteresis_tracker']}"
            )
        if counters["_growth_tracker"] >= policy.growth_interval:
            raise ValueError(
                f"scaler state '_growth_tracker' must be < growth_interval "
                f"({policy.growth_interval}), got {counters['_growth_tracker']}"
            )
        min_is_default = state.get(
            "min_scale_is_default", self.min_scale_is_default and "min_scale" not in state
        )
        if not isinstance(min_is_default, bool):
            raise TypeError(
                f"scaler state 'min_scale_is_default' must be a bool, got {min_is_default!r}"
            )

        policy.min_scale_is_default = min_is_default
        policy.growth_tracker = counters["_growth_tracker"]
        policy.hysteresis_tracker = counters["_hysteresis_tracker"]
        policy.steps = counters["steps"]
        policy.skipped = counters["skipped"]
        policy.growths = counters["growths"]
        policy.backoffs = counters["backoffs"]
        policy.overflow_streak = counters["overflow_streak"]
        policy.underflow_growths = counters["underflow_growths"]
        ceiling = state.get("underflow_ceiling")
        if ceiling is not None:
            policy.underflow_ceiling = scale_value("underflow_ceiling", ceiling)
        return policy

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(scale={self.scale:g}, growth_factor={self.growth_factor:g}, "
            f"backoff_factor={self.backoff_factor:g}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis}, min_scale={self.min_scale:g}, "
            f"max_scale={self.max_scale!r}, on_min_scale={self.on_min_scale!r}"
            + (", grow_on_underflow=True)" if self.grow_on_underflow else ")")
        )

"""DeepSpeed's own loss scaler, configured with amp-trainer's knobs.

DeepSpeed scales the loss inside its engine, so neither :class:`~amp_trainer.AmpAccelerator` nor
:class:`~amp_trainer.AmpTrainer` installs a :class:`~amp_trainer.scaler.DynamicLossScaler` under
it. :func:`deepspeed_fp16_config` writes the same knobs as DeepSpeed's ``"fp16"`` config section
instead, from keyword arguments or (``deepspeed_fp16_config.from_training_args``) from an
:class:`~amp_trainer.training_args.AmpTrainingArguments`' ``loss_scale_*`` fields.
"""

from __future__ import annotations

import math
from typing import Any

from amp_trainer.training_args import AmpTrainingArguments, in_field_names

__all__ = ["deepspeed_fp16_config"]


def _power_of_two_exponent(value: float) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"init_scale must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 1.0):
        raise ValueError(f"init_scale must be a finite power of two >= 1, got {value!r}")
    mantissa, exponent = math.frexp(value)
    if mantissa != 0.5:
        raise ValueError(
            f"init_scale must be a power of two (DeepSpeed stores it as initial_scale_power), got "
            f"{value!r}; nearest: {2.0 ** round(math.log2(value))!r}"
        )
    return exponent - 1


def _whole_min_scale(min_scale: Any, init_scale: float) -> int:
    """DeepSpeed's parser wants an integer ``min_loss_scale`` (it rejects 0.5): a whole number."""
    if min_scale is None:
        return 1  # our default floor (1.0; init_scale is >= 1 here), and DeepSpeed's
    if isinstance(min_scale, bool) or not isinstance(min_scale, (int, float)):
        raise TypeError(f"min_scale must be a number, got {min_scale!r}")
    if math.isfinite(min_scale) and min_scale != int(min_scale):
        raise ValueError(
            f"min_scale must be a whole number under DeepSpeed (its config stores min_loss_scale "
            f"as an integer), got {min_scale!r}; nearest valid: {max(1, round(min_scale))}"
        )
    if not (math.isfinite(min_scale) and 1 <= min_scale <= init_scale):
        raise ValueError(
            f"min_scale must be in [1, init_scale={init_scale!r}] under DeepSpeed, got "
            f"{min_scale!r}"
        )
    return int(min_scale)


def deepspeed_fp16_config(
    init_scale: float = 2.0**16,
    growth_interval: int = 2000,
    hysteresis: int = 1,
    consecutive_hysteresis: bool = False,
    min_scale: float | None = None,
    *,
    growth_factor: float = 2.0,
    backoff_factor: float = 0.5,
    max_scale: float | None = None,
    on_min_scale: str = "raise",
    grow_on_underflow: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    """Our scaler's knobs as DeepSpeed's ``"fp16"`` config section (dynamic loss scaling).

    DeepSpeed scales inside its engine, so under DeepSpeed the knobs go in its config rather than
    in a :class:`DynamicLossScaler`: ``{"fp16": deepspeed_fp16_config(hysteresis=2)}``, or from
    the training arguments: ``deepspeed_fp16_config.from_training_args(args)``. The defaults are
    :class:`DynamicLossScaler`'s (``hysteresis=1``, torch's behaviour; DeepSpeed's own default is
    2). What DeepSpeed 0.19.8 cannot express is refused with the reason: growth/backoff other than
    x2 / x0.5, a ``max_scale``, an ``on_min_scale`` other than ``"raise"`` (its scaler raises at
    the minimum), ``grow_on_underflow=True`` (it has no underflow meter) and a fractional
    ``min_scale`` (its parser wants an integer ``min_loss_scale``).
    One difference stays: DeepSpeed grows the scale first after ``growth_interval + 1`` clean
    steps (counted from the start or the last overflow), then every ``growth_interval``.
    ``extra`` adds other keys of the section as they are (``auto_cast``,
    ``fp16_master_weights_and_grads``); it may not override the ones computed here.
    """
    power = _power_of_two_exponent(init_scale)
    for name, value in (("growth_interval", growth_interval), ("hysteresis", hysteresis)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    min_loss_scale = _whole_min_scale(min_scale, init_scale)
    if growth_factor != 2.0 or backoff_factor != 0.5:
        raise ValueError(
            "DeepSpeed's dynamic loss scaler only doubles and halves the scale: growth_factor "
            f"must be 2.0 and backoff_factor 0.5, got {growth_factor!r} and {backoff_factor!r}"
        )
    if max_scale is not None:
        raise ValueError(
            f"DeepSpeed's dynamic loss scaler has no upper bound: max_scale must be None, got "
            f"{max_scale!r}"
        )
    if grow_on_underflow:
        raise ValueError(
            "DeepSpeed's dynamic loss scaler has no underflow meter: grow_on_underflow must be "
            "False under DeepSpeed, got True"
        )
    if on_min_scale != "raise":
        raise ValueError(
            "DeepSpeed's dynamic loss scaler raises when it overflows at min_loss_scale: "
            f"on_min_scale must be 'raise' under DeepSpeed, got {on_min_scale!r}"
        )
    config: dict[str, Any] = {
        "enabled": True,
        "loss_scale": 0,  # 0 = dynamic loss scaling
        "initial_scale_power": power,
        "loss_scale_window": growth_interval,
        "hysteresis": hysteresis,
        "consecutive_hysteresis": bool(consecutive_hysteresis),
        "min_loss_scale": min_loss_scale,
    }
    clash = sorted(set(extra) & set(config))
    if clash:
        raise ValueError(
            f"deepspeed_fp16_config() computes {clash} itself; pass them as its arguments"
        )
    config.update(extra)
    return config


def _deepspeed_fp16_config_from_training_args(args: Any, **extra: Any) -> dict[str, Any]:
    """``deepspeed_fp16_config`` from an ``AmpTrainingArguments``' ``loss_scale_*`` fields.

    The same knobs then mean the same under DeepSpeed as under our scaler, within what DeepSpeed
    can express (see :func:`deepspeed_fp16_config`; an error names the ``loss_scale_*`` field).
    """
    if not isinstance(args, AmpTrainingArguments):
        raise TypeError(
            f"from_training_args() expects AmpTrainingArguments, got {type(args).__name__}"
        )
    knobs = args.loss_scaler_kwargs()
    try:
        return deepspeed_fp16_config(**knobs, **extra)
    except ValueError as err:
        raise ValueError(in_field_names(str(err))) from err


deepspeed_fp16_config.from_training_args = _deepspeed_fp16_config_from_training_args  # type: ignore[attr-defined]

"""The loss scaler's state as data: :class:`ScalerStats` (what it reports) and the checkpoint
format of :meth:`~amp_trainer.scaler.DynamicLossScaler.state_dict` (what it saves and reads).

The checkpoint holds plain Python numbers, strings and lists only, so
``torch.load(weights_only=True)`` reads it; its first five keys are ``torch.amp.GradScaler``'s,
with the same meaning, so checkpoints move between the two scalers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["NAME_KEYS", "STATE_VERSION", "ScalerStats", "read_state"]

#: The format version :meth:`~amp_trainer.scaler.DynamicLossScaler.state_dict` writes; a
#: checkpoint of a newer one is refused (the keys it adds would be lost silently).
STATE_VERSION = 2
#: The keys that hold parameter or module names (lists of str) beside the scale policy's.
NAME_KEYS = ("last_overflow_params", "last_forward_overflow_modules")


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
    the growths the two-sided rule made; ``grad_unreachable`` its share that FP16 flushes at
    every usable scale (``None`` when not probed) and ``unreachable_params`` the parameters
    holding it, most first.
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
    grad_unreachable: float | None = None
    unreachable_params: tuple[str, ...] = ()

    @classmethod
    def of(cls, scale: float, policy: Any, attribution: Any, reading: Any) -> ScalerStats:
        """The snapshot of a scaler at ``scale``: its :class:`~amp_trainer.scale_policy.ScalePolicy`
        counters, its :class:`~amp_trainer.overflow_attribution.OverflowAttribution` names and
        its last :class:`~amp_trainer.underflow.UnderflowReading` (``None`` before any)."""
        return cls(
            scale=scale,
            steps=policy.steps,
            skipped=policy.skipped,
            growths=policy.growths,
            backoffs=policy.backoffs,
            overflow_streak=policy.overflow_streak,
            last_overflow_params=attribution.last_params,
            last_forward_overflow_modules=attribution.last_forward_modules,
            grad_underflow=None if reading is None else reading.underflow,
            grad_headroom=None if reading is None else reading.headroom,
            underflow_growths=policy.underflow_growths,
            underflow_by_param=dict(reading.by_param) if reading else {},
            grad_unreachable=None if reading is None else reading.unreachable,
            unreachable_params=() if reading is None else reading.unreachable_params,
        )


def read_state(state_dict: Any) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """A scaler checkpoint (ours or ``torch.amp.GradScaler``'s) checked and made plain: its
    values with 1-element tensors as numbers (torch's may hold them), and the name lists of
    :data:`NAME_KEYS` (``[]`` where absent). Raises on a malformed one; the scale policy's own
    keys are checked by :meth:`~amp_trainer.scale_policy.ScalePolicy.restored`."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"load_state_dict() expects a mapping, got {type(state_dict).__name__}")
    if len(state_dict) == 0:
        raise RuntimeError(
            "The source state dict is empty, possibly because it was saved from a disabled "
            "scaler (enabled=False)."
        )
    version = state_dict.get("version", STATE_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version > STATE_VERSION:
        raise ValueError(
            f"scaler state 'version' {version!r} is newer than this amp-trainer reads "
            f"(versions up to {STATE_VERSION}): upgrade amp-trainer to resume it"
        )
    plain = {
        key: value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
        for key, value in state_dict.items()
    }
    names = {key: plain.get(key, []) for key in NAME_KEYS}
    for key, value in names.items():
        if not isinstance(value, (list, tuple)) or not all(isinstance(n, str) for n in value):
            raise TypeError(f"scaler state {key!r} must be a list of str, got {value!r}")
    return plain, {key: list(value) for key, value in names.items()}

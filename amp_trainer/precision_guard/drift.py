"""What a drift is: the modes, the error, one broken invariant, and which dtypes are lower."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from amp_trainer.numerics import describe_names

__all__ = [
    "GUARD_MODES",
    "Drift",
    "PrecisionDriftError",
    "check_guard_mode",
    "dtype_name",
    "lower_precision",
]

#: What a drift does (see :mod:`amp_trainer.precision_guard`).
GUARD_MODES = ("raise", "repair", "warn", "off")

# Higher is more precise; 16-bit types are equal in rank, so fp16 <-> bf16 is a drift both ways.
_RANK = {torch.float64: 3, torch.float32: 2, torch.float16: 1, torch.bfloat16: 1}


def check_guard_mode(mode: Any) -> str:
    """``mode`` if it is one of :data:`GUARD_MODES`, else a ``ValueError`` naming them."""
    if mode not in GUARD_MODES:
        raise ValueError(f"precision_guard must be one of {GUARD_MODES}, got {mode!r}")
    return mode


class PrecisionDriftError(RuntimeError):
    """A tensor the run's precision rests on changed dtype; ``drifts`` lists what was seen."""

    def __init__(self, message: str, drifts: tuple[Drift, ...] = ()) -> None:
        super().__init__(message)
        self.drifts = drifts


@dataclass(frozen=True)
class Drift:
    """One broken invariant: what (``kind``), which tensors, seen vs expected, and who did it."""

    kind: str
    tensors: tuple[str, ...]
    seen: str
    expected: str
    site: str | None = None

    def describe(self) -> str:
        names = describe_names(list(self.tensors))
        if self.kind == "FP32 islands":
            return f"{len(self.tensors)} FP32 island(s) {names} no longer compute in FP32"
        if self.kind == "training forwards":
            return f"training forwards ran {self.seen}; expected {self.expected}"
        if self.kind == "FSDP2 MixedPrecisionPolicy":
            policy = f"the FSDP2 MixedPrecisionPolicy of {names}"
            why = f" ({self.site})" if self.site else ""
            return f"{policy} is {self.seen}, expected {self.expected}{why}"
        by = f", changed by {self.site}" if self.site else ""
        verb = "are" if len(self.tensors) != 1 else "is"
        return (
            f"{self.kind} of {len(self.tensors)} tensor(s) {names} {verb} {self.seen}, "
            f"expected {self.expected}{by}"
        )


def lower_precision(seen: torch.dtype, expected: torch.dtype) -> bool:
    """Whether ``seen`` holds less than ``expected`` (a drift), for floating dtypes."""
    if seen is expected:
        return False
    return _RANK.get(seen, 0) <= _RANK.get(expected, 0)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")

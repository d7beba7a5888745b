"""Small numeric facts and walkers that every layer of amp-trainer shares.

These sit at the bottom of the package: the FP32 islands, the scaler, the forward-overflow guard
that runs inside every FP16 step, the NaN doctor and the exporter all import from here, and this
module imports nothing of amp-trainer's. Keeping them here (not in the doctor, the CLI's triage
tool) is what lets the training path stay independent of the tools built on top of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "FP16_MAX",
    "OverflowProbe",
    "all_finite",
    "describe_module",
    "describe_names",
    "iter_tensors",
    "nonfinite_inputs",
]

#: Largest finite float16 value; anything larger becomes ``inf`` in FP16.
FP16_MAX = float(torch.finfo(torch.float16).max)
#: How many names a message lists before "and N more": enough to act on, short enough to read.
NAMES_SHOWN = 8


def describe_names(names: list[str]) -> str:
    """``"a, b, c and 5 more"``: the first :data:`NAMES_SHOWN` names of a list for a message."""
    shown = ", ".join(names[:NAMES_SHOWN])
    more = len(names) - NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


def iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside ``value``: tensors, lists, tuples and mappings (BatchEncoding too)."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from iter_tensors(item)
    elif isinstance(value, Mapping):  # dicts, and transformers' BatchEncoding (a UserDict)
        for item in value.values():
            yield from iter_tensors(item)


def all_finite(value: Any, limit: float = math.inf) -> bool:
    """Whether every floating tensor in ``value`` is finite and (if ``limit``) ``|x| <= limit``."""
    for tensor in iter_tensors(value):
        if tensor.is_floating_point() and tensor.numel():
            if not bool(torch.isfinite(tensor).all()):
                return False
            if limit != math.inf and float(tensor.detach().abs().max()) > limit:
                return False
    return True


class OverflowProbe:
    """Forward hooks that name the first module whose output overflows although its inputs don't.

    "First" is in completion order, so when a Linear inside an MLP inside a block overflows, the
    Linear is named (it finishes first), not the block. ``limit`` is the largest allowed
    magnitude: ``FP16_MAX`` to catch values an FP16 tensor cannot hold (they are ``inf`` already
    if the tensor is FP16; an FP32 tensor above it would overflow when cast), ``math.inf`` to catch
    only inf/NaN. Modules under a name in ``skip_under`` are not probed (the exporter's FP32
    islands: only the island's FP16 output matters). A context manager; hooks are removed on exit.
    """

    def __init__(
        self, model: nn.Module, *, limit: float = FP16_MAX, skip_under: Iterable[str] = ()
    ) -> None:
        self.first: str | None = None
        self.called: set[str] = set()
        self._limit = limit
        self._handles: list[Any] = []
        inside = tuple(name + "." for name in skip_under)
        for name, module in model.named_modules():
            if inside and name.startswith(inside):
                continue
            self._handles.append(
                module.register_forward_hook(self._make_hook(name), with_kwargs=True)
            )

    def _make_hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            self.called.add(name)
            if (
                self.first is None
                and not all_finite(output, self._limit)
                and all_finite((args, kwargs), self._limit)
            ):
                self.first = name

        return hook

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> OverflowProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def nonfinite_inputs(batch: Mapping[str, Any]) -> list[str]:
    """The batch's floating inputs that hold inf/NaN, described ('key' (N non-finite value(s)))."""
    bad = []
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            count = int((~torch.isfinite(value)).sum())
            if count:
                bad.append(f"{key!r} ({count} non-finite value(s))")
    return bad


def describe_module(model: nn.Module, name: str) -> str:
    """``'name' (ClassName, eps=...)``: how messages name a module (eps matters for norms)."""
    module = dict(model.named_modules()).get(name)
    if module is None:
        return repr(name)
    detail = ""
    eps = getattr(module, "eps", None)
    if isinstance(eps, float):
        detail = f", eps={eps:g}"
    return f"{name!r} ({type(module).__name__}{detail})"

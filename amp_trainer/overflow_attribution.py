"""Which parameters' gradients overflowed, by name: attribution on overflow steps only.

A skipped step says *that* something overflowed; the names say *where* (step 3 of the standard
inf/NaN triage: "report which parameters have non-finite gradients, by name"). The check costs
nothing on clean steps: :class:`~amp_trainer.scaler.DynamicLossScaler` calls
:func:`non_finite_parameters` only after its fused check already found an inf/NaN.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

try:  # a sharding engine's gradients (FSDP2, tensor parallel) are DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None  # type: ignore[assignment,misc]

__all__ = [
    "OverflowAttribution",
    "ParameterNames",
    "grad_values",
    "local_values",
    "non_finite_parameters",
]


class ParameterNames:
    """Parameter -> name, for the parameters :meth:`watch` was given (keyed by object id, so a
    model's parameters need not be hashable or kept alive by this map)."""

    def __init__(self) -> None:
        self._names: dict[int, str] = {}

    def __bool__(self) -> bool:
        return bool(self._names)

    def watch(self, model_or_named_parameters: nn.Module | Iterable[tuple[str, Any]]) -> None:
        """Remember the names of a module's parameters, or of ``(name, parameter)`` pairs."""
        if isinstance(model_or_named_parameters, nn.Module):
            named = model_or_named_parameters.named_parameters()
        else:
            named = model_or_named_parameters
        for name, param in named:
            if not isinstance(param, torch.Tensor):
                raise TypeError(f"watch() expects (name, parameter) pairs, got {name!r}: {param!r}")
            self._names[id(param)] = name

    def label(self, param: torch.Tensor, group: int, index: int) -> str:
        """``param``'s name, or its place in the optimizer and its shape when not watched."""
        name = self._names.get(id(param))
        if name is not None:
            return name
        shape = "x".join(str(s) for s in param.shape) or "scalar"
        return f"param_groups[{group}]['params'][{index}] (shape {shape})"


def grad_values(param: torch.Tensor) -> torch.Tensor:
    """The values of ``param.grad`` the optimizer reads (a sparse gradient's ``_values()``)."""
    grad = param.grad
    assert grad is not None
    return grad._values() if grad.is_sparse else grad


def local_values(values: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: a DTensor's local shard, else the tensor itself."""
    if DTensor is not None and isinstance(values, DTensor):
        return values.to_local()
    return values


def _local_non_finite(optimizer: torch.optim.Optimizer, names: ParameterNames) -> tuple[str, ...]:
    """Names of the parameters whose gradients hold inf/NaN, from this rank's values only (a
    DTensor's local shard): one stacked check and one read-back per device."""
    located: list[tuple[torch.Tensor, str]] = []
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if param.grad is not None:
                located.append((local_values(grad_values(param)), names.label(param, g, i)))
    if not located:
        return ()
    finite: dict[int, bool] = {}
    by_device: dict[torch.device, list[int]] = defaultdict(list)
    for index, (values, _) in enumerate(located):
        by_device[values.device].append(index)
    with torch.no_grad():
        for indices in by_device.values():
            checks = torch.stack([torch.isfinite(located[i][0]).all() for i in indices])
            finite.update(zip(indices, checks.tolist()))
    return tuple(label for i, (_, label) in enumerate(located) if not finite[i])


def non_finite_parameters(
    optimizer: torch.optim.Optimizer, names: ParameterNames, process_group: Any = False
) -> tuple[str, ...]:
    """The parameters with non-finite gradients, the same tuple on every rank, in model order.

    ``process_group=False``: this process alone. Otherwise (``None`` is the world) each rank
    can only see its own gradient shards (or, without sharding, its own gradients before they
    were reduced), so the per-rank answers are gathered (``all_gather_object``, a collective:
    every rank must call this on the same step); the union is ordered as this rank's optimizer
    lists the parameters (names only another rank holds, e.g. under pipeline parallelism, come
    last, in rank order).
    """
    local = _local_non_finite(optimizer, names)
    if process_group is False:
        return local
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(gathered, list(local), group=process_group)
    merged = list(dict.fromkeys(name for names_ in gathered for name in names_))
    order = {
        names.label(p, g, i): n
        for n, (g, i, p) in enumerate(
            (g, i, p)
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        )
    }
    rank_order = {name: n for n, name in enumerate(merged)}
    return tuple(sorted(merged, key=lambda name: (order.get(name, len(order)), rank_order[name])))


class OverflowAttribution:
    """A loss scaler's record of where its overflows were: the names it watches, the parameters
    whose gradients overflowed last (:attr:`last_params`) and the modules whose forward overflowed
    last (:attr:`last_forward_modules`).

    Watching costs nothing on clean steps: the per-parameter finiteness check runs only on steps
    whose fused check already found an inf/NaN. Sharded gradients (FSDP2's DTensors) are checked
    where they live: each rank looks at its own local shards only (no full gradient is
    gathered). Under ``torch.distributed`` with more than one rank, the names found are then
    gathered (``all_gather_object`` over the scaler's process group, on overflow steps only), so
    every rank reports the same list, whichever rank's shard held the inf.
    """

    def __init__(self) -> None:
        self.names = ParameterNames()
        self.last_params: tuple[str, ...] = ()
        self.last_forward_modules: tuple[str, ...] = ()

    def attribute(
        self,
        optimizer: torch.optim.Optimizer,
        process_group: Any,
        *,
        distributed: bool,
        needed: bool,
    ) -> None:
        """An overflow step: name its parameters when any are watched, when ``needed`` (the scale
        is at its floor, whose error names them) or when ``distributed`` (every rank joins the
        gather of the names: the verdict is the all-reduced one, so all of them get here)."""
        if self.names or needed or distributed:
            self.last_params = non_finite_parameters(
                optimizer, self.names, process_group if distributed else False
            )

    def forward_overflow(self, modules: Iterable[str]) -> None:
        """The step just skipped was a forward overflow in ``modules``: they become
        :attr:`last_forward_modules` (kept when ``modules`` is empty: none found), and
        :attr:`last_params`, which would list every parameter, is emptied."""
        names = tuple(modules)
        if names:
            self.last_forward_modules = names
        self.last_params = ()

    def state_dict(self) -> dict[str, list[str]]:
        """The names a scaler checkpoint carries (plain lists of str)."""
        return {
            "last_overflow_params": list(self.last_params),
            "last_forward_overflow_modules": list(self.last_forward_modules),
        }

    def load_state_dict(self, names: dict[str, list[str]]) -> None:
        """Restore :meth:`state_dict`'s names (checked by the caller)."""
        self.last_params = tuple(names["last_overflow_params"])
        self.last_forward_modules = tuple(names["last_forward_overflow_modules"])

    def for_copy(self) -> OverflowAttribution:
        """What a pickled or deep-copied scaler keeps: the last names, not the watched map
        (keyed by object id, meaningless in another process)."""
        copy = OverflowAttribution()
        copy.last_params, copy.last_forward_modules = self.last_params, self.last_forward_modules
        return copy

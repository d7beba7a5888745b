"""Detection: was a skipped step a forward overflow, and which module produced it.

A skipped FP16 step is a *forward* overflow when the unscaled loss was already inf/NaN.
:class:`ForwardOverflowDetector` keeps references to the step's losses (no sync on clean steps)
and reads them back once on a skipped step; with several ranks they agree with one flag, so that
every replica handles the same steps.

Which module produced it is found while the batch is re-run (the re-run itself is
:mod:`~amp_trainer.forward_overflow.rerun`'s): :class:`OverflowLocator` hooks the model with
:class:`~amp_trainer.numerics.OverflowProbe` (the first module whose output went non-finite
from finite inputs) and with producer hooks, because a module without parameters (Dropout
scaling 60000 by 1/(1-p), an activation) cannot overflow on its own: the module with parameters
that produced its input is the culprit.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from amp_trainer.numerics import FP16_MAX, OverflowProbe, all_finite, iter_tensors
from amp_trainer.scaler import DynamicLossScaler

__all__ = ["ForwardOverflowDetector", "Located", "OverflowLocator", "has_parameters", "loss_value"]


class ForwardOverflowDetector:
    """The losses of one optimizer step, read back only when the step was skipped.

    ``scaler``: the :class:`DynamicLossScaler` stepping the optimizer(s); its process group is
    the one the ranks agree over.
    """

    def __init__(self, scaler: DynamicLossScaler) -> None:
        self.scaler = scaler
        self._pending: list[tuple[torch.Tensor, Any]] = []
        #: The losses of the last step :meth:`overflowing_inputs` read back, as observed.
        self.losses: tuple[float, ...] = ()

    def observe(self, loss: torch.Tensor, inputs: Any = None) -> None:
        """Remember one micro-batch's detached loss and its inputs. No device sync."""
        self._pending.append((loss, inputs))

    def forget(self) -> None:
        """Drop the step's losses (a clean step, or one the guard does not handle)."""
        self._pending = []

    def overflowing_inputs(self) -> list[Any]:
        """The inputs of the step's micro-batches whose loss was non-finite, then forget them;
        their loss values go to :attr:`losses`.

        One device-to-host transfer for all of them; call it on skipped steps only.
        """
        pending, self._pending = self._pending, []
        self.losses = ()
        if not pending:
            return []
        read = torch.stack(
            [
                torch.stack([torch.isfinite(v.float()).all().float(), v.float().mean()])
                for v, _ in pending
            ]
        ).tolist()
        self.losses = tuple(value for _, value in read)
        return [inputs for (_, inputs), (ok, _) in zip(pending, read) if not ok]

    def group(self) -> Any:
        """The process group the ranks agree over (``None`` for the default one); ``False``
        when this process trains alone."""
        import torch.distributed as dist

        group = self.scaler.process_group
        if not dist.is_available() or not dist.is_initialized():
            return False
        return group if dist.get_world_size(group) > 1 else False

    @staticmethod
    def on_any_rank(flag: bool, group: Any) -> bool:
        """Whether ``flag`` holds on any rank of ``group``: one all-reduce (MAX) of one number."""
        import torch.distributed as dist

        device = "cpu" if dist.get_backend(group) == "gloo" else torch.cuda.current_device()
        value = torch.tensor(float(flag), device=device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
        return bool(value.item())


@dataclass(frozen=True)
class Located:
    """What one re-run of the overflowing batch showed (see :class:`OverflowLocator`)."""

    first: str | None  # the first module whose output went non-finite from finite inputs
    culprit: str | None  # the module to blame: ``first``, or its input's producer
    output_finite: bool
    over_range: list[str]  # modules with parameters out of FP16's range (FP32 run only)
    loss: float | None = None  # the output's loss (it, or its ``loss``), when it has one


class OverflowLocator:
    """Hooks for one re-run of a batch: which module produced the first inf/NaN, and (``census``,
    the FP32 re-run) which modules with parameters put out values beyond FP16's range.

    A context manager; hooks removed on exit. Call :meth:`located` with the re-run's output.
    """

    def __init__(self, model: nn.Module, *, census: bool) -> None:
        self.model = model
        self._census = census
        self._probe: OverflowProbe | None = None
        self._producers: _Producers | None = None

    def __enter__(self) -> OverflowLocator:
        self._probe = OverflowProbe(self.model, limit=math.inf)
        self._producers = _Producers(self.model, census=self._census)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._producers is not None:
            self._producers.__exit__(*exc)
        if self._probe is not None:
            self._probe.__exit__(*exc)

    def located(self, output: Any) -> Located:
        """The first non-finite module, the one to blame for it, whether ``output`` is finite,
        and the census of modules out of FP16's range."""
        if self._probe is None or self._producers is None:
            raise RuntimeError("OverflowLocator.located() needs the re-run inside `with` first")
        first = self._probe.first
        culprit = first
        if culprit is not None and not has_parameters(self.model.get_submodule(culprit)):
            culprit = self._producers.producer_of.get(culprit) or _enclosing_with_parameters(
                self.model, culprit
            )
        return Located(
            first, culprit, all_finite(output), self._producers.over_range, loss_value(output)
        )


def loss_value(output: Any) -> float | None:
    """The loss a re-run's output holds: the output itself when it is a one-element tensor (a
    forward returning the loss, as the Trainer's does), else its ``loss`` (a transformers
    ``ModelOutput`` or a mapping); ``None`` when it has none."""
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", output)
    if isinstance(loss, torch.Tensor) and loss.numel() == 1 and loss.is_floating_point():
        return float(loss.detach().float().item())
    return None


def has_parameters(module: nn.Module) -> bool:
    """Whether ``module`` or one of its submodules holds a parameter."""
    return next(module.parameters(), None) is not None


def _enclosing_with_parameters(model: nn.Module, name: str) -> str | None:
    """The innermost module above ``name`` that holds parameters, never the model itself: where
    a parameter-free module's input was computed when no module's output was it."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        outer = ".".join(parts[:end])
        if has_parameters(model.get_submodule(outer)):
            return outer
    return None


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
        module_has_parameters = has_parameters(module)
        own_parameters = bool(module._parameters)

        def hook(mod: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
            inputs = [t for t in iter_tensors((args, kwargs)) if t.is_floating_point()]
            if module_has_parameters:
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

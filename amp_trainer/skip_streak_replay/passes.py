"""The replays themselves: one forward and backward of a batch from the current weights, in FP16
autocast at a given loss scale or in pure FP32, isolated from the real run.

:class:`ReplayPass` puts back the run's gradients, the model's buffers (BatchNorm statistics) and
the RNG state after every pass, and (``locate``) names the module the first non-finite gradient
comes from: full backward hooks, registered for that pass only, find the first module (in
backward order) whose gradient input is non-finite while its gradient output is finite.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from amp_trainer.forward_overflow.rerun import default_forward
from amp_trainer.numerics import all_finite, iter_tensors
from amp_trainer.precision import without_autocast_wrapper

__all__ = ["ReplayPass"]

_ROWS_SEARCHED = 64  # a batch with more rows is named as a whole when no input holds inf/NaN


def _loss_of(output: Any) -> torch.Tensor | None:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", output)
    if isinstance(loss, torch.Tensor) and loss.is_floating_point():
        return loss if loss.numel() == 1 else loss.mean()
    return None


class _FirstNonFiniteGradient:
    """Full backward hooks for one replay: the first module (in backward order) whose gradient
    input is non-finite while its gradient output is finite. Removed on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.first: str | None = None
        self._handles = [
            module.register_full_backward_hook(self._hook(name))
            for name, module in model.named_modules()
            if name  # the model's own output is a ModelOutput/mapping: no backward hook there
        ]

    def _hook(self, name: str) -> Callable[..., None]:
        def hook(module: nn.Module, grad_input: Any, grad_output: Any) -> None:
            if self.first is not None:
                return
            given = [g for g in iter_tensors(list(grad_input)) if g is not None]
            if given and all_finite(list(grad_output)) and not all_finite(given):
                self.first = name

        return hook

    def __enter__(self) -> _FirstNonFiniteGradient:
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class ReplayPass:
    """Replays of batches on ``model`` (unwrapped: its backward runs no DDP reduction).

    Args:
        model: the model being trained.
        forward: ``(model, inputs) -> loss or output``; default ``model(**inputs)``.
        dtype: the autocast dtype of the training forward (FP16).

    Attributes:
        loss_finite: whether the last pass's loss was finite (a non-finite FP16 loss is a
            forward overflow, not a gradient one).
    """

    def __init__(
        self,
        model: nn.Module,
        forward: Callable[[nn.Module, Any], Any] | None = None,
        dtype: torch.dtype = torch.float16,
    ) -> None:
        self.model = model
        self.forward = forward or default_forward
        self.dtype = dtype
        self.loss_finite: bool | None = None

    def run(
        self, inputs: Any, *, fp16: bool, scale: float, locate: bool = False
    ) -> tuple[bool, str | None]:
        """One forward and backward of ``inputs`` from the current weights, in FP16 autocast at
        loss scale ``scale`` or in pure FP32: whether the loss and every gradient are finite, and
        (``locate``) the module the first non-finite gradient comes from. The run's gradients,
        buffers and RNG are as before afterwards."""
        with self._isolated():
            try:
                with (
                    warnings.catch_warnings(),  # "no inputs require gradients": a module fed ids
                    _FirstNonFiniteGradient(self.model)
                    if locate
                    else contextlib.nullcontext() as hooks,
                ):
                    warnings.simplefilter("ignore", UserWarning)
                    finite = self._forward_backward(inputs, fp16=fp16, scale=scale)
            except RuntimeError:
                if not locate:
                    raise
                # Full backward hooks refuse modules whose output is modified in place: replay
                # without them and name the module of the first non-finite parameter gradient.
                hooks = None
                self._clear_grads()
                finite = self._forward_backward(inputs, fp16=fp16, scale=scale)
            culprit = None
            if locate and not finite:
                culprit = getattr(hooks, "first", None) or self._module_of_bad_gradient()
        return finite, culprit

    def _forward_backward(self, inputs: Any, *, fp16: bool, scale: float) -> bool:
        device_type = self._device_type(inputs)
        with (
            without_autocast_wrapper(self.model) if not fp16 else contextlib.nullcontext(),
            torch.autocast(device_type, dtype=self.dtype, enabled=fp16),
        ):
            loss = _loss_of(self.forward(self.model, inputs))
        self.loss_finite = loss is not None and bool(torch.isfinite(loss.detach()).all())
        if not self.loss_finite:
            return False
        (loss.float() * scale).backward()
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return True
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def _module_of_bad_gradient(self) -> str | None:
        """The module owning the last parameter (the first in backward order) whose gradient is
        non-finite."""
        named = [
            name
            for name, p in self.model.named_parameters()
            if p.grad is not None and not bool(torch.isfinite(p.grad).all())
        ]
        return named[-1].rpartition(".")[0] or None if named else None

    @contextlib.contextmanager
    def _isolated(self) -> Any:
        """The replay's gradients, buffer updates (BatchNorm statistics) and random draws are
        its own: the real run's are put back on exit."""
        params = list(self.model.parameters())
        saved_grads = [p.grad for p in params]
        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        device_type = next((p.device.type for p in params), "cpu")
        devices = [torch.cuda.current_device()] if device_type == "cuda" else []
        self._clear_grads()
        try:
            with torch.random.fork_rng(devices=devices), torch.enable_grad():
                yield
        finally:
            for p, grad in zip(params, saved_grads):
                p.grad = grad
            with torch.no_grad():
                for buffer, value in buffers:
                    buffer.copy_(value)

    def _clear_grads(self) -> None:
        for p in self.model.parameters():
            p.grad = None

    def _device_type(self, inputs: Any) -> str:
        for tensor in iter_tensors(inputs):
            return tensor.device.type
        return next((p.device.type for p in self.model.parameters()), "cpu")

    def bad_rows(self, inputs: Any) -> list[int]:
        """The rows of a mapping batch that hold inf/NaN in a floating input, else (up to
        64 rows) those whose FP32 loss alone is non-finite."""
        if not isinstance(inputs, Mapping):
            return []
        sizes = {v.shape[0] for v in inputs.values() if isinstance(v, torch.Tensor) and v.ndim}
        if len(sizes) != 1:
            return []
        (size,) = sizes
        rows = set()
        for value in inputs.values():
            if isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim:
                bad = ~torch.isfinite(value.reshape(size, -1)).all(dim=1)
                rows.update(int(i) for i in torch.nonzero(bad).flatten())
        if rows or size > _ROWS_SEARCHED:
            return sorted(rows)
        for row in range(size):  # no input holds inf/NaN: the row whose FP32 loss is not finite
            one = {
                k: v[row : row + 1] if isinstance(v, torch.Tensor) and v.ndim else v
                for k, v in inputs.items()
            }
            if not self.run(one, fp16=False, scale=1.0)[0]:
                rows.add(row)
        return sorted(rows)

"""Optimizers that unscale and skip themselves: torch's ``_step_supports_amp_scaling`` contract.

An optimizer may declare ``_step_supports_amp_scaling = True``: it expects the scaler to set
``optimizer.grad_scale`` (the scale its gradients still carry, or ``None`` once they are
unscaled) and ``optimizer.found_inf`` (a tensor, nonzero on overflow), and to call its
``step()`` on every iteration, overflow or not, so that it unscales inside its own kernel and
decides the skip itself; torch's ``GradScaler`` does exactly that, then deletes both attributes.
A scaler that unscales the gradients itself and does not call ``step()`` on overflow breaks
such an optimizer's own bookkeeping (a step counter it keeps, a state it advances on skips).

:class:`~amp_trainer.scaler.DynamicLossScaler` honours the contract for those optimizers, with
two choices of its own. The gradients are unscaled first, on its usual path (so clipping, the
found-inf all-reduce across ranks and overflow attribution are unchanged), hence
``grad_scale = None``, which the contract allows. And on overflow the optimizer's class
``step`` is called, not the instance's: wrappers that replaced ``optimizer.step`` to watch for
the call (Accelerate's ``AcceleratedOptimizer``, whose skip flag holds the learning-rate
schedule) see the skip, as with every other optimizer.

torch's own optimizers (fused Adam/AdamW/SGD declare the contract) stay on the usual path:
unscaled by the scaler, not stepped on overflow, bit-identical either way. An optimizer whose
``step`` takes the deprecated ``grad_scaler=`` keyword expects a ``torch.amp.GradScaler`` object
to call private methods on; it stays on the usual path too.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

__all__ = ["declares_amp_scaling", "step_declaring_amp_scaling"]


def declares_amp_scaling(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` takes the contract's attribute path (see the module docstring)."""
    if not getattr(optimizer, "_step_supports_amp_scaling", False):
        return False
    if type(optimizer).__module__.startswith("torch."):
        return False
    try:
        parameters = inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return False
    return "grad_scaler" not in parameters


def step_declaring_amp_scaling(
    optimizer: torch.optim.Optimizer, found_inf: bool, *args: Any, **kwargs: Any
) -> Any:
    """Call ``optimizer.step`` as the contract asks, its gradients already unscaled."""
    params = (p for group in optimizer.param_groups for p in group["params"])
    device = next(params, torch.empty(0)).device  # found_inf lives with the parameters
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    optimizer.found_inf = torch.full(  # type: ignore[attr-defined]
        (), float(found_inf), dtype=torch.float32, device=device
    )
    try:
        if found_inf:  # past any instance-level wrapper that counts calls as applied steps
            return type(optimizer).step(optimizer, *args, **kwargs)
        return optimizer.step(*args, **kwargs)
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]

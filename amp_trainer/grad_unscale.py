"""The arithmetic of one unscale: gradients grouped for the fused kernel, the check-and-divide,
the found-inf flag reduced across ranks, and the exact one-pass fold of unscale and clip.

:class:`~amp_trainer.scaler.DynamicLossScaler` owns the step protocol (which optimizer is at which
stage, what a verdict means for the scale); these functions own the tensors. They are plain
functions over tensors so that each device-to-host sync is visible where it happens: there is
exactly one per step, in :func:`reduce_found_inf`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from amp_trainer.numerics import describe_names
from amp_trainer.overflow_attribution import ParameterNames, grad_values, local_values

__all__ = [
    "GradientGroups",
    "ScaleTensors",
    "all_zero",
    "check_and_unscale",
    "distributed",
    "group_gradients",
    "half_gradients_error",
    "multiply_",
    "one_pass_clip_factor",
    "one_pass_is_exact",
    "reduce_found_inf",
    "unscale_and_clip_",
]

#: device -> dtype -> the gradient tensors of that group (what the fused kernel takes at once).
GradientGroups = dict[torch.device, dict[torch.dtype, list[torch.Tensor]]]


def group_gradients(
    optimizer: torch.optim.Optimizer, names: ParameterNames
) -> tuple[GradientGroups, list[str]]:
    """``optimizer``'s gradients by device and dtype, and the labels of any FP16 ones (which the
    caller refuses: FP16 master weights cannot be unscaled safely). Sparse gradients are
    coalesced first: duplicate indices add up on ``coalesce()``, which can overflow, so the
    values checked are the ones the optimizer will see."""
    groups: GradientGroups = defaultdict(lambda: defaultdict(list))
    half: list[str] = []
    with torch.no_grad():
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                if param.grad.dtype == torch.float16:
                    half.append(names.label(param, g, i))
                    continue
                if param.grad.is_sparse:
                    param.grad = param.grad.coalesce()
                values = grad_values(param)
                groups[values.device][values.dtype].append(values)
    return groups, half


def all_zero(groups: Mapping[Any, Mapping[Any, list[torch.Tensor]]]) -> bool:
    """Whether every gradient is exactly zero (this rank's shards). One sync per tensor: call it
    only off the training path (the scaler does so only when no ``scale()`` preceded them)."""
    return not any(
        bool(local_values(grad).any())
        for per_dtype in groups.values()
        for grads in per_dtype.values()
        for grad in grads
    )


def check_and_unscale(groups: GradientGroups, inv_scale_on: Any) -> list[torch.Tensor]:
    """Divide every gradient by the scale and flag inf/NaN: one fused kernel per (device, dtype)
    group, torch's own ``_amp_foreach_non_finite_check_and_unscale_``. ``inv_scale_on(device)``
    gives the reciprocal scale on a device. Returns one found-inf tensor per device (no sync)."""
    found: list[torch.Tensor] = []
    with torch.no_grad():
        for device, per_dtype in groups.items():
            found_inf = torch.zeros((), dtype=torch.float32, device=device)
            inv_scale = inv_scale_on(device)
            for grads in per_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
            found.append(found_inf)
    return found


def distributed(process_group: Any) -> bool:
    """Whether ``torch.distributed`` is up with more than one rank in ``process_group``."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return False
    return torch.distributed.get_world_size(process_group) > 1


def reduce_found_inf(
    found: list[torch.Tensor], process_group: Any, fallback_device: torch.device
) -> bool:
    """The step's verdict: the flags summed on one device, all-reduced (MAX) across the ranks of
    ``process_group`` when distributed, then read back: the step's one device-to-host sync.

    A rank with no gradients at all still joins the collective, with a zero on
    ``fallback_device``, so that no rank waits forever for it.
    """
    if found:
        total = found[0]
        for other in found[1:]:
            total = total + other.to(total.device)
    else:
        total = torch.zeros((), dtype=torch.float32, device=fallback_device)
    if distributed(process_group):
        import torch.distributed as dist

        flag = total
        if dist.get_backend(process_group) == "gloo" and flag.device.type != "cpu":
            flag = flag.cpu()
        flag = flag.clone()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=process_group)
        total = flag
    return bool(total.item())


def one_pass_is_exact(scale: float, params: list[torch.Tensor], norm_type: float) -> bool:
    """Whether folding unscale into the clip gives bit for bit what unscale-then-clip gives.

    The scale must be a power of two whose reciprocal is a normal float32 (dividing by it is
    then exact), the norm one whose terms scale exactly (``|x|``, ``x*x``, ``max``: the 1-, 2-
    and inf-norms; a general p-norm goes through ``pow``, which does not), and the gradients
    dense float32/float64 plain tensors (not DTensors, sparse or bf16 ones).
    """
    if norm_type not in (1.0, 2.0, math.inf):
        return False
    mantissa, exponent = math.frexp(scale)
    if mantissa != 0.5 or not -125 <= exponent - 1 <= 126:
        return False
    for param in params:
        grad = param.grad
        if (
            type(grad) is not torch.Tensor
            or grad.is_sparse
            or grad.dtype not in (torch.float32, torch.float64)
        ):
            return False
    return True


def one_pass_clip_factor(
    grads: list[torch.Tensor],
    inv_scale: torch.Tensor,
    max_norm: float,
    norm_type: float,
    foreach: bool | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From still-scaled gradients: the true total norm, the one factor that unscales and clips
    (``min(1, max_norm / norm) / S``), and a flag (a 0-d tensor, not yet read) for when the fold
    cannot be used: a non-finite scaled norm (an inf/NaN gradient, or finite ones whose scaled
    norm overflows float32) or a factor below float32's smallest normal. No sync.

    Why: unscale (read + write every gradient), norm (read) and clip (read + write) is three
    reads and two writes; the norm of the *scaled* gradients (one read) is non-finite exactly
    when some gradient is, divided by a power-of-two S it is the true norm exactly, and 1/S and
    the clip coefficient fold into one multiply (read + write).
    """
    with torch.no_grad():
        scaled_norm = nn.utils.get_total_norm(grads, norm_type, foreach=foreach)
        total_norm = scaled_norm * inv_scale.to(scaled_norm.device)  # exact: a power of two
        # As torch.nn.utils.clip_grads_with_norm_ computes it, from the same total norm.
        coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
        factor = coef * inv_scale.to(scaled_norm.device)  # exact while a normal float32
        unusual = (~torch.isfinite(scaled_norm)) | (factor < torch.finfo(torch.float32).tiny)
    return total_norm, factor, unusual


class ScaleTensors(dict):
    """The loss scale and its reciprocal as float32 tensors, per device: ``device -> (scale,
    scale tensor, reciprocal tensor)``. Made lazily on the device of first use and refreshed
    only when the scale changes, so ``scale()`` and unscaling cost no host-to-device copy on
    the steady-state path; nothing is allocated before."""

    def on(self, device: torch.device, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The scale and its reciprocal on ``device``."""
        cached = self.get(device)
        if cached is None or cached[0] != scale:
            scale_tensor = torch.full((), scale, dtype=torch.float32, device=device)
            # The reciprocal is taken in float64, then rounded, as torch does: an FP32
            # division can be imprecise under some compile options.
            inv_scale = torch.full((), 1.0 / scale, dtype=torch.float64).to(torch.float32)
            cached = (scale, scale_tensor, inv_scale.to(device))
            self[device] = cached
        return cached[1], cached[2]

    def any_device(self, device_type: str) -> torch.device:
        """A device for a flag when there are no gradients: one in use, else the current CUDA
        device for a ``"cuda"`` scaler where there is one, else the CPU."""
        if self:
            return next(iter(self))
        if device_type == "cuda" and torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def half_gradients_error(names: list[str]) -> ValueError:
    """FP16 gradients cannot be unscaled: the update needs FP32 master weights."""
    return ValueError(
        "Attempting to unscale FP16 gradients of "
        f"{len(names)} parameter(s): {describe_names(names)}. "
        "Mixed-precision training needs FP32 master weights: keep trainable "
        "parameters in float32 (autocast runs the maths in FP16) - e.g. "
        "amp_trainer.precision.cast_trainable_params_to_fp32(model) - and load "
        "models without dtype=torch.float16 for training."
    )


def multiply_(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """``grads *= factor`` in place, one foreach kernel per device (``factor`` copied to each)."""
    by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        by_device[grad.device].append(grad)
    with torch.no_grad():
        for device, device_grads in by_device.items():
            torch._foreach_mul_(device_grads, factor.to(device))


def unscale_and_clip_(
    params: list[torch.Tensor],
    inv_scale: torch.Tensor,
    max_norm: float,
    norm_type: float,
    foreach: bool | None,
    reduce: Callable[[list[torch.Tensor]], bool],
) -> torch.Tensor | None:
    """Unscale and clip ``params``' still-scaled gradients in one pass; the unscaled total norm.

    The gradients are read twice and written once instead of three reads and two writes
    (:func:`one_pass_clip_factor` says why that is exact); where :func:`one_pass_is_exact`
    holds, the result is bit-identical to unscale-then-clip (and to
    ``torch.amp.GradScaler.unscale_`` + ``clip_grad_norm_``), the returned norm included.
    One device-to-host read: ``reduce`` (the scaler's found-inf reduction, all-reduced so every
    rank takes the same path) of the flag saying the scaled norm is not finite. Then nothing is
    written and ``None`` returned: the caller's two-pass path tells an inf gradient from finite
    ones whose scaled norm overflows.
    """
    grads = [p.grad for p in params]
    total_norm, factor, unusual = one_pass_clip_factor(
        grads, inv_scale, max_norm, norm_type, foreach
    )
    if reduce([unusual.float()]):
        return None
    multiply_(grads, factor)
    return total_norm

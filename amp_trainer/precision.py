"""Precision policy: what precision a device runs, its autocast, and FP32 master weights.

Three decisions every mixed-precision run makes, made once here so the scaler, the Accelerate
hooks, the Trainer and the exporter agree:

* :func:`resolve_precision` turns a request (``"auto"``, ``"fp16"``, ``"bf16"``, ``"fp32"``) and a
  device into the precision that will really run. Nothing is a silent no-op: FP16 asked for on a
  CPU *is* FP16 (autocast + loss scaling), with one warning that it is slow there; a precision a
  device cannot run is a :class:`ValueError`, not a quiet fall-back to FP32.
* :func:`autocast_for` is the matching forward-pass context. autocast and the loss scaler must be
  switched on and off together: autocast alone silently loses small gradients, a scaler alone is
  wasted work.
* :func:`check_trainable_params_fp32` and :func:`cast_trainable_params_to_fp32` enforce the
  other half of the contract: the weights the optimizer updates (master weights) are FP32.

Which modules compute in FP32 inside an FP16 forward (norms, ``fp32_modules``, the overflow
fallback) is :mod:`amp_trainer.islands`.

Example::

    precision = resolve_precision("auto", "cuda")            # "fp16" on CUDA
    check_trainable_params_fp32(model)
    with autocast_for(precision, "cuda"):
        loss = model(**batch).loss
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from amp_trainer.islands import is_fp32_island
from amp_trainer.numerics import describe_names

__all__ = [
    "PRECISIONS",
    "CpuFp16Warning",
    "autocast_for",
    "cast_trainable_params_to_fp32",
    "check_trainable_params_fp32",
    "resolve_precision",
    "without_autocast_wrapper",
]

logger = logging.getLogger(__name__)

#: The precisions :func:`resolve_precision` can return.
PRECISIONS = ("fp16", "bf16", "fp32")

# Accepted spellings -> canonical name. "no" is Accelerate's spelling of FP32
# (ACCELERATE_MIXED_PRECISION=no), so a value read from its config resolves as-is.
_ALIASES = {
    "auto": "auto",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp32": "fp32",
    "float32": "fp32",
    "no": "fp32",
}
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

# One warning per process: a training loop resolves its precision once, but a Trainer, an
# Accelerator and a recipe may each resolve it again, and the user only needs telling once.
_warned_cpu_fp16 = False
_warn_lock = threading.Lock()


class CpuFp16Warning(UserWarning):
    """FP16 is running on a CPU: correct (real autocast + loss scaling) but slow."""


# --------------------------------------------------------------------------------------------
# resolving a precision
# --------------------------------------------------------------------------------------------
def _canonical(requested: str) -> str:
    if not isinstance(requested, str) or requested.lower() not in _ALIASES:
        aliases = ", ".join(repr(a) for a in _ALIASES if a not in (*PRECISIONS, "auto"))
        raise ValueError(
            f"Unknown precision {requested!r}; valid values are 'auto', 'fp16', 'bf16', 'fp32' "
            f"(aliases: {aliases})"
        )
    return _ALIASES[requested.lower()]


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return torch.device("xpu")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def _as_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return _default_device()
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"Not a device: {device!r} ({err})") from err


def _device_available(device: torch.device) -> bool:
    if device.type in ("cpu", "meta"):
        return True
    backend = getattr(torch, device.type, None)
    is_available = getattr(backend, "is_available", None)
    if device.type == "mps":
        return torch.backends.mps.is_available()
    return bool(is_available()) if callable(is_available) else False


def _autocast_available(device_type: str) -> bool:
    return bool(torch.amp.autocast_mode.is_autocast_available(device_type))


def _native_bf16(device: torch.device) -> bool:
    """Whether ``device`` has bf16 arithmetic in hardware (not emulated through FP32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        # oneDNN's check: AVX512-BF16 / AMX on x86, BF16 extensions on Arm.
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if device.type == "xpu":
        return bool(torch.xpu.is_bf16_supported())
    if device.type == "mps":
        return bool(torch.backends.mps.is_macos_or_newer(14, 0))
    return False


def _warn_cpu_fp16() -> None:
    global _warned_cpu_fp16
    with _warn_lock:
        if _warned_cpu_fp16:
            return
        _warned_cpu_fp16 = True
    # Point the warning at the first caller outside amp_trainer (the user's script, or the
    # library that built the Trainer/Accelerator), not at our internals, nor at generated code
    # with no file: AmpTrainingArguments(...) runs our __post_init__ from the __init__ that
    # @dataclass writes, whose frame is "<string>" (the warning read "<string>:131:").
    package_dir = os.path.dirname(os.path.abspath(__file__))
    frame, stacklevel = sys._getframe(1), 2
    while frame.f_back is not None and (
        frame.f_code.co_filename.startswith(package_dir) or frame.f_code.co_filename.startswith("<")
    ):
        frame, stacklevel = frame.f_back, stacklevel + 1
    warnings.warn(
        "fp16 on CPU runs for real (autocast to float16 plus dynamic loss scaling), but CPUs "
        "without FP16 arithmetic units emulate it and are usually slower than fp32. Use it to "
        "test an FP16 setup; train on a GPU, or use bf16 on CPUs that support it.",
        CpuFp16Warning,
        stacklevel=stacklevel,
    )


def resolve_precision(requested: str = "auto", device: str | torch.device | None = None) -> str:
    """The precision that will actually run: ``"fp16"``, ``"bf16"`` or ``"fp32"``.

    Args:
        requested: ``"auto"``, ``"fp16"``, ``"bf16"`` or ``"fp32"`` (also ``"no"``, Accelerate's
            spelling of FP32, and ``"float16"``/``"half"``/``"bfloat16"``/``"float32"``).
        device: where the model runs; ``None`` picks CUDA, then XPU, then MPS, then CPU.

    ``"auto"`` is FP16 on CUDA (the loss scaler exists for it, and it runs on every CUDA GPU),
    BF16 on other devices that have BF16 in hardware, else FP32. An explicit request is honoured
    or refused, never silently changed: FP16 on a CPU runs (real autocast + scaler) with one
    :class:`CpuFp16Warning` per process; a request the device cannot run raises ``ValueError``.
    """
    precision = _canonical(requested)
    dev = _as_device(device)
    if not _device_available(dev):
        raise ValueError(
            f"Cannot run precision {requested!r} on device {str(dev)!r}: no {dev.type} device is "
            "available in this process."
        )
    if precision == "auto":
        if dev.type == "cuda":
            picked, why = "fp16", "a CUDA device (FP16 tensor cores, made safe by the loss scaler)"
        elif _autocast_available(dev.type) and _native_bf16(dev):
            picked, why = "bf16", "it has BF16 arithmetic in hardware"
        else:
            picked, why = "fp32", "it has no BF16 in hardware (FP16/BF16 would be emulated, slower)"
        logger.info("precision='auto' picked %s on %s: %s", picked, dev, why)
        return picked
    if precision == "fp32":
        return "fp32"
    if not _autocast_available(dev.type):
        raise ValueError(
            f"Cannot run precision {requested!r} on device {str(dev)!r}: torch has no autocast for "
            f"{dev.type!r} devices. Use 'fp32' there."
        )
    if precision == "bf16" and dev.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError(
            f"Cannot run precision {requested!r} on device {str(dev)!r} "
            f"({torch.cuda.get_device_name(dev)}): it has no bf16 support. Use 'fp16' (with the "
            "loss scaler) instead."
        )
    if precision == "bf16" and not _native_bf16(dev):
        logger.info("bf16 on %s is emulated in software: expect it to be slow.", dev)
    if precision == "fp16" and dev.type == "cpu":
        _warn_cpu_fp16()
    return precision


def autocast_for(
    precision: str, device: str | torch.device
) -> contextlib.AbstractContextManager[Any]:
    """The forward-pass context for ``precision``: ``torch.autocast`` for fp16/bf16, else a no-op.

    Wrap the forward pass and the loss only; backward runs outside it (autocast already recorded
    which dtype each op's backward uses).
    """
    canonical = _canonical(precision)
    if canonical == "auto":
        raise ValueError(
            "autocast_for() needs a resolved precision; call resolve_precision() first"
        )
    if canonical == "fp32":
        return contextlib.nullcontext()
    device_type = _as_device(device).type
    return torch.autocast(device_type=device_type, dtype=_DTYPES[canonical])


@contextlib.contextmanager
def without_autocast_wrapper(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` with its own ``forward`` for the duration of the block.

    Accelerate's ``prepare()`` replaces a model's ``forward`` with one wrapped in the run's
    autocast (keeping the original as ``_original_forward``), and that autocast is the innermost
    one: an FP32 re-run, or a forward in another precision, inside it would still compute in the
    run's precision. The wrapper is put back on exit; a model without one is left as it is.
    """
    wrapped = model.__dict__.get("forward")
    original = model.__dict__.get("_original_forward")
    if wrapped is None or original is None:
        yield model
        return
    model.forward = original
    try:
        yield model
    finally:
        model.forward = wrapped


# --------------------------------------------------------------------------------------------
# FP32 master weights
# --------------------------------------------------------------------------------------------
def check_trainable_params_fp32(model: nn.Module) -> None:
    """Raise ``ValueError`` if any trainable parameter is not FP32.

    FP16 training keeps FP32 master weights: the optimizer adds updates of ~1e-4 relative size,
    which an FP16 weight rounds away, and the loss scaler refuses FP16 gradients. Frozen
    parameters (a PEFT base model) may be any dtype.
    """
    bad = [
        f"{name} ({str(p.dtype).removeprefix('torch.')})"
        for name, p in model.named_parameters()
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32
    ]
    if bad:
        raise ValueError(
            f"{len(bad)} trainable parameter(s) are not float32: {describe_names(bad)}. "
            "Mixed-precision training needs FP32 master weights (autocast does the FP16 maths). "
            "Fix: amp_trainer.precision.cast_trainable_params_to_fp32(model), or load the model "
            "without dtype=torch.float16."
        )


def cast_trainable_params_to_fp32(
    model: nn.Module, frozen_dtype: torch.dtype | None = None
) -> list[str]:
    """Cast trainable floating parameters to FP32 (and frozen ones to ``frozen_dtype`` if given).

    The LoRA / ``modules_to_save`` case: a base model loaded in FP16 to save memory, adapters
    trained on top. Parameters keep their identity (``param.data`` is replaced), so an optimizer
    built earlier still holds them. Norm layers handled by :func:`keep_norms_in_fp32` stay FP32
    even when frozen, as does every other FP32 island (:func:`keep_in_fp32`). Returns the names
    of the parameters whose dtype changed.
    """
    if frozen_dtype is not None and not (
        isinstance(frozen_dtype, torch.dtype) and frozen_dtype.is_floating_point
    ):
        raise ValueError(
            f"frozen_dtype must be a floating torch.dtype or None, got {frozen_dtype!r}"
        )
    fp32_modules = {id(p) for m in model.modules() if is_fp32_island(m) for p in m.parameters()}
    cast: list[str] = []
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            if param.requires_grad or id(param) in fp32_modules:
                target = torch.float32
            elif frozen_dtype is not None:
                target = frozen_dtype
            else:
                continue
            if param.dtype != target:
                param.data = param.data.to(target)
                if param.grad is not None:
                    param.grad = param.grad.to(target)
                cast.append(name)
    return cast

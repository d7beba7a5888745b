"""Precision policy: what precision a device runs, its autocast, and FP32 islands for norms.

Three decisions every mixed-precision run makes, made once here so the scaler, the Accelerate
hooks, the Trainer and the exporter agree:

* :func:`resolve_precision` turns a request (``"auto"``, ``"fp16"``, ``"bf16"``, ``"fp32"``) and a
  device into the precision that will really run. Nothing is a silent no-op: FP16 asked for on a
  CPU *is* FP16 (autocast + loss scaling), with one warning that it is slow there; a precision a
  device cannot run is a :class:`ValueError`, not a quiet fall-back to FP32.
* :func:`autocast_for` is the matching forward-pass context. autocast and the loss scaler must be
  switched on and off together: autocast alone silently loses small gradients, a scaler alone is
  wasted work.
* :func:`keep_norms_in_fp32` keeps normalisation layers (LayerNorm, RMSNorm, BatchNorm, GroupNorm,
  InstanceNorm) in FP32, parameters *and* arithmetic, whatever autocast or ``.half()`` say: their
  mean/variance reductions are where FP16 loses the most. :func:`check_trainable_params_fp32` and
  :func:`cast_trainable_params_to_fp32` enforce the other half of the contract: the weights the
  optimizer updates (master weights) are FP32.

Example::

    precision = resolve_precision("auto", "cuda")            # "fp16" on CUDA
    keep_norms_in_fp32(model)
    check_trainable_params_fp32(model)
    with autocast_for(precision, "cuda"):
        loss = model(**batch).loss
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = [
    "PRECISIONS",
    "CpuFp16Warning",
    "autocast_for",
    "cast_trainable_params_to_fp32",
    "check_trainable_params_fp32",
    "is_norm_module",
    "keep_norms_in_fp32",
    "resolve_precision",
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
_NAMES_SHOWN = 8

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
    # library that built the Trainer/Accelerator), not at our internals.
    package_dir = os.path.dirname(os.path.abspath(__file__))
    frame, stacklevel = sys._getframe(1), 2
    while frame.f_back is not None and frame.f_code.co_filename.startswith(package_dir):
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
            return "fp16"
        if _autocast_available(dev.type) and _native_bf16(dev):
            return "bf16"
        return "fp32"
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


# --------------------------------------------------------------------------------------------
# normalisation layers in FP32
# --------------------------------------------------------------------------------------------
_TORCH_NORMS: tuple[type[nn.Module], ...] = (
    nn.LayerNorm,
    nn.GroupNorm,
    nn.modules.batchnorm._NormBase,  # BatchNorm1d/2d/3d, SyncBatchNorm, InstanceNorm*, lazy ones
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)
# Model libraries define their own norms (LlamaRMSNorm, T5LayerNorm, DetrFrozenBatchNorm2d,
# ConvNextLayerNorm, ...) that do not subclass torch's; the class name is the stable signal.
_NORM_NAME = re.compile(r"(LayerNorm|RMSNorm|GroupNorm|BatchNorm[123]?d?|InstanceNorm[123]?d?)$")


def is_norm_module(module: nn.Module) -> bool:
    """Whether ``module`` is a normalisation layer.

    torch's norm classes are recognised by type. Any other class whose name ends in
    ``LayerNorm``, ``RMSNorm``, ``GroupNorm``, ``BatchNorm[1-3]d`` or ``InstanceNorm[1-3]d`` counts
    too, provided it is a leaf or holds only norm layers: a block *named* like a norm that
    contains a Linear (an adaptive LayerNorm, say) is not one, and its inner norm is found on
    its own.
    """
    if isinstance(module, _TORCH_NORMS):
        return True
    if not _NORM_NAME.search(type(module).__name__):
        return False
    return all(is_norm_module(child) for child in module.children())


class _Fp32Norm:
    """Keeps one norm layer in FP32: a forward pre-hook, a forward hook and a ``forward``.

    One instance per layer, a top-level class rather than closures so that a model carrying it
    still pickles and deep-copies (the reference to its layer follows the copy).

    In eager mode the hooks do the work, as a region around the whole call: the pre-hook (1)
    restores FP32 parameters and buffers if something cast the layer since (``model.half()``
    after :func:`keep_norms_in_fp32`), (2) upcasts floating inputs to FP32 and (3) disables
    autocast; the post-hook (``always_call=True``, so it runs even when forward raises) leaves
    the autocast-disabled region and casts floating outputs back to the input's dtype, which is
    what the surrounding half-precision code expects. Hooks registered after these see what the
    layer computes on: FP32 inputs, autocast off.

    torch.compile cannot trace that region: dynamo fails on an autocast context entered in one
    hook and left in another (``'autocast' object has no attribute 'prev'`` in torch 2.13). So
    the layer's ``forward`` is replaced (an instance attribute; the class's method is untouched)
    by :meth:`__call__`, which does the same upcast / autocast-off / cast-back inside one
    ``with`` block, which dynamo traces. While dynamo traces, the hooks only restore FP32
    parameters and leave the rest to it; in eager mode it finds FP32 inputs and autocast already
    off, and just calls the original forward.
    """

    def __init__(self, module: nn.Module, forward: Any = None) -> None:
        self.module = module
        # The forward this one wraps when it is not the class's own (another library's wrapper
        # set as an instance attribute); None means type(module).forward, looked up at call time
        # so that no bound method of the layer has to be pickled.
        self.forward = forward
        self._local = threading.local()

    def __getstate__(self) -> dict[str, Any]:
        # The per-call stack is runtime state; thread-locals don't pickle.
        return {"module": self.module, "forward": self.forward}

    def __setstate__(self, state: dict[str, Any]) -> None:
        # .get: a model pickled before the forward existed carries hooks-only state ({}).
        self.module = state.get("module")
        self.forward = state.get("forward")
        self._local = threading.local()

    def _stack(self) -> list[tuple[contextlib.AbstractContextManager[Any] | None, Any]]:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        _to_fp32_in_place(module)
        if torch.compiler.is_dynamo_compiling():
            return None  # __call__ does the rest inside one traceable `with` block
        if not kwargs and len(args) == 1 and isinstance(args[0], torch.Tensor):
            # The common case (one hidden-states tensor), without walking nested containers.
            first = args[0]
            is_float = first.is_floating_point()
            input_dtype = first.dtype if is_float else None
            device = first.device if is_float else None
        else:
            input_dtype = _first_float_dtype(args, kwargs)
            device = _first_float_device(args, kwargs)
        ctx: contextlib.AbstractContextManager[Any] | None = None
        if device is not None and _autocast_available(device.type):
            ctx = torch.autocast(device_type=device.type, enabled=False)
            ctx.__enter__()
        self._stack().append((ctx, input_dtype))
        if not kwargs and len(args) == 1 and input_dtype is not None:
            return (args[0].float(),), kwargs
        return _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)

    def post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if torch.compiler.is_dynamo_compiling():
            return None
        stack = self._stack()
        if not stack:  # a pre-hook before ours raised: ours never ran
            return None
        ctx, input_dtype = stack.pop()
        if ctx is not None:
            ctx.__exit__(None, None, None)
        if output is None or input_dtype is None or input_dtype == torch.float32:
            return None
        return _cast_floats(output, input_dtype)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The layer's forward in FP32 with autocast off, output in the input's dtype.

        Self-sufficient, so the layer is FP32 whichever hooks ran: in eager mode the pre-hook has
        already upcast the inputs and disabled autocast, and this only calls the original forward.
        """
        if getattr(self._local, "stack", None) and not torch.compiler.is_dynamo_compiling():
            # Eager mode, inside the hooks' region: inputs are FP32 and autocast is off already.
            return self._forward(args, kwargs)
        input_dtype = _first_float_dtype(args, kwargs)
        device = _first_float_device(args, kwargs)
        args, kwargs = _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)
        if (
            device is not None
            and _autocast_available(device.type)
            and torch.is_autocast_enabled(device.type)
        ):
            with torch.autocast(device_type=device.type, enabled=False):
                output = self._forward(args, kwargs)
        else:
            output = self._forward(args, kwargs)
        if output is None or input_dtype is None or input_dtype == torch.float32:
            return output
        return _cast_floats(output, input_dtype)

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self.forward is None:
            return type(self.module).forward(self.module, *args, **kwargs)
        return self.forward(*args, **kwargs)


def _install_fp32_norm(module: nn.Module) -> None:
    current = module.__dict__.get("forward")
    if getattr(current, "__self__", None) is module and getattr(
        current, "__func__", None
    ) is getattr(type(module), "forward", None):
        current = None  # a bound copy of the class's own forward: nothing to keep
    hooks = _Fp32Norm(module, current)
    module.forward = hooks
    module.register_forward_pre_hook(hooks.pre_forward, with_kwargs=True)
    module.register_forward_hook(hooks.post_forward, always_call=True)
    module.register_state_dict_pre_hook(_state_dict_pre_hook)


def _first_float_dtype(*values: Any) -> torch.dtype | None:
    for tensor in _iter_tensors(values):
        if tensor.is_floating_point():
            return tensor.dtype
    return None


def _first_float_device(*values: Any) -> torch.device | None:
    for tensor in _iter_tensors(values):
        if tensor.is_floating_point():
            return tensor.device
    return None


def _iter_tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _iter_tensors(item)
    elif isinstance(value, Mapping):  # dicts, and transformers' BatchEncoding (a UserDict)
        for item in value.values():
            yield from _iter_tensors(item)


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_cast_floats(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _to_fp32_in_place(module: nn.Module) -> bool:
    """Cast ``module``'s own floating parameters and buffers to FP32, keeping their identity.

    ``param.data = ...`` is what ``module.half()`` itself does, so an optimizer that already holds
    the parameter keeps updating the same object. Returns whether anything changed.
    """
    # Fast path, taken on every forward: nothing to do once the layer is FP32 (the usual case).
    if all(
        t is None or not t.is_floating_point() or t.dtype == torch.float32
        for t in (*module._parameters.values(), *module._buffers.values())
    ):
        return False
    changed = False
    with torch.no_grad():
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()
                if param.grad is not None:
                    param.grad = param.grad.float()
                changed = True
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                setattr(module, name, buf.float())
                changed = True
    return changed


def _state_dict_pre_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    # A state_dict taken after model.half() but before the next forward still holds FP32 norms.
    _to_fp32_in_place(module)


def _has_fp32_hooks(module: nn.Module) -> bool:
    return any(isinstance(getattr(h, "__self__", None), _Fp32Norm) for h in _pre_hooks(module))


def _pre_hooks(module: nn.Module) -> list[Any]:
    return list(module._forward_pre_hooks.values())


def keep_norms_in_fp32(model: nn.Module) -> list[str]:
    """Keep every normalisation layer of ``model`` in FP32, parameters and arithmetic.

    Each norm layer (see :func:`is_norm_module`) gets its parameters and buffers cast to FP32 now
    and a pair of forward hooks that, on every call, re-cast them if something halved them since,
    upcast the inputs, run the layer with autocast disabled and cast the output back to the
    input's dtype. Its ``forward`` becomes an instance attribute that does the same inside one
    ``with`` block, the form ``torch.compile`` can trace. So it holds inside ``torch.autocast``,
    after ``model.half()`` (called before or after this function), under ``torch.compile`` and in
    a model exported to FP16 (TorchScript, ONNX).

    Idempotent: a layer handled by an earlier call (or carried over by ``copy.deepcopy`` or
    pickling) gets no second set of hooks; its parameters are re-cast to FP32 now. Parameter
    names and ``state_dict`` keys are unchanged; the model still pickles, deep-copies and
    ``save_pretrained``s.

    Returns the qualified names of *every* norm layer now kept in FP32, whether this call or an
    earlier one added its hooks, so the answer is the same on every call (an exporter can list
    them even for a model a trainer already prepared).
    """
    covered: list[str] = []  # norms kept in FP32, by this call or an earlier one
    added = 0
    for name, module in model.named_modules():
        if not is_norm_module(module):
            continue
        # A norm nested in a norm (a name-matched wrapper around nn.LayerNorm): the outer one
        # already runs everything inside it in FP32.
        if any(name.startswith(outer + ".") or outer == "" for outer in covered):
            continue
        covered.append(name)
        _to_fp32_in_place(module)
        if _has_fp32_hooks(module):
            continue
        _install_fp32_norm(module)
        added += 1
    if added:
        logger.debug("Kept %d new normalisation layer(s) in fp32 (%d in all)", added, len(covered))
    return covered


# --------------------------------------------------------------------------------------------
# FP32 master weights
# --------------------------------------------------------------------------------------------
def _describe(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return shown + (f" and {more} more" if more > 0 else "")


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
            f"{len(bad)} trainable parameter(s) are not float32: {_describe(bad)}. Mixed-precision "
            "training needs FP32 master weights (autocast does the FP16 maths). Fix: "
            "amp_trainer.precision.cast_trainable_params_to_fp32(model), or load the model "
            "without dtype=torch.float16."
        )


def cast_trainable_params_to_fp32(
    model: nn.Module, frozen_dtype: torch.dtype | None = None
) -> list[str]:
    """Cast trainable floating parameters to FP32 (and frozen ones to ``frozen_dtype`` if given).

    The LoRA / ``modules_to_save`` case: a base model loaded in FP16 to save memory, adapters
    trained on top. Parameters keep their identity (``param.data`` is replaced), so an optimizer
    built earlier still holds them. Norm layers handled by :func:`keep_norms_in_fp32` stay FP32
    even when frozen. Returns the names of the parameters whose dtype changed.
    """
    if frozen_dtype is not None and not (
        isinstance(frozen_dtype, torch.dtype) and frozen_dtype.is_floating_point
    ):
        raise ValueError(
            f"frozen_dtype must be a floating torch.dtype or None, got {frozen_dtype!r}"
        )
    fp32_modules = {
        id(p) for m in model.modules() if _has_fp32_hooks(m) for p in m.parameters(recurse=False)
    }
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

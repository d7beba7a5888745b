"""FP32 islands, the mechanism: which modules are norm layers, the forward wrapper that runs a
module in FP32 under autocast or ``.half()`` and hands its output back in the expected dtype,
and :func:`keep_in_fp32` / :func:`keep_norms_in_fp32`, which make islands.

Which islands a training run needs and how they travel with the model is
:mod:`amp_trainer.islands.records`.
"""

from __future__ import annotations

import fnmatch
import logging
import re
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from amp_trainer.numerics import iter_tensors

__all__ = [
    "is_fp32_island",
    "is_norm_module",
    "is_within",
    "keep_in_fp32",
    "keep_norms_in_fp32",
    "remove_fp32_island",
]

logger = logging.getLogger(__name__)


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


# --------------------------------------------------------------------------------------------
# FP32 islands: modules that compute in FP32 whatever autocast or .half() say
# --------------------------------------------------------------------------------------------
#: What an island hands back under autocast: ``"input"`` casts its output to the input's dtype
#: (norms: their output is bounded, and the surrounding code got that dtype before);
#: ``"fp32"`` keeps it FP32 (an island made because its output does not fit FP16: casting it back
#: would bring the inf back; autocast casts it again for the next FP16 op). Without autocast both
#: cast back to the input's dtype (or to the model's, for a module fed only integer ids), which is
#: what a ``.half()`` model's FP16 weights around the island need.
_AUTOCAST_OUTPUTS = ("input", "fp32")


_F32 = torch.float32
# Looked up once: module attribute lookups are a measurable part of a few-microsecond call.
_is_compiling = torch.compiler.is_dynamo_compiling
_is_autocast_enabled = torch.is_autocast_enabled
_set_autocast_enabled = torch.set_autocast_enabled


class _Fp32Island:
    """The ``forward`` of one FP32 island (set as an instance attribute of its module).

    One object per island, a top-level class rather than a closure so that the model still
    pickles and deep-copies (the reference to its module follows the copy). It replaces the
    module's ``forward`` rather than adding forward hooks: a module with hooks goes through
    ``nn.Module``'s slow call path: the earlier hook pair cost 16-36 us of host time per
    ``LayerNorm(768)`` call, this 3-10 (``benchmarks/islands``). It also keeps the whole
    region in one ``try`` (autocast is restored when the forward raises) and in one ``with`` block
    under ``torch.compile``, the form dynamo can trace. Forward hooks of the module see what its
    callers pass and get.

    Parameters the island does not own are never re-cast: a sharding engine (FSDP2, whose
    ``MixedPrecisionPolicy(param_dtype=float16)`` registers FP16 unsharded copies for the
    forward) swaps its own tensors into the module, and changing their dtype behind its back
    breaks its gradient reduction. The island knows its own parameters (the objects the module
    held when it was made; ``.half()`` changes their ``data``, not the objects) and upcasts a
    swapped-in low-precision one on the fly for the call: the arithmetic is FP32, the storage
    stays the engine's, and the gradient flows back in the parameter's dtype.
    """

    def __init__(self, module: nn.Module, forward: Any, autocast_output: str) -> None:
        self.module = module
        # The forward this one wraps when it is not the class's own (another library's wrapper
        # set as an instance attribute); None means type(module).forward, looked up at call time
        # so that no bound method of the module has to be pickled.
        self.forward = forward
        self.autocast_output = autocast_output
        # The dtype the rest of the model was cast to (seen when .half() halved this module's
        # weights): what a module fed only integer ids hands back without autocast.
        self.outer_dtype: torch.dtype | None = None
        self._refresh()

    def _refresh(self) -> None:
        # The tensors to keep FP32 (the whole subtree), gathered once: checking their dtypes is
        # the only per-call cost when nothing changed. Module-held lists, so a later
        # module.half() (which replaces param.data, not the parameter) is still seen.
        self._holders = [m for m in self.module.modules() if m._parameters or m._buffers]
        # Weak references: an engine that replaced a parameter must be able to free the original.
        self._owned = {
            (id(holder), name): weakref.ref(param)
            for holder in self._holders
            for name, param in holder._parameters.items()
            if param is not None
        }

    def __getstate__(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "forward": self.forward,
            "autocast_output": self.autocast_output,
            "outer_dtype": self.outer_dtype,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.module = state["module"]
        self.forward = state.get("forward")
        self.autocast_output = state.get("autocast_output", "input")
        self.outer_dtype = state.get("outer_dtype")
        # The module may not be fully unpickled yet (a reference cycle): gather lazily.
        self._holders = None  # type: ignore[assignment]

    def ensure_fp32(self) -> tuple[tuple[nn.Module, str], ...]:
        """Re-cast the island's own parameters and buffers to FP32 if something cast them since.

        Returns the low-precision parameters it does not own (swapped in by a sharding engine),
        as ``(module, name)`` pairs: the call upcasts those on the fly instead.
        """
        holders = self._holders
        if holders is None:
            self._refresh()
            holders = self._holders
        # Plain loops and identity tests, no allocation: this runs on every call (one pass over
        # a norm's two parameters when nothing changed, the usual case).
        for holder in holders:
            for tensor in holder._parameters.values():
                if tensor is not None and tensor.dtype is not _F32 and tensor.is_floating_point():
                    return self._sort_out(holders)
            for tensor in holder._buffers.values():
                if tensor is not None and tensor.dtype is not _F32 and tensor.is_floating_point():
                    return self._sort_out(holders)
        return ()

    def _sort_out(self, holders: list[nn.Module]) -> tuple[tuple[nn.Module, str], ...]:
        """Something is not FP32: re-cast what the island owns, list what an engine swapped in."""
        borrowed: list[tuple[nn.Module, str]] = []
        for holder in holders:
            foreign: list[str] = []
            recast = False
            for name, tensor in holder._parameters.items():
                if tensor is not None and tensor.dtype is not _F32 and tensor.is_floating_point():
                    ref = self._owned.get((id(holder), name))
                    if ref is not None and ref() is tensor:
                        recast = True
                    else:
                        foreign.append(name)
            recast = recast or any(
                t is not None and t.dtype is not _F32 and t.is_floating_point()
                for t in holder._buffers.values()
            )
            if recast:
                self._recast(holder, foreign)
            borrowed.extend((holder, name) for name in foreign)
        return tuple(borrowed)

    def _recast(self, holder: nn.Module, foreign: list[str]) -> None:
        outer = _to_fp32_in_place(holder, skip=foreign)
        if outer is not None:
            self.outer_dtype = outer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        borrowed = self.ensure_fp32()
        if borrowed:
            return self._call_upcast(borrowed, args, kwargs)
        return self._call(args, kwargs)

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if _is_compiling():
            return self._traced(args, kwargs)
        # The common case (one hidden-states tensor) without walking nested containers.
        first = args[0] if not kwargs and len(args) == 1 else None
        if not (isinstance(first, torch.Tensor) and first.is_floating_point()):
            first = _first_float(args, kwargs)
        if first is not None:
            device_type, input_dtype = first.device.type, first.dtype
        else:
            device_type, input_dtype = self._device_type(args, kwargs), None
        autocast = device_type in _AUTOCAST_TYPES and _is_autocast_enabled(device_type)
        if not autocast:
            if input_dtype is _F32 or (input_dtype is None and self.outer_dtype is None):
                return self._forward(args, kwargs)  # FP32 in, FP32 out: nothing to do
            if input_dtype is not None:
                args, kwargs = _cast_floats(args, _F32), _cast_floats(kwargs, _F32)
            return self._cast_back(self._forward(args, kwargs), input_dtype, False)
        # The casts too run with autocast off: every op dispatched under autocast pays for it.
        _set_autocast_enabled(device_type, False)
        try:
            if input_dtype is not _F32 and input_dtype is not None:
                if not kwargs and len(args) == 1:
                    args = (first.float(),)  # type: ignore[union-attr]
                else:
                    args, kwargs = _cast_floats(args, _F32), _cast_floats(kwargs, _F32)
            return self._cast_back(self._forward(args, kwargs), input_dtype, True)
        finally:
            _set_autocast_enabled(device_type, True)

    def _call_upcast(
        self, borrowed: tuple[tuple[nn.Module, str], ...], args: tuple[Any, ...], kwargs: Any
    ) -> Any:
        """One call with the engine-owned parameters seen as FP32 copies (differentiable
        ``.float()``: the gradient reaches the engine's tensor in its own dtype), put back after.

        Written into ``_parameters`` directly, as the engines themselves do (``nn.Module``'s
        ``__setattr__`` accepts only ``nn.Parameter`` there)."""
        saved = [(holder, name, holder._parameters[name]) for holder, name in borrowed]
        try:
            for holder, name, tensor in saved:
                holder._parameters[name] = tensor.float()  # type: ignore[union-attr]
            return self._call(args, kwargs)
        finally:
            for holder, name, tensor in saved:
                holder._parameters[name] = tensor

    def _traced(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The same region as one ``with`` block: what dynamo traces (it cannot trace
        ``set_autocast_enabled`` pairs)."""
        first = _first_float(args, kwargs)
        input_dtype = first.dtype if first is not None else None
        device_type = first.device.type if first is not None else self._device_type(args, kwargs)
        args, kwargs = _cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)
        autocast = device_type in _AUTOCAST_TYPES and torch.is_autocast_enabled(device_type)
        if autocast:
            with torch.autocast(device_type=device_type, enabled=False):
                output = self._forward(args, kwargs)
        else:
            output = self._forward(args, kwargs)
        return self._cast_back(output, input_dtype, autocast)

    def _cast_back(self, output: Any, input_dtype: torch.dtype | None, autocast: bool) -> Any:
        if autocast and self.autocast_output == "fp32":
            return output
        target = input_dtype if input_dtype is not None else self.outer_dtype
        if output is None or target is None or target is _F32:
            return output
        if isinstance(output, torch.Tensor):
            return output.to(target) if output.is_floating_point() else output
        return _cast_floats(output, target)

    def _device_type(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        for tensor in iter_tensors((args, kwargs)):
            return tensor.device.type
        for holder in self._holders or ():
            for tensor in holder._parameters.values():
                if tensor is not None:
                    return tensor.device.type
        return "cpu"

    def _forward(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        forward = self.forward
        if forward is None:
            module = self.module
            return type(module).forward(module, *args, **kwargs)
        return forward(*args, **kwargs)


# Device types autocast exists for, asked once (is_autocast_available is not free per call).
_AUTOCAST_TYPES = frozenset(
    t
    for t in ("cpu", "cuda", "xpu", "mps", "hpu", "xla", "mtia", "ipu", "maia")
    if torch.amp.autocast_mode.is_autocast_available(t)
)


def _island_of(module: nn.Module) -> _Fp32Island | None:
    """The island object running ``module``'s forward, looking through wrappers set later
    (Accelerate's ``add_hook_to_module`` keeps the previous forward as ``_old_forward``)."""
    forward = module.__dict__.get("forward")
    for _ in range(8):
        if isinstance(forward, _Fp32Island):
            return forward
        if forward is None:
            break
        forward = getattr(forward, "__wrapped__", None) or module.__dict__.get("_old_forward")
        if forward is module.__dict__.get("forward"):
            break
    old = module.__dict__.get("_old_forward")
    return old if isinstance(old, _Fp32Island) else None


def is_fp32_island(module: nn.Module) -> bool:
    """Whether ``module`` computes in FP32 through :func:`keep_in_fp32` (or the norm policy)."""
    return _island_of(module) is not None


def _install_island(module: nn.Module, autocast_output: str) -> _Fp32Island:
    current = module.__dict__.get("forward")
    if getattr(current, "__self__", None) is module and getattr(
        current, "__func__", None
    ) is getattr(type(module), "forward", None):
        current = None  # a bound copy of the class's own forward: nothing to keep
    island = _Fp32Island(module, current, autocast_output)
    module.forward = island
    # A state_dict taken after model.half() but before the next forward still holds FP32.
    module.register_state_dict_pre_hook(_state_dict_pre_hook)
    return island


def remove_fp32_island(module: nn.Module) -> None:
    """Undo :func:`keep_in_fp32` for one module (the exporter widening an island). Its
    parameters stay where they are; the next ``.half()`` halves them."""
    island = module.__dict__.get("forward")
    if not isinstance(island, _Fp32Island):
        return
    if island.forward is None:
        del module.forward
    else:
        module.forward = island.forward
    for key, hook in list(module._state_dict_pre_hooks.items()):
        if hook is _state_dict_pre_hook:
            del module._state_dict_pre_hooks[key]


def _first_float(*values: Any) -> torch.Tensor | None:
    for tensor in iter_tensors(values):
        if tensor.is_floating_point():
            return tensor
    return None


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor inside ``value`` (tensors, tuples, lists, dicts, ModelOutputs)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() and value.dtype != dtype else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(_cast_floats(v, dtype) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        cast = {k: _cast_floats(v, dtype) for k, v in value.items()}
        if type(value) is dict:
            return cast
        try:  # keep ModelOutput and other dict subclasses what they were
            return type(value)(**cast)
        except TypeError:
            return cast
    return value


def _to_fp32_in_place(module: nn.Module, skip: Iterable[str] = ()) -> torch.dtype | None:
    """Cast ``module``'s own floating parameters and buffers to FP32, keeping their identity.

    ``param.data = ...`` is what ``module.half()`` itself does, so an optimizer that already holds
    the parameter keeps updating the same object. Parameters named in ``skip`` (a sharding
    engine's, see :class:`_Fp32Island`) are left alone. Returns the dtype they had been cast to,
    or ``None`` if nothing changed.
    """
    # Fast path: nothing to do once the module is FP32 (the usual case).
    if all(
        t is None or not t.is_floating_point() or t.dtype == torch.float32
        for t in (*module._parameters.values(), *module._buffers.values())
    ):
        return None
    was: torch.dtype | None = None
    with torch.no_grad():
        skipped = set(skip)
        for name, param in module.named_parameters(recurse=False):
            if name in skipped:
                continue
            if param.is_floating_point() and param.dtype != torch.float32:
                was = param.dtype
                param.data = param.data.float()
                if param.grad is not None:
                    param.grad = param.grad.float()
        for name, buf in module.named_buffers(recurse=False):
            if buf is not None and buf.is_floating_point() and buf.dtype != torch.float32:
                was = was or buf.dtype
                setattr(module, name, buf.float())
    return was


def _subtree_to_fp32(module: nn.Module) -> torch.dtype | None:
    """:func:`_to_fp32_in_place` on ``module`` and everything in it; the dtype seen, if any."""
    seen = None
    for sub in module.modules():
        seen = _to_fp32_in_place(sub) or seen
    return seen


def _state_dict_pre_hook(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    # A state_dict taken after model.half() but before the next forward still holds FP32.
    island = _island_of(module)
    if island is not None:
        island.ensure_fp32()


def _matches(name: str, spec: str | re.Pattern[str]) -> bool:
    """``spec`` names ``name``: a regex (full match), or a qualified name, a dotted suffix of one
    (``"wo"``, ``"DenseReluDense.wo"``, as transformers' ``_keep_in_fp32_modules`` are written),
    or a glob of either (``"encoder.block.*.wo"``)."""
    if isinstance(spec, re.Pattern):
        return spec.fullmatch(name) is not None
    if name == spec or name.endswith("." + spec):
        return True
    if any(c in spec for c in "*?["):
        return fnmatch.fnmatchcase(name, spec) or fnmatch.fnmatchcase(name, "*." + spec)
    return False


def is_within(name: str, outer: str) -> bool:
    """Module ``name`` is ``outer`` or inside it (``""``, the root, holds every module)."""
    return outer == "" or name == outer or name.startswith(outer + ".")


def keep_in_fp32(
    model: nn.Module,
    modules: str | re.Pattern[str] | Iterable[str | re.Pattern[str]],
    *,
    autocast_output: str = "fp32",
    missing_ok: bool = False,
) -> list[str]:
    """Make the named modules of ``model`` FP32 islands: FP32 parameters *and* arithmetic.

    An island computes in FP32 whatever ``torch.autocast`` or ``model.half()`` say: on every call
    it re-casts its parameters and buffers to FP32 if something halved them since (in place: an
    optimizer holding them keeps the same objects), upcasts floating inputs, runs with autocast
    disabled and hands back what the surrounding code expects: without autocast the input's
    dtype (the model's, for a module fed only integer ids), so the FP16 layers after it get FP16;
    under autocast FP32 (``autocast_output="fp32"``, the default: a value that overflowed FP16
    must not be cast back to it; the next autocast op casts it as it needs) or the input's dtype
    (``"input"``, what the norm policy uses). The one mechanism behind the FP32 norms, the
    ``fp32_modules`` option, transformers' ``_keep_in_fp32_modules``, the trainer's
    forward-overflow fallback and the FP16 exporter.

    Args:
        model: the model; changed in place.
        modules: names or patterns: a qualified name
            (``"encoder.block.0.layer.1.DenseReluDense.wo"``), a dotted suffix that matches every
            module ending so (``"wo"``), a glob (``"encoder.block.*.wo"``) or a compiled regex
            (full match).
        autocast_output: ``"fp32"`` or ``"input"``, see above.
        missing_ok: a name that matches no module is ignored instead of a ``ValueError``.

    Tied parameters: a parameter has one dtype, so every module that uses a parameter of an
    island becomes an island too (GPT-2's ``lm_head`` shares ``transformer.wte.weight``: keeping
    ``wte`` FP32 in a halved model would hand ``lm_head`` FP32 weights and FP16 inputs).

    Idempotent and safe to call on a copied or unpickled model (its islands come along and are
    recognised); a module inside an island is covered by it. ``state_dict`` keys and parameter
    names are unchanged; the model still pickles, deep-copies, ``save_pretrained``s and runs under
    ``torch.compile``, TorchScript tracing and ONNX export.

    Returns the qualified names of the islands that cover what was asked, plus those added for
    tied parameters, in model order (the same answer on every call).
    """
    if autocast_output not in _AUTOCAST_OUTPUTS:
        raise ValueError(
            f"autocast_output must be one of {_AUTOCAST_OUTPUTS}, got {autocast_output!r}"
        )
    specs = [modules] if isinstance(modules, (str, re.Pattern)) else list(modules)
    for spec in specs:
        if not isinstance(spec, (str, re.Pattern)):
            raise TypeError(
                f"keep_in_fp32() takes module names or patterns (str or re.Pattern), got "
                f"{spec!r} ({type(spec).__name__})"
            )
    named = list(model.named_modules())
    wanted = [name for name, _ in named if any(_matches(name, spec) for spec in specs)]
    if not missing_ok:
        found = {spec for spec in specs for name in wanted if _matches(name, spec)}
        missing = [spec for spec in specs if spec not in found]
        if missing:
            sample = ", ".join(repr(n) for n, _ in named[1:6])
            raise ValueError(
                f"keep_in_fp32(): no module of {type(model).__name__} matches "
                f"{', '.join(repr(getattr(s, 'pattern', s)) for s in missing)}; give qualified "
                f"names (e.g. {sample}), a dotted suffix such as 'wo', a glob or a regex"
            )
    return _make_islands(model, named, wanted, autocast_output)


def _make_islands(
    model: nn.Module,
    named: list[tuple[str, nn.Module]],
    wanted: list[str],
    autocast_output: str,
) -> list[str]:
    modules = dict(named)
    existing = [name for name, module in named if is_fp32_island(module)]
    covered: list[str] = []
    for name in wanted:
        if any(is_within(name, outer) for outer in covered):
            continue  # inside an island asked for in this call
        outer = next((o for o in existing if is_within(name, o) and o != name), None)
        if outer is not None:
            covered.append(outer)  # inside an existing island: that one covers it
            continue
        covered.append(name)
    # Tied parameters: every module holding a parameter of an island joins (closure).
    queue = list(covered)
    while queue:
        inside_ids = {id(p) for island in queue for p in modules[island].parameters()}
        queue = []
        for name, module in named:
            if any(is_within(name, c) for c in covered):
                continue
            shared = [n for n, p in module.named_parameters(recurse=False) if id(p) in inside_ids]
            if shared:
                logger.info(
                    "Keeping %r in FP32 too: it shares %s with an FP32 island",
                    name,
                    ", ".join(shared),
                )
                covered.append(name)
                queue.append(name)
    # The dtype each island's subtree was cast to, before any is made FP32. Modules that share a
    # parameter are cast once: the first one in the loop sees the FP16 it had, the others see it
    # FP32 already, so they take the dtype the others saw (an embedding tied to an island, fed
    # only ids, must still hand FP16 to the FP16 layers after it).
    outers = {name: _subtree_to_fp32(modules[name]) for name in covered}
    seen = next((dtype for dtype in outers.values() if dtype is not None), None)
    added = 0
    for name in covered:
        module = modules[name]
        outer = outers[name] or seen
        island = _island_of(module)
        if island is not None:
            island.outer_dtype = outer or island.outer_dtype
            island._refresh()  # the parameters the module holds now are the island's own
            if autocast_output == "fp32":
                island.autocast_output = "fp32"  # an overflow fix outranks the norm policy
            continue
        _install_island(module, autocast_output).outer_dtype = outer
        added += 1
    if added:
        logger.debug("Made %d new FP32 island(s) (%d covered)", added, len(covered))
    order = {name: i for i, (name, _) in enumerate(named)}
    return sorted(dict.fromkeys(covered), key=order.__getitem__)


def keep_norms_in_fp32(model: nn.Module) -> list[str]:
    """Keep every normalisation layer of ``model`` in FP32, parameters and arithmetic.

    The norm policy of :func:`keep_in_fp32`: each norm layer (see :func:`is_norm_module`)
    becomes an FP32 island that hands back its input's dtype, under autocast too (a norm's output
    is bounded, and the code after it got that dtype before). So it holds inside
    ``torch.autocast``, after ``model.half()`` (called before or after this function), under
    ``torch.compile`` and in a model exported to FP16 (TorchScript, ONNX).

    Idempotent: a layer handled by an earlier call (or carried over by ``copy.deepcopy`` or
    pickling) is not wrapped twice; its parameters are re-cast to FP32 now. Parameter names and
    ``state_dict`` keys are unchanged; the model still pickles, deep-copies and
    ``save_pretrained``s.

    Returns the qualified names of *every* norm layer now kept in FP32, whether this call or an
    earlier one made it an island, so the answer is the same on every call (an exporter can list
    them even for a model a trainer already prepared).
    """
    named = list(model.named_modules())
    norms: list[str] = []
    for name, module in named:
        # A norm nested in a norm (a name-matched wrapper around nn.LayerNorm): the outer one
        # already runs everything inside it in FP32.
        if is_norm_module(module) and not any(is_within(name, outer) for outer in norms):
            norms.append(name)
    if norms:
        exact = re.compile("|".join(re.escape(name) for name in norms))
        keep_in_fp32(model, exact, autocast_output="input")
    return norms

"""Who changed a dtype: ``nn.Module._apply`` seen while a guard is open, and the guard's
forward pre-hook (a weak reference, so models still copy and pickle)."""

from __future__ import annotations

import os
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["TRACKER", "ApplyTracker", "Cast", "ForwardWatch", "call_site"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

# The conversion methods themselves (torch's, and the overrides of transformers, PEFT, ...):
# the call site is whoever called them.
_CONVERSIONS = frozenset(("to", "half", "float", "bfloat16", "double", "type", "cuda", "_apply"))


def call_site() -> str:
    """The first frame outside torch, this module and the conversion methods: who called
    ``.to()``/``.half()``."""
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        inside = path.startswith(_TORCH_DIR) or path.startswith(_PACKAGE_DIR)
        if not inside and frame.f_code.co_name not in _CONVERSIONS:
            return f"{path}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "an unknown caller"


@dataclass
class Cast:
    """What a watched ``Module._apply`` did to one parameter."""

    site: str
    kept: torch.Tensor | None  # the tensor it replaced (the exact FP32 values), while held
    under_no_grad: bool


class ApplyTracker:
    """``nn.Module._apply`` (what ``.to()``, ``.half()``, ``.float()``, ``.cuda()`` call), seen.

    Patched into ``nn.Module`` while at least one guard is open, never at import, and put back
    when the last one closes. Only the outermost call of a recursion looks at dtypes, so a cast
    of a whole model costs one pass over its parameters before and after. (Guards are typed
    ``Any`` here: this module sits below :mod:`~amp_trainer.precision_guard.guard`, which
    imports it.)
    """

    def __init__(self) -> None:
        self.guards: weakref.WeakSet[Any] = weakref.WeakSet()
        self.torch_apply: Any = None
        self.installed = False
        self.local = threading.local()
        self.lock = threading.Lock()

    def add(self, guard: Any) -> None:
        with self.lock:
            self.guards.add(guard)
            if not self.installed:
                if self.torch_apply is None:
                    self.torch_apply = nn.Module._apply
                tracker = self

                def _apply(module: nn.Module, fn: Any, *args: Any, **kwargs: Any) -> Any:
                    return tracker.apply(module, fn, args, kwargs)

                nn.Module._apply = _apply  # type: ignore[method-assign]
                self.installed = True

    def discard(self, guard: Any) -> None:
        with self.lock:
            self.guards.discard(guard)
            if not self.guards and self.installed:
                nn.Module._apply = self.torch_apply  # type: ignore[method-assign]
                self.installed = False

    def apply(self, module: nn.Module, fn: Any, args: Any, kwargs: Any) -> Any:
        if getattr(self.local, "depth", 0) or not self.guards:
            return self.torch_apply(module, fn, *args, **kwargs)
        before = [(g, g.watched_in(module)) for g in list(self.guards)]
        before = [(g, params) for g, params in before if params]
        self.local.depth = 1
        try:
            result = self.torch_apply(module, fn, *args, **kwargs)
        finally:
            self.local.depth = 0
        if before:
            site, no_grad = call_site(), not torch.is_grad_enabled()
            for guard, params in before:
                guard.saw_apply(params, site, no_grad)
        return result


TRACKER = ApplyTracker()


class ForwardWatch:
    """The guard's forward pre-hook: a weak reference, so a model that is copied, pickled or
    saved whole carries a hook that does nothing rather than the guard and its run."""

    def __init__(self, guard: Any) -> None:
        self.guard: Any = weakref.ref(guard)

    def __call__(self, module: nn.Module, args: Any) -> None:
        guard = self.guard()
        if guard is not None and not guard.closed:
            guard.before_forward(module)

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.guard = lambda: None

    def __deepcopy__(self, memo: dict[int, Any]) -> ForwardWatch:
        copy = ForwardWatch.__new__(ForwardWatch)
        copy.guard = lambda: None
        return copy

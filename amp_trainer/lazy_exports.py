"""Module attributes resolved on first use (PEP 562), for a package's public names.

``amp_trainer`` and ``amp_trainer.recipes`` both export names whose modules pull in transformers
or accelerate; resolving each on first access keeps ``import amp_trainer`` cheap. Both packages
get their ``__getattr__`` / ``__dir__`` from :func:`lazy_attributes`, so that the lookup, the
error a missing name raises and the caching are one piece of code.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(
    namespace: dict[str, Any], where: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The ``__getattr__`` and ``__dir__`` of the package whose ``globals()`` is ``namespace``.

    ``where`` maps each lazily exported name to the module that defines it. A name resolved once
    is written into ``namespace``, so the next lookup is a plain module attribute and this
    ``__getattr__`` is not called again. ``__dir__`` lists what is loaded and ``__all__``.
    """
    package = namespace["__name__"]

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted([*namespace, *namespace.get("__all__", ())])

    return __getattr__, __dir__

"""Which modules are FP32 islands in a training run, and recording them with the model: the
policy one call applies (:func:`apply_fp32_policy`: norms, transformers' declared FP32 modules,
islands recorded by an earlier run, the user's), and the ``model.config`` key
(:data:`ISLANDS_CONFIG_KEY`) that makes a saved model, every Trainer checkpoint and an FP16 export
carry them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from amp_trainer.islands.engine import (
    is_fp32_island,
    is_norm_module,
    is_within,
    keep_in_fp32,
    keep_norms_in_fp32,
)

__all__ = [
    "ISLANDS_CONFIG_KEY",
    "apply_fp32_policy",
    "declared_fp32_modules",
    "fp32_islands",
    "record_fp32_islands",
    "recorded_fp32_islands",
    "restore_fp32_islands",
]

logger = logging.getLogger(__name__)

#: The ``model.config`` key under which training records its non-norm FP32 islands, so that
#: ``save_pretrained`` (and so every Trainer checkpoint) carries them in config.json.
ISLANDS_CONFIG_KEY = "amp_trainer_fp32_modules"


def fp32_islands(model: nn.Module) -> list[str]:
    """The outermost FP32 islands of ``model`` that are not norm layers: what ``fp32_modules``,
    ``_keep_in_fp32_modules`` and the forward-overflow fallback added to the norm policy."""
    found: list[str] = []
    for name, module in model.named_modules():
        if any(is_within(name, outer) for outer in found):
            continue
        if is_fp32_island(module) and not is_norm_module(module):
            found.append(name)
    return found


def record_fp32_islands(model: nn.Module) -> list[str]:
    """Write :func:`fp32_islands` into ``model.config`` (:data:`ISLANDS_CONFIG_KEY`); returns
    them. A model without a transformers config is left alone."""
    names = fp32_islands(model)
    config = getattr(model, "config", None)
    if config is not None and callable(getattr(config, "update", None)):
        config.update({ISLANDS_CONFIG_KEY: names})
    return names


def recorded_fp32_islands(config: Any) -> list[str]:
    """The island names a config (object or ``config.json`` dict) recorded, else ``[]``."""
    if isinstance(config, Mapping):
        value = config.get(ISLANDS_CONFIG_KEY)
    else:
        value = getattr(config, ISLANDS_CONFIG_KEY, None)
    if value is None:
        return []
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(
            f"config key {ISLANDS_CONFIG_KEY!r} must be a list of module names, got {value!r}"
        )
    return list(value)


def restore_fp32_islands(model: nn.Module, names: Iterable[str]) -> list[str]:
    """Make recorded islands (exact qualified names) FP32 islands again; names the model lacks
    are skipped with a warning (a checkpoint of another model). Returns what is covered."""
    modules = dict(model.named_modules())
    names = list(dict.fromkeys(names))
    missing = [n for n in names if n not in modules]
    if missing:
        logger.warning("Recorded FP32 islands not in this model, ignored: %s", ", ".join(missing))
    present = [n for n in names if n in modules]
    if not present:
        return []
    logger.info("FP32 islands restored: %s", ", ".join(present))
    return keep_in_fp32(model, [re.compile(re.escape(n)) for n in present])


def declared_fp32_modules(model: nn.Module, precision: str) -> list[str]:
    """transformers' own FP32 list for ``precision``: ``_keep_in_fp32_modules`` under fp16,
    ``_keep_in_fp32_modules_strict`` under fp16 and bf16 (as ``from_pretrained`` reads them;
    instance values first, which transformers 5 fills from every submodel)."""
    names: list[str] = []
    if precision == "fp16":
        names += list(getattr(model, "_keep_in_fp32_modules", None) or ())
    if precision in ("fp16", "bf16"):
        names += list(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    return list(dict.fromkeys(n for n in names if isinstance(n, str)))


def apply_fp32_policy(
    model: nn.Module,
    precision: str,
    *,
    norms: bool = True,
    modules: str | Iterable[str | re.Pattern[str]] = (),
) -> list[str]:
    """Every FP32 island a ``precision`` training run needs, in one call (Trainer, Accelerate).

    Under fp16/bf16: the norm layers (``norms``), the model's declared FP32 modules
    (:func:`declared_fp32_modules`), the islands recorded in its config by an earlier run
    (:data:`ISLANDS_CONFIG_KEY`: a model saved after the forward-overflow fallback added some) and
    the user's ``modules`` (names or patterns; one that matches nothing is a ``ValueError``).
    Under fp32 nothing is needed, and nothing is done. Idempotent; records the non-norm islands
    in the config and returns them.
    """
    if precision not in ("fp16", "bf16"):
        return []
    if norms:
        keep_norms_in_fp32(model)
    declared = declared_fp32_modules(model, precision)
    if declared:
        keep_in_fp32(model, declared, missing_ok=True)
    recorded = recorded_fp32_islands(getattr(model, "config", None))
    if recorded:
        restore_fp32_islands(model, recorded)
    wanted = [modules] if isinstance(modules, (str, re.Pattern)) else list(modules)
    if wanted:
        keep_in_fp32(model, wanted)
    if declared or recorded or wanted or fp32_islands(model):
        return record_fp32_islands(model)
    return []

"""What the FP16 copy keeps in FP32: norms, the model's own islands, and the overflow guard.

Steps 1 and 2 of :mod:`amp_trainer.export`'s flow, and the same islands again when an export is
reloaded. The only export module that uses the overflow probe and the FP32-island machinery.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from amp_trainer.islands import (
    fp32_islands,
    keep_in_fp32,
    keep_norms_in_fp32,
    recorded_fp32_islands,
    remove_fp32_island,
    restore_fp32_islands,
)
from amp_trainer.numerics import FP16_MAX, OverflowProbe

logger = logging.getLogger(__name__)


def _exactly(name: str) -> re.Pattern[str]:
    """``name`` as a keep_in_fp32 pattern matching that one module (not every ``*.name``)."""
    return re.compile(re.escape(name))


def _restore_fp32_weights(model: nn.Module, source: nn.Module, names: Iterable[str]) -> None:
    """Give the islands ``names`` of the halved ``model`` the FP32 source's exact weights.

    ``.half()`` rounded them (or turned them into ``inf``: a weight above 65504 does not survive
    the cast); the island made them FP32 again but cannot undo the rounding. State-dict keys are
    unchanged by islands, so the source's keys address the same tensors.
    """
    modules = dict(model.named_modules())
    source_modules = dict(source.named_modules())
    with torch.no_grad():
        for name in names:
            if name not in source_modules:
                continue
            reference = source_modules[name].state_dict()
            for key, value in modules[name].state_dict().items():
                if key in reference and value.is_floating_point():
                    value.copy_(reference[key].to(torch.float32))


def keep_known_fp32(
    fp16: nn.Module, source: nn.Module, keep_norms: bool
) -> tuple[list[str], list[str]]:
    """Make the halved copy's norms (when ``keep_norms``) and its own islands FP32 again.

    Islands the model came with (trained with fp32_modules, _keep_in_fp32_modules or the
    forward-overflow fallback) stay FP32, with the modules tied to them; a model loaded from a
    folder has them in its config (AmpTrainer records them there). Their weights are the FP32
    ``source``'s. Returns (norm module names, island module names).
    """
    norms = keep_norms_in_fp32(fp16) if keep_norms else []
    own = [*fp32_islands(fp16), *recorded_fp32_islands(getattr(fp16, "config", None))]
    own = restore_fp32_islands(fp16, own) if own else []
    _restore_fp32_weights(fp16, source, [*norms, *own])
    return norms, own


def reinstate_fp32_islands(model: nn.Module, norms: Sequence[str], guarded: Sequence[str]) -> None:
    """Make a reloaded export's FP32 modules islands again (their weights are FP32 already).

    Every norm when the export kept ``norms``; each module in ``guarded`` exactly (that module,
    not every module of the same name).
    """
    if norms:
        keep_norms_in_fp32(model)
    if guarded:
        keep_in_fp32(model, [_exactly(name) for name in guarded])


def fp32_weight_share(model: nn.Module) -> float:
    """The fraction of the model's floating weights (shared ones counted once) kept FP32."""
    seen: set[int] = set()
    fp32 = total = 0
    for param in model.parameters():
        if id(param) in seen or not param.is_floating_point():
            continue
        seen.add(id(param))
        total += param.numel()
        fp32 += param.numel() if param.dtype == torch.float32 else 0
    return fp32 / total if total else 0.0


def _enclosing_called(name: str, called: set[str]) -> str:
    """The nearest ancestor of ``name`` that ran a forward (``""`` is the root)."""
    while name:
        name = name.rsplit(".", 1)[0] if "." in name else ""
        if name in called:
            return name
    return ""


def guard_overflows(
    model: nn.Module,
    source: nn.Module,
    inputs: Mapping[str, torch.Tensor],
    max_iterations: int,
    kept: Iterable[str] = (),
) -> tuple[list[str], list[str], list[str]]:
    """Keep modules in FP32 until an FP16 forward on ``inputs`` is clean (bounded).

    Returns (guarded module names, modules kept FP32 because they share a parameter with a
    guarded one, failures). Each iteration runs one forward with probes: the first overflowing
    module becomes an island (:func:`~amp_trainer.islands.keep_in_fp32`); an island that itself
    overflows (its FP32 output does not fit FP16) is replaced by its nearest enclosing module that
    runs a forward (not a ModuleList), whose descendants' islands are dropped. ``kept`` are islands
    the model came with (they are widened the same way). Island weights come from ``source``
    (the FP32 model), not from the halved copy. Tied parameters: a module that shares one with an
    island becomes an island too (GPT-2's ``lm_head`` and ``transformer.wte``), so no module ever
    meets FP32 weights with FP16 inputs. An island whose caller then fails (it casts the island's
    input to the island's FP32 weight dtype and cannot use the FP32 it gets back) is widened the
    same way.
    """
    modules = dict(model.named_modules())
    islands: list[str] = []
    tied: list[str] = []
    called: set[str] = set()  # the modules the last clean-running forward called
    for _ in range(max_iterations):
        try:
            with (
                OverflowProbe(model, limit=FP16_MAX, skip_under=[*kept, *islands, *tied]) as probe,
                torch.no_grad(),
            ):
                model(**inputs)
        except RuntimeError as err:
            if not islands or not called:
                raise  # the model's own failure, not one an island of ours caused
            # The newest island broke its caller: code that casts a module's input to that
            # module's weight dtype (T5 does so for "wo") hands the island FP32 and gets FP32
            # back, which the FP16 layers after it refuse. Its enclosing module, fed FP16,
            # hands back FP16.
            culprit = islands[-1]
            target = _enclosing_called(culprit, called)
            logger.info("Overflow guard: island %r broke its caller (%s)", culprit, err)
        else:
            called = set(probe.called)
            culprit = probe.first
            if culprit is None:
                return sorted(islands), sorted(tied), []
            target = culprit
            if culprit in islands or culprit in tied or culprit in kept:
                target = _enclosing_called(culprit, probe.called)
        if target == "":
            return (
                sorted(islands),
                sorted(tied),
                [
                    f"module {culprit or '<root>'!r} overflows FP16 and no enclosing module below "
                    "the root brings its output back into the FP16 range; this model cannot be "
                    "exported to FP16 as is"
                ],
            )
        for name in [n for n in [*islands, *tied] if n.startswith(target + ".")]:
            remove_fp32_island(modules[name])
            (islands if name in islands else tied).remove(name)
        logger.info("Overflow guard: keeping %r in FP32 (first FP16 overflow: %r)", target, culprit)
        covered = keep_in_fp32(model, _exactly(target))
        _restore_fp32_weights(model, source, covered)
        islands.append(target)
        for name in covered:
            if name != target and name not in tied and name not in kept:
                logger.info("Overflow guard: keeping %r in FP32 too (tied to %r)", name, target)
                tied.append(name)
    return (
        sorted(islands),
        sorted(tied),
        [
            f"overflow guard gave up after {max_iterations} iterations; still overflowing: "
            f"{sorted(islands)}"
        ],
    )

"""Divergence or an FP16 layer: the judgement on a forward overflow.

A run whose learning rate is far too high overflows FP16 too, and an FP32 island would only hide
it. :class:`DivergenceJudge` remembers what "when training started" was (the parameter norms at
the first observed forward, the first and latest micro-batch losses, as references: read back on
overflow steps only) and, for the module an overflow is blamed on, says whether the run is
diverging. The rule (docs/guides/nan-triage.md, "Divergence"): one strong sign or two weak ones.

* strong: the culprit's weights grew >= 10x since the first step, or the loss rose past
  :func:`loss_diverged`;
* weak: >= 3x weight growth, a loss twice its first values, >= 3 modules with parameters out of
  FP16's range at once in FP32.

A diverging run raises :class:`DivergenceError` naming the learning rate and the evidence, or
(``on_divergence="warn"``) warns once and goes on. :func:`loss_diverged` is also the doctor's rule.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections import deque
from typing import Any

import torch
from torch import nn

from amp_trainer.numerics import describe_module, describe_names

try:  # a sharding engine's parameters (FSDP2, tensor parallel) are DTensors
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support
    DTensor = None  # type: ignore[assignment,misc]

__all__ = [
    "DIVERGENCE_POLICIES",
    "DivergenceError",
    "DivergenceJudge",
    "check_divergence_policy",
    "loss_diverged",
]

logger = logging.getLogger(__name__)

#: What a forward overflow that is really divergence does: stop the run, or warn once and go on.
DIVERGENCE_POLICIES = ("raise", "warn")
# The evidence that an overflow is divergence, not an FP16-unfriendly layer. One strong sign is
# enough, two weak ones too. A healthy run moves a layer's weight norm by a few percent, at most
# a few-fold over a long from-scratch run; one AdamW step at lr 10 moves it ~500-fold.
_WEIGHT_GROWTH = 10.0  # strong: the culprit's weight norm over its norm at the first step
_WEAK_WEIGHT_GROWTH = 3.0
_LOSS_RISE = 4.0  # strong: the loss above this multiple of its first values (see loss_diverged)
_WEAK_LOSS_RISE = 2.0
_LOSS_MARGIN = 1.0  # absolute margin, so a loss that starts near 0 may still wobble
_AT_ONCE = 3  # weak: modules with parameters leaving FP16's range at once, in FP32
_FIRST_LOSSES = 4  # micro-batch losses whose median is "the first values"
_RECENT_LOSSES = 16  # micro-batch losses remembered before an overflow (references, no sync)


class DivergenceError(FloatingPointError):
    """The run is diverging (weights or loss far beyond their values when training started):
    the forward overflow is a symptom of the learning rate, not of FP16, and an FP32 island would
    only hide it. A ``FloatingPointError``, like
    :class:`~amp_trainer.forward_overflow.NonFiniteForwardError`."""


def loss_diverged(first: float, later: float, rise: float = _LOSS_RISE) -> bool:
    """Whether a loss of ``later`` is far above a first value of ``first``: more than ``rise``
    times it (by ``|first|``, so a negative objective works too) plus an absolute margin of 1.

    The one rule the guard and the doctor share: 0.69 -> 3.8 is divergence, 0.69 -> 2.1 is not;
    a language model starting at 10.8 diverges above 44.
    """
    return later - first > (rise - 1.0) * abs(first) + _LOSS_MARGIN


def check_divergence_policy(value: Any) -> str:
    """``value`` if it is one of :data:`DIVERGENCE_POLICIES`, else a ``ValueError`` naming them."""
    if value not in DIVERGENCE_POLICIES:
        raise ValueError(f"on_divergence must be one of {DIVERGENCE_POLICIES}, got {value!r}")
    return value


class DivergenceJudge:
    """Tells a diverging run from an FP16-unfriendly layer, for one model (see the module doc).

    Args:
        model: the model being trained, unwrapped: the names of the culprits are its own.
        on_divergence: ``"raise"`` or ``"warn"`` (see :meth:`report`).
        optimizer: the optimizer, to name its learning rate in the message (may be set later as
            the ``optimizer`` attribute).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        on_divergence: str = "raise",
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        self.model = model
        self.on_divergence = check_divergence_policy(on_divergence)
        self.optimizer = optimizer
        self._reference_norms: dict[str, float] | None = None
        self._first_losses: list[torch.Tensor] = []
        self._recent_losses: deque[torch.Tensor] = deque(maxlen=_RECENT_LOSSES)
        self._warned = False

    def observe(self, loss: torch.Tensor) -> None:
        """Remember one micro-batch's (detached) loss. No device sync, except once, at the first
        call: the parameter norms divergence is measured against."""
        if self._reference_norms is None:
            self.remember_start()
        if len(self._first_losses) < _FIRST_LOSSES:
            self._first_losses.append(loss)
        self._recent_losses.append(loss)

    def remember_start(self) -> None:
        """Record the parameter norms divergence is measured against: "when training started".
        One pass over the parameters and one device-to-host transfer."""
        self._reference_norms = _parameter_norms(self.model.named_parameters())

    def evidence(self, culprit: str, at_once: list[str]) -> tuple[str, ...]:
        """Why an overflow blamed on ``culprit`` is divergence, not an FP16 layer; empty when it
        is not. ``at_once``: the modules with parameters out of FP16's range in the FP32 re-run.
        Reads back the culprit's parameter norms and the remembered losses (overflow steps only).
        """
        strong: list[str] = []
        weak: list[str] = []
        growth = self._weight_growth(culprit)
        if growth is not None:
            ratio, before, now = growth
            text = (
                f"the weights of {culprit!r} grew {ratio:.3g}x since the first step (norm "
                f"{before:.3g} -> {now:.3g})"
            )
            if ratio >= _WEIGHT_GROWTH:
                strong.append(text)
            elif ratio >= _WEAK_WEIGHT_GROWTH:
                weak.append(text)
        trend = self._loss_trend()
        if trend is not None:
            first, latest = trend
            text = f"the loss rose from {first:.3g} to {latest:.3g}"
            if loss_diverged(first, latest):
                strong.append(text)
            elif loss_diverged(first, latest, _WEAK_LOSS_RISE):
                weak.append(text)
        if len(at_once) >= _AT_ONCE:
            weak.append(
                f"{len(at_once)} modules leave FP16's range at once even in FP32 "
                f"({describe_names(at_once)})"
            )
        if strong or len(weak) >= 2:
            return tuple(strong + weak)
        return ()

    def report(self, step: int, culprit: str, evidence: tuple[str, ...]) -> None:
        """Say that the run is diverging: raise :class:`DivergenceError` (``"raise"``), or warn
        once and log later steps at INFO (``"warn"``)."""
        message = (
            f"Step {step}: training is diverging at {self._learning_rate()}; this is not "
            f"an FP16 problem. {describe_module(self.model, culprit)} overflows FP16 because the "
            f"run is blowing up: {'; '.join(evidence)}. An FP32 island would only hide the "
            "divergence, so none was added. Lower the learning rate (or add warmup and gradient "
            "clipping, max_grad_norm) and restart from a checkpoint saved before the loss rose."
        )
        if self.on_divergence == "raise":
            raise DivergenceError(
                message + " To go on anyway (no islands, the overflowing steps skipped): "
                "on_divergence='warn'."
            )
        if not self._warned:
            self._warned = True
            logger.warning(
                "%s Going on (on_divergence='warn'): overflowing steps are skipped; this warning "
                "is not repeated.",
                message,
            )
        else:
            logger.info("Step %d: still diverging (%s).", step, "; ".join(evidence))

    def _weight_growth(self, culprit: str) -> tuple[float, float, float] | None:
        """(now / first, first, now) for the culprit's parameter norm; None without a
        reference or parameters. Computed for this one module, on overflow steps only."""
        reference = self._reference_norms
        if not reference:
            return None
        module = dict(self.model.named_modules()).get(culprit)
        if module is None:
            return None
        prefix = f"{culprit}." if culprit else ""
        named = [(prefix + n, p) for n, p in module.named_parameters()]
        named = [(n, p) for n, p in named if n in reference]
        if DTensor is not None:  # sharded since the reference was taken (FSDP2 after prepare)
            named = [(n, p) for n, p in named if not isinstance(p, DTensor)]
        if not named:
            return None
        before = math.sqrt(sum(reference[n] ** 2 for n, _ in named))
        now_norms = _parameter_norms(named)
        now = math.sqrt(sum(v**2 for v in now_norms.values()))
        if not math.isfinite(now):
            return math.inf, before, now
        if before == 0.0:
            return None  # a zero-initialised module: no scale to compare against
        return now / before, before, now

    def _loss_trend(self) -> tuple[float, float] | None:
        """(median of the first finite losses, largest finite recent loss), one read-back."""
        if not self._first_losses:
            return None
        values = torch.stack(
            [v.float().mean() for v in [*self._first_losses, *self._recent_losses]]
        ).tolist()
        first = [v for v in values[: len(self._first_losses)] if math.isfinite(v)]
        recent = [v for v in values[len(self._first_losses) :] if math.isfinite(v)]
        if not first or not recent:
            return None
        return statistics.median(first), max(recent)

    def _learning_rate(self) -> str:
        """``learning rate 10`` (the configured one; the scheduled value too when it differs)."""
        optimizer = self.optimizer
        groups = getattr(optimizer, "param_groups", None) if optimizer is not None else None
        if not groups:
            return "the current learning rate (unknown to the guard: give it optimizer=)"
        configured = list(dict.fromkeys(float(g.get("initial_lr", g["lr"])) for g in groups))
        current = list(dict.fromkeys(float(g["lr"]) for g in groups))
        text = "learning rate" + ("s " if len(configured) > 1 else " ")
        text += ", ".join(f"{lr:g}" for lr in configured)
        if current != configured:
            text += f" (now {', '.join(f'{lr:g}' for lr in current)} on its schedule)"
        return text


def _parameter_norms(named: Any) -> dict[str, float]:
    """The L2 norm of each parameter, read back in one transfer.

    Sharded (DTensor) parameters are left out: their norm is a collective, and the guard may
    run on the overflowing ranks only; their growth is simply not part of the evidence.
    """
    names: list[str] = []
    norms: list[torch.Tensor] = []
    for name, param in named:
        if DTensor is not None and isinstance(param, DTensor):
            continue
        names.append(name)
        norms.append(torch.linalg.vector_norm(param.detach(), dtype=torch.float32).cpu())
    if not norms:
        return {}
    return dict(zip(names, torch.stack(norms).tolist()))

"""The step protocol's bookkeeping: where each optimizer is in the current iteration.

torch's ``GradScaler`` keeps a per-optimizer ``OptState`` (READY, UNSCALED, STEPPED) and checks it
in every method; :class:`OptimizerStages` is that record for
:class:`~amp_trainer.scaler.DynamicLossScaler`, with the three things torch's lacks: the overflow
verdict of an optimizer unscaled (to clip) but not stepped yet is carried to its own ``step()``
across another optimizer's ``update()`` (Accelerate steps and updates one optimizer at a time);
gradients that no ``scale()`` produced are told apart (a plain ``loss.backward()``); and
``torch.distributed.checkpoint``'s one step on all-zero gradients passes through uncounted.

Plain Python: no tensor, no device, nothing that costs a sync. Every refusal says what the
caller did wrong and what to do instead.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

__all__ = [
    "OptimizerStage",
    "OptimizerStages",
    "Settled",
    "Stage",
    "refuse_closure",
    "unscaled_gradients_error",
]


class Stage(Enum):
    """Where one optimizer is in the current iteration (torch's ``OptState``)."""

    READY = 0
    UNSCALED = 1
    STEPPED = 2


@dataclass
class OptimizerStage:
    """One optimizer's iteration: its stage and overflow verdict (``None`` before unscaling).

    ``counted``: an ``update()`` already acted on this verdict (carried to the optimizer's own
    ``step()``). ``passthrough``: the step DCP runs on all-zero, never-scaled gradients.
    """

    stage: Stage = Stage.READY
    found_inf: bool | None = None
    counted: bool = False
    passthrough: bool = False


class Settled(NamedTuple):
    """What an ``update()`` found: whether the iteration overflowed, and whether that verdict
    is new (``fresh``; ``False`` when an earlier ``update()`` already acted on it)."""

    overflow: bool
    fresh: bool


class OptimizerStages:
    """Every optimizer's :class:`OptimizerStage` this iteration, by ``id(optimizer)``, and the
    count of ``scale()`` calls that tells scaled gradients from unscaled ones.

    One integer increment per ``scale()`` and one compare per unscale: free on clean steps.
    """

    def __init__(self, scale_calls: int = 0) -> None:
        self.by_id: dict[int, OptimizerStage] = defaultdict(OptimizerStage)
        # scale() calls so far, and their count when each optimizer last unscaled: gradients
        # that appear with no scale() call since then came from a plain backward.
        self.scale_calls = scale_calls
        self._scale_calls_at_unscale: dict[int, int] = {}
        self._carried = False  # records kept across update() (see settle())

    def of(self, optimizer: Any) -> OptimizerStage:
        """``optimizer``'s record (a fresh READY one the first time)."""
        return self.by_id[id(optimizer)]

    def found_inf(self, optimizer: Any) -> bool | None:
        """This iteration's verdict for ``optimizer``; ``None`` before it was unscaled."""
        record = self.by_id.get(id(optimizer))
        return None if record is None else record.found_inf

    def scaled(self) -> None:
        """A ``scale()`` call: a new backward begins, so records carried from before are stale."""
        self.scale_calls += 1
        if self._carried:
            for key in [k for k, record in self.by_id.items() if record.counted]:
                del self.by_id[key]
            self._carried = False

    def never_scaled(self, optimizer: Any) -> bool:
        """No ``scale()`` call since ``optimizer`` last unscaled (or ever)."""
        return self.scale_calls == self._scale_calls_at_unscale.get(id(optimizer), 0)

    def check_unscale(self, record: OptimizerStage) -> None:
        """Refuse a second unscale in one iteration (gradients divided twice) or one after
        ``step()``."""
        if record.stage is Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(); "
                "gradients would be divided by the scale twice. Call it once per step, before "
                "step()."
            )
        if record.stage is Stage.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(); call update() to finish the "
                "iteration first."
            )

    def unscaled(self, optimizer: Any, record: OptimizerStage, overflow: bool) -> None:
        """``optimizer``'s gradients were unscaled with verdict ``overflow``."""
        record.found_inf = overflow
        record.stage = Stage.UNSCALED
        self._scale_calls_at_unscale[id(optimizer)] = self.scale_calls

    @staticmethod
    def passed_through(record: OptimizerStage) -> None:
        """All-zero gradients no ``scale()`` produced: ``torch.distributed.checkpoint``'s
        ``_init_optim_state`` (Accelerate's FSDP2 ``load_state``) steps once with zero gradients
        and lr 0 to create the optimizer state. Zero is the same scaled or not, so the step runs
        as asked; it is no training step, so ``update()`` will not count it and no rank joins a
        collective for it (every rank runs the same dummy step)."""
        record.found_inf = False
        record.stage = Stage.UNSCALED
        record.passthrough = True

    def stepped(self, record: OptimizerStage) -> bool:
        """Mark ``record`` stepped; whether any optimizer stepped this iteration skipped (with
        several optimizers, "skipped" means any of them)."""
        record.stage = Stage.STEPPED
        return any(r.found_inf for r in self.by_id.values() if r.stage is Stage.STEPPED)

    def settle(self) -> Settled | None:
        """End the iteration for ``update()``: the verdict to act on, or ``None`` when only DCP's
        dummy step ran (no training step: nothing to decide). Raises when no optimizer was
        unscaled or stepped since the last ``update()``.

        Accelerate steps and updates one optimizer at a time. An optimizer unscaled (to clip)
        but not stepped yet keeps its unscaled gradients and verdict for its own ``step()``, so
        they are not divided twice; its verdict counts in this update only (as in torch, the
        scale backs off once). A new backward (the next ``scale()``) drops what is left.
        """
        records = self.by_id
        dummies = [key for key, record in records.items() if record.passthrough]
        for key in dummies:
            del records[key]
        verdicts = [r.found_inf for r in records.values() if r.found_inf is not None]
        if dummies and not verdicts:
            # torch's GradScaler counts DCP's dummy step as a clean step (accelerate#4289).
            return None
        if not verdicts:
            raise RuntimeError(
                "update() found no inf checks recorded since the last update(): call "
                "scaler.step(optimizer) (or unscale_) for each optimizer before update()."
            )
        fresh = [r.found_inf for r in records.values() if r.found_inf is not None and not r.counted]
        carried = {
            key: dataclasses.replace(record, counted=True)
            for key, record in records.items()
            if record.stage is Stage.UNSCALED
        }
        records.clear()
        records.update(carried)
        self._carried = bool(carried)
        if not fresh:  # only verdicts an earlier update() already acted on
            return Settled(overflow=any(verdicts), fresh=False)
        return Settled(overflow=any(fresh), fresh=True)

    def reset(self) -> None:
        """Forget every record: a scale set between iterations starts the next afresh."""
        self.by_id.clear()
        self._carried = False

    def check_copyable(self) -> None:
        """Refuse a pickle or deep copy mid-iteration (after unscale/step, before ``update()``):
        the copy could not know which gradients are already unscaled and would divide them
        again (torch refuses too)."""
        if any(record.stage is not Stage.READY for record in self.by_id.values()):
            raise RuntimeError(
                "A DynamicLossScaler may only be pickled or deep-copied at the beginning of an "
                "iteration or after scaler.update(), not between unscale_()/step() and update() "
                "(nor while an optimizer unscaled before another's update() awaits its step())."
            )

    def for_copy(self) -> OptimizerStages:
        """What a pickled or deep-copied scaler starts with: no record (they are keyed by object
        id, meaningless in another process), the ``scale()`` count kept."""
        return OptimizerStages(self.scale_calls)


def unscaled_gradients_error(scale: float) -> RuntimeError:
    """The gradients came from a backward that bypassed ``scale()``: dividing them by ``scale``
    would apply an update ``scale`` times too small.

    What can be seen: no ``scale()`` call at all since this optimizer last unscaled (or ever).
    What cannot: a plain ``loss.backward()`` in an iteration that also scaled another loss, or
    stale gradients left from an earlier step without ``zero_grad()``.
    """
    return RuntimeError(
        "The optimizer holds gradients but scaler.scale() was not called since they were "
        "last unscaled (or ever): they were never multiplied by the loss scale "
        f"{scale:g} (a plain loss.backward()?), and dividing them by it would apply an update "
        f"{scale:g}x too small. Use scaler.scale(loss).backward() "
        "(accelerator.backward(loss) under Accelerate), or DynamicLossScaler(enabled=False) "
        "for unscaled training."
    )


def refuse_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``step(closure)`` under loss scaling: refused, as torch's ``GradScaler`` refuses it."""
    if "closure" in kwargs or (args and callable(args[0])):
        raise RuntimeError(
            "step() with a closure is not supported when loss scaling is enabled: the closure "
            "would re-run backward on an unscaled loss."
        )

"""A streak of skipped updates: replay the batch, prove why, and act on the verdict.

A skipped FP16 step leaves the parameters and the optimizer state untouched, so after a streak of
skipped updates the weights are the ones every skipped step ran with, and the last batch can be
replayed from them with gradients, in other precisions, at other scales, as often as needed.
That turns "the scale backs off until ``LossScaleError``" into a verdict that can be proved:

* ``"scale_warmup"``: the batch's FP16 gradients are finite at a scale the scaler will reach
  (at ``min_scale`` at the latest): the start-up skips of an initial scale that is too high.
  Nothing to do.
* ``"fp16_backward_range"``: FP32 gradients finite, FP16 non-finite at every scale down to
  ``min_scale``: an activation gradient leaves FP16's range inside one module. It is the module
  whose gradient input is the first non-finite one while its gradient output is finite (full
  backward hooks, registered only for that replay). It becomes an FP32 island
  (:func:`~amp_trainer.islands.keep_in_fp32`, recorded in ``model.config`` as the forward path
  does), the scale is set back to the highest scale from the streak's start down at which the
  replayed batch is finite with the island, and the run goes on.
* ``"data"``: FP32 is non-finite too on this batch but finite on the other recent batches (the
  weights are fine): the batch is named (its rows, and its dataset indices where the sampler is
  sequential) and the run stops with :class:`BadBatchError`, or, within the user's quarantine
  count, the batch is dropped (its step stays skipped, the scale is put back) and the run goes on.
* ``"divergence"``: the :class:`~amp_trainer.forward_overflow.divergence.DivergenceJudge` sees its
  marks (weights or loss far beyond their values at the start), or FP32 is non-finite on every
  recent batch: no island (it would hide the learning rate);
  :class:`~amp_trainer.forward_overflow.DivergenceError` (``on_divergence="warn"``: one warning).

A replay runs only after a streak (``streak`` consecutive skipped updates, or sooner when the
scale has reached ``min_scale``, where the next overflow would end the run), once per streak. It
restores the RNG state, the model's buffers and the real run's gradients, and leaves no hook
behind: the real run is changed only by the island and the scale. With several ranks every rank
replays its own last batch and the findings are gathered, so every rank reaches the same verdict,
the same islands and the same scale.

Each verdict is appended to ``verdicts`` (``{"step", "attempt", "verdict", "modules", ...}``),
said in one log line and handed to ``on_verdict`` (the trainer logs it as ``replay_verdict``).
This package holds :class:`SkipStreakReplay` (when to replay, the verdict, acting on it);
:mod:`~amp_trainer.skip_streak_replay.passes` the replays themselves (isolated from the run, the
backward hooks that name the module) and :mod:`~amp_trainer.skip_streak_replay.for_trainer` how
:class:`~amp_trainer.AmpTrainer` runs it by itself (``skip_streak_replay``,
``skip_streak_quarantine``). In any other loop::

    replay = SkipStreakReplay(model, scaler, streak=8)
    for step, batch in enumerate(loader, 1):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(**batch).loss
        replay.observe(batch, loss)                  # a reference, no sync
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        replay.after_step(scaler.step_was_skipped, step)  # work only after a streak
        optimizer.zero_grad()
"""

from __future__ import annotations

import logging
import re
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from amp_trainer.forward_overflow.divergence import DivergenceJudge
from amp_trainer.islands import is_fp32_island, keep_in_fp32, record_fp32_islands
from amp_trainer.numerics import describe_module, nonfinite_inputs
from amp_trainer.scaler import DynamicLossScaler
from amp_trainer.skip_streak_replay.passes import ReplayPass

__all__ = [
    "VERDICTS",
    "BadBatchError",
    "SkipStreakReplay",
    "check_replay_arguments",
]

logger = logging.getLogger(__name__)

#: What a replay can prove, most serious first (the order several ranks' findings are merged in).
VERDICTS = ("divergence", "data", "fp16_backward_range", "scale_warmup")
_OTHER_BATCHES = 3  # recent batches replayed in FP32 to tell one bad batch from broken weights
_RESTORE_STEP = 16.0  # the scales tried for the restored scale: the streak's start, / 16, ...


class BadBatchError(FloatingPointError):
    """A skip streak's replay proved one batch non-finite in pure FP32 while other batches are
    finite from the same weights: the data, not FP16 and not the model. A ``FloatingPointError``,
    like :class:`~amp_trainer.scaler.LossScaleError`."""


def check_replay_arguments(streak: Any, quarantine: Any) -> None:
    """A ``ValueError`` naming a bad ``skip_streak_replay`` / ``skip_streak_quarantine``."""
    for name, value in (("skip_streak_replay", streak), ("skip_streak_quarantine", quarantine)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(
                f"{name} must be an int >= 0 (0: "
                f"{'off' if name == 'skip_streak_replay' else 'no batch is quarantined'}), "
                f"got {value!r}"
            )


class SkipStreakReplay:
    """Replays the last batch after a streak of skipped updates and acts on the verdict.

    Args:
        model: the model being trained, unwrapped: its module names are reported and made
            islands; its backward in the replay runs no DDP reduction.
        scaler: the :class:`DynamicLossScaler` stepping the optimizer(s).
        streak: consecutive skipped updates before the replay (>= 1).
        quarantine: how many batches a ``"data"`` verdict may drop before it stops the run.
        forward: ``(model, inputs) -> loss or output``; default ``model(**inputs)``.
        judge: the divergence judgement (the forward-overflow guard's, so both share their
            reference norms and losses); ``None``: one of its own, fed by :meth:`observe`.
        on_divergence: ``"raise"`` or ``"warn"``, for a judge of its own.
        make_islands: ``(names) -> names added``; default :func:`keep_in_fp32` and
            :func:`record_fp32_islands`.
        locate_batch: ``(record) -> (dataset indices of its rows) or None`` (see :meth:`observe`).
        on_verdict: called with each verdict's entry (the trainer logs it).
        verdicts: the list verdicts are appended to (default a new one).
        where: ``() -> {"epoch", "position"}``, where the micro-batch :meth:`observe` is given
            sits in the data (its index in the epoch), for naming a bad batch.
    """

    def __init__(
        self,
        model: nn.Module,
        scaler: DynamicLossScaler,
        *,
        streak: int = 8,
        quarantine: int = 0,
        forward: Callable[[nn.Module, Any], Any] | None = None,
        dtype: torch.dtype = torch.float16,
        judge: DivergenceJudge | None = None,
        on_divergence: str = "raise",
        make_islands: Callable[[list[str]], list[str]] | None = None,
        locate_batch: Callable[[dict[str, Any]], list[int] | None] | None = None,
        on_verdict: Callable[[dict[str, Any]], None] | None = None,
        verdicts: list[dict[str, Any]] | None = None,
        where: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        check_replay_arguments(streak, quarantine)
        if streak < 1:
            raise ValueError(f"streak must be >= 1 (0 means no replay: build none), got {streak}")
        self.model = model
        self.scaler = scaler
        self.streak = streak
        self.quarantine = quarantine
        self.passes = ReplayPass(model, forward, dtype)
        self._own_judge = judge is None
        self.judge = judge or DivergenceJudge(model, on_divergence=on_divergence)
        self.make_islands = make_islands or self._keep_in_fp32
        self.locate_batch = locate_batch
        self.on_verdict = on_verdict
        self.where = where
        #: ``() -> optimizer``, to name the learning rate of a divergence (a judge of its own).
        self.optimizer_of: Callable[[], Any] | None = None
        self.verdicts: list[dict[str, Any]] = [] if verdicts is None else verdicts
        self.quarantined: list[dict[str, Any]] = []
        self._step_batches: list[dict[str, Any]] = []  # the micro-batches of the step under way
        self._recent: deque[dict[str, Any]] = deque(maxlen=_OTHER_BATCHES + 1)
        self._skips = 0
        self._replayed_at_min = False  # this streak has had its replay at min_scale
        self._scale_at_start: float | None = None  # the scale the streak's first step ran with
        self._scale = scaler.get_scale()  # the scale the next step runs with
        self._attempts = 0

    # -- the training loop's side ----------------------------------------------------------
    @property
    def pending(self) -> int:
        """Micro-batches observed for the step under way."""
        return len(self._step_batches)

    def observe(self, inputs: Any, loss: torch.Tensor | None = None) -> None:
        """Remember one micro-batch (a reference: no copy, no sync), and its loss for a
        divergence judgement of its own."""
        record = {"inputs": inputs, **(self.where() if self.where is not None else {})}
        self._step_batches.append(record)
        if self._own_judge and isinstance(loss, torch.Tensor):
            self.judge.observe(loss.detach())

    def after_step(
        self,
        skipped: bool,
        step: int,
        *,
        handled: bool = False,
        proven: BaseException | None = None,
    ) -> dict | None:
        """Once per optimizer step attempt, after ``scaler.update()``. ``handled``: the step was
        a forward overflow another guard dealt with (not part of a gradient streak). ``proven``:
        the forward-overflow guard's error for a batch that is non-finite in FP32 too; with a
        quarantine allowed the step is replayed at once, and a ``"data"`` verdict quarantines
        it (any other verdict raises ``proven``). Returns the verdict's entry when this step's
        streak was replayed."""
        self._attempts += 1
        batches, self._step_batches = self._step_batches, []
        scale_before, self._scale = self._scale, self.scaler.get_scale()
        self._recent.extend(batches)
        if proven is not None:
            self._skips += 1
            entry = self._replay(step, batches, scale_before)  # every rank: they gather
            if entry.get("verdict") != "data":
                raise proven
            self._scale = self.scaler.get_scale()
            return entry
        if not skipped or handled:
            self._skips, self._replayed_at_min, self._scale_at_start = 0, False, None
            return None
        if self._skips == 0:
            self._scale_at_start = scale_before
        self._skips += 1
        # The next overflow at min_scale ends the run: replay then too, even after an earlier
        # verdict of this streak (scale_warmup proved another batch finite at min_scale).
        at_min = self.scaler.get_scale() <= self.scaler.policy.min_scale
        due = self._skips == self.streak or (at_min and not self._replayed_at_min)
        if not due:  # the same on every rank (the found-inf flag is reduced): they gather
            return None
        self._replayed_at_min = at_min
        entry = self._replay(step, batches, scale_before)
        self._scale = self.scaler.get_scale()
        return entry

    # -- the replay -----------------------------------------------------------------------
    def _replay(self, step: int, batches: list[dict[str, Any]], scale_before: float) -> dict:
        try:
            local = self._local_finding(batches)
        except Exception as err:  # a replay must never be what ends the run
            local = {"verdict": None, "error": f"{type(err).__name__}: {err}"}
        findings = self._gather(local)
        failed = [f["error"] for f in findings if f.get("error")]
        if failed:
            logger.warning(
                "Step %d: %d skipped updates in a row; the replay of the batch failed (%s), so "
                "no verdict: the scaler goes on backing off.",
                step,
                self._skips,
                failed[0],
            )
            return {}
        proved = [f["verdict"] for f in findings if f["verdict"] is not None]
        if not proved:
            logger.warning(
                "Step %d: %d skipped updates in a row; the replay proves no verdict (%s): the "
                "scaler goes on backing off.",
                step,
                self._skips,
                next(f["why"] for f in findings),
            )
            return {}
        verdict = min(proved, key=VERDICTS.index)
        modules = list(dict.fromkeys(m for f in findings for m in f.get("modules", [])))
        entry: dict[str, Any] = {
            "step": step,
            "attempt": self._attempts,
            "verdict": verdict,
            "modules": modules if verdict == "fp16_backward_range" else [],
            "skips": self._skips,
        }
        if len(findings) > 1:  # which rank's batch proved it
            entry["rank_verdicts"] = [f["verdict"] for f in findings]
        evidence = next((f["evidence"] for f in findings if f.get("evidence")), [])
        if verdict == "data":
            entry["batches"] = [b for f in findings for b in f.get("batches", [])]
        if verdict == "divergence":
            entry["evidence"] = evidence
            culprit = next((f["culprit"] for f in findings if f.get("culprit")), None)
            return self._act_divergence(entry, culprit)
        return getattr(self, f"_act_{verdict}")(entry, scale_before)

    def _local_finding(self, batches: list[dict[str, Any]]) -> dict[str, Any]:
        """This rank's verdict on its own last step's micro-batches (replays only)."""
        if not batches:
            return {"verdict": None, "why": "no batch of the step was given to observe()"}
        bad = [b for b in batches if not self.passes.run(b["inputs"], fp16=False, scale=1.0)[0]]
        if bad:
            evidence = list(self.judge.evidence("", []))
            if evidence:
                return {"verdict": "divergence", "evidence": evidence}
            others = [r for r in self._recent if all(r is not b for b in bad)][-_OTHER_BATCHES:]
            fine = sum(self.passes.run(r["inputs"], fp16=False, scale=1.0)[0] for r in others)
            if others and not fine:
                return {
                    "verdict": None,
                    "why": f"the gradients are non-finite in pure FP32 on every one of "
                    f"{len(others)} other recent batches too, with no mark of divergence: the "
                    "model or its loss, not FP16 nor one batch",
                }
            named = [self._name_batch(b, compared=len(others)) for b in bad]
            if not others and not any(b.get("inputs") for b in named):
                return {
                    "verdict": None,
                    "why": "the gradients are non-finite in pure FP32 too, but there is no other "
                    "recent batch to tell one bad batch from the model, and the batch's inputs "
                    "are finite",
                }
            return {"verdict": "data", "batches": named}
        min_scale = float(self.scaler.policy.min_scale)
        for record in batches:
            finite, culprit = self.passes.run(
                record["inputs"], fp16=True, scale=min_scale, locate=True
            )
            if finite:
                continue
            if self.passes.loss_finite is False:
                return {
                    "verdict": None,
                    "why": "the FP16 loss itself is non-finite (a forward overflow, the "
                    "forward-overflow guard's to handle: on_forward_overflow)",
                }
            evidence = list(self.judge.evidence(culprit or "", []))
            if evidence:
                return {"verdict": "divergence", "evidence": evidence, "culprit": culprit}
            return {"verdict": "fp16_backward_range", "modules": [culprit] if culprit else []}
        return {"verdict": "scale_warmup"}

    def _name_batch(self, record: dict[str, Any], *, compared: int) -> dict[str, Any]:
        """Where a bad batch is: its rows that hold inf/NaN (or whose FP32 loss alone is
        non-finite), their dataset indices where the sampler says, and its place in the run."""
        inputs = record["inputs"]
        rows = self.passes.bad_rows(inputs)
        named: dict[str, Any] = {
            "attempt": self._attempts,
            "rows": rows,
            "compared_with": compared,
        }
        if isinstance(inputs, Mapping):
            named["inputs"] = nonfinite_inputs(inputs)
        for key in ("epoch", "position"):
            if record.get(key) is not None:
                named[key] = record[key]
        indices = self.locate_batch(record) if self.locate_batch is not None else None
        named["sample_indices"] = (
            [indices[r] for r in rows if r < len(indices)] if indices and rows else None
        )
        return named

    # -- several ranks ----------------------------------------------------------------------
    def _group(self) -> Any:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return False
        group = self.scaler.process_group
        return group if dist.get_world_size(group) > 1 else False

    def _gather(self, local: Any) -> list[Any]:
        """Every rank's ``local``, in rank order (``[local]`` on one process)."""
        group = self._group()
        if group is False:
            return [local]
        import torch.distributed as dist

        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
        return gathered

    # -- acting on a verdict ----------------------------------------------------------------
    def _record(self, entry: dict[str, Any], level: int, message: str, *args: Any) -> dict:
        self.verdicts.append(entry)
        logger.log(level, message, *args)
        if self.on_verdict is not None:
            self.on_verdict(entry)
        return entry

    def _act_scale_warmup(self, entry: dict, scale_before: float) -> dict:
        return self._record(
            entry,
            logging.INFO,
            "Step %d: replay verdict scale_warmup after %d skipped updates: the batch's FP16 "
            "gradients are finite at a scale the scaler reaches (min_scale %g at the latest); "
            "the initial scale was too high. Nothing to do.",
            entry["step"],
            self._skips,
            self.scaler.policy.min_scale,
        )

    def _act_fp16_backward_range(self, entry: dict, scale_before: float) -> dict:
        names = [n for n in entry["modules"] if not is_fp32_island(self.model.get_submodule(n))]
        if not names:  # nothing new to keep in FP32: resetting the scale would only loop
            logger.warning(
                "Step %d: %d skipped updates in a row; the replay finds the gradients finite in "
                "FP32 and non-finite in FP16 at every scale, but no module it could name that "
                "is not already FP32 (%s): nothing it can fix, the scaler goes on backing off.",
                entry["step"],
                self._skips,
                ", ".join(entry["modules"]) or "none named",
            )
            return {}
        entry["modules"] = names
        self.make_islands(names)
        scale = self._restored_scale()
        self.scaler.update(new_scale=scale)
        entry["scale"] = scale
        self._skips, self._replayed_at_min = 0, False
        where = ", ".join(describe_module(self.model, n) for n in names)
        return self._record(
            entry,
            logging.WARNING,
            "Step %d: replay verdict fp16_backward_range after %d skipped updates: the batch's "
            "gradients are finite in FP32 and non-finite in FP16 at every loss scale down to "
            "min_scale %g; the first non-finite gradient comes from %s, which now computes in "
            "FP32 (an FP32 island); loss scale set to %g, training continues. To start with it: "
            "fp32_modules=%r.",
            entry["step"],
            entry["skips"],
            self.scaler.policy.min_scale,
            where,
            scale,
            names,
        )

    def _restored_scale(self) -> float:
        """The highest scale from the streak's start down (by 16x) at which this rank's last
        batch is finite with the new islands; the ranks agree on the lowest one."""
        policy = self.scaler.policy
        top = max(self._scale_at_start or policy.scale, float(policy.min_scale))
        candidates = []
        scale = top
        while scale > policy.min_scale:
            candidates.append(scale)
            scale /= _RESTORE_STEP
        candidates.append(float(policy.min_scale))
        chosen = candidates[-1]
        records = list(self._recent)[-1:]
        try:
            for scale in candidates:
                if all(self.passes.run(r["inputs"], fp16=True, scale=scale)[0] for r in records):
                    chosen = scale
                    break
        except RuntimeError:
            pass
        return min(self._gather(chosen))

    def _act_data(self, entry: dict, scale_before: float) -> dict:
        named = "; ".join(_describe_batch(b) for b in entry["batches"])
        if len(self.quarantined) < self.quarantine:
            self.quarantined.append(entry)
            entry["quarantined"] = True
            self.scaler.undo_backoff(scale_before)  # the data, not the scale: put it back
            self._skips, self._replayed_at_min = 0, False
            return self._record(
                entry,
                logging.WARNING,
                "Step %d: replay verdict data: the batch is non-finite in pure FP32 too, while "
                "other recent batches are finite from the same weights: %s. Quarantined (%d of "
                "skip_streak_quarantine=%d): its update stays skipped, training continues.",
                entry["step"],
                named,
                len(self.quarantined),
                self.quarantine,
            )
        self._record(
            entry,
            logging.ERROR,
            "Step %d: replay verdict data: %s.",
            entry["step"],
            named,
        )
        raise BadBatchError(
            f"Step {entry['step']}: a bad batch: its loss or gradients are non-finite in pure "
            f"FP32 too, while other recent batches are finite from the same weights, so this is "
            f"the data, not FP16 nor the model: {named}. Fix or filter those rows (inf/NaN "
            "features, labels out of range), or allow skip_streak_quarantine=N to drop up to N "
            "such batches and go on."
        )

    def _act_divergence(self, entry: dict, culprit: str | None) -> dict:
        self._record(
            entry,
            logging.WARNING,
            "Step %d: replay verdict divergence after %d skipped updates: %s.",
            entry["step"],
            entry["skips"],
            "; ".join(entry["evidence"]),
        )
        if self.optimizer_of is not None and self.judge.optimizer is None:
            self.judge.optimizer = self.optimizer_of()  # names the learning rate
        self.judge.report(entry["step"], culprit or "", tuple(entry["evidence"]))  # raises
        return entry

    def _keep_in_fp32(self, names: list[str]) -> list[str]:
        covered = keep_in_fp32(self.model, [re.compile(re.escape(n)) for n in names])
        record_fp32_islands(self.model)
        return covered


def _describe_batch(batch: Mapping[str, Any]) -> str:
    """``optimizer step attempt 5 (epoch 0, batch 3 of the epoch), rows [2] (dataset indices
    [14]); inputs 'x' (1 non-finite value(s))``."""
    where = f"optimizer step attempt {batch.get('attempt')}"
    if batch.get("position") is not None:
        where += f" (epoch {batch.get('epoch', '?')}, batch {batch['position']} of the epoch)"
    rows = batch.get("rows") or []
    where += f", rows {rows}" if rows else ", rows not isolated"
    indices = batch.get("sample_indices")
    where += (
        f" (dataset indices {indices})"
        if indices
        else " (dataset indices unknown: the sampler is not sequential)"
    )
    if batch.get("inputs"):
        where += f"; inputs {', '.join(batch['inputs'])}"
    if not batch.get("compared_with"):
        where += "; no other recent batch to compare with"
    return where

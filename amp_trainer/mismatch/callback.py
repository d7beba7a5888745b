""":class:`PrecisionMismatchCallback`: the precision-mismatch meter inside a training run, on the
run's own batches every N steps, its figures in the Trainer's logs."""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

from amp_trainer.mismatch.meter import (
    MismatchReport,
    MismatchStats,
    Tally,
    check_batch_size,
    check_causal_lm,
    check_device_runs,
    check_fp32_parameters,
    check_number,
    check_precisions,
    device_of,
    format_mismatch_table,
    forward_keywords,
    measure_batch,
    measuring,
    scored,
)
from amp_trainer.mismatch.objective_clip import token_advantages
from amp_trainer.numerics import describe_names
from amp_trainer.precision import PRECISIONS

__all__ = ["PrecisionMismatchCallback"]

logger = logging.getLogger(__name__)

# Forward keywords of a captured training batch that the meter cannot reproduce (the image or
# embedding inputs of a multimodal or soft-prompt model): such a batch is not measured.
_TEXT_ONLY = ("pixel_values", "inputs_embeds", "input_features", "input_values")
# TRL's losses whose clip is PPO's, the rule of objective_clip_rate (its clip_ratio/region_mean).
_PPO_CLIPPED_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")


def _run_precision(trainer: Any, args: Any) -> str:
    """The precision a trainer runs: AmpTrainerMixin's resolved one, else the stock flags."""
    precision = getattr(trainer, "precision", None)
    if precision in PRECISIONS:
        return str(precision)
    if getattr(args, "fp16", False):
        return "fp16"
    return "bf16" if getattr(args, "bf16", False) else "fp32"


class PrecisionMismatchCallback(TrainerCallback):
    """Measure a training run's own completions against FP32 every ``every_n_steps`` steps.

    On a sampled optimizer step the callback keeps references to the tokens of that step's
    training forwards (a forward pre-hook on the trained model that only records, and only
    while the model trains with gradients: generation and reference-model forwards run without
    them), and at the step's end measures them with :func:`measure_precision_mismatch`: the
    tokens the loss scores (``labels`` not -100 when the forward is given labels, as TRL's
    GRPOTrainer gives them for the completion; every attended token otherwise), at GRPO's
    ``temperature`` when the arguments have one. The figures go into the step's log, or the
    next training log, as ``mismatch/<precision>/<figure>`` (see :data:`FIGURES`), so
    ``state.log_history``, TensorBoard and W&B get them; ``history`` holds each measured step,
    ``summary`` the whole run, logged as a table when training ends.

    The measurement is invisible to training: no gradients, eval mode for its own forwards
    only, RNG streams forked; a run with the callback ends with the parameters of the run
    without it, bit for bit (``tests/precision/test_precision_mismatch.py``). It costs three
    forwards of the step's batch (FP32 and two precisions) every ``every_n_steps`` steps.

    Why a hook on the model and not the batch: Trainer hands callbacks no batch, and TRL's
    GRPOTrainer builds its completions inside ``training_step``; the model's forward is the one
    place every Trainer shows its tokens. Why ``attach``: a callback is handed no trainer either,
    and logging into the step's log needs the callback to come before the reporting
    integrations' (TensorBoard, W&B) in the trainer's list. :class:`~amp_trainer.AmpTrainerMixin`
    trainers attach the ones passed in ``callbacks=`` themselves; with any other Trainer::

        trainer = GRPOTrainer(...)
        PrecisionMismatchCallback(every_n_steps=10).attach(trainer)

    Args:
        every_n_steps: measure the optimizer steps whose number is a multiple of it.
        precisions: what to measure; default the run's precision and the alternative one
            (``("fp16", "bf16")`` for an fp16 run, ``("bf16", "fp16")`` for bf16, both for
            fp32), leaving out one the device cannot run (bf16 on a GPU without it).
        clip_epsilon: the clip range of ``clip_rate`` and the lower bound's of
            ``objective_clip_rate``; default the run's ``epsilon`` (GRPO's), else 0.2.
        clip_epsilon_high: the upper bound's of ``objective_clip_rate``; default the run's
            ``epsilon_high`` (TRL's clip-higher), else the lower one.
        batch_size: rows per measuring forward (default: each training forward's batch).

    ``objective_clip_rate`` (the share the clipped objective really clips, by the sign of the
    advantage) is measured where the step's training inputs carry ``advantages`` (TRL's GRPO):
    the callback reads them from the ``inputs`` of the trainer's ``compute_loss``, which it
    wraps while the run trains, and gives each captured forward its rows' advantages.

    The figures are the local process's batch (each rank measures its own).
    """

    def __init__(
        self,
        every_n_steps: int = 10,
        precisions: Sequence[str] | None = None,
        *,
        clip_epsilon: float | None = None,
        clip_epsilon_high: float | None = None,
        batch_size: int | None = None,
    ) -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int):
            raise TypeError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an integer >= 1, got {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.precisions = None if precisions is None else check_precisions(precisions)
        self.clip_epsilon = (
            None if clip_epsilon is None else check_number("clip_epsilon", clip_epsilon, 0.0, 1.0)
        )
        self.clip_epsilon_high = (
            None
            if clip_epsilon_high is None
            else check_number("clip_epsilon_high", clip_epsilon_high, 0.0, math.inf)
        )
        self.batch_size = check_batch_size(batch_size)
        #: ``{"step": n, precision: MismatchStats, ...}`` for every measured step.
        self.history: list[dict[str, Any]] = []
        self._trainer: Any = None
        self._handle: Any = None
        self._recording = False
        # (input_ids, attention_mask, labels, advantages) of each training forward.
        self._captured: list[tuple[Any, ...]] = []
        self._tap: tuple[Any, Any, Any] | None = None  # (trainer, our compute_loss, its own)
        self._pending: dict[str, float] = {}
        self._run: dict[str, Tally] = {}
        self._nonfinite_steps: dict[str, list[int]] = {}
        self._active: tuple[str, ...] = ()
        self._epsilon = 0.2
        self._epsilon_high = 0.2
        self._temperature = 1.0
        self._warned: set[str] = set()
        self._rollout: str | None = None

    def measure_rollout(self, precision: str | None) -> None:
        """Measure ``precision`` too: the rollout side's, allowed to differ from the trainer's
        (``rollout_precision_mismatch="allow"``; :class:`~amp_trainer.AmpTrainerMixin` calls
        this before training). Its ``mismatch/<precision>/...`` figures are the log-probability
        gap of the rollouts to FP32; an FP32 rollout side is the reference itself, so the
        trainer's precision is what is measured then. ``None``: no rollout precision of its own."""
        self._rollout = None if precision is None else check_precisions(precision)[0]

    # -- wiring ------------------------------------------------------------------------------
    def attach(self, trainer: Any) -> PrecisionMismatchCallback:
        """Bind to ``trainer`` and put this callback first in its callback list (added if not
        there), so that the figures are in each log before any integration reports it."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        self._trainer = trainer
        return self

    def on_train_begin(self, args, state, control, **kwargs):
        trainer = self._trainer
        if trainer is None:
            raise RuntimeError(
                "PrecisionMismatchCallback is not attached to its trainer, so its figures could "
                "not reach the logs: call PrecisionMismatchCallback(...).attach(trainer) instead "
                "of passing it in callbacks= (AmpTrainerMixin trainers attach it themselves)."
            )
        model = trainer.model
        check_causal_lm(model)
        check_fp32_parameters(model)
        device = device_of(model)
        run = _run_precision(trainer, args)
        if self.precisions is not None:
            for name in self.precisions:
                check_device_runs(name, device)
            self._active = self.precisions
        else:
            wanted = {"fp16": ("fp16", "bf16"), "bf16": ("bf16", "fp16")}.get(run, ("fp16", "bf16"))
            self._active = tuple(p for p in wanted if self._runs_on(p, device))
        rollout = run if self._rollout == "fp32" else self._rollout
        if rollout is not None and rollout not in self._active and self._runs_on(rollout, device):
            self._active = (*self._active, rollout)
            logger.info("Precision mismatch: measuring %s too, the rollouts' precision", rollout)
        epsilon = self.clip_epsilon
        if epsilon is None:
            run_epsilon = getattr(args, "epsilon", None)  # GRPO's (and PPO's) clip range
            epsilon = run_epsilon if isinstance(run_epsilon, float) and 0 < run_epsilon < 1 else 0.2
        self._epsilon = float(epsilon)
        high = self.clip_epsilon_high
        if high is None:
            run_high = getattr(args, "epsilon_high", None)  # TRL's clip-higher
            high = run_high if isinstance(run_high, (int, float)) and run_high > 0 else epsilon
        self._epsilon_high = float(high)
        self._say_what_the_objective_rule_is(args)
        temperature = getattr(args, "temperature", None)
        self._temperature = (
            float(temperature) if isinstance(temperature, (int, float)) and temperature > 0 else 1.0
        )
        self.history = []
        self._run = {p: Tally() for p in self._active}
        self._nonfinite_steps = {p: [] for p in self._active}
        self._pending = {}
        self._remove_hook()
        self._handle = model.register_forward_pre_hook(self._capture, with_kwargs=True)
        self._untap_compute_loss()
        self._tap_compute_loss(trainer)
        logger.info(
            "Precision mismatch: measuring %s against FP32 every %d step(s) (run: %s)",
            ", ".join(self._active),
            self.every_n_steps,
            run,
        )

    @staticmethod
    def _runs_on(precision: str, device: torch.device) -> bool:
        try:
            check_device_runs(precision, device)
        except ValueError as err:
            logger.warning("Precision mismatch: not measuring %s: %s", precision, err)
            return False
        return True

    def _capture(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook: keep references to a training forward's tokens (no copy, no sync)."""
        if not (self._recording and module.training and torch.is_grad_enabled()):
            return
        if any(kwargs.get(name) is not None for name in _TEXT_ONLY):
            self._warn_once(
                "inputs",
                "a training forward carries image/embedding inputs, which the meter cannot "
                "reproduce: such batches are not measured",
            )
            return
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return
        attention_mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        labels = kwargs.get("labels")
        self._captured.append(
            (
                input_ids,
                attention_mask if isinstance(attention_mask, torch.Tensor) else None,
                labels if isinstance(labels, torch.Tensor) else None,
                None,
            )
        )

    def _say_what_the_objective_rule_is(self, args: Any) -> None:
        """Once per run where TRL's loss does not clip as PPO does, token by token: the figure
        keeps PPO's token-level rule, which is then not this run's own clip."""
        loss_type = getattr(args, "loss_type", None)
        level = getattr(args, "importance_sampling_level", "token")
        if loss_type is None or (loss_type in _PPO_CLIPPED_LOSSES and level == "token"):
            return
        self._warn_once(
            "objective",
            f"objective_clip_rate counts PPO's token-level clip (ratio > 1 + epsilon_high with a "
            f"positive advantage, < 1 - epsilon with a negative one); this run's loss_type="
            f"{loss_type!r} with importance_sampling_level={level!r} clips otherwise",
        )

    def _tap_compute_loss(self, trainer: Any) -> None:
        """Wrap ``trainer.compute_loss`` (this instance's, until training ends) to read the
        ``advantages`` of the inputs whose forwards were captured during the call."""
        own = trainer.__dict__.get("compute_loss")
        original = trainer.compute_loss

        def compute_loss(model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            start = len(self._captured)
            result = original(model, inputs, *args, **kwargs)
            if self._recording and isinstance(inputs, Mapping):
                self._give_advantages(inputs.get("advantages"), start)
            return result

        trainer.compute_loss = compute_loss
        self._tap = (trainer, compute_loss, own)

    def _untap_compute_loss(self) -> None:
        if self._tap is None:
            return
        trainer, ours, own = self._tap
        self._tap = None
        if trainer.__dict__.get("compute_loss") is ours:
            if own is None:
                del trainer.compute_loss
            else:
                trainer.compute_loss = own

    def _give_advantages(self, advantages: Any, start: int) -> None:
        """Split ``advantages`` (one per row of the call's inputs) over the forwards captured
        since ``start``, in order: TRL's loss runs its rows in chunks, one forward each."""
        captured = self._captured[start:]
        if not isinstance(advantages, torch.Tensor) or not captured:
            return
        rows = sum(int(entry[0].shape[0]) for entry in captured)
        if advantages.dim() not in (1, 2) or advantages.shape[0] != rows:
            self._warn_once(
                "advantages",
                f"the inputs' advantages of shape {tuple(advantages.shape)} do not match the "
                f"{rows} rows of the step's forwards: objective_clip_rate is not measured",
            )
            return
        offset = 0
        for index, (input_ids, mask, labels, _) in enumerate(captured, start):
            count = int(input_ids.shape[0])
            mine, offset = advantages[offset : offset + count], offset + count
            if mine.dim() == 1 or mine.shape[1] < input_ids.shape[1]:  # else: nothing to align
                self._captured[index] = (input_ids, mask, labels, mine)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("Precision mismatch: %s.", message)

    def _remove_hook(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    # -- per step ----------------------------------------------------------------------------
    def on_step_begin(self, args, state, control, **kwargs):
        self._captured = []
        self._recording = (state.global_step + 1) % self.every_n_steps == 0

    def on_step_end(self, args, state, control, **kwargs):
        if not self._recording:
            return
        self._recording = False
        batches, self._captured = self._captured, []
        if not batches:
            self._warn_once(
                "no-batch",
                f"step {state.global_step} had no training forward with input_ids to measure",
            )
            return
        step_stats = self._measure(batches)
        if step_stats is None:
            return
        self.history.append({"step": state.global_step, **step_stats})
        for name, stats in step_stats.items():
            self._pending.update(stats.log_items())
            if stats.nonfinite:
                self._nonfinite_steps[name].append(state.global_step)
                where = describe_names([repr(m) for m in stats.nonfinite_modules])
                logger.warning(
                    "Precision mismatch at step %d: %s logits are non-finite (first module to "
                    "overflow: %s)",
                    state.global_step,
                    name,
                    where or "no single module",
                )

    def _measure(self, batches: list[tuple[Any, ...]]) -> dict[str, MismatchStats] | None:
        model = self._trainer.model
        device = device_of(model)
        step = {name: Tally() for name in self._active}
        with measuring(model, device):
            keywords = forward_keywords(model)
            for input_ids, attention_mask, labels, advantages in batches:
                valid, _ = scored(input_ids, attention_mask, labels)
                if not bool(valid.any()):
                    continue
                if advantages is not None:
                    advantages = token_advantages(advantages, input_ids.shape[1])
                tallies = measure_batch(
                    model,
                    input_ids,
                    attention_mask,
                    labels,
                    self._active,
                    clip_epsilon=self._epsilon,
                    temperature=self._temperature,
                    batch_size=self.batch_size,
                    device=device,
                    keywords=keywords,
                    advantages=advantages,
                    clip_epsilon_high=self._epsilon_high,
                )
                for name, tally in tallies.items():
                    step[name].add(tally)
        if not any(tally.tokens for tally in step.values()):
            return None
        for name, tally in step.items():
            self._run[name].add(tally)
        return {name: self._stats(name, tally) for name, tally in step.items()}

    def _stats(self, name: str, tally: Tally, *, finite_part: bool = False) -> MismatchStats:
        return tally.stats(
            name, self._epsilon, clip_epsilon_high=self._epsilon_high, finite_part=finite_part
        )

    def on_log(self, args, state, control, logs=None, **kwargs):
        """Put the pending figures into this log (a training log, not an evaluation's)."""
        if not self._pending or logs is None or any(k.startswith("eval_") for k in logs):
            return
        logs.update(self._pending)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(self._pending)  # Trainer.log appended a copy of logs
        self._pending = {}

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hook()
        self._untap_compute_loss()
        self._recording = False
        self._captured = []
        if self.history:
            logger.info("%s", self.format_summary())

    # -- the run's summary -------------------------------------------------------------------
    @property
    def summary(self) -> MismatchReport:
        """Every measured step of the last ``train()`` together, per precision: token-weighted
        means, the largest difference. A precision non-finite on some steps is flagged
        (``nonfinite``, the modules named) and its figures cover its finite steps."""
        return MismatchReport(
            (name, self._stats(name, tally, finite_part=True))
            for name, tally in self._run.items()
            if tally.tokens
        )

    def format_summary(self) -> str:
        """The run's summary as a table, with the steps whose logits were non-finite."""
        steps = [entry["step"] for entry in self.history]
        notes = [
            f"{name}: non-finite on step(s) {', '.join(map(str, bad))}; figures cover the rest"
            for name, bad in self._nonfinite_steps.items()
            if bad
        ]
        title = (
            f"Precision mismatch against FP32, {len(steps)} measured step(s) "
            f"({steps[0]}..{steps[-1]}, every {self.every_n_steps}):"
            if steps
            else "Precision mismatch: no step measured"
        )
        return format_mismatch_table(self.summary, title, notes=notes)

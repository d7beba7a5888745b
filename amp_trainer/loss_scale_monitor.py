"""The loss-scale monitor: the callback an fp16 :class:`~amp_trainer.AmpTrainer` runs on every
optimizer step attempt. It keeps ``trainer.scale_history`` (compact: the events, the logging
steps and the latest step), names the parameters of an overflow step at INFO level, asks the
scaler for its periodic underflow check, and stops a run whose updates keep being skipped
(``max_consecutive_skipped_steps``).
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import TrainerCallback

from amp_trainer.forward_overflow import NonFiniteForwardError
from amp_trainer.scaler import LossScaleError

__all__ = ["MAX_CONSECUTIVE_SKIPS", "LossScaleMonitor", "record_scale_step"]

# The trainer's logger: these are the trainer's messages, filtered and levelled with its others.
logger = logging.getLogger("amp_trainer.trainer")

# Default runaway guard for arguments without the field (a plain TrainingArguments or SFTConfig):
# the limit transformers' own Trainer applies to consecutive skipped optimizer steps.
MAX_CONSECUTIVE_SKIPS = 100


def _worth_keeping(
    entry: dict[str, Any], previous: dict[str, Any] | None, sample_every: int
) -> bool:
    """Whether ``entry`` (one optimizer step) stays in a compact ``scale_history``.

    It does when it is the first step recorded, a skipped step (overflow, FP32 island), the first
    step at a new scale (a growth or backoff happened on the step before) or a logging step
    (``step % sample_every == 0``; ``0``: no samples).
    """
    return (
        previous is None
        or bool(entry["skipped"])
        or entry["scale"] != previous["scale"]
        or (sample_every > 0 and entry["step"] % sample_every == 0)
    )


def record_scale_step(
    history: list[dict[str, Any]], entry: dict[str, Any], sample_every: int
) -> None:
    """Append ``entry`` (``{"step", "scale", "skipped"}``) to ``history``, keeping it compact.

    Why: one entry per step grows without bound (about 250 MB of RAM and a 54 MB
    ``amp_trainer_state.json`` per checkpoint at a million steps), while the summary, the plot
    and resume need only the events. The history holds every entry :func:`_worth_keeping`
    keeps, plus the latest step as its last element (replaced by the next one unless it is worth
    keeping), so its size is ``events + steps / logging_steps + 2`` and the last entry is always
    the last step. Every scale change is an entry, so the scale of any step is that of the
    entry at or before it. The rule reads only the history itself: a resumed run continues the
    checkpoint's history into exactly the list the uninterrupted run holds.
    """
    if history and not _worth_keeping(
        history[-1], history[-2] if len(history) > 1 else None, sample_every
    ):
        history.pop()  # the previous latest step: neither an event nor a sample
    history.append(entry)


class LossScaleMonitor(TrainerCallback):
    """Records each optimizer step attempt into ``scale_history`` and names overflowing parameters.

    Installed only when there is a loss scaler, after stock's default callbacks and before the
    user's (see ``AmpTrainerMixin._place_loss_scale_monitor``), so user callbacks see an
    up-to-date history. Costs two Python floats per step: the skip verdict is the one the scaler
    already synced to the host.

    Every attempt is recorded, applied or skipped: ``follows_every_attempt`` has the step
    accounting's callback handler send it ``on_optimizer_step`` for skipped attempts too, which
    other callbacks do not hear of (a skipped update is not a step). Where transformers itself
    keeps skipped updates out of the events, an attempt that got no ``on_optimizer_step`` is
    recorded as skipped at the next event (``on_step_begin``, before the next batch runs).
    """

    follows_every_attempt = True

    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer
        self._scale_before_step = 1.0
        self._skips_in_a_row = 0
        self._attempt_open = False

    def on_step_begin(self, args, state, control, **kwargs):
        """Ask the scaler to measure underflow on this step's first loss: on the first step,
        on every ``loss_scale_underflow_check_interval``-th (500, 1000, ...: logging steps too
        when ``logging_steps`` divides the interval, so a check is logged on its own step) and
        right after the two-sided rule grew the scale. The figures go into the next log."""
        self._close_unreported_attempt(args, state)
        trainer, scaler = self._trainer, self._trainer.loss_scaler
        interval = getattr(args, "loss_scale_underflow_check_interval", 0)
        if scaler is None or not interval or trainer.is_fsdp_enabled:
            return  # FSDP: a second backward would run its reduce-scatter hooks
        # Counted over the whole run (attempts where the state counts them), so a resumed run
        # checks the very steps the uninterrupted one does.
        done = getattr(state, "optimizer_step_attempts", None) or state.global_step
        if done == 0 or (done + 1) % interval == 0 or scaler.underflow_recheck_due:
            scaler.request_underflow_check(trainer.model)

    def on_train_begin(self, args, state, control, **kwargs):
        self._skips_in_a_row = 0
        self._attempt_open = False
        self._say_the_meter_is_off_under_fsdp(args)
        self._trainer._steps.start_log_window(state)
        trainer = self._trainer
        trainer._overflow_step_loss.start()
        if trainer.loss_scaler is not None and trainer.model is not None:
            # Sharding in train()'s prepare (Accelerate's FSDP2) replaced the parameter objects
            # the scaler watched; their names stay, so watching again keeps overflows named.
            trainer.loss_scaler.watch(trainer.model)

    def _say_the_meter_is_off_under_fsdp(self, args: Any) -> None:
        """Once per run: under FSDP the meter (and so the two-sided rule) does not run, because
        its two extra backward passes would run the engine's reduce-scatter hooks. A warning
        when the rule was asked for (it cannot act), an INFO line for the meter's default."""
        trainer = self._trainer
        interval = getattr(args, "loss_scale_underflow_check_interval", 0)
        if trainer.loss_scaler is None or not interval or not trainer.is_fsdp_enabled:
            return
        if getattr(args, "loss_scale_grow_on_underflow", False):
            logger.warning(
                "loss_scale_grow_on_underflow=True does nothing under FSDP: the underflow meter "
                "it acts on does not run there (its extra backward passes would run FSDP's "
                "reduce-scatter), so the scale follows the default rule only (growth every "
                "loss_scale_growth_interval=%s clean steps) and no grad_underflow is logged.",
                getattr(args, "loss_scale_growth_interval", "?"),
            )
        else:
            logger.info(
                "The underflow meter (loss_scale_underflow_check_interval=%d) does not run under "
                "FSDP: no grad_underflow / grad_headroom in the logs.",
                interval,
            )

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._close_unreported_attempt(args, state)
        scaler = self._trainer.loss_scaler
        if scaler is not None:
            self._scale_before_step = scaler.get_scale()
            self._attempt_open = True

    def on_epoch_end(self, args, state, control, **kwargs):
        self._close_unreported_attempt(args, state)

    def on_train_end(self, args, state, control, **kwargs):
        self._close_unreported_attempt(args, state)

    def _close_unreported_attempt(self, args: Any, state: Any) -> None:
        """An attempt that got no ``on_optimizer_step`` was skipped by transformers itself."""
        if self._attempt_open:
            self.on_optimizer_step(args, state, None)

    def on_optimizer_step(self, args, state, control, **kwargs):
        scaler = self._trainer.loss_scaler
        if scaler is None or not self._attempt_open:
            return
        self._attempt_open = False
        forward = None
        replay = getattr(self._trainer, "_skip_replay", None)
        try:
            if self._trainer._forward_overflow is not None:
                forward = self._trainer._forward_overflow.after_step()  # skipped steps only
        except NonFiniteForwardError as err:
            if replay is None or not replay.quarantine:
                raise
            # The batch is non-finite in FP32 too: the replay proves it is the data and
            # quarantines it, or raises the error.
            replay.after_step(True, state.global_step + 1, proven=err)
            replay = None
        skipped = scaler.step_was_skipped
        if replay is not None:  # replays the batch after a streak of skipped updates only
            replay.after_step(skipped, state.global_step + 1, handled=forward is not None)
        # The step this attempt would make: global_step is raised right after this event if the
        # update is applied (a skipped one leaves it, and the next attempt has the same number).
        step = state.global_step + 1
        sample_every = state.logging_steps if args.logging_strategy == "steps" else 0
        entry: dict[str, Any] = {"step": step, "scale": self._scale_before_step, "skipped": skipped}
        if forward is not None:
            # Not a gradient overflow: the plot and the summary show it as its own kind of event.
            entry["fp32_islands"] = list(forward.islands)
            self._trainer._overflow_step_loss.record(forward)  # its logged loss: the FP32 re-run's
        record_scale_step(self._trainer.scale_history, entry, int(sample_every or 0))
        self._trainer._last_step_skipped = skipped
        if skipped and forward is None:  # a forward overflow was reported as such already
            names = scaler.stats.last_overflow_params
            logger.info(
                "Step %d skipped: non-finite gradients at loss scale %g (now %g)%s",
                step,
                self._scale_before_step,
                scaler.get_scale(),
                f" in {', '.join(names[:8])}{' ...' if len(names) > 8 else ''}" if names else "",
            )
        self._skips_in_a_row = self._skips_in_a_row + 1 if skipped else 0
        limit = getattr(args, "max_consecutive_skipped_steps", MAX_CONSECUTIVE_SKIPS)
        if limit and self._skips_in_a_row >= limit:
            # Every on_min_loss_scale mode ends here: "warn"/"clamp" (and "raise" with a low
            # loss_scale_min or hysteresis) would otherwise skip to max_steps and return normally.
            names = scaler.stats.last_overflow_params
            attempts = getattr(state, "optimizer_step_attempts", None)
            tried = (
                f"attempts {attempts - self._skips_in_a_row + 1}-{attempts} at step {step}"
                if attempts is not None and attempts >= self._skips_in_a_row
                else f"at step {step}"
            )
            raise LossScaleError(
                f"{self._skips_in_a_row} consecutive optimizer steps were skipped ({tried}, "
                f"non-finite gradients; loss scale now {scaler.get_scale():g}): the run is no "
                f"longer training, so it stops here (max_consecutive_skipped_steps={limit})."
                + (f" Last overflowing parameters: {', '.join(names[:8])}." if names else "")
                + " Rerun the batch in FP32 (`amp-trainer doctor`) to tell a model/data/learning "
                "rate bug from an FP16 range problem."
            )

"""What a training step is under FP16: an applied optimizer update, not an attempt.

An update the loss scaler skips (non-finite gradients) changes no weight and no learning rate, so
it is not a step: it does not count toward ``global_step``, ``max_steps`` or the epochs, and
``state.optimizer_step_attempts`` counts every attempt. The data it read is consumed all the same:
the run reads on, and a resume continues from the batch position actually reached, saved in
``trainer_state.json`` as ``train_dataloader_epoch`` / ``train_dataloader_batches_seen``. These
are transformers' own semantics (at an unreleased commit of its repository, in no release up to
5.25.0: ``TrainerState.optimizer_step_attempts``);
a transformers that has them runs its own and none of this is installed
(:func:`stock_counts_skipped_steps`).

On the released transformers the stock training loop counts every attempt as a step. It is not
copied here: :class:`StepAccounting` keeps the stock loop and corrects it at the points stock calls
for every attempt, each a few lines (``docs/concepts/upstream-hooks.md`` lists them with the tests
that pin each one):

* the callback handler (:class:`_StepAwareCallbackHandler`): a skipped attempt reaches
  ``on_pre_optimizer_step`` as every attempt does, but not ``on_optimizer_step`` or ``on_step_end``
  (only the loss-scale monitor, which records every attempt, hears of it), and ``global_step`` is
  lowered by the one stock adds right after;
* ``set_initial_training_values``: with ``max_steps`` on a sized dataset the epochs run until
  ``max_steps`` updates are applied (stock's epoch count assumes no skip); with
  ``num_train_epochs`` the run ends when the epochs' data is read (attempts), not at a number of
  updates that skips make unreachable;
* ``get_batch_samples``: counts the batches read (the data position); an iterable dataset is read
  on past stock's ``max_steps``-long chunks instead of restarting, and a pass that ends starts the
  next one (none at all: training stops and says so);
* ``_load_callback_state``, the one call between stock loading ``trainer_state.json`` and deriving
  the resume position from ``global_step``: the position is presented in the units stock derives
  it from, and the real ``global_step`` put back at ``on_train_begin``;
* ``log``: the loss is averaged over the attempts that produced it, ``train_loss`` and
  ``train_samples_per_second`` count every attempt's batch.

:func:`carry_step_fields_in_trainer_state` lets ``TrainerState`` save and load the three fields.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers.trainer_callback import CallbackHandler, ProgressCallback, TrainerState
from transformers.trainer_utils import IntervalStrategy, SaveStrategy, has_length

__all__ = [
    "PADDING",
    "STEP_FIELDS",
    "StepAccounting",
    "carry_step_fields_in_trainer_state",
    "stock_counts_skipped_steps",
]

logger = logging.getLogger(__name__)
# transformers' trainer logger (its own hierarchy, not propagated to the root logger by default).
transformers_trainer_logger = logging.getLogger("transformers.trainer")

#: The ``TrainerState`` fields transformers adds at that unreleased commit, saved in
#: ``trainer_state.json``.
STEP_FIELDS = ("optimizer_step_attempts", "train_dataloader_epoch", "train_dataloader_batches_seen")


def stock_counts_skipped_steps() -> bool:
    """Whether the installed transformers already keeps skipped updates out of ``global_step``.

    A feature check, not a version pin: its ``TrainerState`` has ``optimizer_step_attempts``.
    """
    return "optimizer_step_attempts" in {f.name for f in dataclasses.fields(TrainerState)}


def carry_step_fields_in_trainer_state() -> None:
    """Let ``TrainerState`` save and load :data:`STEP_FIELDS` (once; a no-op where it has them).

    Why: stock ``TrainerState.load_from_json`` is ``cls(**json)``, so a ``trainer_state.json``
    holding a key its dataclass lacks raises ``TypeError`` (checkpoints of that unreleased
    transformers do, on a released one); ``save_to_json`` writes dataclass fields only. Here
    loading sets the known extra keys as attributes and saving writes them when a state has them (an
    AmpTrainer's). Process-wide, because stock code calls these class methods; a state without
    the attributes (a plain Trainer's) saves exactly what it did.
    """
    if stock_counts_skipped_steps() or getattr(TrainerState, "_carries_step_fields", False):
        return

    def load_from_json(cls: type[TrainerState], json_path: str) -> TrainerState:
        with open(json_path, encoding="utf-8") as handle:
            data = json.load(handle)
        extra = {name: data.pop(name) for name in STEP_FIELDS if name in data}
        state = cls(**data)
        for name, value in extra.items():
            setattr(state, name, value)
        return state

    stock_save = TrainerState.save_to_json

    def save_to_json(self: TrainerState, json_path: str) -> None:
        extra = {name: self.__dict__[name] for name in STEP_FIELDS if name in self.__dict__}
        if not extra:
            return stock_save(self, json_path)
        text = json.dumps({**dataclasses.asdict(self), **extra}, indent=2, sort_keys=True) + "\n"
        with open(json_path, "w", encoding="utf-8") as handle:  # as stock writes it
            handle.write(text)
        return None

    TrainerState.load_from_json = classmethod(load_from_json)  # type: ignore[method-assign]
    TrainerState.save_to_json = save_to_json  # type: ignore[method-assign]
    TrainerState._carries_step_fields = True  # type: ignore[attr-defined]


class _Padding(dict):
    """The no-op micro-batch that completes a stream's last accumulation window (empty: stock's
    token counting finds no input in it)."""

    def __repr__(self) -> str:
        return "PADDING"


#: See :meth:`StepAccounting.fetch`; ``training_step`` returns a zero loss for it.
PADDING = _Padding()


# The start of the ValueError accelerate's DataLoaderDispatcher raises for a pass with no batch.
_DISPATCHER_FOUND_NO_DATA = "Batch does not contain any data"


class _Pass:
    """One pass over an iterable dataset: its iterator, what was read, whether it ended.

    ``peek`` reads one batch ahead to tell a pass that ended from one that did not (the batch is
    handed out next); a pass that raised ``StopIteration`` is never asked again (a one-shot
    generator or Accelerate's dispatcher need not raise twice).
    """

    def __init__(self, iterator: Iterator[Any]) -> None:
        self.iterator = iterator
        self.read = 0
        self.ended = False
        self._ahead: list[Any] = []

    def __iter__(self) -> _Pass:
        return self

    def __next__(self) -> Any:
        if self._ahead:
            item = self._ahead.pop()
        elif self.ended:
            raise StopIteration
        else:
            try:
                item = next(self.iterator)
            except StopIteration:
                self.ended = True
                raise
            except ValueError as err:
                # Accelerate's batch dispatcher (dispatch_batches, its default for a stream)
                # raises this, on every rank, when the stream is already exhausted as a pass
                # starts: for a one-pass iterator that is the end of the data, as a sized pass's
                # StopIteration is (stock, reading no batch more, never gets here).
                if self.read or not str(err).startswith(_DISPATCHER_FOUND_NO_DATA):
                    raise
                self.ended = True
                raise StopIteration from None
        self.read += 1
        return item

    def peek_ended(self) -> bool:
        if self._ahead or self.ended:
            return self.ended and not self._ahead
        try:
            self._ahead.append(next(self.iterator))
        except StopIteration:
            self.ended = True
        return self.ended


class StepAccounting:
    """Skipped updates out of the step count, for one :class:`~amp_trainer.trainer.AmpTrainerMixin`.

    ``active`` is false where transformers does this itself; the trainer's hooks then pass
    straight through. See the module docstring for the hooks and why each is needed.
    """

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer
        self.active = not stock_counts_skipped_steps()
        if self.active:
            carry_step_fields_in_trainer_state()
        self._checkpoint: str | None = None
        self._true_global_step: int | None = None
        self._log_step = self._log_attempts = self._attempts_at_start = 0
        self._plan: dict[str, Any] = {}
        self._reset_position()

    def _reset_position(self) -> None:
        self._skipped = False
        self._first_epoch = True
        self._stock_epoch = 0
        self._stock_iterator: Iterator[Any] | None = None
        self._pass: _Pass | None = None
        self._discard = 0
        self._reading = 0  # batches of the attempt under way
        self._real_in_group: int | None = None
        self._continuing = False
        self._rng: tuple[torch.Tensor, list[torch.Tensor] | None] | None = None

    # -- train() ------------------------------------------------------------------------------
    def begin(self, checkpoint: str | bool | None) -> None:
        """Before stock ``train``: the checkpoint it resumes from (a path), if any."""
        self._checkpoint = str(checkpoint) if isinstance(checkpoint, (str, os.PathLike)) else None
        self._true_global_step = None
        self._reset_position()

    def planned(self, values: tuple[Any, ...], args: Any, dataloader: Any) -> tuple[Any, ...]:
        """``set_initial_training_values``' result, with the epoch count skips need.

        Both transformers 5.0's and 5.24's tuples start ``(num_train_epochs,
        num_update_steps_per_epoch, ...)`` and end with ``max_steps``.
        """
        sized = has_length(dataloader)
        self._plan = {
            "updates_per_epoch": values[1],
            "batches_per_epoch": len(dataloader) if sized else None,
            "epochs": values[0],
            # num_train_epochs (max_steps <= 0): the epochs hold this many attempts.
            "attempt_budget": values[-1] if args.max_steps <= 0 and sized else None,
        }
        if self.active and args.max_steps > 0 and sized:
            # As stock does for an iterable dataset: as many epochs as max_steps updates take.
            values = (sys.maxsize, *values[1:])
        return values

    def present_resume_position(self, state: TrainerState) -> None:
        """Right after stock loaded ``trainer_state.json``: give it the position in its units.

        Stock resumes at epoch ``global_step // U`` after ``(global_step % U) * G`` batches (``U``
        updates per epoch, ``G`` gradient accumulation steps): one update per ``G`` batches, which
        a skipped update breaks. The saved position is presented as the ``global_step`` that
        yields it (sized data: every attempt reads ``G`` batches, the last of an epoch fewer); an
        iterable dataset's pass restarts at its beginning and :meth:`fetch` reads past the
        batches already seen. The real ``global_step`` is back before any callback sees it.
        """
        if not self.active or self._checkpoint is None or self._true_global_step is not None:
            return
        saved = state.__dict__
        if "train_dataloader_epoch" not in saved or "train_dataloader_batches_seen" not in saved:
            self._say_the_old_position_differs(state)  # stock's own position, from global_step
            return
        updates = self._plan["updates_per_epoch"]
        epoch, seen = (
            int(saved["train_dataloader_epoch"]),
            int(saved["train_dataloader_batches_seen"]),
        )
        accumulation = self.trainer.args.gradient_accumulation_steps
        if self._plan["batches_per_epoch"] is not None:
            position = epoch * updates + math.ceil(seen / accumulation)
        else:
            position = epoch * updates
            self._discard = 0 if self.trainer.args.ignore_data_skip else seen
        self._true_global_step = state.global_step
        state.global_step = position

    def _say_the_old_position_differs(self, state: TrainerState) -> None:
        """A checkpoint without the batch position (written before amp-trainer saved it) resumes
        at stock's position, ``global_step`` updates' worth of batches. That is where the
        interrupted run was only if it skipped no update: each skipped attempt read its batches
        too. Say so once, with the count, where the checkpoint shows skips (or cannot tell)."""
        skipped = skipped_attempts_before(self._checkpoint, state)
        if skipped == 0:
            return
        accumulation = self.trainer.args.gradient_accumulation_steps
        if skipped is None:
            what = (
                "it does not record whether updates were skipped before it; each skipped one "
                f"read {accumulation} batch(es) that this resume reads again"
            )
        else:
            what = (
                f"the interrupted run had skipped {skipped} update(s) by then, so it had read "
                f"{skipped * accumulation} batch(es) more than that position: this resume reads "
                "them again, and its weights will not be those of an uninterrupted run"
            )
        logger.warning(
            "%s has no train_dataloader_epoch / train_dataloader_batches_seen (saved by stock "
            "Trainer or an older amp-trainer): the run resumes at the data position "
            "global_step=%d gives, as stock Trainer does; %s.",
            Path(str(self._checkpoint)).name,
            state.global_step,
            what,
        )

    def train_begin(self, state: TrainerState) -> None:
        """At ``on_train_begin``: the real ``global_step`` back; the counters and position set."""
        trainer = self.trainer
        position = state.global_step
        if self._true_global_step is not None:
            state.global_step = self._true_global_step
            # Stock read the presented value into these two between the load and this event.
            trainer._globalstep_last_logged = state.global_step
            if hasattr(trainer, "_initial_global_step"):
                trainer._initial_global_step = state.global_step
            self._true_global_step = None
        if "optimizer_step_attempts" not in state.__dict__:
            state.optimizer_step_attempts = state.global_step  # an older checkpoint, or a new run
        updates = self._plan.get("updates_per_epoch") or 1
        self._stock_epoch = position // updates
        batches = 0
        if self._plan.get("batches_per_epoch") is not None and not trainer.args.ignore_data_skip:
            batches = (position % updates) * trainer.args.gradient_accumulation_steps
        self._set_position(state, self._stock_epoch, batches)
        if self._plan.get("epochs") is not None:
            state.num_train_epochs = self._plan["epochs"]
        self.start_log_window(state)

    def start_log_window(self, state: TrainerState) -> None:
        """At ``on_train_begin`` (also where transformers counts attempts itself): the counts the
        first training log's window and the run's ``train_loss`` start from."""
        self._attempts_at_start = self._log_attempts = getattr(
            state, "optimizer_step_attempts", state.global_step
        )
        self._log_step = state.global_step

    @staticmethod
    def _set_position(state: TrainerState, epoch: int, batches: int) -> None:
        state.train_dataloader_epoch = epoch
        state.train_dataloader_batches_seen = batches

    # -- epochs ---------------------------------------------------------------------------------
    def epoch_begin(self, state: TrainerState) -> bool:
        """Whether callbacks hear of this ``on_epoch_begin`` (not where a pass reads on)."""
        if self._first_epoch:
            self._first_epoch = False
        else:
            self._stock_epoch += 1
        if self._continuing:
            return False
        if self._plan.get("batches_per_epoch") is not None:
            state.num_train_epochs = max(state.num_train_epochs, self._stock_epoch + 1)
        return True

    def epoch_end(self, state: TrainerState, control: Any) -> bool:
        """Whether callbacks hear of this ``on_epoch_end``; moves the position to the next epoch.

        An iterable dataset's stock "epoch" is ``max_steps`` updates long; one that ran out of
        updates while its pass goes on is no epoch: the pass reads on in the next one, and the
        random state is kept across stock's new ``iter()`` (a ``DataLoader`` draws a seed there).
        """
        batches = self._plan.get("batches_per_epoch")
        if batches is not None:
            read_all = state.train_dataloader_batches_seen >= batches
        else:
            live = self._pass
            read_all = live is None or live.ended
            if not (read_all or control.should_epoch_stop or control.should_training_stop):
                read_all = live.peek_ended()
                if not read_all:
                    self._continuing = True
                    self._rng = _rng_state()
                    return False
        if read_all or (control.should_epoch_stop and not control.should_training_stop):
            self._set_position(state, self._stock_epoch + 1, 0)
            self._pass = None
        return True

    # -- batches ---------------------------------------------------------------------------------
    def fetch(
        self,
        epoch_iterator: Iterator[Any],
        num_batches: int,
        device: Any,
        stock: Callable[[Iterator[Any], int, Any], tuple[list, Any]],
    ) -> tuple[list, Any]:
        """``get_batch_samples``: read ``num_batches`` for one attempt and count them."""
        if not self.active:
            return stock(epoch_iterator, num_batches, device)
        state = self.trainer.state
        if self._plan.get("batches_per_epoch") is not None:
            batches, items = stock(epoch_iterator, num_batches, device)
            self._reading = len(batches)
            return batches, items
        if epoch_iterator is not self._stock_iterator:
            self._stock_iterator = epoch_iterator
            if self._pass is None:  # a pass starts with stock's epoch
                self._pass = _Pass(epoch_iterator)
                self._set_position(state, self._stock_epoch, 0)
            elif self._continuing:  # stock's new iter() is left unread: the pass reads on
                _set_rng_state(self._rng)
            self._continuing, self._rng = False, None
        if self._discard:
            self._read_past_seen_batches(state)
        batches, items = stock(self._pass, num_batches, device)
        self._reading = len(batches)
        self._real_in_group = None
        if 0 < len(batches) < num_batches and self.trainer.accelerator.num_processes == 1:
            # The pass ended inside an accumulation window. Stock syncs only after a full window
            # (it cannot know a stream's length), so these gradients would be added to the next
            # pass's first update. Padding the window with no-op micro-batches makes stock apply
            # them as an update of their own, as it does for a sized dataset's last window.
            self._real_in_group = len(batches)
            batches = batches + [PADDING] * (num_batches - len(batches))
        if not batches:
            control = self.trainer.control
            if self._pass.read == 0:
                # On transformers' own logger, where its loop says it (and users filter it).
                transformers_trainer_logger.warning(
                    "Training data exhausted at global_step=%d before reaching max_steps=%d: the "
                    "dataset yielded no batch in this pass (a one-pass iterator?); training stops.",
                    state.global_step,
                    state.max_steps,
                )
                control.should_training_stop = True
            else:
                control.should_epoch_stop = True  # the pass ended: the next one starts
        return batches, items

    def micro_batch(self, inputs: Any) -> bool:
        """Before each ``training_step``: whether ``inputs`` is a real micro-batch.

        In a padded window (see :meth:`fetch`) the loss is divided by the real micro-batches, as
        stock divides a sized dataset's short last window by its length.
        """
        if inputs is PADDING:
            return False
        if self._real_in_group is not None:
            self.trainer.current_gradient_accumulation_steps = self._real_in_group
        return True

    def _read_past_seen_batches(self, state: TrainerState) -> None:
        """Resume of an iterable dataset: skip the batches the checkpoint's pass had read, then
        restore the random state saved with it (stock restored it before this reading)."""
        assert self._pass is not None
        for _ in range(self._discard):
            try:
                next(self._pass)
            except StopIteration:
                break
        state.train_dataloader_batches_seen = self._pass.read
        self._discard = 0
        trainer = self.trainer
        trainer._load_rng_state(self._checkpoint)
        if self._pass.peek_ended():  # the pass had ended unnoticed: the next one starts here
            loader = trainer.callback_handler.train_dataloader
            epoch = state.train_dataloader_epoch + 1
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)
            self._pass = _Pass(iter(loader))
            self._set_position(state, epoch, 0)

    # -- attempts -------------------------------------------------------------------------------
    def attempt_done(self, state: TrainerState) -> bool:
        """At ``on_optimizer_step``: count the attempt and its batches; whether it was applied.

        The batches count once their attempt is made, not when read: a checkpoint saved between
        reading a window and training it (SIGTERM's, at ``on_step_begin``) resumes with it.
        """
        state.optimizer_step_attempts += 1
        state.train_dataloader_batches_seen += self._reading
        self._reading = 0
        self._skipped = bool(self.trainer.accelerator.optimizer_step_was_skipped)
        return not self._skipped

    def uncount_skipped(self, state: TrainerState) -> None:
        """Stock adds 1 to ``global_step`` right after ``on_optimizer_step``, skipped or not."""
        state.global_step -= 1

    def step_end(self, args: Any, state: TrainerState, control: Any, *, skipped: bool) -> None:
        """At the end of an attempt: with ``num_train_epochs``, stop when the epochs' data is read.

        The end of training then evaluates and saves as stock's ``DefaultFlowCallback`` does at
        ``max_steps``, except a save or evaluation that this step already had.
        """
        budget = self._plan.get("attempt_budget")
        if budget is None or state.optimizer_step_attempts < budget:
            return
        control.should_training_stop = True
        step = state.global_step
        if step == 0:
            return
        if (
            args.eval_strategy == IntervalStrategy.STEPS
            and step % state.eval_steps != 0
            and args.eval_delay <= step
        ):
            control.should_evaluate = True
        if args.save_strategy == SaveStrategy.STEPS and (
            not skipped or state.save_steps <= 0 or step % state.save_steps != 0
        ):
            control.should_save = True

    def last_attempt_skipped(self) -> bool:
        """Whether the attempt now ending was skipped (read once, at its ``on_step_end``)."""
        skipped, self._skipped = self._skipped, False
        return skipped

    def advance_progress_bars(self, callbacks: list[Any], state: TrainerState) -> None:
        """With ``num_train_epochs``, move transformers' progress bar on every attempt.

        Its total is then ``state.max_steps``, the attempts the epochs hold (the run ends when
        their data is read), while stock moves it by ``global_step``: a run with skips would
        end short of its total (151/155). Here it shows the attempts made, so it ends at its
        total; with ``max_steps`` (applied updates) stock's bar already does.
        """
        if self._plan.get("attempt_budget") is None or not state.is_world_process_zero:
            return
        for callback in callbacks:
            bar = getattr(callback, "training_bar", None)
            if isinstance(callback, ProgressCallback) and bar is not None:
                bar.update(state.optimizer_step_attempts - bar.n)

    # -- logs -------------------------------------------------------------------------------------
    def last_log_due(self, state: TrainerState, control: Any) -> bool:
        """Whether the run ends with this attempt and attempts were made since the last log.

        Then a last training log is due, so that the skip counts and the loss scale of the
        summary are those the last log (and with it TensorBoard) shows.
        """
        if not self.active or self.trainer.args.logging_strategy == IntervalStrategy.NO:
            return False
        attempts = getattr(state, "optimizer_step_attempts", state.global_step)
        budget = self._plan.get("attempt_budget")
        ending = control.should_training_stop or (budget is not None and attempts >= budget)
        return bool(ending) and attempts > self._log_attempts

    def skipped_since_last_log(self, state: TrainerState) -> int:
        """Updates skipped since the previous training log (the window this log covers)."""
        attempts = getattr(state, "optimizer_step_attempts", state.global_step)
        return max(0, (attempts - self._log_attempts) - (state.global_step - self._log_step))

    def adjust_logs(self, logs: dict[str, float], state: TrainerState) -> None:
        """The loss over every attempt since the last log; run metrics over every attempt."""
        attempts = getattr(state, "optimizer_step_attempts", state.global_step)
        if "loss" in logs:
            steps, tried = state.global_step - self._log_step, attempts - self._log_attempts
            divided = max(steps, 1)  # stock's divisor (1 for the end's log of skips alone)
            if self.active and divided < tried:
                logs["loss"] = logs["loss"] * divided / tried  # stock divided by the steps
            logs["optimizer_step_attempts"] = attempts
            self._log_step, self._log_attempts = state.global_step, attempts
        tried = attempts - self._attempts_at_start
        if self.active and "train_loss" in logs and tried > 0:
            trainer = self.trainer
            logs["train_loss"] = trainer._total_loss_scalar / tried
            runtime = logs.get("train_runtime")
            if runtime:
                samples = tried * trainer.get_total_train_batch_size(trainer.args)
                logs["train_samples_per_second"] = round(samples / runtime, 3)


def _rng_state() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda


def _set_rng_state(saved: tuple[torch.Tensor, list[torch.Tensor] | None] | None) -> None:
    if saved is None:
        return
    cpu, cuda = saved
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


class _StepAwareCallbackHandler(CallbackHandler):
    """Stock's callback handler, with skipped attempts kept out of the per-update events.

    Installed on a trainer's own handler object (its class swapped), so the callbacks, models
    and data loaders it holds stay what stock set. Callbacks with ``follows_every_attempt =
    True`` (the loss-scale monitor) hear ``on_optimizer_step`` for every attempt.
    """

    step_accounting: StepAccounting

    def on_train_begin(self, args, state, control):
        self.step_accounting.train_begin(state)
        return super().on_train_begin(args, state, control)

    def on_epoch_begin(self, args, state, control):
        if not self.step_accounting.epoch_begin(state):
            return control
        return super().on_epoch_begin(args, state, control)

    def on_epoch_end(self, args, state, control):
        if not self.step_accounting.epoch_end(state, control):
            return control
        return super().on_epoch_end(args, state, control)

    def on_optimizer_step(self, args, state, control):
        accounting = self.step_accounting
        if accounting.attempt_done(state):
            return super().on_optimizer_step(args, state, control)
        everyone = self.callbacks
        self.callbacks = [cb for cb in everyone if getattr(cb, "follows_every_attempt", False)]
        try:
            control = self.call_event("on_optimizer_step", args, state, control)
        finally:
            self.callbacks = everyone
        accounting.uncount_skipped(state)
        return control

    def on_step_end(self, args, state, control):
        accounting = self.step_accounting
        skipped = accounting.last_attempt_skipped()
        if not skipped:
            control = super().on_step_end(args, state, control)
        accounting.step_end(args, state, control, skipped=skipped)
        accounting.advance_progress_bars(self.callbacks, state)
        return control


def install_step_aware_handler(handler: CallbackHandler, accounting: StepAccounting) -> None:
    """Make ``handler`` (a trainer's ``callback_handler``) keep skipped attempts out of steps."""
    if not accounting.active or isinstance(handler, _StepAwareCallbackHandler):
        return
    cls = type(handler)
    if cls is not CallbackHandler:  # another library's handler subclass: keep its behaviour
        cls = type(f"StepAware{cls.__name__}", (_StepAwareCallbackHandler, cls), {})
    else:
        cls = _StepAwareCallbackHandler
    handler.__class__ = cls
    handler.step_accounting = accounting


def skipped_attempts_before(checkpoint: str | None, state: TrainerState) -> int | None:
    """Updates skipped before ``checkpoint``: from its attempt counter where it has one, else
    the skipped attempts its ``amp_trainer_state.json`` scale history lists (every skipped
    attempt is an entry), else the last cumulative ``skipped_steps`` logged at its step; ``None``
    when none of them tells."""
    attempts = state.__dict__.get("optimizer_step_attempts")
    if isinstance(attempts, int):
        return max(attempts - state.global_step, 0)
    if checkpoint is not None:
        # Imported here: amp_trainer.checkpointing imports this module.
        from amp_trainer.checkpointing.layout import AMP_STATE_FILE

        try:
            saved = json.loads((Path(checkpoint) / AMP_STATE_FILE).read_text("utf-8"))
            history = saved["scale_history"]
            return sum(1 for entry in history if entry.get("skipped"))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
    logged = [
        entry["skipped_steps"]
        for entry in state.log_history
        if "skipped_steps" in entry and entry.get("step") == state.global_step
    ]
    return int(logged[-1]) if logged else None

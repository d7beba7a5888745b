"""The Trainer callbacks of checkpointing: transformers' SIGTERM checkpoint, between two steps.

``enable_jit_checkpoint`` makes stock ``Trainer.__init__`` add a ``JITCheckpointCallback`` that
saves inside an optimizer step; :func:`take_over_jit_checkpoint` puts
:class:`JITCheckpointBetweenSteps` in its place, which saves between two steps, and the
trainer's ``jit_checkpoint`` names the folder it wrote.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_callback import TrainerState
from transformers.trainer_jit_checkpoint import JITCheckpointCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

__all__ = ["JITCheckpointBetweenSteps", "take_over_jit_checkpoint"]

logger = logging.getLogger(__name__)


def take_over_jit_checkpoint(trainer: Trainer) -> None:
    """Put :class:`JITCheckpointBetweenSteps` where stock ``Trainer.__init__`` put its
    ``JITCheckpointCallback`` (``enable_jit_checkpoint``), keeping its SIGTERM handler."""
    handler = trainer.callback_handler
    for index, callback in enumerate(handler.callbacks):
        if type(callback) is JITCheckpointCallback and callback.jit_manager is not None:
            handler.callbacks[index] = JITCheckpointBetweenSteps(callback)


class JITCheckpointBetweenSteps(JITCheckpointCallback):
    """transformers' SIGTERM checkpoint (``enable_jit_checkpoint``), saved between two steps.

    Stock ``JITCheckpointCallback`` saves at the first callback after SIGTERM's grace timer,
    which is mostly ``on_pre_optimizer_step``: inside step N+1, after its forward and backward.
    That ``checkpoint-N`` holds step N's weights and loss scale but the RNG state after step
    N+1's dropout, so the resumed step N+1 trains on other dropout masks than the run would
    have; and the interrupted process then trains step N+1 anyway, which nothing saves (and an
    ``epoch`` save strategy evaluates and saves again after the stop). Here a request seen inside
    a step waits for the step's end and is saved there by the ordinary checkpoint path
    (``control.should_save``: logs first, as ``save_steps`` would), a request seen before a
    step starts is saved at once (the state of the step before), and nothing is evaluated or
    saved after it. Either way ``scaler.pt`` and ``amp_trainer_state.json`` are those of the
    step the folder is named after, and a resumed run continues as the uninterrupted one would.

    With several processes each has its own signal handler and grace timer, and the signal may
    reach only some of them (or their timers end in different steps): a rank that stopped alone
    would leave the others waiting in the next step's gradient all-reduce until the orchestrator
    kills them all, without a checkpoint. So the processes decide together, at each step's end
    (one all-reduce of one number per optimizer step), and all save and stop at the same step.
    Takes over the stock callback's manager, so the SIGTERM handler, its grace period and the
    handler's removal at the end of training are transformers' own.
    """

    def __init__(self, stock: JITCheckpointCallback) -> None:
        super().__init__()
        self.trainer, self.jit_manager = stock.trainer, stock.jit_manager
        self._saving = False

    def _requested(self) -> bool:
        """Whether SIGTERM's grace period is over here, or, with several processes, anywhere."""
        requested = bool(self.jit_manager.is_checkpoint_requested)
        accelerator = self.trainer.accelerator
        if accelerator.num_processes <= 1:
            return requested
        flag = torch.tensor([float(requested)], device=accelerator.device)
        return bool(accelerator.reduce(flag, reduction="sum").item() > 0)

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.jit_checkpoint = None
        self._saving = False

    def on_step_begin(self, args, state, control, **kwargs):
        if self.trainer.accelerator.num_processes > 1:
            return  # the processes agree at the step's end: one all-reduce per step, not two
        if self._requested():  # between two steps: checkpoint-N holds step N
            control.should_training_stop = True
            self.jit_manager.execute_jit_checkpoint()  # stock's save, with its "incomplete" marker
            self._saved(args, state)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        pass  # inside a step (after its backward): saved at its end, in on_step_end

    def on_step_end(self, args, state, control, **kwargs):
        self._save_here(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._save_here(control)

    def _save_here(self, control: Any) -> None:
        """At a step's end: save through the stock path if SIGTERM came; no work after it."""
        if self.trainer.jit_checkpoint is not None or self._saving:
            control.should_save = control.should_evaluate = False  # saved: nothing after it
        elif self._requested():
            self.jit_manager.is_checkpoint_requested = False
            control.should_training_stop = True
            control.should_save = True
            control.should_evaluate = False  # the grace period is for the checkpoint
            self._saving = True

    def on_save(self, args, state, control, **kwargs):
        if self._saving:
            self._saving = False
            self._saved(args, state)

    def _saved(self, args: Any, state: TrainerState) -> None:
        trainer = self.trainer
        folder = (
            Path(trainer._get_output_dir(trial=None))
            / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        )
        trainer.jit_checkpoint = str(folder)
        scaler = trainer.loss_scaler
        logger.warning(
            "SIGTERM: saved %s at step %d%s; training stops here. Resume with "
            "resume_from_checkpoint=%s.",
            folder,
            state.global_step,
            "" if scaler is None else f" (loss scale {scaler.get_scale():g})",
            folder,
        )

"""AmpTrainer's checkpoints and resume: say what happens, never lose a finished run.

Stock ``Trainer`` saves ``scaler.pt`` (which holds our scaler's whole state) and resumes it; what
:class:`CheckpointKeeper` adds, called from the three hooks ``AmpTrainerMixin`` overrides
(``train``, ``_save_checkpoint``, ``_load_scaler``):

* :data:`AMP_STATE_FILE` in every checkpoint: the precision and loss-scaler settings the run
  started with and the whole run's (compact: events and logging steps) scale history, so a
  resumed run can tell what changed and report all of its steps;
* resuming a finished run (the checkpoint of its last step) trains nothing and returns the run's
  final metrics, where stock ``train`` trains one more step every time;
* a full disk is one ``OSError(ENOSPC)`` naming the checkpoint, without a half-written folder
  (under FSDP2 too, on every rank);
* a save marks its folder incomplete until every rank wrote its part, and
  ``resume_from_checkpoint=True`` skips incomplete ones, naming what each lacks;
* ``save_total_limit`` rotation spares the checkpoints of another run found in ``output_dir``
  (all of them when the checkpoint resumed is another folder's), and another run's
  ``checkpoint-N`` of the step being saved is moved to ``previous-run-checkpoints/``, not
  overwritten;
* every checkpoint records the size and digest of each of its files, and a resume compares
  them first: a file that differs (truncated, flipped bytes) is one ``ValueError`` naming it,
  what was expected and found; ``resume_from_checkpoint=True`` passes a damaged checkpoint
  over with a warning naming it (``checkpoint_digests=False`` turns both off);
* a damaged or unsafe file in the checkpoint resumed (truncated JSON, a torch file that is not
  plain data, an FSDP ``.metadata`` pickle naming other classes) is one ``ValueError`` naming it,
  before anything reads it;
* a resumed checkpoint without its optimizer, scheduler, RNG or scaler state is one warning
  naming the files and what each costs; a damaged ``scaler.pt`` is one ``ValueError`` naming it;
* resuming in another precision, without ``scaler.pt``, or with ``loss_scale_*`` arguments the
  saved scaler state overrides is said in a warning, not silent (and not a crash);
* ``enable_jit_checkpoint`` (transformers' checkpoint on SIGTERM) saves between two optimizer
  steps, never inside one (see
  :class:`~amp_trainer.checkpointing.callbacks.JITCheckpointBetweenSteps`), and the trainer's
  ``jit_checkpoint`` names the folder it wrote.

This package holds :class:`CheckpointKeeper`, the entry point of those hooks; each side lives in
its own module:

- :mod:`~amp_trainer.checkpointing.layout`: what a checkpoint folder holds (stock's file names,
  :data:`AMP_STATE_FILE`);
- :mod:`~amp_trainer.checkpointing.completeness`: whether a checkpoint folder is whole (the
  in-progress marker, each rank's files), the rule ``resume_from_checkpoint=True`` and the
  recipes apply;
- :mod:`~amp_trainer.checkpointing.resume`: resume auditing (:class:`ResumeAudit`: a finished
  run, missing or foreign state, the scaler's state and the arguments it overrides);
- :mod:`~amp_trainer.checkpointing.digests`: the digest of every file a checkpoint holds,
  written when it is saved and compared before it is resumed;
- :mod:`~amp_trainer.checkpointing.file_checks`: a checkpoint's files read safely before
  resuming (a damaged file named, no pickled code run, FSDP's sharded folders included);
- :mod:`~amp_trainer.checkpointing.saving`: saving (:class:`CheckpointSaver`: the amp state,
  atomic writes, a full disk, another run's checkpoints and rotation);
- :mod:`~amp_trainer.checkpointing.callbacks`: the Trainer callbacks (the SIGTERM checkpoint).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from transformers import Trainer
from transformers.trainer_utils import TrainOutput

from amp_trainer.checkpointing.callbacks import take_over_jit_checkpoint
from amp_trainer.checkpointing.file_checks import check_best_model_checkpoint, check_resume_files
from amp_trainer.checkpointing.layout import AMP_STATE_FILE, TRAINER_STATE_FILE
from amp_trainer.checkpointing.resume import ResumeAudit
from amp_trainer.checkpointing.saving import CheckpointSaver, checkpoint_digests

__all__ = ["AMP_STATE_FILE", "CheckpointKeeper"]


class CheckpointKeeper:
    """The checkpoint and resume behaviour of one :class:`~amp_trainer.trainer.AmpTrainerMixin`.

    ``trainer`` is the AmpTrainerMixin instance. Each method is one of the trainer's hooks; it
    delegates to ``resume`` (a :class:`ResumeAudit`), ``saver`` (a :class:`CheckpointSaver`) or
    the callbacks module. The stock Trainer methods it wraps are passed in by the trainer's own
    hooks.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.resume = ResumeAudit(trainer)
        self.saver = CheckpointSaver(trainer)

    @property
    def missing_state(self) -> list[str]:
        """The training-state files the resumed checkpoint lacks (see
        :meth:`ResumeAudit.report_missing_state`)."""
        return self.resume.missing_state

    # -- __init__() ----------------------------------------------------------------------------
    def take_over_jit_checkpoint(self) -> None:
        """Save ``enable_jit_checkpoint``'s SIGTERM checkpoint between two optimizer steps."""
        take_over_jit_checkpoint(self.trainer)

    # -- train() -------------------------------------------------------------------------------
    def start(self, resume_from_checkpoint: str | bool | None) -> str | bool | None:
        """The checkpoint ``train`` resumes from; remember what ``output_dir`` held at the start.

        Its files are checked before anything reads them (see
        :func:`~amp_trainer.checkpointing.file_checks.check_resume_files`): a damaged or unsafe
        file is one ``ValueError`` naming it, and nothing in it runs.
        """
        checkpoint = self.resume.resolve(resume_from_checkpoint)
        if isinstance(checkpoint, (str, os.PathLike)):
            digests = checkpoint_digests(self.trainer.args)
            checked = self.resume.digests_checked == checkpoint
            check_resume_files(checkpoint, digests=digests, digests_checked=checked)
            if self.trainer.args.load_best_model_at_end:
                state_file = Path(checkpoint) / TRAINER_STATE_FILE
                if state_file.is_file():
                    named = json.loads(state_file.read_text("utf-8")).get("best_model_checkpoint")
                    output_dir = self.trainer.args.output_dir
                    check_best_model_checkpoint(named, output_dir, str(state_file), digests=digests)
        self.saver.remember_start(checkpoint)
        return checkpoint

    def finished_run(
        self, checkpoint: str | bool | None, load: Callable[[str], None]
    ) -> TrainOutput | None:
        """The run's result if ``checkpoint`` is its last step, else ``None`` (train on)."""
        return self.resume.finished_run(checkpoint, load)

    def report_missing_state(self, checkpoint: str | bool | None) -> None:
        """One warning naming the training-state files the resumed checkpoint lacks."""
        self.resume.report_missing_state(checkpoint)

    # -- _save_checkpoint() --------------------------------------------------------------------
    def save(self, run_dir: str | os.PathLike, save: Callable[[], None]) -> None:
        """Run ``save`` (stock ``_save_checkpoint``, into ``run_dir``), then add the amp state
        (see :meth:`CheckpointSaver.save`)."""
        self.saver.save(run_dir, save)

    # -- _load_scaler() ------------------------------------------------------------------------
    def load_scaler(self, checkpoint: str | None, load: Callable[[str], None]) -> None:
        """Resume the loss scaler honestly (see :meth:`ResumeAudit.load_scaler`)."""
        self.resume.load_scaler(checkpoint, load)

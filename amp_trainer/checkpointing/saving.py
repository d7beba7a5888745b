"""Saving a checkpoint: amp-trainer's state in it, nothing half-written, no other run's lost.

Stock ``Trainer._save_checkpoint`` writes ``scaler.pt`` (the scaler's whole state); what
:class:`CheckpointSaver` adds around it, for :class:`~amp_trainer.checkpointing.CheckpointKeeper`:

* :data:`~amp_trainer.checkpointing.layout.AMP_STATE_FILE` in every checkpoint, written
  atomically (:mod:`amp_trainer.atomic_files`);
* the size and digest of every file, written last
  (:data:`~amp_trainer.checkpointing.digests.DIGEST_FILE`), which a resume compares first;
* a full disk is one ``OSError(ENOSPC)`` naming the checkpoint, without a half-written folder;
* ``save_total_limit`` rotation runs only once the new checkpoint is complete (every rank wrote
  its part), so a save killed half-way never leaves a torn checkpoint as the only one;
* rotation spares the checkpoints of another run found in ``output_dir``
  (all of them when the checkpoint resumed is another folder's), and another run's
  ``checkpoint-N`` of the step being saved is moved to ``previous-run-checkpoints/``, not
  overwritten.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from amp_trainer.atomic_files import is_disk_full, write_json_atomic
from amp_trainer.checkpointing.digests import write_digests
from amp_trainer.checkpointing.layout import (
    AMP_STATE_FILE,
    INCOMPLETE_MARKER,
    checkpoint_run,
    checkpoint_step,
)
from amp_trainer.training_args import AmpTrainingArguments

__all__ = ["CheckpointSaver", "checkpoint_digests"]

logger = logging.getLogger(__name__)


class CheckpointSaver:
    """The saving side of one :class:`~amp_trainer.trainer.AmpTrainerMixin`'s checkpoints.

    ``trainer`` is the AmpTrainerMixin instance: this reads its ``args``, ``state``,
    ``precision`` and ``scale_history``.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.resume_step: int | None = None  # N of the checkpoint-N resumed from
        self.resume_dir: Path | None = None  # the folder holding the checkpoint resumed from
        self.at_start: dict[str, int] = {}  # checkpoint folders in output_dir when train() began
        self.run = 1  # this train() call's run number in output_dir (see checkpoint_run)
        self._warned_foreign = False

    def remember_start(self, checkpoint: str | bool | None) -> None:
        """Remember what ``output_dir`` held when ``train`` began, and the checkpoint it resumes
        (``checkpoint``): the checkpoints there that are not this run's are another run's."""
        self.resume_step = self.resume_dir = None
        if isinstance(checkpoint, (str, os.PathLike)):
            self.resume_step = checkpoint_step(Path(checkpoint))
            self.resume_dir = Path(checkpoint).resolve().parent
        folder = Path(self.trainer.args.output_dir)
        self.at_start = {
            path.name: step
            for path in (folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if folder.is_dir() else ())
            if path.is_dir() and (step := checkpoint_step(path)) is not None
        }
        # This run's number (see checkpoint_run): a resume with --resume_from_checkpoint true
        # picks the run started last, not the highest step of an earlier run in the same folder.
        self.run = 1 + max((checkpoint_run(folder / name) for name in self.at_start), default=0)

    def save(self, run_dir: str | os.PathLike, save: Callable[[], None]) -> None:
        """Run ``save`` (stock ``_save_checkpoint``, into ``run_dir``), then add the amp state.

        On a full disk torch says only "[enforce fail at inline_container.cc] ... file write
        failed" and leaves a half-written ``checkpoint-N``: here that folder is removed and an
        ``OSError(ENOSPC)`` names it (also torch.distributed.checkpoint's, which every rank
        raises). The folder holds
        :data:`~amp_trainer.checkpointing.completeness.INCOMPLETE_MARKER` until every rank wrote
        its part (see :meth:`_mark_complete`).

        ``save_total_limit`` is set aside for the stock call, which rotates before the other
        ranks are done (with a limit of 1, a rank killed then left only the torn checkpoint),
        and applied here after the marker is gone (:meth:`_rotate_own_checkpoints`).
        Checkpoints that were in output_dir before this run (and are not the earlier steps of
        the run resumed) are left out of that rotation: they belong to another run.
        """
        args = self.trainer.args
        run_dir = Path(run_dir)
        folder = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.trainer.state.global_step}"
        existed = folder.exists()
        limit = args.save_total_limit
        self._move_aside_if_foreign(run_dir, folder)
        foreign = self._foreign_checkpoints(run_dir)
        try:
            args.save_total_limit = None  # rotated below, once this checkpoint is complete
            if args.should_save:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / INCOMPLETE_MARKER).write_text(
                    f"{folder.name} is being saved; a save stopped half-way leaves this file.\n",
                    encoding="utf-8",
                )
            save()
            if args.should_save:
                write_json_atomic(folder / AMP_STATE_FILE, self.amp_state())
            self._mark_complete(folder)
        except BaseException as err:  # torch.distributed.checkpoint's CheckpointException is one
            if not _disk_full(err, run_dir):
                raise
            if args.should_save and not existed:
                shutil.rmtree(folder, ignore_errors=True)
            raise OSError(
                errno.ENOSPC,
                f"no space left on device saving {folder.name} in {run_dir}; the partial "
                "checkpoint was removed. Free some space and resume from the previous checkpoint.",
            ) from err
        finally:
            args.save_total_limit = limit
        if limit is not None and limit > 0 and args.should_save:
            self._rotate_own_checkpoints(run_dir, foreign, limit)

    def _mark_complete(self, folder: Path) -> None:
        """Remove the in-progress marker once every rank wrote its part of ``folder``.

        Why: each rank writes its own files (``rng_state_K.pth``, its shards) and the main
        process writes ``trainer_state.json`` without waiting for the others, so a rank killed
        mid-save left a folder that looked complete. Every rank waits here; then the main
        process writes the digest of every file (unless ``checkpoint_digests=False``; see
        :mod:`~amp_trainer.checkpointing.digests`) and removes the marker, last (see
        :mod:`~amp_trainer.checkpointing.completeness`).
        """
        accelerator = getattr(self.trainer, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1:
            accelerator.wait_for_everyone()
        if self.trainer.args.should_save:
            if checkpoint_digests(self.trainer.args):
                write_digests(folder)
            (folder / INCOMPLETE_MARKER).unlink(missing_ok=True)

    def _foreign_names(self, run_dir: Path) -> set[str]:
        """Names of the checkpoints in ``run_dir`` at the start that belong to another run: all
        of them, unless this run resumed one of ``run_dir``'s own (then those after it)."""
        if Path(self.trainer.args.output_dir).resolve() != run_dir.resolve():
            return set()  # hyperparameter-search trial folders: stock behaviour
        resumed = self.resume_step if self.resume_dir == run_dir.resolve() else None
        return {name for name, step in self.at_start.items() if resumed is None or step > resumed}

    def _move_aside_if_foreign(self, run_dir: Path, folder: Path) -> None:
        """Move another run's ``checkpoint-N`` out of the way before this run writes its own.

        Why: stock ``_save_checkpoint`` writes into an existing ``checkpoint-N`` and so replaces
        another run's checkpoint of the same step (``--reuse_output_dir``: a new run's
        checkpoint-4 and checkpoint-8 overwrote the previous run's). The previous one is renamed,
        whole, to ``previous-run-checkpoints[-K]/checkpoint-N`` (a name neither
        ``get_last_checkpoint`` nor rotation picks up), and a warning says where it went. The
        decision comes from what every rank saw at the start, so all ranks wait at the same
        barrier while the main process moves it.
        """
        if folder.name not in self._foreign_names(run_dir):
            return
        args = self.trainer.args
        if args.should_save and folder.is_dir():
            for index in range(1, 1000):
                suffix = "" if index == 1 else f"-{index}"
                keep = run_dir / f"previous-run-checkpoints{suffix}" / folder.name
                if not keep.exists():
                    break
            keep.parent.mkdir(exist_ok=True)
            os.replace(folder, keep)
            logger.warning(
                "%s was there before this run started (another run's, or a later step of the run "
                "resumed): moved it to %s so that this run's %s does not overwrite it.",
                folder,
                keep,
                folder.name,
            )
        self.at_start.pop(folder.name, None)
        accelerator = getattr(self.trainer, "accelerator", None)
        if accelerator is not None and accelerator.num_processes > 1:
            accelerator.wait_for_everyone()

    def _foreign_checkpoints(self, run_dir: Path) -> set[str]:
        """Checkpoints of another run that were in ``run_dir`` when training started."""
        foreign = self._foreign_names(run_dir)
        if foreign and not self._warned_foreign:
            self._warned_foreign = True
            logger.warning(
                "output_dir %s holds checkpoint(s) of another run (%s); save_total_limit "
                "rotation leaves them alone.",
                run_dir,
                ", ".join(sorted(foreign)),
            )
        return {name for name in foreign if (run_dir / name).is_dir()}

    def _rotate_own_checkpoints(self, run_dir: Path, foreign: set[str], limit: int) -> None:
        """``save_total_limit`` over this run's checkpoints only, as stock rotation keeps them.

        Called once the checkpoint just saved is complete. Stock's rule: the newest and the best
        checkpoint are always kept, then the oldest others are deleted until ``limit`` (or those
        two) remain. Ordered by step, not by folder mtime as stock does (with a step-number
        fallback): a folder's mtime changes whenever a file in it is added or removed.
        """
        own = sorted(
            (step, path)
            for path in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
            if path.is_dir()
            and path.name not in foreign
            and (step := checkpoint_step(path)) is not None
        )
        if len(own) <= limit:
            return
        best = self.trainer.state.best_model_checkpoint
        protected = {own[-1][1].resolve()}
        if best is not None and Path(best).resolve() in {path.resolve() for _, path in own}:
            protected.add(Path(best).resolve())
        remaining = len(own)
        for _, path in own:
            if remaining <= max(limit, len(protected)):
                break
            if path.resolve() not in protected:
                logger.info("Deleting older checkpoint %s (save_total_limit=%d)", path, limit)
                shutil.rmtree(path, ignore_errors=True)
                remaining -= 1

    def amp_state(self) -> dict[str, Any]:
        """What :data:`AMP_STATE_FILE` holds: the precision and loss-scaler settings the run
        started with, its (compact) scale history and its run number in output_dir."""
        args = self.trainer.args
        return {
            "run": self.run,
            "precision": self.trainer.precision,
            "loss_scaler": args.loss_scaler_kwargs()
            if isinstance(args, AmpTrainingArguments)
            else {},
            "scale_history": self.trainer.scale_history,
            # How many ranks wrote their part: what a complete checkpoint holds of each.
            "world_size": getattr(getattr(self.trainer, "accelerator", None), "num_processes", 1),
        }


def checkpoint_digests(args: Any) -> bool:
    """Whether checkpoints record and check file digests: ``args.checkpoint_digests``, on for
    arguments without the field (a plain ``TrainingArguments``)."""
    return bool(getattr(args, "checkpoint_digests", True))


def _disk_full(err: BaseException, folder: Path) -> bool:
    """Whether ``err`` is a full disk, also when torch.distributed.checkpoint gathered it.

    DCP's ``CheckpointException`` (a ``BaseException``) carries each failed rank's exception
    in ``failures`` (rank: exception, or exception and traceback) and says "file write failed"
    for all of them; every rank raises it, so every rank can tell.
    """
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for failure in failures.values():
            cause = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(cause, BaseException) and is_disk_full(cause, folder):
                return True
    return isinstance(err, Exception) and is_disk_full(err, folder)

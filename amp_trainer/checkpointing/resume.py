"""Resume auditing: what a resumed checkpoint restores, and what it lacks, said.

Stock ``Trainer`` resumes a checkpoint without a word about what is missing, crashes on an fp16
checkpoint resumed in another precision and trains one more step from the checkpoint of a
finished run. :class:`ResumeAudit` is the resume side of
:class:`~amp_trainer.checkpointing.CheckpointKeeper`:

* resuming a finished run (the checkpoint of its last step) trains nothing and returns the run's
  final metrics;
* a resumed checkpoint without its optimizer, scheduler, RNG or scaler state is one warning
  naming the files and what each costs; a damaged ``scaler.pt`` is one ``ValueError`` naming it;
* resuming in another precision, without ``scaler.pt``, or with ``loss_scale_*`` arguments the
  saved scaler state overrides is said in a warning, not silent (and not a crash);
* the scale history starts from the checkpoint's, so the run's summary covers all its steps.
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_callback import TrainerState
from transformers.trainer_utils import TrainOutput, get_last_checkpoint

from amp_trainer.atomic_files import is_disk_full
from amp_trainer.checkpointing.completeness import (
    last_complete_checkpoint,
    missing_rank_files,
    why_incomplete,
)
from amp_trainer.checkpointing.layout import (
    AMP_STATE_FILE,
    OPTIMIZER_FILE,
    RNG_FILE,
    SCALER_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
    checkpoint_step,
    read_amp_state,
)
from amp_trainer.checkpointing.saving import checkpoint_digests
from amp_trainer.training_args import LOSS_SCALER_FIELDS

__all__ = ["ResumeAudit"]

logger = logging.getLogger(__name__)


class ResumeAudit:
    """What resuming a checkpoint restores, for one :class:`~amp_trainer.trainer.AmpTrainerMixin`.

    ``trainer`` is the AmpTrainerMixin instance: this reads its ``args``, ``state``,
    ``precision`` and ``loss_scaler`` and writes its ``scale_history`` and ``resume_overrides``.
    The stock Trainer methods it wraps are passed in by the trainer's own hooks.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.missing_state: list[str] = []  # training-state files the resumed checkpoint lacks
        self.digests_checked: str | None = None  # the checkpoint resolve() compared with digests

    def resolve(self, resume_from_checkpoint: str | bool | None) -> str | bool | None:
        """The checkpoint ``train`` resumes from: ``True`` is output_dir's latest complete one.

        Stock takes the highest ``checkpoint-N`` whatever it holds, so a save stopped half-way
        (a killed rank, a preemption) is resumed and dies on its missing files, or resumes with
        one rank's state missing. Incomplete ones are skipped with a warning naming what each
        lacks (:func:`~amp_trainer.checkpointing.completeness.last_complete_checkpoint`, the
        recipes' rule too), and so are damaged ones (files that differ from their digests,
        unless ``checkpoint_digests=False``); when none is left, a ``ValueError`` says so.
        """
        self.digests_checked = None
        if resume_from_checkpoint is not True:
            return resume_from_checkpoint
        folder = self.trainer.args.output_dir
        digests = checkpoint_digests(self.trainer.args)
        last = last_complete_checkpoint(folder, digests=digests)
        if last is None and os.path.isdir(folder) and get_last_checkpoint(folder) is not None:
            raise ValueError(
                f"resume_from_checkpoint=True: no checkpoint in {folder} is complete and intact "
                "(the warnings above name what each lacks or which file differs); pass "
                "resume_from_checkpoint=PATH or start a new run"
            )
        if last is not None and digests:
            self.digests_checked = last
        return last or True  # none at all: stock train() raises its own error

    def finished_run(
        self, checkpoint: str | bool | None, load: Callable[[str], None]
    ) -> TrainOutput | None:
        """The run's result if ``checkpoint`` is its last step, else ``None`` (train on).

        A finished run's checkpoint is loaded (``load``, the trainer's ``_load_from_checkpoint``)
        together with its state and scale history, and a warning names it.
        """
        if not isinstance(checkpoint, (str, os.PathLike)):
            return None
        checkpoint = str(checkpoint)
        state_file = Path(checkpoint) / TRAINER_STATE_FILE
        if not state_file.is_file():
            return None  # stock train refuses a checkpoint without its state
        state = TrainerState.load_from_json(str(state_file))
        trainer = self.trainer
        if trainer.args.auto_find_batch_size and state.train_batch_size is not None:
            trainer._train_batch_size = state.train_batch_size  # what stock train() restores
        target = self._planned_max_steps()
        # max_steps counts applied updates; the epochs of num_train_epochs hold `target` optimizer
        # step attempts (a skipped update reads its batches too; see amp_trainer.step_accounting).
        by_epochs = trainer.args.max_steps <= 0
        done = getattr(state, "optimizer_step_attempts", state.global_step)
        done = done if by_epochs else state.global_step
        if not target or done < target:
            return None
        where = (
            f"optimizer step attempt {done} of the {target} its epochs hold"
            if by_epochs
            else f"step {done} of max_steps {target}"
        )
        logger.warning(
            "%s is the end of its run (%s): nothing to train. The model is the checkpoint's; "
            "pass a larger max_steps (or num_train_epochs) to train on.",
            checkpoint,
            where,
        )
        load(checkpoint)
        trainer.state = state
        # Stock train() restores stateful callbacks (EarlyStoppingCallback, ...) from the state
        # (if restore_callback_states_from_checkpoint); so does a finished run here.
        trainer._load_callback_state()
        trainer._load_scaler(checkpoint)  # the final loss scale is the checkpoint's, not init's
        final = next((e for e in reversed(state.log_history) if "train_loss" in e), {})
        metrics = {k: v for k, v in final.items() if k.startswith("train_") or k == "total_flos"}
        return TrainOutput(state.global_step, final.get("train_loss", float("nan")), metrics)

    def _planned_max_steps(self) -> int | None:
        """The ``max_steps`` this ``train`` call would run to (``None`` if it cannot be known).

        With ``num_train_epochs`` that is stock's own count over the train dataloader, not the
        checkpoint's ``max_steps``: a checkpoint of a ``max_steps=2`` run stores one epoch, yet
        one epoch of 8 steps still has 6 to train.
        """
        trainer = self.trainer
        args = trainer.args
        if args.max_steps > 0:
            return args.max_steps
        try:
            dataloader = trainer.get_train_dataloader()
            extra = ()
            if (
                "total_train_batch_size"
                in inspect.signature(Trainer.set_initial_training_values).parameters
            ):
                extra = (
                    trainer.get_total_train_batch_size(args),
                )  # transformers before 5.x's split
            return trainer.set_initial_training_values(args, dataloader, *extra)[-1]
        except (ValueError, TypeError):  # no train_dataset, or no length: stock train() says so
            return None

    def report_missing_state(self, checkpoint: str | bool | None) -> None:
        """One warning naming the training-state files the resumed checkpoint lacks, and what
        each costs; remembered in :attr:`missing_state`.

        Why: stock ``train`` resumes a checkpoint without ``optimizer.pt``/``scheduler.pt`` (one
        saved with ``save_only_model``, or copied without them) with a fresh optimizer and a
        learning-rate schedule that starts its warm-up again, and one without ``rng_state.pth``
        with other dropout masks and data order: the resumed run silently differs from the one
        that was interrupted. Warned rather than refused, because such a checkpoint is usually
        saved that way on purpose and the model weights are what it carries; the warning is the
        first line about the resume, so the choice is the user's, informed. DeepSpeed and FSDP
        lay their state out differently and are left to their own loaders.
        """
        self.missing_state = []
        if not isinstance(checkpoint, (str, os.PathLike)):
            return
        trainer = self.trainer
        folder = Path(checkpoint)
        if not folder.is_dir():
            return
        if self._report_incomplete(folder):
            return
        if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            return
        scaler = trainer.loss_scaler
        costs = {
            OPTIMIZER_FILE: "the optimizer starts afresh (no momentum/Adam statistics)",
            SCHEDULER_FILE: "the learning-rate schedule starts again (warm-up included)",
            RNG_FILE: "dropout masks and data order differ from an uninterrupted run",
            SCALER_FILE: f"the loss scale restarts at {scaler.get_scale() if scaler else 1:g}",
        }
        missing = [
            name for name in (OPTIMIZER_FILE, SCHEDULER_FILE) if not (folder / name).is_file()
        ]
        if not any(folder.glob("rng_state*.pth")):
            missing.append(RNG_FILE)
        if not missing:
            return  # scaler.pt alone missing: load_scaler's own warning says it
        if scaler is not None and not (folder / SCALER_FILE).is_file():
            saved = (read_amp_state(folder) or {}).get("precision")
            if saved in (None, "fp16"):  # another precision's checkpoint is said in load_scaler
                missing.append(SCALER_FILE)
        self.missing_state = missing
        if OPTIMIZER_FILE in missing or SCHEDULER_FILE in missing:
            # Stock loads the two together: without either, neither is loaded.
            said = [costs[OPTIMIZER_FILE], costs[SCHEDULER_FILE]]
        else:
            said = []
        said += [costs[name] for name in (RNG_FILE, SCALER_FILE) if name in missing]
        logger.warning(
            "Resuming %s, which has no %s (saved with save_only_model?): %s.",
            folder,
            " / ".join(missing),
            "; ".join(said),
        )

    def _report_incomplete(self, folder: Path) -> bool:
        """One warning when ``folder`` was stopped mid-save (a rank's files missing, or the
        in-progress marker left), naming the files and the last complete checkpoint beside it.

        Checked under every launcher (FSDP and DeepSpeed included): a rank without its
        ``rng_state_K.pth`` resumes with other dropout masks and data order and nothing says so.
        Warned rather than refused, as a checkpoint passed by path is the user's explicit choice.
        """
        reason = why_incomplete(folder)
        if reason is None or not (folder / TRAINER_STATE_FILE).is_file():
            return False  # complete, or no state at all: stock train() refuses it by itself
        self.missing_state = missing_rank_files(folder)
        digests = checkpoint_digests(self.trainer.args)
        earlier = last_complete_checkpoint(folder.parent, warn=False, digests=digests)
        logger.warning(
            "Resuming %s, which is incomplete (%s; interrupted while saving?): the resumed run "
            "differs from the interrupted one (the ranks without their files start with other "
            "state). %s",
            folder,
            reason,
            f"The last complete checkpoint is {earlier}."
            if earlier
            else "No complete checkpoint is beside it.",
        )
        return True

    def restore_scale_history(self, checkpoint: Path) -> dict[str, Any] | None:
        """Start ``scale_history`` from the checkpoint's (the run so far); its saved state.

        ``checkpoint-N`` holds the entries of steps up to N and the skipped attempts at step N+1
        made before it was saved (a skipped update is no step: a checkpoint saved between two
        attempts, SIGTERM's or the end of training's, can follow one).
        """
        saved = read_amp_state(checkpoint)
        step = checkpoint_step(checkpoint)
        if saved is not None:
            history = saved.get("scale_history") or []
            self.trainer.scale_history = [
                e
                for e in history
                if step is None or e["step"] <= step or (e["skipped"] and e["step"] == step + 1)
            ]
        elif self.trainer.loss_scaler is not None:
            logger.warning(
                "%s has no %s: the loss-scale summary covers only the steps after it.",
                checkpoint,
                AMP_STATE_FILE,
            )
        return saved

    def load_scaler(self, checkpoint: str | None, load: Callable[[str], None]) -> None:
        """Resume the loss scaler honestly: say when its state is dropped, missing or overrides.

        ``load`` is stock ``_load_scaler``, which crashes (``'NoneType' object has no attribute
        'load_state_dict'``) when an fp16 checkpoint is resumed in bf16/fp32 (what LossScaleError
        advises), and starts a fresh scaler without a word when ``scaler.pt`` is missing.
        """
        if checkpoint is None:
            return
        trainer = self.trainer
        scaler = trainer.loss_scaler
        path = Path(checkpoint)
        saved = self.restore_scale_history(path)
        has_state = (path / SCALER_FILE).is_file()
        was = (saved or {}).get("precision")
        if scaler is None:
            if has_state and trainer.accelerator.scaler is None:
                scale = _saved_scale(path / SCALER_FILE)
                logger.warning(
                    "Resuming an fp16 checkpoint (%s) in %s: its loss-scaler state%s is dropped; "
                    "%s trains without loss scaling.",
                    path.name,
                    trainer.precision,
                    "" if scale is None else f" (scale {scale:g})",
                    trainer.precision,
                )
                return
            load(checkpoint)
            return
        if not has_state:
            if was is not None and was != "fp16":
                logger.warning(
                    "Resuming a %s checkpoint (%s) in fp16: the loss scaler starts afresh at "
                    "scale %g.",
                    was,
                    path.name,
                    scaler.get_scale(),
                )
            elif SCALER_FILE not in self.missing_state:  # else said with the other files
                logger.warning(
                    "%s has no %s: the loss scaler starts afresh at scale %g instead of where the "
                    "run left it (expect extra skipped steps, and a shifted LR schedule).",
                    path,
                    SCALER_FILE,
                    scaler.get_scale(),
                )
            return
        given = scaler.state_dict()
        _load_scaler_file(path / SCALER_FILE, lambda: load(checkpoint))
        self._report_scaler_overrides(given, scaler.state_dict(), saved, path.name)

    def _report_scaler_overrides(
        self,
        given: dict[str, Any],
        used: dict[str, Any],
        saved: dict[str, Any] | None,
        checkpoint: str,
    ) -> None:
        """Log the loss_scale_* arguments the checkpoint overrode; write the used ones back."""
        args = self.trainer.args
        overrides: dict[str, dict[str, Any]] = {}
        for name, key in LOSS_SCALER_FIELDS.items():
            if key == "init_scale":
                started = ((saved or {}).get("loss_scaler") or {}).get("init_scale")
                if started is not None and started != getattr(args, name, started):
                    overrides[name] = {"given": getattr(args, name), "used": started}
            elif key in given and key in used and given[key] != used[key]:
                overrides[name] = {"given": given[key], "used": used[key]}
        self.trainer.resume_overrides = overrides
        if not overrides:
            return
        for name, values in overrides.items():
            if hasattr(args, name):
                setattr(args, name, values["used"])
        logger.warning(
            "Resumed the loss scaler from %s (scale %g): its state overrides %s. To change them, "
            "start a new run.",
            checkpoint,
            self.trainer.loss_scaler.get_scale(),
            ", ".join(
                f"{name}={v['given']!r} (given) with {v['used']!r}" for name, v in overrides.items()
            ),
        )


def _load_scaler_file(path: Path, load: Callable[[], None]) -> None:
    """``load()`` (stock ``_load_scaler``), with a damaged ``scaler.pt`` said in one line naming it.

    Why: torch reports a truncated file as ``EOFError: EOFError`` or ``PytorchStreamReader
    failed reading zip archive``, and a file that does not hold plain numbers with advice to
    pass ``weights_only=False``, which would run whatever code the file holds; the scaler's own
    validation (``skipped`` > ``steps``, a negative counter) names the field, not the file.
    A ``ValueError`` (a usage error: the file is the user's to fix) names the file, the reason
    and what to do instead.
    """
    try:
        load()
    except Exception as err:  # torch.load and load_state_dict raise many types
        if is_disk_full(err):
            raise
        text = " ".join(str(err).split())
        if isinstance(err, pickle.UnpicklingError) or "weights_only" in text:
            reason = (
                "not a scaler state of plain numbers (refused unread: loading it could run code)"
            )
        elif isinstance(err, EOFError) or "zip archive" in text or "central directory" in text:
            reason = "truncated or not a torch file"
        else:
            reason = f"{type(err).__name__}: {text.split('. ')[0]}" if text else type(err).__name__
        raise ValueError(
            f"{path} is unreadable ({reason}). Resume from another checkpoint, or delete "
            f"{path.name} to start the loss scaler afresh (a warning will say so)."
        ) from err


def _saved_scale(path: Path) -> float | None:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        return float(state["scale"])
    except Exception:  # only for the message; the state is being dropped anyway
        return None

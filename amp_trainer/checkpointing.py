"""AmpTrainer's checkpoints and resume: say what happens, never lose a finished run.

Stock ``Trainer`` saves ``scaler.pt`` (which holds our scaler's whole state) and resumes it; what
:class:`CheckpointKeeper` adds, called from the three hooks ``AmpTrainerMixin`` overrides
(``train``, ``_save_checkpoint``, ``_load_scaler``):

* :data:`AMP_STATE_FILE` in every checkpoint: the precision and loss-scaler settings the run
  started with and the whole run's (compact: events and logging steps) scale history, so a
  resumed run can tell what changed and report all of its steps;
* resuming a finished run (the checkpoint of its last step) trains nothing and returns the run's
  final metrics, where stock ``train`` trains one more step every time;
* a full disk is one ``OSError(ENOSPC)`` naming the checkpoint, without a half-written folder;
* ``save_total_limit`` rotation spares the checkpoints of another run found in ``output_dir``
  (all of them when the checkpoint resumed is another folder's), and another run's
  ``checkpoint-N`` of the step being saved is moved to ``previous-run-checkpoints/``, not
  overwritten;
* a resumed checkpoint without its optimizer, scheduler, RNG or scaler state is one warning
  naming the files and what each costs; a damaged ``scaler.pt`` is one ``ValueError`` naming it;
* resuming in another precision, without ``scaler.pt``, or with ``loss_scale_*`` arguments the
  saved scaler state overrides is said in a warning, not silent (and not a crash);
* ``enable_jit_checkpoint`` (transformers' checkpoint on SIGTERM) saves between two optimizer
  steps, never inside one (see :class:`_JITCheckpointBetweenSteps`), and the trainer's
  ``jit_checkpoint`` names the folder it wrote.
"""

from __future__ import annotations

import errno
import inspect
import json
import logging
import os
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_callback import TrainerState
from transformers.trainer_jit_checkpoint import JITCheckpointCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint

from amp_trainer.atomic_files import is_disk_full, write_json_atomic
from amp_trainer.training_args import LOSS_SCALER_FIELDS, AmpTrainingArguments

__all__ = ["AMP_STATE_FILE", "CheckpointKeeper"]

logger = logging.getLogger(__name__)

#: What amp-trainer adds to every checkpoint: the precision and loss-scaler settings the run
#: started with and the whole run's scale history, so that a resumed run can tell what changed
#: and report all of its steps, not just those since the resume.
AMP_STATE_FILE = "amp_trainer_state.json"
# Stock Trainer's checkpoint file names (transformers.trainer module constants).
_SCALER_FILE, _TRAINER_STATE_FILE = "scaler.pt", "trainer_state.json"
_OPTIMIZER_FILE, _SCHEDULER_FILE, _RNG_FILE = "optimizer.pt", "scheduler.pt", "rng_state.pth"


class CheckpointKeeper:
    """The checkpoint and resume behaviour of one :class:`~amp_trainer.trainer.AmpTrainerMixin`.

    ``trainer`` is the AmpTrainerMixin instance: this reads its ``args``, ``state``,
    ``precision`` and ``loss_scaler`` and writes its ``scale_history`` and ``resume_overrides``.
    The stock Trainer methods it wraps are passed in by the trainer's own hooks.
    """

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.resume_step: int | None = None  # N of the checkpoint-N resumed from
        self.resume_dir: Path | None = None  # the folder holding the checkpoint resumed from
        self.at_start: dict[str, int] = {}  # checkpoint folders in output_dir when train() began
        self._warned_foreign = False
        self.missing_state: list[str] = []  # training-state files the resumed checkpoint lacks

    # -- train() -----------------------------------------------------------------------------
    def start(self, resume_from_checkpoint: str | bool | None) -> str | bool | None:
        """The checkpoint ``train`` resumes from; remember what ``output_dir`` held at the start."""
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.trainer.args.output_dir) or True  # stock raises
        self.resume_step = self.resume_dir = None
        if isinstance(checkpoint, (str, os.PathLike)):
            self.resume_step = _checkpoint_step(Path(checkpoint))
            self.resume_dir = Path(checkpoint).resolve().parent
        folder = Path(self.trainer.args.output_dir)
        self.at_start = {
            path.name: step
            for path in (folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*") if folder.is_dir() else ())
            if path.is_dir() and (step := _checkpoint_step(path)) is not None
        }
        return checkpoint

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
        state_file = Path(checkpoint) / _TRAINER_STATE_FILE
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
        self.restore_scale_history(Path(checkpoint))
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
        if not folder.is_dir() or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
            return
        scaler = trainer.loss_scaler
        costs = {
            _OPTIMIZER_FILE: "the optimizer starts afresh (no momentum/Adam statistics)",
            _SCHEDULER_FILE: "the learning-rate schedule starts again (warm-up included)",
            _RNG_FILE: "dropout masks and data order differ from an uninterrupted run",
            _SCALER_FILE: f"the loss scale restarts at {scaler.get_scale() if scaler else 1:g}",
        }
        missing = [
            name for name in (_OPTIMIZER_FILE, _SCHEDULER_FILE) if not (folder / name).is_file()
        ]
        if not any(folder.glob("rng_state*.pth")):
            missing.append(_RNG_FILE)
        if not missing:
            return  # scaler.pt alone missing: load_scaler's own warning says it
        if scaler is not None and not (folder / _SCALER_FILE).is_file():
            saved = (_read_amp_state(folder) or {}).get("precision")
            if saved in (None, "fp16"):  # another precision's checkpoint is said in load_scaler
                missing.append(_SCALER_FILE)
        self.missing_state = missing
        if _OPTIMIZER_FILE in missing or _SCHEDULER_FILE in missing:
            # Stock loads the two together: without either, neither is loaded.
            said = [costs[_OPTIMIZER_FILE], costs[_SCHEDULER_FILE]]
        else:
            said = []
        said += [costs[name] for name in (_RNG_FILE, _SCALER_FILE) if name in missing]
        logger.warning(
            "Resuming %s, which has no %s (saved with save_only_model?): %s.",
            folder,
            " / ".join(missing),
            "; ".join(said),
        )

    # -- enable_jit_checkpoint -----------------------------------------------------------------
    def take_over_jit_checkpoint(self) -> None:
        """Put :class:`_JITCheckpointBetweenSteps` where stock ``Trainer.__init__`` put its
        ``JITCheckpointCallback`` (``enable_jit_checkpoint``), keeping its SIGTERM handler."""
        handler = self.trainer.callback_handler
        for index, callback in enumerate(handler.callbacks):
            if type(callback) is JITCheckpointCallback and callback.jit_manager is not None:
                handler.callbacks[index] = _JITCheckpointBetweenSteps(callback)

    # -- _save_checkpoint() ------------------------------------------------------------------
    def save(self, run_dir: str | os.PathLike, save: Callable[[], None]) -> None:
        """Run ``save`` (stock ``_save_checkpoint``, into ``run_dir``), then add the amp state.

        On a full disk torch says only "[enforce fail at inline_container.cc] ... file write
        failed" and leaves a half-written ``checkpoint-N``: here that folder is removed and an
        ``OSError(ENOSPC)`` names it. Checkpoints that were in output_dir before this run (and
        are not the earlier steps of the run resumed) are left out of ``save_total_limit``
        rotation: they belong to another run.
        """
        args = self.trainer.args
        run_dir = Path(run_dir)
        folder = run_dir / f"{PREFIX_CHECKPOINT_DIR}-{self.trainer.state.global_step}"
        existed = folder.exists()
        limit = args.save_total_limit
        self._move_aside_if_foreign(run_dir, folder)
        foreign = self._foreign_checkpoints(run_dir)
        try:
            if foreign and limit:
                args.save_total_limit = None  # rotated below, without the foreign ones
            save()
            if args.should_save:
                write_json_atomic(folder / AMP_STATE_FILE, self._amp_state())
        except Exception as err:
            if not is_disk_full(err, run_dir):
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
        if foreign and limit and args.should_save:
            self._rotate_own_checkpoints(run_dir, foreign, limit)

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
        """``save_total_limit`` over this run's checkpoints only (the best one is kept)."""
        own = sorted(
            (step, path)
            for path in run_dir.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
            if path.is_dir()
            and path.name not in foreign
            and (step := _checkpoint_step(path)) is not None
        )
        best = self.trainer.state.best_model_checkpoint
        keep = {path for _, path in own[-limit:]}
        for _, path in own:
            if path not in keep and (best is None or Path(best).resolve() != path.resolve()):
                logger.info("Deleting older checkpoint %s (save_total_limit=%d)", path, limit)
                shutil.rmtree(path, ignore_errors=True)

    def _amp_state(self) -> dict[str, Any]:
        args = self.trainer.args
        return {
            "precision": self.trainer.precision,
            "loss_scaler": args.loss_scaler_kwargs()
            if isinstance(args, AmpTrainingArguments)
            else {},
            "scale_history": self.trainer.scale_history,
        }

    # -- _load_scaler() ----------------------------------------------------------------------
    def restore_scale_history(self, checkpoint: Path) -> dict[str, Any] | None:
        """Start ``scale_history`` from the checkpoint's (the run so far); its saved state.

        ``checkpoint-N`` holds the entries of steps up to N and the skipped attempts at step N+1
        made before it was saved (a skipped update is no step: a checkpoint saved between two
        attempts, SIGTERM's or the end of training's, can follow one).
        """
        saved = _read_amp_state(checkpoint)
        step = _checkpoint_step(checkpoint)
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
        has_state = (path / _SCALER_FILE).is_file()
        was = (saved or {}).get("precision")
        if scaler is None:
            if has_state and trainer.accelerator.scaler is None:
                scale = _saved_scale(path / _SCALER_FILE)
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
            elif _SCALER_FILE not in self.missing_state:  # else said with the other files
                logger.warning(
                    "%s has no %s: the loss scaler starts afresh at scale %g instead of where the "
                    "run left it (expect extra skipped steps, and a shifted LR schedule).",
                    path,
                    _SCALER_FILE,
                    scaler.get_scale(),
                )
            return
        given = scaler.state_dict()
        _load_scaler_file(path / _SCALER_FILE, lambda: load(checkpoint))
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


class _JITCheckpointBetweenSteps(JITCheckpointCallback):
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


def _checkpoint_step(path: Path) -> int | None:
    """N of a ``checkpoint-N`` folder (``None`` for another name)."""
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    name = path.name
    if name.startswith(prefix) and name[len(prefix) :].isdigit():
        return int(name[len(prefix) :])
    return None


def _read_amp_state(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's :data:`AMP_STATE_FILE` (``None`` if it has none, or an unreadable one)."""
    try:
        data = json.loads((checkpoint / AMP_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


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

"""Where a recipe run writes and what it resumes, settled before anything is loaded.

``--resume_from_checkpoint`` takes what transformers users pass: ``true`` (the last
``checkpoint-N`` in ``output_dir``, found as :func:`transformers.trainer_utils.get_last_checkpoint`
finds it, but skipping one left half-written by a Ctrl-C or a killed rank: see
:mod:`amp_trainer.checkpointing.completeness`), a run folder (its last checkpoint) or a
``checkpoint-N`` folder. Stock Trainer knows
only the last form, and says so after the ~20 s of loading data and model ("Can't find a valid
checkpoint at true", ``[Errno 2] ... trainer_state.json``); here a bad value is one line before
any of that.

When ``output_dir`` comes from the config file rather than ``--output_dir``, a run does not collide
with the previous one: resuming continues in the checkpoint's own run folder, and a new run next
to a previous run's folder (``runs/bert_offline``) gets the next free one (``runs/bert_offline-2``).
An ``--output_dir`` given on the command line is used as given.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from amp_trainer.checkpointing.completeness import (
    INCOMPLETE_MARKER,
    last_complete_checkpoint,
    why_incomplete,
)
from amp_trainer.recipes.config import EXIT_INTERRUPTED, EXIT_TERMINATED, UsageError

__all__ = [
    "ResumeInterrupted",
    "RunPreempted",
    "interrupted",
    "last_complete_checkpoint",
    "launcher_prefix",
    "preempted",
    "resolve_checkpoint",
    "resume_command",
    "resumed_from_line",
    "settle_run_folder",
]

logger = logging.getLogger(__name__)

_TRUE, _FALSE = ("true", "yes", "1"), ("", "false", "no", "0", "none")
_STATE_FILE = "trainer_state.json"  # stock Trainer's TRAINER_STATE_NAME
_STEP = re.compile(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)")


class ResumeInterrupted(KeyboardInterrupt):
    """Ctrl-C during training; its message is the one line to print, with the resume command."""

    exit_code = EXIT_INTERRUPTED


class RunPreempted(ResumeInterrupted):
    """SIGTERM with ``--enable_jit_checkpoint``: the checkpoint is saved and the run stops; the
    message is the one line to print, with the resume command. Exit 143, as a shell reports a
    process ended by SIGTERM (the orchestrator's restart policy takes it from there)."""

    exit_code = EXIT_TERMINATED


def _flag_given(argv: Sequence[str], name: str) -> bool:
    spellings = (f"--{name}", f"--{name.replace('_', '-')}")
    return any(arg in spellings or arg.split("=", 1)[0] in spellings for arg in argv)


def _contents(folder: Path) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    if not names:
        return "it is empty"
    return "it holds " + ", ".join(names[:6]) + (" ..." if len(names) > 6 else "")


def resolve_checkpoint(value: str | None, output_dir: str, *, digests: bool = True) -> str | None:
    """The ``checkpoint-N`` folder ``--resume_from_checkpoint value`` means (``None``: none).
    ``digests``: pass over a checkpoint whose files differ from its digest list
    (``--checkpoint_digests``).

    ``true``: the last checkpoint in ``output_dir``; a folder with ``trainer_state.json``: that
    checkpoint; another folder: its last ``checkpoint-N``. Anything else is a
    :class:`UsageError` naming the value and what the folder holds.
    """
    if value is None or str(value).strip().lower() in _FALSE:
        return None
    text = str(value).strip()
    if text.lower() in _TRUE:
        folder, said = Path(output_dir), f"true (the last checkpoint in output_dir {output_dir!r})"
        if not folder.is_dir():
            raise UsageError(
                f"--resume_from_checkpoint {said}: {output_dir!r} does not exist; pass "
                "--output_dir RUN_DIR or --resume_from_checkpoint RUN_DIR/checkpoint-N"
            )
    else:
        folder, said = Path(os.path.expanduser(text)), repr(text)
        if not folder.exists():
            raise UsageError(
                f"--resume_from_checkpoint {said} does not exist; pass true (the last checkpoint "
                "in --output_dir), a run folder or a checkpoint-N folder"
            )
        if not folder.is_dir():
            raise UsageError(
                f"--resume_from_checkpoint {said} is a file; pass a run folder or a "
                "checkpoint-N folder"
            )
        missing = why_incomplete(folder)
        if missing is None:
            return str(folder)
        if _STEP.fullmatch(folder.name) or (folder / INCOMPLETE_MARKER).is_file():
            earlier = last_complete_checkpoint(folder.parent, digests=digests)
            raise UsageError(
                f"--resume_from_checkpoint {said} is an incomplete checkpoint ({missing}: "
                "interrupted while saving?); "
                + (f"the last complete one is {earlier}" if earlier else "pass another one")
            )
    if get_last_checkpoint(str(folder)) is None:
        raise UsageError(
            f"--resume_from_checkpoint {said}: {str(folder)!r} holds no {PREFIX_CHECKPOINT_DIR}-N "
            f"folder ({_contents(folder)}); pass a run folder with checkpoints (--save_strategy "
            "not 'no') or a checkpoint-N folder"
        )
    last = last_complete_checkpoint(folder, digests=digests)
    if last is None:
        raise UsageError(
            f"--resume_from_checkpoint {said}: no checkpoint in {str(folder)!r} is complete "
            f"and intact (each lacks {_STATE_FILE} or a rank's part, holds {INCOMPLETE_MARKER}, "
            "or has a file that differs from its digest); start a new run"
        )
    return last


def _next_free(folder: Path) -> Path:
    n = 2
    while (candidate := folder.with_name(f"{folder.name}-{n}")).exists():
        n += 1
    return candidate


def _latest_run(folder: Path) -> Path:
    """The highest-numbered of ``folder``, ``folder-2``, ``folder-3`` ... that has a checkpoint."""
    runs = [(1, folder)]
    if folder.parent.is_dir():
        prefix = f"{folder.name}-"
        runs += [
            (int(p.name[len(prefix) :]), p)
            for p in folder.parent.glob(f"{prefix}*")
            if p.name[len(prefix) :].isdigit() and p.is_dir()
        ]
    with_checkpoints = [(n, p) for n, p in runs if p.is_dir() and get_last_checkpoint(str(p))]
    return max(with_checkpoints)[1] if with_checkpoints else folder


def _holds_a_run(folder: Path) -> bool:
    return folder.is_dir() and any(
        p.name == "metrics.json" or p.name.startswith(f"{PREFIX_CHECKPOINT_DIR}-")
        for p in folder.iterdir()
    )


def settle_run_folder(training_args: Any, argv: Sequence[str], *, reuse: bool) -> None:
    """Resolve ``--resume_from_checkpoint`` and choose the run folder, in ``training_args``.

    Called on the parsed arguments before the output folder check and before any loading.
    ``output_dir`` changes only when the command line did not name it (see the module doc).
    """
    explicit_dir = _flag_given(argv, "output_dir")
    value = training_args.resume_from_checkpoint
    if not explicit_dir and str(value).strip().lower() in _TRUE:
        # "true" with the config's folder: the latest run of that name (runs/bert_offline-3).
        training_args.output_dir = str(_latest_run(Path(training_args.output_dir)))
    digests = getattr(training_args, "checkpoint_digests", True)
    checkpoint = resolve_checkpoint(value, training_args.output_dir, digests=digests)
    training_args.resume_from_checkpoint = checkpoint
    if explicit_dir:
        return
    if checkpoint is not None:
        run_dir = str(Path(checkpoint).parent)
        if Path(run_dir).resolve() != Path(training_args.output_dir).resolve():
            logger.info("Resuming in the checkpoint's run folder %s", run_dir)
            training_args.output_dir = run_dir
        return
    folder = Path(training_args.output_dir)
    if not reuse and _holds_a_run(folder):
        new = _next_free(folder)
        logger.warning(
            "%s holds a previous run: this run writes to %s (--output_dir chooses the folder, "
            "--resume_from_checkpoint true continues the previous run)",
            folder,
            new,
        )
        training_args.output_dir = str(new)


def resumed_from_line(checkpoint: str) -> str:
    """ "Resumed from CHECKPOINT at step N (loss scale S)": what the run logs as it resumes."""
    step, scale = _step_and_scale(Path(checkpoint))
    return f"Resumed from {checkpoint} at step {step} (loss scale {scale})"


def _step_and_scale(path: Path) -> tuple[str, str]:
    """The checkpoint's step and loss scale as they are said (from its files, not the run)."""
    import json

    import torch

    try:
        step = json.loads((path / _STATE_FILE).read_text(encoding="utf-8"))["global_step"]
    except (OSError, ValueError, KeyError):
        step = "?"
    scaler = path / "scaler.pt"
    scale = "none: the checkpoint has no loss scaler state"
    if scaler.is_file():
        try:
            scale = f"{float(torch.load(scaler, map_location='cpu', weights_only=True)['scale']):g}"
        except Exception:  # only for the message; loading the scaler itself reports failures
            scale = "unreadable scaler.pt"
    return str(step), scale


def resume_command(argv: Sequence[str], output_dir: str, checkpoint: str | None = None) -> str:
    """The command that resumes this run: the same flags, ``--resume_from_checkpoint`` set to
    ``checkpoint`` (default: the last complete one in ``output_dir``; the caller checks that
    there is one)."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in ("--resume_from_checkpoint", "--resume-from-checkpoint", "--output_dir"):
            skip = "=" not in arg
            continue
        kept.append(arg)
    prefix, _ = launcher_prefix()
    # Completeness only: the resume itself compares the digests (hashing every checkpoint here
    # would hold up a Ctrl-C for as long as it takes to read them all).
    last = checkpoint or last_complete_checkpoint(output_dir, digests=False)
    return shlex.join(
        [*prefix, sys.argv[0], *kept, "--output_dir", output_dir, "--resume_from_checkpoint", last]
    )


# What each launcher exports to the script it starts. accelerate launch (1.10 to 1.16) exports
# ACCELERATE_MIXED_PRECISION from its simple, multi-GPU and DeepSpeed launchers alike and
# ACCELERATE_DYNAMO_BACKEND from the first two; its multi-process launchers run torchrun's
# elastic agent underneath, so accelerate's variables are looked at first. torchrun's agent exports
# TORCHELASTIC_RUN_ID, LOCAL_WORLD_SIZE and WORLD_SIZE; LOCAL_RANK alone is some other launcher.
_ACCELERATE_ENV = ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_DYNAMO_BACKEND")


def launcher_prefix(environ: Mapping[str, str] | None = None) -> tuple[list[str], str | None]:
    """The launcher that started this process, as the start of the command that resumes it,
    and what that start cannot repeat (``None``: nothing).

    Only what the launcher exports is known, not its flags: ``accelerate launch`` with a config
    file or ``--num_processes`` looks the same to the script, and torchrun's rendezvous flags
    are not exported. So the process counts that are known are given, and the line says which
    flags to add, rather than print ``python`` for a run that needs its launcher.
    """
    env = os.environ if environ is None else environ
    world = env.get("WORLD_SIZE", "")
    local = env.get("LOCAL_WORLD_SIZE", "")
    if any(name in env for name in _ACCELERATE_ENV):
        prefix = ["accelerate", "launch"]
        if world.isdigit() and int(world) > 1:
            prefix += ["--num_processes", world]
        return prefix, "add your accelerate launch flags"
    if "TORCHELASTIC_RUN_ID" in env:
        prefix = ["torchrun", "--nproc_per_node", local or "1"]
        if world.isdigit() and local.isdigit() and int(world) > int(local) > 0:
            prefix += ["--nnodes", str(int(world) // int(local))]
            return prefix, "add your torchrun rendezvous flags"
        return prefix, None
    if "LOCAL_RANK" in env:  # another launcher (DeepSpeed's, mpirun wrappers): not torchrun's
        prefix = ["torchrun", "--nproc_per_node", local or world or "1"]
        return prefix, "or the launcher you started it with, and its flags"
    return ["python"], None


def _resume_with(argv: Sequence[str], output_dir: str, checkpoint: str | None = None) -> str:
    """ "Resume with: COMMAND", with what to add to it when the launcher's flags are unknown."""
    _, note = launcher_prefix()
    said = f"Resume with ({note}): " if note else "Resume with: "
    return said + resume_command(argv, output_dir, checkpoint)


def interrupted(argv: Sequence[str], output_dir: str) -> ResumeInterrupted:
    """The one-line :class:`ResumeInterrupted` for a Ctrl-C while training into ``output_dir``."""
    last = last_complete_checkpoint(output_dir, digests=False)  # as in resume_command
    if last is not None:
        return ResumeInterrupted(
            f"interrupted; {Path(last).name} is the last checkpoint. "
            f"{_resume_with(argv, output_dir)}"
        )
    return ResumeInterrupted(
        f"interrupted before the first checkpoint in {output_dir} (save_steps): nothing to resume"
    )


def preempted(argv: Sequence[str], output_dir: str, checkpoint: str) -> RunPreempted:
    """The one-line :class:`RunPreempted` for a run that saved ``checkpoint`` on SIGTERM."""
    step, scale = _step_and_scale(Path(checkpoint))
    return RunPreempted(
        f"stopped by SIGTERM (--enable_jit_checkpoint); {Path(checkpoint).name} saved at step "
        f"{step} (loss scale {scale}). {_resume_with(argv, output_dir, checkpoint)}"
    )

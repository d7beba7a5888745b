"""Whether a checkpoint folder is whole: the one rule every resume path applies.

A save can stop half-way (a Ctrl-C, a preemption, one rank killed): a ``checkpoint-N`` folder then
exists with some of its files. transformers' ``get_last_checkpoint`` takes the highest number
whatever it holds, so a resumed run dies on a missing ``trainer_state.json`` (every rank, with a
``FileNotFoundError``), or, worse, resumes a checkpoint where one rank's RNG state is missing and
silently trains on other data order and dropout masks. The recipes' ``--resume_from_checkpoint``
and :class:`~amp_trainer.trainer.AmpTrainerMixin`'s ``resume_from_checkpoint=True`` both pick the
last checkpoint :func:`why_incomplete` accepts, with one warning naming what each skipped one lacks,
and pass over a complete one whose files differ from their recorded digests
(:mod:`~amp_trainer.checkpointing.digests`), with one warning naming the file.

A folder is complete when it holds ``trainer_state.json``, no :data:`INCOMPLETE_MARKER` (written
before a save's files and removed once every rank wrote its part; transformers' SIGTERM save uses
the same name), and every rank's part: ``rng_state_K.pth`` of each rank K once any rank saved one,
and the ``__K_0.distcp`` shard of each rank plus ``.metadata`` in each
``torch.distributed.checkpoint`` folder (FSDP's sharded model and optimizer). The number of ranks
is the ``world_size`` recorded in ``amp_trainer_state.json``, else the most any file shows.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from amp_trainer.checkpointing.digests import why_damaged
from amp_trainer.checkpointing.layout import (
    INCOMPLETE_MARKER,
    TRAINER_STATE_FILE,
    checkpoint_run,
    checkpoint_step,
    read_amp_state,
)

__all__ = [
    "INCOMPLETE_MARKER",
    "last_complete_checkpoint",
    "missing_rank_files",
    "why_incomplete",
]

logger = logging.getLogger(__name__)

_RNG = re.compile(r"rng_state_(\d+)\.pth")
_SHARD = re.compile(r"__(\d+)_\d+\.distcp")
_DCP_METADATA = ".metadata"


def _ranks_saved(folder: Path) -> int:
    """How many ranks wrote ``folder``: ``world_size`` in its amp state, else what files show."""
    recorded = (read_amp_state(folder) or {}).get("world_size")
    if isinstance(recorded, int) and recorded > 0:
        return recorded
    seen = [int(m.group(1)) for p in folder.iterdir() if (m := _RNG.fullmatch(p.name))]
    for sub in folder.iterdir():
        if sub.is_dir():
            seen += [int(m.group(1)) for p in sub.iterdir() if (m := _SHARD.fullmatch(p.name))]
    return max(seen, default=0) + 1


def missing_rank_files(folder: str | os.PathLike[str]) -> list[str]:
    """The files of some rank's part that ``folder`` lacks (relative names; empty: none).

    A checkpoint saved without RNG state (``save_only_model``) lacks them for every rank and is
    whole; one that holds rank 0's ``rng_state_0.pth`` but not rank 1's was stopped mid-save.
    """
    folder = Path(folder)
    ranks = _ranks_saved(folder)
    missing: list[str] = []
    names = {p.name for p in folder.iterdir()}
    if ranks > 1 and any(_RNG.fullmatch(name) for name in names):
        missing += [f"rng_state_{k}.pth" for k in range(ranks) if f"rng_state_{k}.pth" not in names]
    for sub in sorted(p for p in folder.iterdir() if p.is_dir()):
        shards = {p.name for p in sub.iterdir()}
        if not any(_SHARD.fullmatch(name) for name in shards):
            continue  # not a torch.distributed.checkpoint folder
        taken = {int(m.group(1)) for name in shards if (m := _SHARD.fullmatch(name))}
        missing += [f"{sub.name}/__{k}_0.distcp" for k in range(ranks) if k not in taken]
        if _DCP_METADATA not in shards:
            missing.append(f"{sub.name}/{_DCP_METADATA}")
    return missing


def why_incomplete(folder: str | os.PathLike[str]) -> str | None:
    """Why ``folder`` is not a complete checkpoint (what it holds or lacks), ``None`` when it is.

    See the module doc for the rule; the reason names the files, as the warnings say them.
    """
    folder = Path(folder)
    reasons = []
    if (folder / INCOMPLETE_MARKER).is_file():
        reasons.append(f"it holds {INCOMPLETE_MARKER}")
    missing = [] if (folder / TRAINER_STATE_FILE).is_file() else [TRAINER_STATE_FILE]
    missing += missing_rank_files(folder)
    if missing:
        reasons.append("no " + ", ".join(missing))
    return "; ".join(reasons) or None


def last_complete_checkpoint(
    folder: str | os.PathLike[str],
    *,
    warn: bool = True,
    digests: bool = True,
    before: int | None = None,
) -> str | None:
    """The highest-numbered complete ``checkpoint-N`` of the run started last in ``folder``
    (``None``: there is none); with ``before``, the highest below step ``before``.

    Each newer one skipped is named in a warning (unless ``warn`` is false), with what it lacks
    and the one taken instead. With ``digests``, a complete one whose files differ from its
    :data:`~amp_trainer.checkpointing.digests.DIGEST_FILE` is damaged and skipped the same way
    (naming the file). Only the run started last counts (see :func:`_earlier_runs`): after
    ``--reuse_output_dir true``, the previous run's higher steps are not this run's to resume.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    steps = sorted(
        (
            (step, path)
            for path in folder.glob(f"{PREFIX_CHECKPOINT_DIR}-*")
            if path.is_dir()
            and (step := checkpoint_step(path)) is not None
            and (before is None or step < before)
        ),
        reverse=True,
    )
    reasons = {path: why_incomplete(path) for _, path in steps}
    others = _earlier_runs([path for path, reason in reasons.items() if reason is None])
    skipped: list[tuple[Path, str]] = []
    damaged: list[tuple[Path, str]] = []
    found: str | None = None
    for _, path in steps:
        if path in others:
            continue
        reason = reasons[path]
        if reason is None and digests and (damage := why_damaged(path)) is not None:
            damaged.append((path, damage))
            continue
        if reason is None:
            found = str(path)
            break
        skipped.append((path, reason))
    if others and found is not None:
        logger.info(
            "%s holds checkpoints of an earlier run (%s): resuming the run started last, %s",
            folder,
            ", ".join(sorted(p.name for p in others)),
            Path(found).name,
        )
    instead = f"the last intact one is {found}" if found else "no intact one is left"
    for path, reason in damaged if warn else ():
        logger.warning("%s is damaged (%s): skipped; %s", path, reason, instead)
    for path, reason in skipped if warn else ():
        logger.warning(
            "%s is incomplete (%s; interrupted while saving?): skipped; %s",
            path,
            reason,
            f"the last complete one is {found}" if found else "no complete one is left",
        )
    return found


def _earlier_runs(complete: list[Path]) -> set[Path]:
    """The checkpoints among the ``complete`` ones that a run earlier than the last one wrote.

    Every checkpoint names the run that wrote it (:func:`~amp_trainer.checkpointing.layout.
    checkpoint_run`: each ``train`` call, resumes included, numbers itself one above the
    checkpoints it finds). Why: a new run in a reused output folder saves ``checkpoint-2`` beside
    the previous run's ``checkpoint-4``; the highest step is the previous run's, and resuming it
    would train (or, finished, save) the previous run's model over this one's.
    """
    runs = {path: checkpoint_run(path) for path in complete}
    latest = max(runs.values(), default=0)
    return {path for path, run in runs.items() if run < latest}

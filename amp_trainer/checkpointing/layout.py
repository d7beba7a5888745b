"""What a Trainer checkpoint folder holds: stock's file names and amp-trainer's own file.

Saving and resuming both read this layout; it is stock ``Trainer``'s (the constants of
``transformers.trainer``) plus :data:`AMP_STATE_FILE`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

__all__ = [
    "AMP_STATE_FILE",
    "INCOMPLETE_MARKER",
    "OPTIMIZER_FILE",
    "RNG_FILE",
    "SCALER_FILE",
    "SCHEDULER_FILE",
    "TRAINER_STATE_FILE",
    "checkpoint_run",
    "checkpoint_step",
    "read_amp_state",
]

#: What amp-trainer adds to every checkpoint: the precision and loss-scaler settings the run
#: started with and the whole run's scale history, so that a resumed run can tell what changed
#: and report all of its steps, not just those since the resume.
AMP_STATE_FILE = "amp_trainer_state.json"
#: Present while a checkpoint is being written (by :class:`CheckpointSaver` and by
#: transformers' SIGTERM save, 5.0 to 5.24): a folder that holds it was stopped mid-save.
INCOMPLETE_MARKER = "checkpoint-is-incomplete.txt"
# Stock Trainer's checkpoint file names (transformers.trainer module constants).
SCALER_FILE, TRAINER_STATE_FILE = "scaler.pt", "trainer_state.json"
OPTIMIZER_FILE, SCHEDULER_FILE, RNG_FILE = "optimizer.pt", "scheduler.pt", "rng_state.pth"


def checkpoint_step(path: Path) -> int | None:
    """N of a ``checkpoint-N`` folder (``None`` for another name)."""
    prefix = f"{PREFIX_CHECKPOINT_DIR}-"
    name = path.name
    if name.startswith(prefix) and name[len(prefix) :].isdigit():
        return int(name[len(prefix) :])
    return None


def read_amp_state(checkpoint: Path) -> dict[str, Any] | None:
    """The checkpoint's :data:`AMP_STATE_FILE` (``None`` if it has none, or an unreadable one)."""
    try:
        data = json.loads((checkpoint / AMP_STATE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def checkpoint_run(checkpoint: Path) -> int:
    """The number of the run that wrote ``checkpoint`` (its :data:`AMP_STATE_FILE`'s ``run``).

    Each ``train`` call numbers itself one above the highest run among the checkpoints in its
    ``output_dir`` when it starts, so the checkpoints of the run started last (a resume is a run
    too) have the highest number, whatever their steps. 0: a checkpoint without the number
    (another library's, or an older amp-trainer's), older than any numbered one.
    """
    run = (read_amp_state(checkpoint) or {}).get("run")
    return run if isinstance(run, int) and not isinstance(run, bool) else 0

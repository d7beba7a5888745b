"""SIGTERM after training, with ``--enable_jit_checkpoint``: the trained model is saved first.

transformers' SIGTERM handler (``enable_jit_checkpoint``) lives only while ``train()`` runs; a
recipe then evaluates and saves its final model, and a SIGTERM there (a preemption that comes
a little later) ended the process at once: with ``--save_strategy no`` every trained step was
lost. :func:`saved_on_sigterm` covers those phases: a SIGTERM stops them, the trained model is
saved as an ordinary ``checkpoint-N`` (model, optimizer, scheduler, RNG, ``scaler.pt``,
``amp_trainer_state.json``) unless a complete one of that step exists, and the run ends as a
preempted one: one line with the command that resumes (which trains nothing: the run is done)
and exit 143.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from amp_trainer.checkpointing.completeness import why_incomplete
from amp_trainer.recipes.resume import preempted

__all__ = ["saved_on_sigterm"]


class _Terminated(Exception):
    """SIGTERM arrived in the phases :func:`saved_on_sigterm` covers."""


def _terminated(signum: int, frame: Any) -> None:
    raise _Terminated


@contextlib.contextmanager
def saved_on_sigterm(
    trainer: Any, argv: Sequence[str], output_dir: str, *, enabled: bool
) -> Iterator[None]:
    """Within the block, SIGTERM saves the trained model and raises ``RunPreempted``.

    ``trainer`` is the recipe's (trained) AmpTrainer; ``argv`` and ``output_dir`` make the
    resume command. Only when ``enabled`` (``--enable_jit_checkpoint``) and on the main thread
    (where Python runs signal handlers); the handler before it is put back at the end. While the
    checkpoint is saved a second SIGTERM is ignored: the grace period is for that save.
    With several processes every rank must get the signal (torchrun and ``accelerate launch``
    pass it on to each), as the save waits for all of them.
    """
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        checkpoint = _trained_checkpoint(trainer)
        raise preempted(argv, output_dir, checkpoint) from None
    finally:
        signal.signal(signal.SIGTERM, previous)


def _trained_checkpoint(trainer: Any) -> str:
    """The complete ``checkpoint-N`` of the trained model: the one saved at the last step, else
    one saved now."""
    folder = Path(trainer.args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
    if not (folder.is_dir() and why_incomplete(folder) is None):
        trainer._save_checkpoint(trainer.model, trial=None)
    return str(folder)

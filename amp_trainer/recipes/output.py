"""What a recipe run writes to the terminal besides its own log lines, kept to what a user needs.

A recipe run drives transformers, datasets and the tokenizers library, and each of them writes
things of its own: progress bars, notices, colour codes. Three of those are noise that the run
itself causes and that tell a user nothing, so the recipe turns them off for the duration of the
run, and only then (nothing changes at import; :func:`recipe_output` restores what it changed):

* ``--disable_tqdm true`` silences only the Trainer's own bars in transformers; the bars of
  ``datasets.map`` ("Tokenizing"), of loading a checkpoint ("Loading weights") and of every
  ``save_pretrained`` ("Writing model shards": each checkpoint, the final save, the export) kept
  drawing, in a log file as ``\\r``-joined lines. With the flag they are all off.
* transformers' load report ("... LOAD REPORT from: ...", e.g. the new classifier head of a
  MiniLM fine-tune) starts with bold-on/bold-off escape codes even when stderr is a file (its
  table checks ``isatty``, the title does not): they are removed when stderr is not a terminal.
* ``dataloader_pin_memory`` (on by default in TrainingArguments and in the GPU configs) makes
  torch warn once per DataLoader that no accelerator is found when the run is on a CPU; pinning
  means nothing there, so :func:`no_pin_memory_on_cpu` turns it off for CPU runs.

One notice of our own changes form: FP16 on a CPU is a
:class:`~amp_trainer.precision.CpuFp16Warning` for code that builds ``AmpTrainingArguments``,
located at the caller's line. In a recipe the
caller is the ``__init__`` that ``@dataclass`` generated, called by argparse ("<string>:131:" was
the location a user saw), and the user wrote no code to point at: :func:`cpu_fp16_notices` keeps
the message, and the recipe logs it as one line.

The tokenizers library's own trainer bars (a from-scratch tokenizer) follow the same switch:
see :func:`progress_bars_enabled`. GPT-2's "`loss_type=None` ... unrecognized" line is answered
where the model is built (``models.build_causal_lm``).
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = [
    "cpu_fp16_notices",
    "no_pin_memory_on_cpu",
    "progress_bars_enabled",
    "recipe_output",
]

logger = logging.getLogger(__name__)

# SGR sequences ("\x1b[1m", "\x1b[0m", "\x1b[38;5;208m"): the only escapes transformers writes.
_SGR = re.compile(r"\x1b\[[0-9;]*m")
# The loggers whose records carry colour codes regardless of the stream: transformers logs the
# load report through modeling_utils' logger (5.24), else through loading_report's own.
_COLOURED_LOGGERS = ("transformers.modeling_utils", "transformers.utils.loading_report")


class _StripColourCodes(logging.Filter):
    """Remove SGR escape codes from a record's message (the stream is not a terminal)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "\x1b[" in message:
            record.msg, record.args = _SGR.sub("", message), ()
        return True


def _stream_is_terminal(stream: Any) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if callable(isatty) else False
    except ValueError:  # a closed stream
        return False


@contextlib.contextmanager
def cpu_fp16_notices() -> Iterator[list[str]]:
    """Collect the messages of the :class:`~amp_trainer.precision.CpuFp16Warning` raised inside,
    instead of printing them; every other warning is shown as it would have been."""
    from amp_trainer.precision import CpuFp16Warning

    notices: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CpuFp16Warning)
        try:
            yield notices
        finally:
            others = [w for w in caught if not issubclass(w.category, CpuFp16Warning)]
            notices += [str(w.message) for w in caught if issubclass(w.category, CpuFp16Warning)]
    for other in others:  # outside catch_warnings: shown by the caller's warning display
        warnings.showwarning(other.message, other.category, other.filename, other.lineno)


def progress_bars_enabled() -> bool:
    """Whether third-party progress bars are on in this process (off under a recipe's
    ``--disable_tqdm true``): the switch that the tokenizer trainers follow too."""
    from transformers.utils import logging as hf_logging

    return bool(hf_logging.is_progress_bar_enabled())


@contextlib.contextmanager
def _progress_bars_off() -> Iterator[None]:
    """transformers' (and with it huggingface_hub's) and datasets' progress bars off, then back
    as they were. An ``HF_DATASETS_DISABLE_PROGRESS_BARS`` the user set wins (datasets warns if
    code overrides it), so it is left alone."""
    from datasets import config as datasets_config
    from datasets.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )
    from transformers.utils import logging as hf_logging

    hf_was_on = hf_logging.is_progress_bar_enabled()
    pinned = getattr(datasets_config, "HF_DATASETS_DISABLE_PROGRESS_BARS", None)
    datasets_pinned = pinned is not None
    datasets_was_on = not are_progress_bars_disabled()
    hf_logging.disable_progress_bar()
    if datasets_was_on and not datasets_pinned:
        disable_progress_bars()
    try:
        yield
    finally:
        if hf_was_on:
            hf_logging.enable_progress_bar()
        if datasets_was_on and not datasets_pinned:
            enable_progress_bars()


@contextlib.contextmanager
def _plain_text_logs() -> Iterator[None]:
    """Strip colour codes from the records of :data:`_COLOURED_LOGGERS` while attached."""
    colour_filter = _StripColourCodes()
    loggers = [logging.getLogger(name) for name in _COLOURED_LOGGERS]
    for each in loggers:
        each.addFilter(colour_filter)
    try:
        yield
    finally:
        for each in loggers:
            each.removeFilter(colour_filter)


@contextlib.contextmanager
def recipe_output(*, disable_tqdm: bool) -> Iterator[None]:
    """The run's output policy (the module docstring), undone on exit: no third-party progress
    bars under ``disable_tqdm``, no colour codes when stderr is not a terminal."""
    with contextlib.ExitStack() as stack:
        if disable_tqdm:
            stack.enter_context(_progress_bars_off())
        if not _stream_is_terminal(sys.stderr):
            stack.enter_context(_plain_text_logs())
        yield


def no_pin_memory_on_cpu(training_args: Any) -> None:
    """Turn ``dataloader_pin_memory`` off when the run is on a CPU.

    Pinned (page-locked) host memory only speeds up copies to an accelerator. On a CPU run torch
    skips it and warns "'pin_memory' argument is set as true but no accelerator is found" for
    every DataLoader (train, each evaluation): a warning about a setting the user did not
    choose (TrainingArguments defaults it to true, and so do the GPU configs). The flag means
    nothing there, so it is switched off instead.
    """
    if training_args.dataloader_pin_memory and training_args.device.type == "cpu":
        training_args.dataloader_pin_memory = False

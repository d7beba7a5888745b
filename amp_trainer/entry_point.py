"""How the ``amp-trainer`` command and the recipes end: one line and an exit code, no traceback.

:func:`run_entry_point` turns every exception into ONE line on stderr and an exit code (2: a
usage error the user can fix, 1: a runtime failure such as a full disk or a run that overflowed at
the minimum loss scale). The traceback is not lost: it goes to a log file named on that line
(runtime failures) and to stderr with ``AMP_TRAINER_DEBUG=1`` (or the CLI's ``--debug``).

It lives in the core, not in :mod:`amp_trainer.recipes`, because the CLI's ``export`` and
``doctor --model`` use it and must not import recipe code.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import os
import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

from amp_trainer.atomic_files import is_disk_full

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_OK",
    "EXIT_TERMINATED",
    "EXIT_USAGE",
    "UsageError",
    "describe_error",
    "one_line",
    "run_entry_point",
]

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
# 128 + SIGTERM: a preempted run (--enable_jit_checkpoint) saved its checkpoint and wants to be
# restarted; not 0, so that a Kubernetes Job restarts it and a SLURM script can tell it apart.
EXIT_TERMINATED = 143


class UsageError(ValueError):
    """A mistake the user can fix (a flag, a value, a file); reported as one line, exit 2."""


def one_line(err: BaseException) -> str:
    """``err``'s message on one line (a ``KeyError``'s key without its quotes)."""
    text = " ".join(part.strip() for part in str(err).strip().splitlines() if part.strip())
    if isinstance(err, KeyError) and len(err.args) == 1 and isinstance(err.args[0], str):
        text = err.args[0]  # str(KeyError) is the repr of its argument
    return text or type(err).__name__


def describe_error(err: BaseException) -> tuple[int, str]:
    """The exit code and the one-line message for ``err``.

    Usage (2): our :class:`UsageError` and ``DataError``, every ``ValueError`` (out-of-range
    settings, contradictory flags, unknown keys), missing extras, YAML syntax, and ``OSError``
    other than a full disk (missing files, a path that is not a model folder, permissions), and a
    garbled safetensors file. Runtime (1): a full disk wherever it hits, ``LossScaleError`` (a
    ``FloatingPointError``), and anything else, named by its type.
    """
    from amp_trainer.scaler import LossScaleError

    message = one_line(err)
    if is_disk_full(err):
        if "no space left" not in message.lower():
            message = f"no space left on device: {message}"
        return EXIT_FAILED, message
    if isinstance(err, LossScaleError):
        return EXIT_FAILED, message
    if isinstance(err, (ValueError, ImportError, OSError, argparse.ArgumentError)):
        return EXIT_USAGE, message
    if type(err).__name__ == "SafetensorError":  # a truncated or garbled weights file
        return EXIT_USAGE, f"unreadable safetensors file: {message}"
    if type(err).__module__.startswith("yaml"):  # yaml.YAMLError, without importing yaml here
        return EXIT_USAGE, f"not valid YAML: {message}"
    return EXIT_FAILED, f"{type(err).__name__}: {message}"


def _traceback_file(prog: str, err: BaseException) -> Path | None:
    """Write ``err``'s traceback to a log file and return its path (``None`` if that fails)."""
    folder = Path(tempfile.gettempdir()) / "amp-trainer-logs"
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = folder / f"{prog.replace(' ', '-')}-{stamp}-{os.getpid()}.log"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(err)), encoding="utf-8")
    except OSError:
        return None
    return path


def _tell_torchrun(line: str) -> None:
    """Under torchrun (``accelerate launch`` with several processes) put ``line`` in the
    worker's error file, so that torch's ``ChildFailedError`` summary shows it as the root cause
    instead of "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html".

    The format is the one :class:`torch.distributed.elastic.multiprocessing.errors.ProcessFailure`
    reads (a ``message`` string and a ``timestamp``). Best effort: the line is on stderr anyway.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    data = {"message": line, "timestamp": str(int(datetime.datetime.now().timestamp()))}
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps(data), encoding="utf-8")


def run_entry_point(main: Callable[[], int | None], prog: str, *, debug: bool | None = None) -> int:
    """Run ``main()`` and turn any exception into one line on stderr and an exit code.

    Returns ``main()``'s own return value (``None`` counts as 0). ``debug`` (default: the
    ``AMP_TRAINER_DEBUG`` environment variable) also prints the traceback; without it the
    traceback of a runtime failure is written to a log file whose path ends the line.
    ``KeyboardInterrupt`` (Ctrl-C) is one line too, its own message if it has one (a recipe's
    says how to resume), exit 130 as a shell reports SIGINT, or its ``exit_code`` (a recipe's
    stop on SIGTERM: 143); ``SystemExit`` (``--help``) passes through untouched.
    """
    if debug is None:
        debug = os.environ.get("AMP_TRAINER_DEBUG", "").lower() not in ("", "0", "false", "no")
    try:
        code = main()
    except KeyboardInterrupt as err:
        print(f"{prog}: {str(err) or 'interrupted'}", file=sys.stderr, flush=True)
        return int(getattr(err, "exit_code", EXIT_INTERRUPTED))
    except Exception as err:  # the one place every failure is reported
        code, message = describe_error(err)
        logger.debug("%s failed", prog, exc_info=True)
        if debug:
            traceback.print_exc()
        elif code == EXIT_FAILED:
            log = _traceback_file(prog, err)
            if log is not None:
                message += f" (traceback: {log})"
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
        _tell_torchrun(f"{prog}: error: {message}")
        return code
    return EXIT_OK if code is None else int(code)

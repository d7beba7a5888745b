"""The library's log lines from while a recipe parses its flags, held until its logging is set up.

``AmpTrainingArguments`` says what it decided as it is built (``precision='auto' picked bf16 on
cpu: ...``), and resolving ``--resume_from_checkpoint`` says which checkpoint it skipped or which
folder it continues in. A recipe parses its flags before it sets up logging, as the level it
logs at comes from those flags (``should_log``: the main process only): at that point an INFO
line goes nowhere and a WARNING comes out bare through :data:`logging.lastResort`. So the
``amp_trainer`` logger's records are held while the flags are parsed and handed to the configured
logging afterwards, each once, where the run's level lets it through. If parsing fails, they
come out at once, as they did before (its WARNING lines before the one-line error).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["holding_library_logs", "release"]

_LIBRARY = "amp_trainer"
_T = TypeVar("_T")


class _Held(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def release(records: list[logging.LogRecord]) -> None:
    """Hand ``records`` to their loggers as logging is configured now (once each; those below a
    logger's level are dropped, as they would have been when logged), and forget them."""
    for record in records:
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(record.levelno):
            logger.handle(record)
    records.clear()


def holding_library_logs(parse: Callable[..., _T]) -> Callable[..., _T]:
    """Decorate ``parse`` (returning an object with a ``held_logs`` list): the ``amp_trainer``
    records of INFO and above (DEBUG too where it was on) logged while it runs go into that
    list instead of out, for :func:`release` once logging is set up; if it raises, they are
    released at once."""

    @functools.wraps(parse)
    def wrapper(*args: Any, **kwargs: Any) -> _T:
        library = logging.getLogger(_LIBRARY)
        held = _Held()
        saved = library.level, library.propagate
        library.addHandler(held)
        library.setLevel(min(logging.INFO, library.getEffectiveLevel()))  # DEBUG if it was
        library.propagate = False
        try:
            try:
                result = parse(*args, **kwargs)
            finally:
                library.removeHandler(held)
                library.setLevel(saved[0])
                library.propagate = saved[1]
        except BaseException:
            release(held.records)
            raise
        result.held_logs = held.records
        return result

    return wrapper

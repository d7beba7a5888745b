"""Dropping one known message of a third-party logger, for the duration of a block.

Libraries the export and the recipes drive log lines that say nothing about the user's run
(torch's ONNX exporter lists four ``torchvision`` operators it skips on every export; transformers
warns about a missing attention mask on blocks that are never padded). Each such line is dropped
by its exact opening words, on the one logger that writes it, only while the code that causes it
runs: every other record of that logger, and every logger of our own, passes untouched, and the
filter is gone when the block ends.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = ["dropping_messages"]


class _DropMessages(logging.Filter):
    """Rejects the records whose message starts with one of ``openings``."""

    def __init__(self, openings: tuple[str, ...]) -> None:
        super().__init__()
        self.openings = openings

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.openings)


@contextlib.contextmanager
def dropping_messages(logger_name: str, *openings: str) -> Iterator[None]:
    """Drop the records of ``logger_name`` that start with any of ``openings`` inside the block.

    The filter sits on that logger itself (records propagated from its children are not
    filtered there, so a child that writes the message must be named), and is removed on exit
    even when the block raises.
    """
    target = logging.getLogger(logger_name)
    drop = _DropMessages(tuple(openings))
    target.addFilter(drop)
    try:
        yield
    finally:
        target.removeFilter(drop)

"""The library's log lines from parsing a recipe's flags are held until its logging is set up
(recipes/held_logs.py): once each, at the run's level, and at once if parsing fails."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from amp_trainer.recipes.held_logs import holding_library_logs, release

LIBRARY = logging.getLogger("amp_trainer.precision")


@holding_library_logs
def parse(fail: bool = False) -> SimpleNamespace:
    LIBRARY.info("precision='auto' picked bf16 on cpu: held")
    LIBRARY.warning("a warning from parsing")
    if fail:
        raise ValueError("bad flag")
    return SimpleNamespace()


def test_held_while_parsing_then_released_once(caplog):
    caplog.set_level(logging.INFO)
    run = parse()
    assert caplog.records == []  # nothing out before the recipe's logging is set up
    assert len(run.held_logs) == 2
    release(run.held_logs)
    release(run.held_logs)  # a second call has nothing left to say
    assert [r.getMessage() for r in caplog.records] == [
        "precision='auto' picked bf16 on cpu: held",
        "a warning from parsing",
    ]
    assert logging.getLogger("amp_trainer").propagate  # restored


def test_released_at_the_runs_level(caplog):
    caplog.set_level(logging.WARNING)  # a rank other than the main one
    release(parse().held_logs)
    assert [r.getMessage() for r in caplog.records] == ["a warning from parsing"]


def test_released_at_once_when_parsing_fails(caplog):
    caplog.set_level(logging.WARNING)
    with pytest.raises(ValueError, match="bad flag"):
        parse(fail=True)
    assert [r.getMessage() for r in caplog.records] == ["a warning from parsing"]

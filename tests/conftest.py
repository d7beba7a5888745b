"""Shared test fixtures: the suite runs offline, every test starts without Accelerate's state or
a previous test's logger settings, and the tiny models as fixtures.

What tests import (model builders, datasets, runners) is in ``tests/helpers/``."""

from __future__ import annotations

import logging
import os
import sys

import pytest

# Nothing in the test suite may reach a model hub: fail fast instead of hanging on a socket. Set
# before the helpers below import transformers (huggingface_hub reads them once, at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.helpers.tiny_models import make_tiny_bert, make_tiny_gpt2
from tests.helpers.training import reset_accelerate_state


@pytest.fixture
def python_executable() -> str:
    return sys.executable


@pytest.fixture(autouse=True)
def fresh_accelerate_state(monkeypatch):
    """Accelerate's state is a process singleton: every test starts and ends without one, and
    without a launcher's ACCELERATE_MIXED_PRECISION leaking in from the shell."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    reset_accelerate_state()
    yield
    reset_accelerate_state()


@pytest.fixture(autouse=True)
def restore_library_logger():
    """``amp-trainer``'s CLI, run in-process by some tests, sets the ``amp_trainer`` logger's level
    (WARNING unless --verbose) as a command should; the next test must not inherit it (the
    held-logs tests saw their INFO records dropped after the CLI tests had run)."""
    library = logging.getLogger("amp_trainer")
    saved = library.level, library.propagate, list(library.handlers)
    yield
    library.setLevel(saved[0])
    library.propagate = saved[1]
    library.handlers[:] = saved[2]


@pytest.fixture
def tiny_bert():
    return make_tiny_bert()


@pytest.fixture
def tiny_gpt2():
    return make_tiny_gpt2()

"""Shared test fixtures: tiny real models built from configs (nothing is downloaded)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent

# Nothing in the test suite may reach a model hub: fail fast instead of hanging on a socket.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for tests that run the project as a user would (a subprocess).

    PYTHONPATH points at this checkout so the child imports the code under test, not whatever
    copy of amp_trainer happens to be installed.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


@pytest.fixture
def python_executable() -> str:
    return sys.executable


def reset_accelerate_state() -> None:
    """Forget Accelerate's process-wide singletons (no-op until a test imported accelerate)."""
    if "accelerate.state" in sys.modules:
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.fixture(autouse=True)
def fresh_accelerate_state(monkeypatch):
    """Accelerate's state is a process singleton: every test starts and ends without one, and
    without a launcher's ACCELERATE_MIXED_PRECISION leaking in from the shell."""
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    reset_accelerate_state()
    yield
    reset_accelerate_state()


def make_tiny_bert(num_labels: int = 2, vocab_size: int = 128, seed: int = 0, **overrides):
    """A 2-layer, 32-wide BERT classifier: small enough for CPU fp16, real enough to overflow."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=num_labels,
        **overrides,
    )
    return BertForSequenceClassification(config)


def make_tiny_gpt2(vocab_size: int = 128, seed: int = 0, **overrides):
    """A 2-layer, 32-wide GPT-2 LM head model."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab_size,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=vocab_size - 1,
        eos_token_id=vocab_size - 1,
        **overrides,
    )
    return GPT2LMHeadModel(config)


@pytest.fixture
def tiny_bert():
    return make_tiny_bert()


@pytest.fixture
def tiny_gpt2():
    return make_tiny_gpt2()

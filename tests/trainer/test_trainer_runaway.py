"""The runaway guard: a run whose optimizer steps keep being skipped ends with an error.

Real overflows: an inf written into a real gradient on every chosen step (InjectOverflow), with
the real scaler deciding the skip. Whatever ``on_min_loss_scale`` says, ``max_consecutive_skipped_
steps`` skipped steps in a row end the run with a :class:`LossScaleError`, which is also a
``RuntimeError`` (what transformers' own Trainer raises for the same condition).
"""

from __future__ import annotations

import logging

import pytest
from transformers import HfArgumentParser

from amp_trainer import AmpTrainer, AmpTrainingArguments
from amp_trainer.scaler import LossScaleError
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import InjectOverflow, ToyClassification, tiny_training_args


def _trainer(tmp_path, overflow_steps, **overrides):
    model = make_tiny_bert()
    return AmpTrainer(
        model=model,
        args=tiny_training_args(tmp_path, **overrides),
        train_dataset=ToyClassification(),
        callbacks=[InjectOverflow(model.classifier.weight, overflow_steps)],
    )


@pytest.mark.parametrize("mode", ["raise", "warn", "clamp"])
def test_consecutive_skipped_steps_end_the_run_in_every_min_scale_mode(tmp_path, mode):
    trainer = _trainer(
        tmp_path,
        set(range(1, 11)),
        max_steps=10,
        on_min_loss_scale=mode,
        loss_scale_init=2.0**10,
        max_consecutive_skipped_steps=3,
    )

    with pytest.raises(RuntimeError, match="3 consecutive optimizer steps were skipped") as err:
        trainer.train()

    assert isinstance(err.value, LossScaleError)
    message = str(err.value)
    assert "attempts 1-3 at step 1" in message and "max_consecutive_skipped_steps=3" in message
    assert trainer.loss_scaler.stats.skipped == 3
    # Stopped inside the third attempt; none was applied, so no step was made.
    assert (trainer.state.global_step, trainer.state.optimizer_step_attempts) == (0, 3)


def test_the_default_limit_of_100_stops_a_run_that_would_skip_to_the_end(tmp_path, caplog):
    # The silent no-op: "warn" at the minimum scale keeps skipping. 100 skips, then stop.
    trainer = _trainer(
        tmp_path, set(range(1, 151)), max_steps=150, on_min_loss_scale="warn", logging_steps=50
    )

    with caplog.at_level(logging.WARNING), pytest.raises(LossScaleError, match=r"^100 consecutive"):
        trainer.train()

    assert trainer.args.max_consecutive_skipped_steps == 100
    assert trainer.loss_scaler.stats.skipped == 100
    assert trainer.loss_scaler.get_scale() == 1.0
    assert any("minimum loss scale" in r.getMessage() for r in caplog.records)  # warned first


def test_a_clean_step_resets_the_count(tmp_path):
    trainer = _trainer(tmp_path, {1, 2, 4, 5, 7}, max_steps=8, max_consecutive_skipped_steps=3)
    trainer.train()

    assert trainer.state.global_step == 8
    assert trainer.loss_scaler.stats.skipped == 5


def test_zero_disables_the_limit(tmp_path):
    trainer = _trainer(
        tmp_path,
        set(range(1, 7)),
        max_steps=6,
        on_min_loss_scale="clamp",
        loss_scale_init=2.0,
        max_consecutive_skipped_steps=0,
    )
    trainer.train()

    assert trainer.state.global_step == 6
    assert trainer.loss_scaler.stats.skipped == 6


@pytest.mark.parametrize("value", [-1, 2.5, True, "10"])
def test_a_bad_limit_is_a_value_error_naming_the_argument(tmp_path, value):
    with pytest.raises(ValueError, match="max_consecutive_skipped_steps must be an int >= 0"):
        tiny_training_args(tmp_path, max_consecutive_skipped_steps=value)


def test_loss_scale_error_is_both_a_runtime_error_and_a_floating_point_error():
    assert issubclass(LossScaleError, RuntimeError)
    assert issubclass(LossScaleError, FloatingPointError)


def test_the_limit_parses_from_a_cli_flag(tmp_path):
    (args,) = HfArgumentParser(AmpTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--max_consecutive_skipped_steps", "7"]
    )

    assert args.max_consecutive_skipped_steps == 7

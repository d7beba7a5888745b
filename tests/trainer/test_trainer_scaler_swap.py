"""A scaler put on ``trainer.accelerator.scaler`` after the trainer is built (as transformers' own
tests and some scripts do) is the one that steps, so it is the one everything reads: the logged
``loss_scale`` / ``skipped_steps``, ``trainer.loss_scaler`` and the consecutive-skip guard, not
the scaler AmpTrainer built and that never steps."""

from __future__ import annotations

import pytest
import torch

from amp_trainer import AmpTrainer, DynamicLossScaler, LossScaleError
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import (
    InjectOverflow,
    ToyClassification,
    reset_accelerate_state,
    tiny_training_args,
)


def trainer_with(tmp_path, overflow_steps, **overrides) -> AmpTrainer:
    reset_accelerate_state()
    model = make_tiny_bert()
    return AmpTrainer(
        model=model,
        args=tiny_training_args(tmp_path, **overrides),
        train_dataset=ToyClassification(),
        callbacks=[InjectOverflow(model.classifier.weight, overflow_steps)],
    )


def logged(trainer, key):
    return [entry[key] for entry in trainer.state.log_history if key in entry]


@pytest.mark.parametrize("kind", ["DynamicLossScaler", "GradScaler"])
def test_a_scaler_swapped_in_after_init_is_the_one_logged_and_read(tmp_path, kind):
    trainer = trainer_with(tmp_path, {2})
    built = trainer.loss_scaler
    if kind == "GradScaler":
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    else:
        trainer.accelerator.scaler = DynamicLossScaler("cpu", init_scale=16.0)
    trainer.train()
    assert trainer.loss_scaler is not built and trainer.loss_scaler is trainer.accelerator.scaler
    assert isinstance(trainer.loss_scaler, DynamicLossScaler)
    # The scale the logs show is the one that ran: 16, halved by the skip of attempt 2.
    assert logged(trainer, "loss_scale") == [16.0, 8.0, 8.0, 8.0]
    assert logged(trainer, "skipped_steps")[-1] == 1 == trainer.loss_scaler.stats.skipped
    assert [entry["scale"] for entry in trainer.scale_history][:2] == [16.0, 16.0]
    assert built.stats.steps == 0  # the scaler AmpTrainer built never ran


def test_the_consecutive_skip_guard_reads_the_swapped_in_scaler(tmp_path):
    trainer = trainer_with(
        tmp_path, set(range(1, 50)), max_steps=40, max_consecutive_skipped_steps=5
    )
    trainer.accelerator.scaler = DynamicLossScaler(
        "cpu", init_scale=2.0**10, min_scale=2.0**-30, on_min_scale="warn"
    )
    with pytest.raises(LossScaleError, match="5 consecutive optimizer steps were skipped"):
        trainer.train()
    assert trainer.loss_scaler.stats.skipped == 5


@pytest.mark.parametrize("swapped", [None, object()], ids=["none", "other-object"])
def test_a_scaler_swapped_for_something_unusable_is_one_error_saying_how_to_pass_one(
    tmp_path, swapped
):
    trainer = trainer_with(tmp_path, set())
    trainer.accelerator.scaler = swapped
    with pytest.raises(ValueError) as raised:
        trainer.train()
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(
        f"trainer.accelerator.scaler was replaced by {type(swapped).__name__ if swapped else None}"
    )
    assert "loss_scaler=DynamicLossScaler(" in message


def test_a_swapped_in_grad_scaler_keeps_halving_as_torchs_until_the_skip_guard_stops_the_run(
    tmp_path,
):
    # torch's GradScaler has no minimum scale: from 16 it halves past 1 on every skip, and the
    # run ends at max_consecutive_skipped_steps (transformers' own test expects exactly that).
    trainer = trainer_with(
        tmp_path, set(range(1, 50)), max_steps=40, max_consecutive_skipped_steps=8
    )
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    with pytest.raises(LossScaleError, match="8 consecutive optimizer steps were skipped"):
        trainer.train()
    assert trainer.loss_scaler.get_scale() == 16.0 / 2**8

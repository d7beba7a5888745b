"""Checkpoints carry the full scaler state; a resumed run is the uninterrupted run."""

from __future__ import annotations

import pytest
import torch

from amp_trainer import AmpTrainer
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import (
    InjectOverflow,
    ToyClassification,
    reset_accelerate_state,
    tiny_training_args,
    train_logs,
)

MAX_STEPS = 8
CHECKPOINT_STEP = 2
# Overflows (optimizer step attempts 2 and 6) on both sides of the checkpoint and growth every 2
# clean steps, so the scale moves throughout (see the first test) and a scaler restored from
# anything but its exact state (scale, growth tracker, counters) logs differently after the
# checkpoint. A skipped attempt is no step: checkpoint-2 is saved after attempt 3.
OVERFLOW_STEPS = {2, 6}


def _trainer(output_dir):
    model = make_tiny_bert()
    args = tiny_training_args(
        output_dir,
        max_steps=MAX_STEPS,
        save_strategy="steps",
        save_steps=CHECKPOINT_STEP,
        loss_scale_init=2.0**10,
        loss_scale_growth_interval=2,
    )
    return AmpTrainer(
        model=model,
        args=args,
        train_dataset=ToyClassification(),
        callbacks=[InjectOverflow(model.classifier.weight, OVERFLOW_STEPS)],
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    reset_accelerate_state()
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    trainer = _trainer(output_dir)
    trainer.train()
    reset_accelerate_state()
    return output_dir, trainer


def _comparable(entry):
    return {k: v for k, v in entry.items() if k not in ("epoch",)}


def test_checkpoint_holds_the_full_scaler_state(uninterrupted):
    output_dir, _ = uninterrupted
    state = torch.load(
        output_dir / f"checkpoint-{CHECKPOINT_STEP}" / "scaler.pt", weights_only=True
    )

    # Not the initial state (1024, tracker 0): a resume that ignored scaler.pt would diverge.
    assert state["scale"] == 512.0
    assert state["_growth_tracker"] == 1
    assert (state["steps"], state["skipped"], state["growths"], state["backoffs"]) == (3, 1, 0, 1)
    assert state["growth_interval"] == 2 and state["hysteresis"] == 1


@pytest.fixture(scope="module")
def resumed(uninterrupted, tmp_path_factory):
    output_dir, _ = uninterrupted
    reset_accelerate_state()
    trainer = _trainer(tmp_path_factory.mktemp("resumed"))
    trainer.train(resume_from_checkpoint=str(output_dir / f"checkpoint-{CHECKPOINT_STEP}"))
    reset_accelerate_state()
    return trainer


def test_the_loss_scale_really_moves_on_both_sides_of_the_checkpoint(uninterrupted):
    _, full = uninterrupted

    assert [e["loss_scale"] for e in train_logs(full)] == [
        1024,
        512,
        1024,
        1024,
        512,
        1024,
        1024,
        2048,
    ]


def test_resumed_run_reproduces_losses_and_loss_scales_of_the_uninterrupted_run(
    uninterrupted, resumed
):
    _, full = uninterrupted
    expected = [_comparable(e) for e in train_logs(full)]
    got = [_comparable(e) for e in train_logs(resumed)]

    assert [e["step"] for e in got] == list(range(1, MAX_STEPS + 1))
    assert got[CHECKPOINT_STEP:] == expected[CHECKPOINT_STEP:]
    assert resumed.loss_scaler.state_dict() == full.loss_scaler.state_dict()


def test_resumed_scale_history_covers_the_whole_run(uninterrupted, resumed):
    _, full = uninterrupted

    assert resumed.scale_history == full.scale_history

"""A diverging run is not an FP16 problem: the guard and the doctor say so, and add no islands.

A tiny BERT at learning rate 10 overflows FP16 from its second step on because its
weights exploded, not because a layer is FP16-unfriendly. A guard that did not tell the two apart
would make one module after another an FP32 island (an FP32 re-check on the exploded weights
proves nothing) and end the run "fine" at chance accuracy. The guard sees
the evidence (the module's weights far beyond their values at the first step, the loss far above
its first values, several modules out of range at once) and stops with a
:class:`DivergenceError` naming the learning rate; healthy overflows (a boosted layer at a sane
learning rate) still become islands, and a parameter-free module (Dropout) is never one.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch import nn

from amp_trainer import AmpTrainer, DivergenceError, DynamicLossScaler, Verdict, diagnose
from amp_trainer.forward_overflow import ForwardOverflowGuard
from amp_trainer.islands import ISLANDS_CONFIG_KEY, is_fp32_island
from amp_trainer.scaler import LossScaleError
from tests.helpers.tiny_models import bert_batch, make_tiny_bert
from tests.helpers.training import ToyClassification, tiny_training_args

BOOSTED = "bert.encoder.layer.0.intermediate.dense"


def linear_islands(model: nn.Module) -> list[str]:
    """The modules holding parameters, other than norms, that compute in FP32."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, (nn.Linear, nn.Embedding)) and is_fp32_island(module)
    ]


# --------------------------------------------------------------------------------------------
# the guard, through the real AmpTrainer
# --------------------------------------------------------------------------------------------
def test_a_tiny_bert_at_lr_10_stops_with_one_divergence_message_and_no_islands(tmp_path, caplog):
    trainer = AmpTrainer(
        model=make_tiny_bert(),
        args=tiny_training_args(tmp_path, max_steps=8, learning_rate=10.0),
        train_dataset=ToyClassification(),
    )
    with (
        caplog.at_level(logging.WARNING, logger="amp_trainer.forward_overflow"),
        pytest.raises(DivergenceError) as raised,
    ):
        trainer.train()

    message = str(raised.value)
    assert isinstance(raised.value, FloatingPointError)
    assert "diverging" in message and "learning rate 10" in message
    assert "grew" in message  # the evidence: the module's weights since the first step
    assert "on_divergence='warn'" in message  # how to go on anyway
    assert trainer.state.global_step < 8  # stopped, not "finished" at chance accuracy
    assert linear_islands(trainer.model) == []
    assert not trainer.model.config.to_dict().get(ISLANDS_CONFIG_KEY)
    assert not any("Forward overflow at step" in r.getMessage() for r in caplog.records)


def test_on_divergence_warn_goes_on_with_one_warning_and_still_no_islands(tmp_path, caplog):
    trainer = AmpTrainer(
        model=make_tiny_bert(),
        args=tiny_training_args(
            tmp_path,
            max_steps=8,
            learning_rate=10.0,
            on_divergence="warn",
            max_consecutive_skipped_steps=6,
        ),
        train_dataset=ToyClassification(),
    )
    # It goes on: no DivergenceError. The diverged model overflows on every attempt from then on,
    # no update is applied, and the runaway guard ends the run.
    with (
        caplog.at_level(logging.WARNING, logger="amp_trainer.forward_overflow"),
        pytest.raises(LossScaleError, match="6 consecutive optimizer steps were skipped"),
    ):
        trainer.train()

    assert trainer.state.optimizer_step_attempts > trainer.state.global_step
    warnings = [r.getMessage() for r in caplog.records if "diverging" in r.getMessage()]
    assert len(warnings) == 1 and "learning rate 10" in warnings[0]
    assert linear_islands(trainer.model) == []
    assert not any("Forward overflow at step" in r.getMessage() for r in caplog.records)


def test_an_unknown_on_divergence_is_an_error_naming_the_valid_values(tmp_path):
    with pytest.raises(ValueError, match=r"on_divergence must be one of \('raise', 'warn'\)"):
        tiny_training_args(tmp_path, on_divergence="ignore")


def test_a_boosted_layer_at_a_sane_lr_still_becomes_an_island(tmp_path, caplog):
    model = make_tiny_bert()
    with torch.no_grad():
        model.get_submodule(BOOSTED).weight.mul_(5e5)  # FP16-unfriendly from the start
    trainer = AmpTrainer(
        model=model,
        args=tiny_training_args(tmp_path, max_steps=4, learning_rate=1e-4),
        train_dataset=ToyClassification(),
    )
    with caplog.at_level(logging.WARNING, logger="amp_trainer.forward_overflow"):
        trainer.train()

    assert trainer.state.global_step == 4
    assert BOOSTED in linear_islands(trainer.model)
    assert BOOSTED in trainer.model.config.to_dict()[ISLANDS_CONFIG_KEY]
    assert not any("diverging" in r.getMessage() for r in caplog.records)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert all(math.isfinite(loss) for loss in losses[1:])


# --------------------------------------------------------------------------------------------
# the guard in a plain loop: producers, not Dropout; the loss as evidence on its own
# --------------------------------------------------------------------------------------------
class DropoutAfterBigLinear(nn.Module):
    """``lin`` outputs ~40000 (fits FP16); Dropout(0.5) doubles what it keeps: > 65504.

    The Dropout is where FP16 first turns inf, but it cannot overflow on its own: the values
    come from ``lin``, the module an island must cover.
    """

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(4, 2)
        with torch.no_grad():
            self.lin.weight.fill_(10000.0)
            self.lin.bias.zero_()

    def forward(self, x, labels):
        logits = self.head(self.drop(self.lin(x)))
        return {"loss": nn.functional.cross_entropy(logits.float(), labels)}


def one_step(model, scaler, guard, optimizer, batch, loss_factor=1.0):
    optimizer.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch)["loss"] * loss_factor
    guard.observe(loss, batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    return guard.after_step()


def test_dropout_is_never_an_island_the_module_that_produced_its_input_is():
    torch.manual_seed(0)
    model = DropoutAfterBigLinear().train()
    scaler = DynamicLossScaler("cpu")
    guard = ForwardOverflowGuard(model, scaler)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    batch = {"x": torch.ones(8, 4), "labels": torch.zeros(8, dtype=torch.long)}

    event = one_step(model, scaler, guard, optimizer, batch)

    assert event is not None and event.module == "lin"
    assert "lin" in guard.islands and "drop" not in guard.islands
    assert not is_fp32_island(model.drop)
    assert is_fp32_island(model.lin)


class BoostableInput(nn.Module):
    """A Linear whose output overflows FP16 when the input is scaled up (weights unchanged)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x, labels):
        return {"loss": nn.functional.cross_entropy(self.head(self.lin(x)).float(), labels)}


def test_a_loss_far_above_its_first_values_is_divergence_even_with_unchanged_weights():
    torch.manual_seed(0)
    model = BoostableInput()
    scaler = DynamicLossScaler("cpu")
    guard = ForwardOverflowGuard(model, scaler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights never move
    batch = {"x": torch.randn(8, 4), "labels": torch.zeros(8, dtype=torch.long)}
    for factor in (1.0, 1.0, 1.0, 1.0, 50.0, 80.0):  # far above its first (4) values
        assert one_step(model, scaler, guard, optimizer, batch, loss_factor=factor) is None
    huge = {"x": batch["x"] * 1e6, "labels": batch["labels"]}

    with pytest.raises(DivergenceError, match=r"loss rose from 0\.\d+ to \d+"):
        one_step(model, scaler, guard, optimizer, huge)
    assert guard.islands == []


def test_the_same_overflow_without_a_rising_loss_is_an_island():
    torch.manual_seed(0)
    model = BoostableInput()
    scaler = DynamicLossScaler("cpu")
    guard = ForwardOverflowGuard(model, scaler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    batch = {"x": torch.randn(8, 4), "labels": torch.zeros(8, dtype=torch.long)}
    for _ in range(4):
        assert one_step(model, scaler, guard, optimizer, batch) is None
    huge = {"x": batch["x"] * 1e6, "labels": batch["labels"]}

    event = one_step(model, scaler, guard, optimizer, huge)

    assert event is not None and event.module == "lin" and "lin" in guard.islands


# --------------------------------------------------------------------------------------------
# the doctor agrees
# --------------------------------------------------------------------------------------------
def exploded_bert() -> nn.Module:
    """A tiny BERT after two FP32 AdamW steps at lr 10: what the diverged run checkpointed."""
    model = make_tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=10.0)
    for _ in range(2):
        optimizer.zero_grad()
        model(**bert_batch()).loss.backward()
        optimizer.step()
    return model


def test_doctor_calls_fp32_losses_that_blow_up_a_learning_rate_problem():
    diagnosis = diagnose(make_tiny_bert(), bert_batch(), lr=10.0, steps=4)

    assert diagnosis.verdict is Verdict.LEARNING_RATE
    fp32 = diagnosis.stages[0]
    assert fp32.ok and max(fp32.losses[1:]) > 10 * fp32.losses[0]  # finite, but blown up
    assert "diverg" in diagnosis.explanation


def test_doctor_suggests_an_lr_whose_loss_goes_down_not_one_that_merely_stays_finite():
    diagnosis = diagnose(make_tiny_bert(), bert_batch(), lr=10.0, steps=4)

    suggested = diagnosis.stages[-1]
    assert suggested.ok and suggested.lr <= 0.1  # lr 1 stays finite but its loss climbs
    assert suggested.losses[-1] < suggested.losses[0]
    assert f"about {suggested.lr:g}" in diagnosis.suggestion
    # The rejected rungs are in the evidence, with their rising losses.
    assert any(s.lr == 1.0 and s.losses[-1] > s.losses[0] for s in diagnosis.stages)


def test_doctor_on_a_diverged_checkpoint_says_divergence_not_fp16_unfriendly_layer():
    diagnosis = diagnose(exploded_bert(), bert_batch(seed=1), lr=5e-5, steps=4)

    assert diagnosis.verdict is Verdict.LEARNING_RATE
    assert diagnosis.verdict is not Verdict.FP16_UNFRIENDLY_LAYER
    assert "diverged" in diagnosis.explanation


def test_doctor_still_names_a_boosted_layer_at_a_sane_lr_fp16_unfriendly():
    model = make_tiny_bert()
    with torch.no_grad():
        model.get_submodule(BOOSTED).weight.mul_(5e5)

    diagnosis = diagnose(model, bert_batch(), lr=1e-4, steps=2)

    assert diagnosis.verdict is Verdict.FP16_UNFRIENDLY_LAYER
    assert diagnosis.culprit == BOOSTED


def test_a_plain_accelerate_loop_at_lr_10_stops_with_the_divergence_message():
    from amp_trainer import AmpAccelerator

    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True)
    model = make_tiny_bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=10.0)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = bert_batch()
    with pytest.raises(DivergenceError, match=r"learning rate 10\b.*grew"):
        for _ in range(6):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            accelerator.check_forward_overflow(loss, batch)
            optimizer.zero_grad()
    assert linear_islands(accelerator.unwrap_model(model)) == []

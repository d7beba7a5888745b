"""A streak of skipped updates is replayed and its verdict acted on, each fault provoked for real.

The faults: a module whose FP16 backward overflows at every loss scale with an exact forward
(:mod:`tests.helpers.replay_models`), an inf in one sample's features, a learning rate that
diverges, and the plain start-up skips of an initial scale that is too high.
"""

from __future__ import annotations

import logging

import pytest
import torch

from amp_trainer import AmpTrainer, BadBatchError, DivergenceError, LossScaleError
from amp_trainer.islands import is_fp32_island
from amp_trainer.scaler import DynamicLossScaler
from amp_trainer.skip_streak_replay import SkipStreakReplay
from tests.helpers.replay_models import (
    Amplifier,
    BackwardOverflowRegression,
    PlainRegression,
    Regression,
)
from tests.helpers.training import tiny_training_args

# Full-batch training (the batch is the dataset): the skipped attempts of the FP16 run read the
# same data as the FP32 run's steps, so both make the same updates up to FP16 rounding.
FULL_BATCH = dict(max_steps=30, learning_rate=3e-2, per_device_train_batch_size=32, seed=0)


class SequentialTrainer(AmpTrainer):
    """Reads the dataset in order (``train_sampling_strategy="sequential"`` where transformers
    has it): the replay can name a bad sample's dataset index."""

    def _get_train_sampler(self, *args, **kwargs):
        return torch.utils.data.SequentialSampler(self.train_dataset)


def _run(tmp_path, name, model, data, eval_data=None, cls=AmpTrainer, **overrides):
    trainer = cls(
        model=model,
        args=tiny_training_args(tmp_path / name, logging_steps=100, **overrides),
        train_dataset=data,
        eval_dataset=eval_data,
    )
    return trainer


def test_the_test_module_overflows_fp16_backward_at_scale_1_with_a_finite_forward():
    model, batch = BackwardOverflowRegression(), Regression(8)[:8]
    for fp16 in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16, enabled=fp16):
            loss = model(**batch)["loss"]
        loss.backward()
        grads_finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
        assert torch.isfinite(loss) and grads_finite is not fp16


def test_without_the_replay_a_backward_range_overflow_ends_in_loss_scale_error(tmp_path):
    trainer = _run(
        tmp_path,
        "off",
        BackwardOverflowRegression(),
        Regression(),
        **FULL_BATCH,
        skip_streak_replay=0,
    )
    with pytest.raises(LossScaleError):
        trainer.train()
    assert trainer.replay_verdicts == []


def test_a_backward_range_overflow_is_fixed_by_an_fp32_island_and_matches_fp32(tmp_path):
    eval_data = Regression(32, seed=1)
    fp16 = _run(
        tmp_path, "fp16", BackwardOverflowRegression(), Regression(), eval_data, **FULL_BATCH
    )
    fp16.train()
    (verdict,) = fp16.replay_verdicts
    assert verdict["verdict"] == "fp16_backward_range" and verdict["modules"] == ["amp"]
    assert verdict["skips"] == 8 and verdict["attempt"] == 8
    assert is_fp32_island(fp16.model.amp)
    assert fp16.state.global_step == FULL_BATCH["max_steps"]
    assert fp16.loss_scaler.get_scale() >= 1024  # set back: not left at the minimum
    assert [e["replay_verdict"] for e in fp16.state.log_history if "replay_verdict" in e] == [
        "fp16_backward_range"
    ]
    assert not any(m._backward_hooks for m in fp16.model.modules())  # the replay's are gone
    fp32 = _run(
        tmp_path,
        "fp32",
        BackwardOverflowRegression(),
        Regression(),
        eval_data,
        **FULL_BATCH,
        precision="fp32",
    )
    fp32.train()
    assert fp16.evaluate()["eval_loss"] == pytest.approx(fp32.evaluate()["eval_loss"], rel=0.02)


DATA_RUN = dict(
    max_steps=6,
    per_device_train_batch_size=4,
    skip_streak_replay=1,
    loss_scale_init=2.0**8,  # no start-up skips: the one skip is the bad batch's
)


@pytest.mark.parametrize("forward_policy", ["skip", "fp32"])
def test_an_inf_in_one_sample_is_the_data_verdict_naming_its_dataset_index(
    tmp_path, forward_policy
):
    trainer = _run(
        tmp_path,
        "data",
        PlainRegression(),
        Regression(inf_at=9),
        cls=SequentialTrainer,
        **DATA_RUN,
        on_forward_overflow=forward_policy,
        skip_streak_quarantine=int(forward_policy == "fp32"),
    )
    if forward_policy == "skip":
        with pytest.raises(BadBatchError, match=r"rows \[1\] \(dataset indices \[9\]\)"):
            trainer.train()
    else:  # the forward-overflow guard saw the inf loss: the replay proves it is the data
        trainer.train()
    (verdict,) = trainer.replay_verdicts
    assert verdict["verdict"] == "data"
    (batch,) = verdict["batches"]
    assert batch["rows"] == [1] and batch["sample_indices"] == [9] and batch["position"] == 2
    assert batch["inputs"] == ["'x' (1 non-finite value(s))"]


def test_a_quarantined_bad_batch_lets_the_run_finish_with_its_scale(tmp_path):
    trainer = _run(
        tmp_path,
        "quarantine",
        PlainRegression(),
        Regression(inf_at=9),
        **DATA_RUN,
        on_forward_overflow="skip",
        skip_streak_quarantine=1,
    )
    trainer.train()
    assert trainer.state.global_step == DATA_RUN["max_steps"]
    (verdict,) = trainer.replay_verdicts
    assert verdict["verdict"] == "data" and verdict["quarantined"]
    assert trainer.loss_scaler.get_scale() == 2.0**8  # the bad batch's backoff put back


def test_a_diverging_learning_rate_is_the_divergence_verdict(tmp_path):
    trainer = _run(
        tmp_path,
        "diverge",
        PlainRegression(),
        Regression(64),
        max_steps=30,
        learning_rate=5.0,
        per_device_train_batch_size=8,
        max_grad_norm=0.0,
        skip_streak_replay=2,
    )
    with pytest.raises(DivergenceError, match="learning rate 5"):
        trainer.train()
    assert trainer.replay_verdicts[-1]["verdict"] == "divergence"
    assert trainer.replay_verdicts[-1]["modules"] == []
    assert not any(is_fp32_island(m) for m in trainer.model.modules())


def test_start_up_skips_of_a_too_high_initial_scale_are_scale_warmup_and_nothing_more(tmp_path):
    trainer = _run(
        tmp_path,
        "warmup",
        PlainRegression(),
        Regression(64),
        max_steps=4,
        per_device_train_batch_size=8,
        loss_scale_init=2.0**30,
        skip_streak_replay=3,
    )
    trainer.train()
    (verdict,) = trainer.replay_verdicts
    assert verdict["verdict"] == "scale_warmup" and verdict["modules"] == []
    assert verdict["attempt"] == 3
    assert trainer.loss_scaler.stats.skipped > 3  # the scaler kept backing off by itself
    assert not any(is_fp32_island(m) for m in trainer.model.modules())


class CountingReplay(SkipStreakReplay):
    replays = 0

    def _replay(self, *args, **kwargs):
        CountingReplay.replays += 1
        return super()._replay(*args, **kwargs)


def test_a_clean_run_replays_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(
        "amp_trainer.skip_streak_replay.for_trainer.SkipStreakReplay", CountingReplay
    )
    trainer = _run(
        tmp_path,
        "clean",
        PlainRegression(),
        Regression(),
        max_steps=4,
        loss_scale_init=2.0**8,
        skip_streak_replay=1,
    )
    trainer.train()
    assert isinstance(trainer._skip_replay, CountingReplay)
    assert trainer.replay_verdicts == [] and CountingReplay.replays == 0
    assert trainer.loss_scaler.stats.skipped == 0


def test_the_replay_leaves_gradients_buffers_rng_and_hooks_as_they_were():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), Amplifier(8))
    replay = SkipStreakReplay(
        model, DynamicLossScaler("cpu"), forward=lambda m, x: m(x).float().pow(2).mean()
    )
    x = torch.randn(8, 4)
    model(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    buffers = [b.clone() for b in model.buffers()]
    rng = torch.get_rng_state()
    finite, culprit = replay.passes.run(x, fp16=True, scale=1.0, locate=True)
    assert not finite and culprit == "2"
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    assert all(torch.equal(b, c) for b, c in zip(model.buffers(), buffers))
    assert torch.equal(torch.get_rng_state(), rng)
    assert not any(m._backward_hooks for m in model.modules())


@pytest.mark.parametrize(
    ("field", "value"),
    [("skip_streak_replay", -1), ("skip_streak_replay", True), ("skip_streak_quarantine", 1.5)],
)
def test_a_bad_replay_argument_is_an_error_naming_it(tmp_path, field, value):
    with pytest.raises(ValueError, match=rf"{field} must be an int >= 0.*got {value!r}"):
        tiny_training_args(tmp_path, **{field: value})


def test_each_verdict_is_one_log_line(tmp_path, caplog):
    trainer = _run(
        tmp_path,
        "log",
        PlainRegression(),
        Regression(64),
        max_steps=2,
        per_device_train_batch_size=8,
        loss_scale_init=2.0**30,
        skip_streak_replay=3,
    )
    with caplog.at_level(logging.INFO, logger="amp_trainer.skip_streak_replay"):
        trainer.train()
    lines = [r for r in caplog.records if r.name == "amp_trainer.skip_streak_replay"]
    assert len(lines) == 1 and "replay verdict scale_warmup" in lines[0].getMessage()

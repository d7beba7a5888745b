"""The NaN doctor: each deliberately broken model gets the right verdict; a healthy one too."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from amp_trainer.doctor import Verdict, diagnose
from amp_trainer.numerics import FP16_MAX, OverflowProbe
from tests.helpers.tiny_models import (
    TwoBranchNet,
    bert_batch,
    make_tiny_bert,
    make_tiny_gpt2,
    two_branch_batch,
)


class ConstantInputNorm(nn.Module):
    """LayerNorm(eps=0) then a classifier; on a constant row the norm computes 0/0."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8, eps=0.0)
        self.head = nn.Linear(8, 2)

    def forward(self, features, labels):
        logits = self.head(self.norm(features))
        return {"loss": nn.functional.cross_entropy(logits, labels)}


def test_healthy_model_is_diagnosed_healthy():
    batch = {**bert_batch(), "labels": bert_batch()["input_ids"]}
    diagnosis = diagnose(make_tiny_gpt2(), batch, steps=2)
    assert diagnosis.verdict is Verdict.HEALTHY
    assert [s.name for s in diagnosis.stages] == [
        "1. fp32",
        "2. fp16 autocast, no scaler",
        "3. fp16 amp + DynamicLossScaler",
        "4. amp lr/10",
    ]
    assert all(stage.ok and len(stage.losses) == 2 for stage in diagnosis.stages)


def test_a_loss_scale_that_starts_too_high_is_the_scalers_warm_down_not_a_failure():
    """At 2**20 the tiny GPT-2's first backward overflows three times (2**20 -> 2**17) before
    an update applies, as in a training run's first steps; the stage then takes its two steps.
    Counted as steps, those skips would fill a two-step stage and read as "non-finite at step 0"
    (a Wav2Vec2-CTC head skips at 65536 and 32768 the same way)."""
    batch = {**bert_batch(), "labels": bert_batch()["input_ids"]}
    diagnosis = diagnose(make_tiny_gpt2(), batch, steps=2, loss_scale=2.0**20)
    assert diagnosis.verdict is Verdict.HEALTHY, diagnosis.explanation
    amp = diagnosis.stages[2]
    assert amp.ok and len(amp.losses) == 2
    assert amp.skipped_steps == 3 and amp.final_scale == 2.0**17
    assert "3 skipped" in amp.summary()


def test_weights_that_push_activations_past_65504_are_an_fp16_unfriendly_layer():
    model = make_tiny_bert()
    with torch.no_grad():
        model.bert.encoder.layer[0].intermediate.dense.weight.mul_(5e5)
    diagnosis = diagnose(model, bert_batch(), steps=2)
    assert diagnosis.verdict is Verdict.FP16_UNFRIENDLY_LAYER
    assert diagnosis.culprit == "bert.encoder.layer.0.intermediate.dense"
    fp32, autocast_only, amp = diagnosis.stages
    assert fp32.ok and not autocast_only.ok and amp.first_bad_step == 0
    assert "bert.encoder.layer.0.intermediate.dense" in diagnosis.suggestion
    assert "bf16" in diagnosis.suggestion


def test_layernorm_with_eps_zero_on_constant_input_is_a_model_bug():
    batch = {"features": torch.ones(4, 8), "labels": torch.tensor([0, 1, 0, 1])}
    diagnosis = diagnose(ConstantInputNorm(), batch)
    assert diagnosis.verdict is Verdict.MODEL
    assert diagnosis.culprit == "norm"
    assert "eps=0" in diagnosis.explanation
    assert len(diagnosis.stages) == 1  # FP32 already fails: the FP16 stages would prove nothing


def test_nan_in_the_data_is_a_data_problem():
    model = make_tiny_bert(num_labels=1)  # regression: float labels
    batch = {**bert_batch(), "labels": torch.tensor([0.5, float("nan"), 1.0, 0.0])}
    diagnosis = diagnose(model, batch)
    assert diagnosis.verdict is Verdict.DATA
    assert diagnosis.culprit == "labels"
    assert "1 non-finite" in diagnosis.explanation


def test_absurd_learning_rate_is_a_learning_rate_problem_with_a_working_lr():
    diagnosis = diagnose(make_tiny_bert(), bert_batch(), lr=100.0)
    assert diagnosis.verdict is Verdict.LEARNING_RATE
    first_amp = next(s for s in diagnosis.stages if s.name.startswith("3."))
    assert math.isfinite(first_amp.losses[0])  # the first step, before any update, is fine
    assert first_amp.first_bad_step is not None and first_amp.first_bad_step > 0
    clean = diagnosis.stages[-1]
    assert clean.ok and clean.lr < 100.0
    assert f"{clean.lr:g}" in diagnosis.suggestion


def test_diagnose_leaves_the_callers_model_untouched():
    model = make_tiny_bert()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    diagnose(model, bert_batch(), steps=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks for m in model.modules())


def test_a_custom_loss_fn_is_used_when_the_model_returns_no_loss():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def forward(self, x):
            return self.net(x)

    batch = {"x": torch.randn(6, 4)}
    diagnosis = diagnose(Wrapped(), batch, loss_fn=lambda out, b: out.pow(2).mean(), steps=2)
    assert diagnosis.verdict is Verdict.HEALTHY


def test_a_model_without_a_loss_and_no_loss_fn_is_a_clear_error():
    batch = bert_batch()
    del batch["labels"]
    with pytest.raises(ValueError, match="has no loss"):
        diagnose(make_tiny_bert(), batch, steps=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"steps": 0}, "steps must be an int >= 1"), ({"lr": -1.0}, "lr must be a positive")],
)
def test_bad_settings_name_the_value_and_the_valid_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        diagnose(make_tiny_bert(), bert_batch(), **kwargs)


def test_probe_names_the_innermost_module_that_made_the_overflow_not_those_downstream():
    model = nn.Sequential(
        nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1)
    )
    with torch.no_grad():
        model[1][0].weight.fill_(1e5)
    with OverflowProbe(model, limit=FP16_MAX) as probe:
        model(torch.ones(2, 4))
    assert probe.first == "1.0"
    assert {"0", "1", "1.0", "1.1", "2", ""} <= probe.called
    assert not any(m._forward_hooks for m in model.modules())  # removed on exit


def _tiny_loss(output, batch):
    return output.loss * 1e-4  # gradients far below FP16's range at a small loss scale


def test_gradients_flushed_at_the_runs_loss_scale_are_gradient_underflow():
    diagnosis = diagnose(make_tiny_bert(), bert_batch(), steps=2, loss_fn=_tiny_loss, loss_scale=1)
    assert diagnosis.verdict is Verdict.GRADIENT_UNDERFLOW
    reading = diagnosis.underflow
    assert reading.scale == 1.0 and reading.underflow > 0.5
    assert reading.fixable and reading.fixing_scale >= 2.0**10
    assert f"{reading.fixing_scale:g}" in diagnosis.suggestion
    assert "grow_on_underflow=True" in diagnosis.suggestion
    assert diagnosis.culprit in reading.by_param
    assert "5. underflow at loss scale 1:" in str(diagnosis)


def test_the_same_gradients_at_the_scale_the_doctor_names_are_healthy():
    first = diagnose(make_tiny_bert(), bert_batch(), steps=2, loss_fn=_tiny_loss, loss_scale=1)
    fixed = diagnose(
        make_tiny_bert(),
        bert_batch(),
        steps=2,
        loss_fn=_tiny_loss,
        loss_scale=first.underflow.fixing_scale,
    )
    assert fixed.verdict is Verdict.HEALTHY
    assert fixed.underflow.underflow <= 0.01


def test_gradient_fp16_flushes_at_every_usable_scale_is_bf16_or_fp32_not_a_loss_scale():
    diagnosis = diagnose(TwoBranchNet(weak_factor=1e-9), two_branch_batch(), steps=2, loss_scale=1)
    assert diagnosis.verdict is Verdict.GRADIENT_UNDERFLOW
    reading = diagnosis.underflow
    assert reading.unreachable > 0.4 and reading.fixable is False
    assert diagnosis.culprit.startswith("weak.")
    assert "bf16" in diagnosis.suggestion and "['weak.0', 'weak.2']" in diagnosis.suggestion
    assert "loss_scale_init" not in diagnosis.suggestion  # no scale is offered as the fix
    assert "at every usable scale" in str(diagnosis)


def test_the_same_two_heads_at_equal_weight_are_healthy():
    diagnosis = diagnose(TwoBranchNet(weak_factor=1.0), two_branch_batch(), steps=2, loss_scale=1)
    assert diagnosis.verdict is Verdict.HEALTHY
    assert diagnosis.underflow.unreachable == 0.0


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("healthy", Verdict.HEALTHY),
        ("underflow", Verdict.GRADIENT_UNDERFLOW),
        ("data", Verdict.DATA),
        ("model", Verdict.MODEL),
        ("learning_rate", Verdict.LEARNING_RATE),
        ("fp16_layer", Verdict.FP16_UNFRIENDLY_LAYER),
    ],
)
def test_each_provoked_cause_gets_its_own_verdict_and_no_other(case, expected):
    """One cause of each kind, provoked for real; the underflow check never masks the others
    and none of them reads as underflow."""
    model, batch, kwargs = make_tiny_bert(), bert_batch(), {"steps": 2}
    if case == "underflow":
        kwargs.update(loss_fn=_tiny_loss, loss_scale=1)
    elif case == "data":
        batch = {**batch, "attention_mask": batch["attention_mask"].float()}
        batch["attention_mask"][0, 0] = float("nan")
    elif case == "model":
        model = ConstantInputNorm()
        batch = {"features": torch.ones(4, 8), "labels": torch.tensor([0, 1, 0, 1])}
    elif case == "learning_rate":
        kwargs.update(lr=100.0, steps=3)
    elif case == "fp16_layer":
        with torch.no_grad():
            model.bert.encoder.layer[0].intermediate.dense.weight.mul_(5e5)
    assert diagnose(model, batch, **kwargs).verdict is expected

"""The underflow meter: true figures against an FP32 reference, a run it never changes, and the
two-sided rule that grows the scale out of underflow where torch's rule sits still."""

from __future__ import annotations

import math

import pytest
import torch

from amp_trainer import AmpTrainer, DynamicLossScaler
from amp_trainer.underflow import measure_underflow
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import tiny_training_args


class _ScaledLossBert(torch.nn.Module):
    """A tiny BERT (2 layers, hidden 64) whose loss is multiplied by ``factor``: its gradients
    sit far below FP16's range at small loss scales."""

    def __init__(self, factor: float = 1e-4, seed: int = 0):
        super().__init__()
        self.bert = make_tiny_bert(
            vocab_size=1000, seed=seed, hidden_size=64, intermediate_size=128
        )
        self.factor = factor

    def forward(self, input_ids, labels, attention_mask=None):
        out = self.bert(input_ids=input_ids, labels=labels, attention_mask=attention_mask)
        out.loss = out.loss * self.factor
        return out


def _batch(seed: int = 0, n: int = 8):
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(5, 1000, (n, 16), generator=g),
        "labels": torch.randint(0, 2, (n,), generator=g),
    }


def _fp16_loss(model, batch):
    torch.manual_seed(1)  # the same dropout mask for every run of the batch
    with torch.autocast("cpu", dtype=torch.float16):
        return model(**batch).loss


def _fp32_flushed_share(model, batch, scale: float) -> float:
    """The reference: elements nonzero in an FP32 backward, zero in the FP16 one at ``scale``."""
    params = [p for p in model.parameters() if p.requires_grad]
    torch.manual_seed(1)
    fp32 = torch.autograd.grad(model(**batch).loss, params)
    fp16 = torch.autograd.grad(_fp16_loss(model, batch) * scale, params)
    nonzero = sum(int((g != 0).sum()) for g in fp32)
    flushed = sum(int(((a != 0) & (b == 0)).sum()) for a, b in zip(fp32, fp16))
    return flushed / nonzero


@pytest.mark.parametrize("exponent", [0, 8, 16])
def test_the_meter_reads_what_an_fp32_backward_shows_is_flushed(exponent):
    model, batch = _ScaledLossBert().train(), _batch()
    reading = measure_underflow(_fp16_loss(model, batch), model, 2.0**exponent)
    reference = _fp32_flushed_share(model, batch, 2.0**exponent)
    # The meter's counterfactual is the same FP16 backward at the highest scale that does not
    # overflow, so it can only see what FP16 can hold: within a few points of FP32's answer.
    assert reading.underflow == pytest.approx(reference, abs=0.12)
    assert reading.fp16_gradients


def test_the_meter_falls_with_the_scale_as_the_reference_does():
    model, batch = _ScaledLossBert().train(), _batch()
    shares = [
        measure_underflow(_fp16_loss(model, batch), model, 2.0**e).underflow for e in (0, 8, 16)
    ]
    assert shares[0] > 0.8 > shares[1] > 0.1 > shares[2]


def test_legitimate_zeros_are_not_underflow():
    """Unused embedding rows have exact-zero gradients at any scale: the meter ignores them."""
    model, batch = _ScaledLossBert(factor=1.0).train(), _batch()
    loss = _fp16_loss(model, batch)
    embeddings = model.bert.bert.embeddings.word_embeddings.weight
    (grad,) = torch.autograd.grad(loss * 2.0**16, [embeddings], retain_graph=True)
    zero_share = float((grad == 0).float().mean())
    reading = measure_underflow(loss, model, 2.0**16)
    assert zero_share > 0.8  # most embedding rows are unused by the batch: exactly zero...
    assert reading.underflow < 0.01  # ...and none of it is FP16's doing


def test_the_meter_changes_nothing_the_backward_then_computes():
    model, batch = _ScaledLossBert().train(), _batch()
    loss = _fp16_loss(model, batch)
    rng = torch.get_rng_state()
    measure_underflow(loss, model, 2.0**8)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(p.grad is None for p in model.parameters())
    (loss * 2.0**8).backward()
    measured = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    (_fp16_loss(model, batch) * 2.0**8).backward()
    assert all(torch.equal(a, p.grad) for a, p in zip(measured, model.parameters()))


def test_headroom_counts_the_doublings_before_the_largest_fp16_gradient_overflows():
    model, batch = _ScaledLossBert(factor=1.0).train(), _batch()
    reading = measure_underflow(_fp16_loss(model, batch), model, 2.0**8)
    params = list(model.parameters())
    grads = torch.autograd.grad(_fp16_loss(model, batch) * 2.0**8, params)
    fp16_valued = [
        g for g in grads if (g != 0).any() and bool((g[g != 0] == g[g != 0].half().float()).all())
    ]
    largest = max(float(g.abs().max()) for g in fp16_valued)
    assert reading.headroom <= math.log2(65504 / largest) + 1e-9
    # At the scale it promises, the step really is finite; a few doublings past it, it is not.
    at_edge = torch.autograd.grad(
        _fp16_loss(model, batch) * 2.0 ** (8 + math.floor(reading.headroom)), params
    )
    assert all(bool(torch.isfinite(g).all()) for g in at_edge)
    beyond = torch.autograd.grad(
        _fp16_loss(model, batch) * 2.0 ** (8 + math.floor(reading.headroom) + 4), params
    )
    assert not all(bool(torch.isfinite(g).all()) for g in beyond)


def test_per_parameter_shares_name_the_watched_parameters():
    model, batch = _ScaledLossBert().train(), _batch()
    reading = measure_underflow(_fp16_loss(model, batch), model, 1.0)
    assert "bert.classifier.weight" in reading.by_param
    assert all(0.0 <= v <= 1.0 for v in reading.by_param.values())


def test_loss_scaling_with_no_fp16_in_the_computation_is_said_once(caplog):
    model, batch = _ScaledLossBert(factor=1.0).train(), _batch()
    scaler = DynamicLossScaler("cpu")
    for _ in range(2):
        torch.manual_seed(1)
        scaler.check_underflow(model(**batch).loss, model)  # no autocast: all FP32
    said = [r for r in caplog.records if "no gradient went through FP16" in r.getMessage()]
    assert len(said) == 1 and not scaler.last_underflow.fp16_gradients


def test_fp16_compute_without_loss_scaling_is_said_once(caplog):
    model, batch = _ScaledLossBert().train(), _batch()
    scaler = DynamicLossScaler("cpu", enabled=False)
    for _ in range(2):
        scaler.check_underflow(_fp16_loss(model, batch), model)
    said = [r for r in caplog.records if "FP16 compute with no loss scaling" in r.getMessage()]
    assert len(said) == 1 and scaler.stats.grad_underflow > 0.8
    assert not [r for r in caplog.records if "no gradient went through FP16" in r.getMessage()]


def test_bad_input_is_refused_naming_it():
    model = _ScaledLossBert()
    with pytest.raises(ValueError, match="before backward"):
        measure_underflow(torch.tensor(1.0), model, 1.0)


def _train(tmp_path, name, **overrides):
    args = tiny_training_args(tmp_path / name, max_steps=6, seed=3, **overrides)
    from datasets import Dataset

    rows = [_batch(seed=i, n=1) for i in range(24)]
    data = Dataset.from_list(
        [{"input_ids": r["input_ids"][0].tolist(), "labels": int(r["labels"][0])} for r in rows]
    )
    torch.manual_seed(0)
    model = make_tiny_bert(vocab_size=1000)
    trainer = AmpTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return trainer


def test_the_trainer_logs_the_meter_on_checked_steps_only(tmp_path):
    trainer = _train(tmp_path, "metered", loss_scale_underflow_check_interval=4)
    logged = [h for h in trainer.state.log_history if "loss" in h]
    with_meter = [h["step"] for h in logged if "grad_underflow" in h]
    assert with_meter == [1, 4]  # the first step, then every 4th
    assert all(
        0.0 <= h["grad_underflow"] <= 1.0 and "grad_headroom" in h
        for h in logged
        if "grad_underflow" in h
    )
    assert trainer.loss_scaler.stats.grad_underflow == logged[3]["grad_underflow"]


def test_the_meter_on_every_step_leaves_the_run_bit_identical(tmp_path):
    metered = _train(tmp_path, "on", loss_scale_underflow_check_interval=1)
    plain = _train(tmp_path, "off", loss_scale_underflow_check_interval=0)
    for a, b in zip(metered.model.parameters(), plain.model.parameters()):
        assert torch.equal(a, b)
    state_a, state_b = (
        metered.optimizer.state_dict()["state"],
        plain.optimizer.state_dict()["state"],
    )
    assert all(
        torch.equal(state_a[k][n], state_b[k][n])
        for k in state_a
        for n in ("exp_avg", "exp_avg_sq")
    )
    assert metered.scale_history == plain.scale_history
    assert torch.equal(torch.get_rng_state(), torch.get_rng_state())
    losses = lambda t: [h["loss"] for h in t.state.log_history if "loss" in h]  # noqa: E731
    assert losses(metered) == losses(plain)


def _plain_loop(scaler, steps, check_every):
    """A plain PyTorch loop on the scaled-loss BERT; returns the scales it ran with."""
    model = _ScaledLossBert(seed=0).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    scales, skipped = [], 0
    for step in range(steps):
        batch = _batch(seed=step % 4)
        loss = _fp16_loss(model, batch)
        if (check_every and step % check_every == 0) or scaler.underflow_recheck_due:
            scaler.check_underflow(loss, model)
        scales.append(scaler.get_scale())
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.step_was_skipped
        optimizer.zero_grad(set_to_none=True)
    return scales, skipped, model, _batch(seed=0)


def test_the_two_sided_rule_grows_out_of_underflow_where_torchs_rule_sits_still():
    two_sided = DynamicLossScaler("cpu", init_scale=1.0, grow_on_underflow=True)
    _, skipped, model, batch = _plain_loop(two_sided, 30, check_every=10)
    final = measure_underflow(_fp16_loss(model, batch), model, two_sided.get_scale())
    assert final.underflow < 0.01 and skipped <= 3
    assert two_sided.stats.underflow_growths >= 1
    default = DynamicLossScaler("cpu", init_scale=1.0)
    default_scales, _, _, _ = _plain_loop(default, 30, check_every=10)
    assert set(default_scales) == {1.0}  # growth_interval 2000: torch's rule waits


def test_the_two_sided_rule_never_grows_back_to_a_scale_that_overflowed():
    scaler = DynamicLossScaler("cpu", init_scale=1.0, grow_on_underflow=True)
    policy = scaler.policy
    policy.on_underflow(0.5, fixing_scale=2.0**20, headroom=30.0)
    assert policy.scale == 2.0**20
    policy.record(True)  # that scale overflowed on the next step
    assert policy.underflow_ceiling == 2.0**20 and policy.scale == 2.0**19
    policy.on_underflow(0.5, fixing_scale=2.0**24, headroom=30.0)
    assert policy.scale == 2.0**19  # at most one doubling under the ceiling: no growth past it


def test_the_default_rule_ignores_the_meter():
    scaler = DynamicLossScaler("cpu", init_scale=1.0)
    assert scaler.policy.on_underflow(0.9, fixing_scale=2.0**20, headroom=30.0) is False
    assert scaler.get_scale() == 1.0


def test_a_check_goes_into_the_next_log_and_is_drawn_in_the_plot(tmp_path):
    pytest.importorskip("matplotlib")
    from amp_trainer.recipes.reporting import (
        UNDERFLOW_LABEL,
        describe_underflow,
        training_figure,
    )

    trainer = _train(tmp_path, "plot", loss_scale_underflow_check_interval=4, logging_steps=3)
    checks = [h for h in trainer.state.log_history if "grad_underflow" in h]
    # Checked at steps 1 and 4: logged at the next logging steps, 3 and 6; the cadence the user
    # chose is kept (no extra log lines).
    assert [h["step"] for h in checks] == [3, 6]
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [3, 6]
    last = trainer.loss_scaler.last_underflow
    assert checks[-1]["grad_underflow"] == last.underflow
    assert describe_underflow(trainer.state.log_history).startswith(
        f"{100 * last.underflow:.2f}%, headroom {last.headroom:.1f} doublings (logged at step 6; "
        "2 check(s))"
    )
    figure = training_figure(trainer.state.log_history, trainer.scale_history, precision="fp16")
    meter = figure.axes[2]
    (line,) = [ln for ln in meter.get_lines() if ln.get_label() == UNDERFLOW_LABEL]
    assert list(line.get_xdata()) == [3, 6]
    assert list(line.get_ydata()) == [100 * h["grad_underflow"] for h in checks]


def test_a_gradient_flushed_whole_at_the_scale_still_reads_as_fp16_not_as_no_fp16(caplog):
    """At S=1 almost every element of this MLP's gradient is zero: too little left at S to show
    FP16 values; the higher-scale backward shows them, so no false 'no FP16' warning."""
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    x, y = torch.randn(32, 16), torch.randn(32, 1)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.mse_loss(model(x).float(), y) * 1e-6
    reading = DynamicLossScaler("cpu", init_scale=1.0).check_underflow(loss, model)
    assert reading.fp16_gradients and reading.headroom is not None
    assert reading.underflow > 0.5 and reading.reference_scale >= 2.0**16
    assert not [r for r in caplog.records if "no gradient went through FP16" in r.getMessage()]


def test_a_step_whose_gradient_overflows_at_the_scale_reads_no_underflow_and_no_headroom():
    # An FP16 gradient of +inf (no NaN): its largest magnitude is inf, nothing a higher scale
    # could save and no doubling left; the reading says so instead of failing on log2(0).
    weight = torch.nn.Parameter(torch.ones(16))
    loss = (weight.half() * 60000.0).float().sum()  # d/dw in FP16: 60000 * S, inf at S = 2
    reading = measure_underflow(loss, [("weight", weight)], 2.0)
    assert reading.underflow is None and reading.headroom == 0.0
    assert reading.fp16_gradients  # +inf is an FP16 value: the gradient went through FP16


def test_a_growth_of_the_two_sided_rule_is_one_info_line_with_its_reading(caplog):
    # Overflow skips get a line; a jump of the scale by 2**20 in one step did not.
    scaler = DynamicLossScaler("cpu", init_scale=1.0, grow_on_underflow=True)
    model = _ScaledLossBert(seed=0)
    loss = _fp16_loss(model, _batch())
    with caplog.at_level("INFO", logger="amp_trainer"):
        reading = scaler.check_underflow(loss, model)
    grown = [r for r in caplog.records if "grow_on_underflow" in r.getMessage()]
    assert len(grown) == 1 and grown[0].levelname == "INFO"
    message = grown[0].getMessage()
    assert message.startswith(f"Loss scale 1 -> {scaler.get_scale():g} (grow_on_underflow): ")
    assert f"{100 * reading.underflow:.2f}% of the gradient was flushed to zero at 1" in message
    assert f"({reading.flushed} of {reading.nonzero} elements;" in message
    caplog.clear()
    with caplog.at_level("INFO", logger="amp_trainer"):
        scaler.check_underflow(_fp16_loss(model, _batch()), model)  # nothing left to fix
    assert not [r for r in caplog.records if "grow_on_underflow" in r.getMessage()]


def test_the_trainer_logs_underflow_growths_where_the_rule_is_on(tmp_path):
    two_sided = _train(
        tmp_path,
        "rule",
        loss_scale_init=1.0,
        loss_scale_grow_on_underflow=True,
        loss_scale_underflow_check_interval=4,
    )
    logged = [h for h in two_sided.state.log_history if "loss" in h]
    assert [h["underflow_growths"] for h in logged][
        -1
    ] == two_sided.loss_scaler.stats.underflow_growths
    assert two_sided.loss_scaler.stats.underflow_growths >= 1
    default = _train(tmp_path, "default", loss_scale_underflow_check_interval=4)
    assert not any("underflow_growths" in h for h in default.state.log_history)


def test_an_all_zero_gradient_is_said_to_be_zero_not_a_run_without_fp16(caplog):
    # A GRPO step whose completions all scored alike has advantages 0: its loss's gradient is
    # exactly zero, though every forward ran in FP16. That is no set-up mistake.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(torch.randn(8, 16))
    advantages = torch.zeros(8, 1)
    loss = (out.float() * advantages).mean()
    scaler = DynamicLossScaler("cpu")
    with caplog.at_level("INFO", logger="amp_trainer"):
        reading = scaler.check_underflow(loss, model)
    assert reading.nonzero == 0 and reading.underflow == 0.0
    assert not [r for r in caplog.records if "no gradient went through FP16" in r.getMessage()]
    zero = [r for r in caplog.records if "gradient is zero in every element" in r.getMessage()]
    assert len(zero) == 1 and zero[0].levelname == "INFO"


def test_fp32_compute_with_nonzero_gradients_is_still_said_to_run_without_fp16(caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    loss = model(torch.randn(8, 16)).pow(2).mean()  # no autocast
    with caplog.at_level("INFO", logger="amp_trainer"):
        DynamicLossScaler("cpu").check_underflow(loss, model)
    said = [r for r in caplog.records if "no gradient went through FP16" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "WARNING"

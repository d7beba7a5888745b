"""AmpAccelerator / install_scaler: our scaler inside real Accelerate loops (CPU, fp16 autocast)."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import GradScalerKwargs

from amp_trainer import precision
from amp_trainer.accelerate_hooks import AmpAccelerator, install_scaler
from amp_trainer.deepspeed import deepspeed_fp16_config
from amp_trainer.islands import is_fp32_island, keep_norms_in_fp32
from amp_trainer.scaler import DynamicLossScaler
from tests.helpers.repo import REPO_ROOT, subprocess_env
from tests.helpers.tiny_models import make_tiny_bert, make_tiny_gpt2


@pytest.fixture(autouse=True)
def quiet_cpu_fp16_warning(monkeypatch):
    monkeypatch.setattr(precision, "_warned_cpu_fp16", True)


class CountingScaler(DynamicLossScaler):
    """A real DynamicLossScaler that counts how often it unscales an optimizer's gradients:
    ``unscale_`` or the one-pass unscale + clip of ``clip_grad_norm_`` (both end in
    ``_mark_unscaled``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.unscale_calls = 0

    def _mark_unscaled(self, optimizer, state, overflow):
        self.unscale_calls += 1
        super()._mark_unscaled(optimizer, state, overflow)


def bert_batch(batch_size: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 128, (batch_size, 8), generator=g),
        "labels": torch.randint(0, 2, (batch_size,), generator=g),
    }


def gpt2_batch(batch_size: int = 4, seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (batch_size, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def snapshot(model, optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, copy.deepcopy(optimizer.state_dict())


def assert_same_state(before, after) -> None:
    (params_a, opt_a), (params_b, opt_b) = before, after
    for name in params_a:
        assert torch.equal(params_a[name], params_b[name]), name
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for key, state in opt_a["state"].items():
        for field, value in state.items():
            other = opt_b["state"][key][field]
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, other), (key, field)
            else:
                assert value == other, (key, field)


# --------------------------------------------------------------------------------------------
# what gets installed
# --------------------------------------------------------------------------------------------
def test_upstream_accelerate_silently_ignores_fp16_on_cpu():
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    assert accelerator.scaler is None
    assert accelerator.native_amp is False


def test_upstream_torch_scaler_hides_fused_optimizer_skips_from_accelerate():
    # Why install_scaler exists: torch's GradScaler hands fused optimizers its found-inf tensor
    # and calls step() anyway, so Accelerate (and its scheduler) never learn of the skip.
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.scaler, accelerator.native_amp = torch.amp.GradScaler("cpu"), True
    model = torch.nn.Linear(4, 2)
    model, optimizer = accelerator.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    )
    accelerator.backward(model(torch.ones(2, 4)).sum())
    model.weight.grad[0, 0] = float("inf")
    optimizer.step()
    assert accelerator.scaler.get_scale() < 2.0**16  # torch did see the overflow...
    assert not accelerator.optimizer_step_was_skipped  # ...but Accelerate was told nothing


def test_fp16_on_cpu_installs_our_scaler_and_real_autocast():
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True)
    assert isinstance(accelerator.scaler, DynamicLossScaler)
    assert accelerator.loss_scaler is accelerator.scaler
    assert accelerator.scaler.is_enabled()
    assert accelerator.precision == "fp16"
    with accelerator.autocast():
        assert (torch.randn(2, 2) @ torch.randn(2, 2)).dtype == torch.float16


def test_fp16_on_cpu_warns_once_that_it_is_slow(monkeypatch):
    monkeypatch.setattr(precision, "_warned_cpu_fp16", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AmpAccelerator(mixed_precision="fp16", cpu=True)
    assert sum(issubclass(w.category, precision.CpuFp16Warning) for w in caught) == 1


def test_prepared_model_forward_runs_in_fp16_on_cpu(tiny_bert):
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True)
    model = accelerator.prepare(tiny_bert)
    seen = []
    model.bert.encoder.layer[0].intermediate.dense.register_forward_hook(
        lambda m, a, out: seen.append(out.dtype)
    )
    model(**bert_batch())
    assert seen == [torch.float16]


def test_mixed_precision_from_the_environment_is_respected(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    accelerator = AmpAccelerator(cpu=True)
    assert accelerator.precision == "fp16"
    assert accelerator.loss_scaler.is_enabled()


@pytest.mark.parametrize(("requested", "expected"), [("bf16", "bf16"), ("no", "fp32")])
def test_bf16_and_fp32_install_a_disabled_pass_through_scaler(requested, expected, tiny_bert):
    accelerator = AmpAccelerator(mixed_precision=requested, cpu=True)
    tiny_bert.eval()  # no dropout: both runs must see the same function
    reference = copy.deepcopy(tiny_bert)
    model = accelerator.prepare(tiny_bert)
    if expected == "bf16":
        keep_norms_in_fp32(reference)  # as prepare() did to the model
    assert accelerator.precision == expected
    assert not accelerator.loss_scaler.is_enabled()
    assert accelerator.loss_scaler.get_scale() == 1.0
    batch = bert_batch()
    accelerator.backward(model(**batch).loss)
    with accelerator.autocast():
        reference_loss = reference(**batch).loss
    reference_loss.backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad), name


def test_auto_resolves_to_what_the_cpu_supports():
    accelerator = AmpAccelerator(mixed_precision="auto", cpu=True)
    expected = "bf16" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "fp32"
    assert accelerator.precision == expected


def test_grad_scaler_kwargs_handler_maps_onto_our_knobs():
    handler = GradScalerKwargs(init_scale=1024.0, growth_interval=3, backoff_factor=0.25)
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True, kwargs_handlers=[handler])
    scaler = accelerator.loss_scaler
    assert scaler.get_scale() == 1024.0
    assert scaler.get_growth_interval() == 3
    assert scaler.get_backoff_factor() == 0.25


def test_fp16_with_a_disabled_scaler_warns_that_gradients_underflow(caplog):
    with caplog.at_level("WARNING", logger="amp_trainer.accelerate_hooks"):
        accelerator = AmpAccelerator(
            mixed_precision="fp16", cpu=True, loss_scaler=DynamicLossScaler("cpu", enabled=False)
        )
    assert not accelerator.loss_scaler.is_enabled()
    assert "silently stop learning" in caplog.text


def test_loss_scaler_mapping_builds_the_scaler():
    accelerator = AmpAccelerator(
        mixed_precision="fp16", cpu=True, loss_scaler={"init_scale": 256.0, "hysteresis": 2}
    )
    state = accelerator.loss_scaler.state_dict()
    assert (state["scale"], state["hysteresis"]) == (256.0, 2)


def test_loss_scaler_instance_is_used_as_is():
    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True, loss_scaler=scaler)
    assert accelerator.scaler is scaler


def test_a_scaler_instance_and_a_grad_scaler_handler_together_are_ambiguous():
    with pytest.raises(ValueError, match="not both"):
        AmpAccelerator(
            mixed_precision="fp16",
            cpu=True,
            loss_scaler=DynamicLossScaler("cpu"),
            kwargs_handlers=[GradScalerKwargs(init_scale=2.0)],
        )


def test_an_enabled_scaler_for_a_bf16_run_is_refused():
    with pytest.raises(ValueError, match="needs no loss scaling"):
        AmpAccelerator(mixed_precision="bf16", cpu=True, loss_scaler=DynamicLossScaler("cpu"))


def test_prepare_keeps_norms_in_fp32_under_fp16(tiny_bert):
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True)
    model = accelerator.prepare(tiny_bert)
    norm = model.bert.embeddings.LayerNorm
    assert is_fp32_island(norm)  # prepare() made it an FP32 island
    keep_norms_in_fp32(model)
    assert is_fp32_island(norm) and not norm._forward_pre_hooks


def test_keep_norms_fp32_false_leaves_the_model_alone(tiny_bert):
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True, keep_norms_fp32=False)
    model = accelerator.prepare(tiny_bert)
    assert not is_fp32_island(model.bert.embeddings.LayerNorm)


# --------------------------------------------------------------------------------------------
# install_scaler on an accelerator built elsewhere
# --------------------------------------------------------------------------------------------
def test_install_scaler_makes_a_plain_accelerator_skip_overflow_steps(tiny_bert):
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    scaler = install_scaler(accelerator, init_scale=64.0)
    assert accelerator.scaler is scaler
    model = accelerator.prepare(tiny_bert)
    optimizer = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    accelerator.backward(model(**bert_batch()).loss)
    model.classifier.weight.grad[0, 0] = float("inf")
    before = snapshot(model, optimizer)
    optimizer.step()
    assert accelerator.optimizer_step_was_skipped
    assert scaler.get_scale() == 32.0
    assert_same_state(before, snapshot(model, optimizer))


def test_install_scaler_after_optimizers_are_prepared_is_an_error(tiny_bert):
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    accelerator.prepare(torch.optim.SGD(tiny_bert.parameters(), lr=0.1))
    with pytest.raises(RuntimeError, match=r"before prepare\(\)"):
        install_scaler(accelerator)


def test_install_scaler_takes_a_scaler_or_kwargs_not_both():
    accelerator = Accelerator(mixed_precision="fp16", cpu=True)
    with pytest.raises(TypeError, match="not both"):
        install_scaler(accelerator, DynamicLossScaler("cpu"), init_scale=2.0)


# --------------------------------------------------------------------------------------------
# the training loop
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("factory", "make_batch"), [(make_tiny_bert, bert_batch), (make_tiny_gpt2, gpt2_batch)]
)
def test_fp16_training_loop_on_cpu_decreases_the_loss(factory, make_batch):
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True)
    model = factory()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = make_batch(batch_size=8)
    losses = []
    for _ in range(12):
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert accelerator.loss_scaler.stats.steps == 12
    assert losses[-1] < 0.8 * losses[0]


@pytest.mark.parametrize(
    "optimizer_kwargs",
    [{"fused": True}, {"foreach": True}, {"foreach": False}],
    ids=["fused", "foreach", "for-loop"],
)
def test_injected_inf_skips_the_step_and_holds_params_state_and_lr(optimizer_kwargs, tiny_bert):
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True)
    optimizer = torch.optim.AdamW(tiny_bert.parameters(), lr=1e-3, **optimizer_kwargs)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(tiny_bert, optimizer, scheduler)
    batch = bert_batch()

    def train_step(inject: bool) -> None:
        accelerator.backward(model(**batch).loss)
        if inject:
            model.bert.encoder.layer[1].output.dense.weight.grad[0, 0] = float("inf")
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()

    train_step(inject=False)  # so that the optimizer has moments and a step count
    assert not accelerator.optimizer_step_was_skipped
    before, lr_before, scale_before = snapshot(model, optimizer), scheduler.get_last_lr(), 2.0**16
    train_step(inject=True)
    assert accelerator.optimizer_step_was_skipped
    assert_same_state(before, snapshot(model, optimizer))
    assert scheduler.get_last_lr() == lr_before
    assert accelerator.loss_scaler.get_scale() == scale_before / 2
    train_step(inject=False)
    assert not accelerator.optimizer_step_was_skipped
    assert scheduler.get_last_lr() != lr_before


def test_gradient_accumulation_of_four_micro_batches_equals_one_4x_batch():
    model = make_tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    reference = copy.deepcopy(model)
    keep_norms_in_fp32(reference)
    scaler = CountingScaler("cpu")
    accelerator = AmpAccelerator(
        mixed_precision="fp16", cpu=True, gradient_accumulation_steps=4, loss_scaler=scaler
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    full = bert_batch(batch_size=16)
    unscaled: dict[str, torch.Tensor] = {}
    for i in range(4):
        micro = {k: v[4 * i : 4 * (i + 1)] for k, v in full.items()}
        with accelerator.accumulate(model):
            accelerator.backward(model(**micro).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1e9)
                unscaled = {n: p.grad.clone() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
    assert scaler.unscale_calls == 1
    assert scaler.stats.steps == 1

    with torch.autocast("cpu", dtype=torch.float16):
        loss = reference(**full).loss
    loss.backward()
    for name, p in reference.named_parameters():
        torch.testing.assert_close(unscaled[name], p.grad, rtol=2e-2, atol=1e-4, msg=name)


def test_explicit_unscale_then_clip_unscales_only_once(tiny_bert):
    scaler = CountingScaler("cpu")
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True, loss_scaler=scaler)
    model, _ = accelerator.prepare(tiny_bert, torch.optim.SGD(tiny_bert.parameters(), lr=0.1))
    accelerator.backward(model(**bert_batch()).loss)
    accelerator.unscale_gradients()
    norm = accelerator.clip_grad_norm_(model.parameters(), 1e9)
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert scaler.unscale_calls == 1
    assert torch.isfinite(norm) and norm < 100  # an S-times-too-large norm would be ~65536x
    torch.testing.assert_close(norm, expected)


def test_clip_on_an_overflow_step_returns_inf_and_leaves_grads_unclipped(tiny_bert):
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True)
    model, _ = accelerator.prepare(tiny_bert, torch.optim.SGD(tiny_bert.parameters(), lr=0.1))
    accelerator.backward(model(**bert_batch()).loss)
    model.classifier.weight.grad[0, 0] = float("inf")
    norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
    assert norm.item() == float("inf")
    assert not torch.isnan(model.classifier.weight.grad).any()


def test_save_state_and_load_state_round_trip_the_full_scaler_state(tiny_bert, tmp_path):
    accelerator = AmpAccelerator(
        mixed_precision="fp16", cpu=True, loss_scaler={"hysteresis": 2, "growth_interval": 3}
    )
    model, optimizer = accelerator.prepare(
        tiny_bert, torch.optim.SGD(tiny_bert.parameters(), lr=0.01)
    )
    for inject in (False, True, False, True):
        accelerator.backward(model(**bert_batch()).loss)
        if inject:
            model.classifier.weight.grad[0, 0] = float("nan")
        optimizer.step()
        optimizer.zero_grad()
    saved = accelerator.loss_scaler.state_dict()
    accelerator.save_state(tmp_path)
    on_disk = torch.load(tmp_path / "scaler.pt", weights_only=True)
    assert on_disk == saved

    accelerator.loss_scaler.update(new_scale=2.0)
    accelerator.load_state(tmp_path)
    assert accelerator.loss_scaler.state_dict() == saved
    assert accelerator.loss_scaler.stats.skipped == 2


# --------------------------------------------------------------------------------------------
# DeepSpeed's own scaler
# --------------------------------------------------------------------------------------------
def test_deepspeed_fp16_config_defaults_are_dynamic_scaling_from_2_to_the_16():
    assert deepspeed_fp16_config() == {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 2000,
        "hysteresis": 1,
        "consecutive_hysteresis": False,
        "min_loss_scale": 1,
    }


def test_deepspeed_fp16_config_maps_our_knobs():
    config = deepspeed_fp16_config(
        init_scale=2.0**12,
        growth_interval=500,
        hysteresis=4,
        consecutive_hysteresis=True,
        min_scale=2.0,
        auto_cast=True,
    )
    assert config["initial_scale_power"] == 12
    assert config["loss_scale_window"] == 500
    assert config["hysteresis"] == 4
    assert config["consecutive_hysteresis"] is True
    assert config["min_loss_scale"] == 2 and isinstance(config["min_loss_scale"], int)
    assert config["auto_cast"] is True


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 1000.0}, "power of two.*1024"),
        ({"init_scale": 0.5}, ">= 1"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"min_scale": 0.0}, "min_scale"),
        ({"min_scale": 0.5}, "whole number.*integer"),
        ({"max_scale": 2.0**24}, "no upper bound"),
        ({"on_min_scale": "warn"}, "raises when it overflows"),
        ({"growth_factor": 4.0}, "only doubles and halves"),
        ({"loss_scale_window": 10}, "computes"),
    ],
)
def test_deepspeed_fp16_config_rejects_what_deepspeed_cannot_express(kwargs, message):
    with pytest.raises(ValueError, match=message):
        deepspeed_fp16_config(**kwargs)


# --------------------------------------------------------------------------------------------
# the example users copy
# --------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_accelerate_loop_example_runs_and_reports_loss_and_scale():
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "accelerate_loop.py"), "--steps", "4"],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loss scale" in result.stdout
    assert "skipped" in result.stdout

"""Unscale and clip in one pass: bit-identical to unscale-then-clip and to torch.

``DynamicLossScaler.clip_grad_norm_`` (and AmpAccelerator / AmpTrainer, which route through
it) reads the still-scaled gradients once for the norm and multiplies once by
``min(1, max_norm / norm) / S``. With a power-of-two S every step is exact, so parameters,
optimizer state and the returned norm must equal torch's GradScaler + clip_grad_norm_ + step bit
for bit, overflow steps included.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

from amp_trainer import AmpAccelerator, DynamicLossScaler

OVERFLOW_STEP = 3
STEPS = 6


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def _param_groups(model: nn.Module) -> list[dict]:
    """Three groups with different hyperparameters (biases, first weight, second weight)."""
    first, _, second = model
    return [
        {"params": [first.bias, second.bias], "weight_decay": 0.0},
        {"params": [first.weight], "lr": 2e-2},
        {"params": [second.weight], "lr": 5e-3, "weight_decay": 0.1},
    ]


OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9, foreach=False),
    "adamw-foreach": lambda groups: torch.optim.AdamW(groups, lr=1e-2, foreach=True),
    "adamw-fused": lambda groups: torch.optim.AdamW(groups, lr=1e-2, fused=True),
}


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    # Large inputs so that the gradient norm is well above max_norm: clipping really bites.
    return torch.randn(8, 16, generator=g) * 30, torch.randn(8, 4, generator=g)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    loss = ((model(x) - y) ** 2).mean()
    if step == OVERFLOW_STEP:
        loss = loss + model[2].bias.sum() * math.inf  # an inf gradient, as an FP16 overflow
    return loss


def _count_unscale_kernel(monkeypatch) -> list[int]:
    """Calls of torch's check-and-unscale kernel (the first of the two-pass path's passes)."""
    calls: list[int] = []
    kernel = torch._amp_foreach_non_finite_check_and_unscale_

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", counted)
    return calls


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_one_pass_matches_torch_gradscaler_clip_and_step_bit_for_bit(kind, monkeypatch):
    ours_model, torch_model = _model(), _model()
    ours_opt = OPTIMIZERS[kind](_param_groups(ours_model))
    torch_opt = OPTIMIZERS[kind](_param_groups(torch_model))
    kwargs = {"init_scale": 2.0**12, "growth_interval": 2}
    ours = DynamicLossScaler("cpu", **kwargs)
    reference = torch.amp.GradScaler("cpu", **kwargs)
    unscale_calls = _count_unscale_kernel(monkeypatch)

    for step in range(1, STEPS + 1):
        ours_opt.zero_grad()
        ours.scale(_loss(ours_model, step)).backward()
        ours_norm = ours.clip_grad_norm_(ours_opt, 1.0)
        ours.step(ours_opt)
        ours.update()

        torch_opt.zero_grad()
        reference.scale(_loss(torch_model, step)).backward()
        reference.unscale_(torch_opt)
        # The same parameters in the same order (the optimizer's): the norm's summation order.
        params = [p for group in torch_opt.param_groups for p in group["params"]]
        torch_norm = nn.utils.clip_grad_norm_(params, 1.0)
        reference.step(torch_opt)
        reference.update()

        assert ours.get_scale() == reference.get_scale()
        if step == OVERFLOW_STEP:
            assert ours_norm.item() == math.inf and ours.step_was_skipped
        else:
            assert torch_norm.item() > 1.0  # clipped
            assert torch.equal(ours_norm, torch_norm)
        for mine, theirs in zip(ours_model.parameters(), torch_model.parameters(), strict=True):
            assert torch.equal(mine, theirs)
            assert torch.equal(mine.grad, theirs.grad) or step == OVERFLOW_STEP
    for mine, theirs in zip(ours_opt.state.values(), torch_opt.state.values(), strict=True):
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    # one check-and-unscale pass for ours on the overflow step only (the two-pass path tells an
    # inf gradient from an overflowing norm); torch's reference runs it on all STEPS steps.
    assert len(unscale_calls) == STEPS + 1


def _scaled_grads(magnitudes: list[float], exponent: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=g) * m * 2.0**exponent for m in magnitudes]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    magnitudes=st.lists(st.floats(1e-6, 1e4), min_size=1, max_size=4),
    exponent=st.integers(-8, 40),
    max_norm=st.floats(1e-3, 1e3),
    norm_type=st.sampled_from([1.0, 2.0, math.inf]),
    seed=st.integers(0, 2**16),
)
def test_one_pass_equals_unscale_then_clip(magnitudes, exponent, max_norm, norm_type, seed):
    grads = _scaled_grads(magnitudes, exponent, seed)
    one = [nn.Parameter(torch.zeros(5, 3)) for _ in grads]
    two = [nn.Parameter(torch.zeros(5, 3)) for _ in grads]
    for a, b, grad in zip(one, two, grads, strict=True):
        a.grad, b.grad = grad.clone(), grad.clone()
    scaler_one = DynamicLossScaler("cpu", init_scale=2.0**exponent, min_scale=2.0**-8)
    scaler_two = copy.deepcopy(scaler_one)
    opt_one, opt_two = torch.optim.SGD(one, lr=1.0), torch.optim.SGD(two, lr=1.0)
    scaler_one.scale(torch.ones(()))  # a scale() call, as before a real backward
    scaler_two.scale(torch.ones(()))

    norm_one = scaler_one.clip_grad_norm_(opt_one, max_norm, norm_type)
    scaler_two.unscale_(opt_two)
    norm_two = nn.utils.clip_grad_norm_(two, max_norm, norm_type)

    assert torch.equal(norm_one, norm_two)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(one, two, strict=True))
    assert scaler_one.found_inf(opt_one) is False


def test_finite_gradients_whose_scaled_norm_overflows_are_clipped_not_skipped():
    # 1e30 * 2**16 is a finite float32, its square is not: the scaled norm is inf although no
    # gradient is. The step must still be taken, with the right (unscaled) norm.
    param = nn.Parameter(torch.zeros(4))
    reference = nn.Parameter(torch.zeros(4))
    param.grad = torch.full((4,), 1e30 * 2.0**16)
    reference.grad = torch.full((4,), 1e30)
    scaler = DynamicLossScaler("cpu")
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler.scale(torch.ones(()))

    norm = scaler.clip_grad_norm_(optimizer, 1.0)

    assert torch.equal(norm, nn.utils.clip_grad_norm_([reference], 1.0))
    assert torch.equal(param.grad, reference.grad)
    assert scaler.found_inf(optimizer) is False


@pytest.mark.parametrize("bad", [math.inf, math.nan])
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf])
def test_any_non_finite_gradient_is_an_overflow_for_every_norm(bad, norm_type):
    params = [nn.Parameter(torch.zeros(3)) for _ in range(2)]
    params[0].grad = torch.ones(3)
    params[1].grad = torch.tensor([1.0, bad, 1.0])
    scaler = DynamicLossScaler("cpu", init_scale=4.0)
    optimizer = torch.optim.SGD(params, lr=1.0)
    scaler.scale(torch.ones(()))

    assert scaler.clip_grad_norm_(optimizer, 1.0, norm_type).item() == math.inf
    scaler.step(optimizer)
    scaler.update()
    assert scaler.step_was_skipped and scaler.get_scale() == 2.0
    assert torch.equal(params[0].data, torch.zeros(3))


@pytest.mark.parametrize("init_scale", [1000.0, 2.0**16])
@pytest.mark.parametrize("norm_type", [3.0, 2.0])
def test_two_pass_path_where_one_pass_would_not_be_exact(init_scale, norm_type, monkeypatch):
    # A scale that is not a power of two, or a general p-norm (pow does not scale exactly), keeps
    # the unscale-then-clip path: the result is that path's by construction.
    calls = _count_unscale_kernel(monkeypatch)
    param, reference = nn.Parameter(torch.zeros(6)), nn.Parameter(torch.zeros(6))
    grad = torch.linspace(-3, 5, 6)
    param.grad, reference.grad = grad * init_scale, grad.clone()
    scaler = DynamicLossScaler("cpu", init_scale=init_scale)
    optimizer = torch.optim.SGD([param], lr=1.0)
    scaler.scale(torch.ones(()))

    norm = scaler.clip_grad_norm_(optimizer, 1.0, norm_type)

    expected = nn.utils.clip_grad_norm_([reference], 1.0, norm_type)
    exact = init_scale == 2.0**16 and norm_type == 2.0
    assert len(calls) == (0 if exact else 1)
    assert torch.allclose(norm, expected) and torch.allclose(param.grad, reference.grad)
    if exact:
        assert torch.equal(norm, expected) and torch.equal(param.grad, reference.grad)


def test_amp_accelerator_clips_in_one_pass_bit_identical_to_unscale_then_clip(monkeypatch):
    def run(one_pass: bool):
        from tests.helpers.training import reset_accelerate_state

        reset_accelerate_state()
        accelerator = AmpAccelerator(
            mixed_precision="fp16", cpu=True, loss_scaler={"init_scale": 2.0**8}
        )
        model = _model()
        optimizer = torch.optim.AdamW(_param_groups(model), lr=1e-2, fused=True)
        model, optimizer = accelerator.prepare(model, optimizer)
        norms = []
        for step in range(1, STEPS + 1):
            optimizer.zero_grad()
            accelerator.backward(_loss(model, step))
            if not one_pass:
                accelerator.unscale_gradients()  # then clip_grad_norm_ clips the unscaled grads
            norms.append(accelerator.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
        return model, norms, accelerator.loss_scaler.stats

    calls = _count_unscale_kernel(monkeypatch)
    one_model, one_norms, one_stats = run(one_pass=True)
    assert len(calls) == one_stats.skipped == 1  # the overflow step only
    two_model, two_norms, two_stats = run(one_pass=False)

    assert one_norms == two_norms and one_norms[OVERFLOW_STEP - 1] == math.inf
    assert one_stats == two_stats
    for a, b in zip(one_model.parameters(), two_model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_amp_trainer_clips_in_one_pass_bit_identical_to_the_two_pass_path(
    tmp_path, max_grad_norm, monkeypatch
):
    # max_grad_norm=0: stock Trainer still unscales and takes the norm (clip at inf) each step.
    import amp_trainer.trainer
    from amp_trainer import AmpTrainer
    from tests.helpers.tiny_models import make_tiny_bert
    from tests.helpers.training import (
        InjectOverflow,
        ToyClassification,
        reset_accelerate_state,
        tiny_training_args,
        train_logs,
    )

    def run(name):
        reset_accelerate_state()
        model = make_tiny_bert()
        trainer = AmpTrainer(
            model=model,
            args=tiny_training_args(
                tmp_path / name, max_steps=3, max_grad_norm=max_grad_norm, loss_scale_init=2.0**8
            ),
            train_dataset=ToyClassification(),
            callbacks=[InjectOverflow(model.classifier.weight, {2})],
        )
        trainer.train()
        return trainer

    # Transformers without Trainer._clip_grad_norm (5.0 among them) clip inline through
    # accelerator.clip_grad_norm_(model.parameters()): parameters in model order, not the
    # optimizer's, so the exact one-pass fold does not apply and every attempt unscales in two
    # passes (4 kernels in 4 attempts: 3 steps and the skipped one). The results must be the
    # same either way.
    from transformers import Trainer

    one_pass = 1 if hasattr(Trainer, "_clip_grad_norm") else 4
    calls = _count_unscale_kernel(monkeypatch)
    one = run("one-pass")
    assert one.loss_scaler.stats.skipped == 1
    assert len(calls) == one_pass  # with the hook: the overflow step only
    monkeypatch.setattr(amp_trainer.trainer, "clip_grad_norm_in_one_pass", lambda *a, **k: None)
    two = run("two-pass")
    assert len(calls) == one_pass + 4

    drop = ("epoch",)
    assert [{k: v for k, v in e.items() if k not in drop} for e in train_logs(one)] == [
        {k: v for k, v in e.items() if k not in drop} for e in train_logs(two)
    ]
    assert [e["step_skipped"] for e in train_logs(one)] == [0, 1, 0]  # no log at the overflow
    for a, b in zip(one.model.parameters(), two.model.parameters(), strict=True):
        assert torch.equal(a, b)

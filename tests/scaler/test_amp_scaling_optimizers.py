"""torch's ``_step_supports_amp_scaling`` contract: an optimizer that unscales and skips itself is
handed ``grad_scale`` and ``found_inf`` and stepped on every iteration, as torch's ``GradScaler``
does (the contract torch's ``test_grad_scaler_pass_itself`` checks). Compared with torch's
scaler on the same optimizer and the same injected overflow; torch's own fused AdamW stays on the
usual path."""

from __future__ import annotations

import pytest
import torch

from amp_trainer import AmpAccelerator, DynamicLossScaler

OVERFLOW_AT = 1  # the second of three iterations


class SelfSkippingSGD(torch.optim.Optimizer):
    """An SGD that follows the contract: it unscales with ``grad_scale`` (``None``: already
    unscaled), skips when ``found_inf`` is set and counts its calls and skips itself."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})
        self._step_supports_amp_scaling = True
        self.calls, self.skips, self.seen = 0, 0, []

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        grad_scale, found_inf = self.grad_scale, self.found_inf
        self.seen.append((grad_scale is None, float(found_inf)))
        if float(found_inf):
            self.skips += 1
            return None
        for group in self.param_groups:
            for p in group["params"]:
                grad = p.grad if grad_scale is None else p.grad / grad_scale
                p.add_(grad, alpha=-group["lr"])
        return None


def run(scaler_factory):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = SelfSkippingSGD(model.parameters())
    scaler = scaler_factory()
    scales = []
    for step in range(3):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(16, 8)).float().pow(2).mean()
        scaler.scale(loss).backward()
        if step == OVERFLOW_AT:
            model.weight.grad[0, 0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler.get_scale())
        optimizer.zero_grad()
        assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
    return model, optimizer, scales


def test_an_optimizer_that_skips_itself_is_stepped_every_iteration_and_ends_as_with_torch():
    ours_model, ours, ours_scales = run(lambda: DynamicLossScaler("cpu", init_scale=2.0**10))
    torch_model, theirs, torch_scales = run(lambda: torch.amp.GradScaler("cpu", init_scale=2.0**10))
    assert ours.calls == theirs.calls == 3 and ours.skips == theirs.skips == 1
    assert [inf for _, inf in ours.seen] == [inf for _, inf in theirs.seen] == [0.0, 1.0, 0.0]
    # torch hands the still-scaled gradients with their scale; ours unscales first (None).
    assert all(unscaled for unscaled, _ in ours.seen)
    assert not any(unscaled for unscaled, _ in theirs.seen)
    assert ours_scales == torch_scales == [2.0**10, 2.0**9, 2.0**9]
    for a, b in zip(ours_model.parameters(), torch_model.parameters()):
        assert torch.equal(a, b)  # power-of-two scales: unscaling either way is exact


def test_under_accelerate_the_self_skipped_step_is_still_a_skip_and_the_lr_holds(
    fresh_accelerate_state,
):
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = SelfSkippingSGD(model.parameters())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    skipped, lrs = [], []
    for step in range(3):
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
        accelerator.backward(loss)
        if step == OVERFLOW_AT:
            accelerator.unwrap_model(model).weight.grad[0, 0] = float("inf")
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
        lrs.append(scheduler.get_last_lr()[0])
    raw = optimizer.optimizer
    assert raw.calls == 3 and raw.skips == 1  # called on the overflow too, as it asks
    assert skipped == [False, True, False]
    assert lrs == [0.05, 0.05, 0.025]  # held on the skip


def test_torchs_own_fused_adamw_stays_on_the_usual_path_not_stepped_on_overflow():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), fused=True)
    assert optimizer._step_supports_amp_scaling
    scaler = DynamicLossScaler("cpu")
    calls = []
    original = optimizer.step
    optimizer.step = lambda *a, **k: calls.append(1) or original(*a, **k)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(16, 8)).float().pow(2).mean()
    scaler.scale(loss).backward()
    model.weight.grad[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    assert calls == [] and scaler.step_was_skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not optimizer.state  # no moment, no step counter created


@pytest.mark.parametrize("closure_as", ["positional", "keyword"])
def test_a_closure_is_still_refused(closure_as):
    model = torch.nn.Linear(2, 1)
    optimizer = SelfSkippingSGD(model.parameters())
    scaler = DynamicLossScaler("cpu")
    scaler.scale(model(torch.ones(1, 2)).sum()).backward()
    args, kwargs = ((lambda: 0.0,), {}) if closure_as == "positional" else ((), {"closure": 1})
    with pytest.raises(RuntimeError, match="step\\(\\) with a closure is not supported"):
        scaler.step(optimizer, *args, **kwargs)

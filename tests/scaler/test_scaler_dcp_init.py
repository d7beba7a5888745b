"""torch.distributed.checkpoint's dummy optimizer step goes through our scaler harmlessly.

Loading an optimizer with ``torch.distributed.checkpoint`` (Accelerate's FSDP2 ``load_state``)
first creates the optimizer state with one ``optimizer.step()`` on all-zero gradients and lr 0
(``_init_optim_state``). Through an ``AcceleratedOptimizer`` that step is ``scaler.step()`` then
``scaler.update()`` with no ``scale()`` call before it. our "scale() was not
called" guard raised there, killing every FSDP2 resume; torch's GradScaler does not raise but
counts the dummy step as a clean one (its growth tracker moves, and with ``growth_interval=1`` the
scale doubles: huggingface/accelerate#4289). Ours must do neither.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    _init_optim_state,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from amp_trainer import AmpAccelerator, DynamicLossScaler
from tests.helpers.tiny_models import make_tiny_bert


def _prepared(growth_interval: int = 1):
    accelerator = AmpAccelerator(
        mixed_precision="fp16",
        cpu=True,
        loss_scaler={"init_scale": 1024.0, "growth_interval": growth_interval},
    )
    model = make_tiny_bert(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def _batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 128, (4, 8), generator=g),
        "labels": torch.tensor([0, 1, 0, 1]),
    }


def _params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in model.parameters()])


def test_dcp_init_optim_state_through_accelerated_optimizer_leaves_scaler_untouched():
    accelerator, model, optimizer = _prepared()
    scaler = accelerator.loss_scaler
    state, stats, before = scaler.state_dict(), scaler.stats, _params(model)

    _init_optim_state(optimizer)  # what DCP's set_optimizer_state_dict runs first

    assert optimizer.optimizer.state  # the optimizer state now exists ...
    assert scaler.state_dict() == state and scaler.stats == stats  # ... the scaler's is unchanged
    assert torch.equal(_params(model), before)  # lr 0: nothing moved
    assert all(p.grad is None for p in model.parameters())


def test_training_after_the_dummy_step_is_counted_as_usual():
    accelerator, model, optimizer = _prepared()
    scaler = accelerator.loss_scaler
    _init_optim_state(optimizer)

    accelerator.backward(model(**_batch(0)).loss)
    optimizer.step()
    optimizer.zero_grad()

    assert scaler.stats.steps == 1 and scaler.get_scale() == 2048.0  # growth_interval=1
    assert not accelerator.optimizer_step_was_skipped


def test_resume_through_dcp_set_optimizer_state_dict_keeps_the_scaler_state():
    # The source run: two real steps, then its optimizer state as DCP hands it over.
    accelerator, model, optimizer = _prepared(growth_interval=100)
    for seed in range(2):
        accelerator.backward(model(**_batch(seed)).loss)
        optimizer.step()
        optimizer.zero_grad()
    saved_optim = get_optimizer_state_dict(model, optimizer.optimizer)
    saved_scaler = accelerator.loss_scaler.state_dict()

    resumed, model2, optimizer2 = _prepared(growth_interval=100)
    resumed.loss_scaler.load_state_dict(saved_scaler)
    set_optimizer_state_dict(model2, optimizer2, saved_optim)  # runs _init_optim_state first

    assert resumed.loss_scaler.state_dict() == saved_scaler
    assert int(optimizer2.optimizer.state_dict()["state"][0]["step"]) == 2


def test_torch_grad_scaler_counts_the_dummy_step_ours_does_not():
    model = make_tiny_bert(seed=0)
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    ours = DynamicLossScaler("cpu", init_scale=1024.0, growth_interval=1)
    for scaler in (theirs, ours):
        # Accelerate's FSDP2 load_state calls this right after loading the scaler's state, before
        # the optimizer's; torch's scaler refuses step() without it (its scale tensor is lazy).
        scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        scaler.step(optimizer)  # AcceleratedOptimizer.step's two calls, no scale() before
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    assert theirs.get_scale() == 2048.0  # torch: the dummy step grew the scale
    assert ours.get_scale() == 1024.0 and ours.stats.steps == 0


def test_unscaled_nonzero_gradients_are_still_refused():
    # The exemption is for all-zero gradients only: those are the same scaled or not.
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=1024.0)
    model(torch.ones(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"scaler\.scale\(\) was not called"):
        scaler.step(optimizer)

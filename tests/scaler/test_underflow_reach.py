"""The meter's blind spot: gradient FP16 flushes at every usable loss scale is zero at both
of the meter's scales, so the flushed share cannot see it. The probe past the first overflowing
scale does: those elements are named, and no loss scale is offered as their fix. And a capped
headroom never promises a doubling that overflows."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from amp_trainer import DynamicLossScaler, keep_in_fp32
from amp_trainer.scale_policy import UNDERFLOW_TARGET
from amp_trainer.underflow import measure_underflow
from tests.helpers.tiny_models import TwoBranchNet, two_branch_batch

WEAK = ("weak.0.weight", "weak.0.bias", "weak.2.weight", "weak.2.bias")


def _fp16_loss(model: nn.Module, batch) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        return model(**batch)["loss"]


def _fp32_flushed_share(model: nn.Module, batch, scale: float) -> float:
    """The FP32 reference: elements nonzero in an FP32 backward that the FP16 backward at
    ``scale`` leaves exactly zero."""
    params = list(model.parameters())
    fp32 = torch.autograd.grad(model(**batch)["loss"], params)
    fp16 = torch.autograd.grad(_fp16_loss(model, batch) * scale, params)
    nonzero = sum(int((g != 0).sum()) for g in fp32)
    return sum(int(((a != 0) & (b == 0)).sum()) for a, b in zip(fp32, fp16)) / nonzero


def test_a_branch_below_fp16_at_every_usable_scale_is_named_and_not_fixable():
    model, batch = TwoBranchNet(weak_factor=1e-9), two_branch_batch()
    reading = measure_underflow(_fp16_loss(model, batch), model, 1.0)
    # The provocation is real: even at the highest scale that does not overflow, an FP32
    # backward finds half the gradient nonzero that FP16 flushes; the scale one doubling
    # higher overflows.
    truth = _fp32_flushed_share(model, batch, reading.reference_scale)
    assert truth == pytest.approx(0.5, abs=0.02)
    params = list(model.parameters())
    above = torch.autograd.grad(_fp16_loss(model, batch) * 2 * reading.reference_scale, params)
    assert not all(bool(torch.isfinite(g).all()) for g in above)
    # The flushed share cannot see it (zero at both of its scales) ...
    assert reading.underflow <= UNDERFLOW_TARGET
    # ... the probe does, names the weak head's parameters and nothing else, and says no
    # scale fixes it.
    assert reading.unreachable == pytest.approx(truth, abs=0.02)
    assert set(reading.unreachable_params) == set(WEAK)
    assert reading.fixable is False


def test_plain_underflow_is_fixable_and_nothing_is_unreachable():
    """A weak head at 1e-4 is flushed at scale 1 but within FP16's range at a higher one."""
    model, batch = TwoBranchNet(weak_factor=1e-4), two_branch_batch()
    reading = measure_underflow(_fp16_loss(model, batch), model, 1.0)
    assert reading.underflow > UNDERFLOW_TARGET
    assert reading.fixable is True and reading.fixing_scale > 1.0
    assert reading.unreachable == 0.0 and reading.unreachable_params == ()


def test_a_healthy_model_reads_nothing_flushed_and_nothing_unreachable():
    model, batch = TwoBranchNet(weak_factor=1.0), two_branch_batch()
    reading = measure_underflow(_fp16_loss(model, batch), model, 1.0)
    assert reading.underflow == 0.0 and reading.unreachable == 0.0
    assert reading.fixable is True


def test_the_modules_owning_the_unreachable_gradient_kept_in_fp32_read_none():
    model, batch = TwoBranchNet(weak_factor=1e-9), two_branch_batch()
    modules = sorted({name.rpartition(".")[0] for name in WEAK})
    keep_in_fp32(model, modules)
    reading = measure_underflow(_fp16_loss(model, batch), model, 1.0)
    # Their gradient is computed in FP32 now: nonzero at every scale, nothing flushed.
    assert reading.unreachable == 0.0 and reading.underflow == 0.0


def test_the_two_sided_rule_does_not_chase_what_no_scale_can_fix(caplog):
    model, batch = TwoBranchNet(weak_factor=1e-9), two_branch_batch()
    scaler = DynamicLossScaler("cpu", init_scale=1.0, grow_on_underflow=True)
    reading = scaler.check_underflow(_fp16_loss(model, batch), model)
    assert reading.unreachable > 0.4 and reading.fixable is False
    assert scaler.get_scale() == 1.0 and scaler.stats.underflow_growths == 0
    assert scaler.stats.grad_unreachable == reading.unreachable
    assert set(scaler.stats.unreachable_params) == set(WEAK)


def _activation_capped():
    """Two bias-free 4x4 linears whose hidden activation's gradient is 8x the largest
    parameter gradient: the parameters promise 39.99 doublings of headroom at scale 1, the
    activation gradient overflows from 2**37 on."""
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[1].weight.fill_(2.0)
    features = torch.full((1, 4), 0.125)
    with torch.autocast("cpu", dtype=torch.float16):
        # d loss / d output = 2**-24 (FP16's smallest subnormal), the hidden one 2**-21.
        loss = model(features).float().sum() * 2.0**-24
    return model, loss


def _finite_at(loss: torch.Tensor, model: nn.Module, scale: float) -> bool:
    grads = torch.autograd.grad(loss * scale, list(model.parameters()), retain_graph=True)
    return all(bool(torch.isfinite(g).all()) for g in grads)


def test_a_capped_headroom_never_promises_a_doubling_that_overflows():
    model, loss = _activation_capped()
    reading = measure_underflow(loss, model, 1.0)
    assert not _finite_at(loss, model, 2.0**38)  # one doubling under the first overflow
    assert reading.headroom != 38.0
    # Exact in whole doublings: the headroom's floor is finite, one more doubling is not.
    doublings = math.floor(reading.headroom)
    assert _finite_at(loss, model, 2.0**doublings)
    assert not _finite_at(loss, model, 2.0 ** (doublings + 1))
    assert reading.headroom == 36.0

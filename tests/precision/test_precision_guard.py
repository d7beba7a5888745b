"""The precision guard: every dtype drift is flagged before the step that would lose precision.

Each case is provoked for real on a real model and optimizer (a ``.half()`` in the middle of a
run, an optimizer moment cast to FP16, an island removed, FP16 autocast without a scaler, a
scaler without FP16 autocast), in plain loops through ``DynamicLossScaler.watch(model)`` and
``PrecisionGuard``, and in ``AmpTrainer`` through a user's callback. Clean runs see no drift and
are bit-identical with the guard off.
"""

from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
from torch import nn
from transformers import TrainerCallback

from amp_trainer import AmpTrainer, AmpTrainingArguments, DynamicLossScaler, PrecisionDriftError
from amp_trainer.islands import keep_norms_in_fp32, remove_fp32_island
from amp_trainer.precision_guard import PrecisionGuard
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import ToyClassification, reset_accelerate_state, tiny_training_args

FP16 = dict(device_type="cpu", dtype=torch.float16)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), nn.Linear(16, 2))


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=generator), torch.randint(0, 2, (4,), generator=generator)


def _fp16_loop(model, steps: int, *, between=None, guard_mode: str | None = None):
    """A plain fp16 loop; ``between(step, model)`` runs after each step's update."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**8).watch(model)
    if guard_mode is not None:
        scaler.precision_guard.close()
        scaler.precision_guard = PrecisionGuard(model, mode=guard_mode, scaler=scaler)
    for step in range(steps):
        x, y = _batch(step)
        with torch.autocast(**FP16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if between is not None:
            between(step, model)
    scaler.precision_guard and scaler.precision_guard.close()
    return optimizer, scaler


def _weights(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _bitwise_equal(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_half_in_the_middle_of_a_plain_fp16_loop_raises_naming_the_tensors_and_the_call_site():
    model = _model()

    def cast_at_step_1(step, model):
        if step == 1:
            model.half()  # the line the error must name

    with pytest.raises(PrecisionDriftError) as caught:
        _fp16_loop(model, 4, between=cast_at_step_1)
    message = str(caught.value)
    assert "master weights" in message and "float16, expected float32" in message
    assert "0.weight" in message and "3.bias" in message
    assert f"{__file__}:" in message and "in cast_at_step_1" in message
    assert caught.value.drifts[0].kind == "master weights"


def test_repair_puts_the_fp32_master_weights_back_exactly_and_the_run_matches_a_clean_one(caplog):
    clean = _model()
    _fp16_loop(clean, 4)
    repaired = _model()
    with caplog.at_level(logging.WARNING, logger="amp_trainer.precision_guard"):
        _fp16_loop(repaired, 4, between=lambda s, m: s == 1 and m.half(), guard_mode="repair")
    assert all(p.dtype == torch.float32 for p in repaired.parameters())
    assert _bitwise_equal(_weights(clean), _weights(repaired))
    assert any("kept and are back bit for bit" in r.getMessage() for r in caplog.records)


def test_a_cast_under_no_grad_for_a_quick_evaluation_is_undone_bit_for_bit_without_an_error(
    caplog,
):
    def evaluate_in_half(step, model):
        if step == 2:
            return  # the last step: nothing trains after it to need the FP32 values back
        with torch.no_grad():
            model.half()
            model(_batch(99)[0].half())

    clean = _model()
    _fp16_loop(clean, 3)
    evaluated = _model()
    with caplog.at_level(logging.WARNING, logger="amp_trainer.precision_guard"):
        _fp16_loop(evaluated, 3, between=evaluate_in_half)  # mode "raise"
    assert _bitwise_equal(_weights(clean), _weights(evaluated))
    said = [r.getMessage() for r in caplog.records]
    assert any("in evaluate_in_half" in m and "under torch.no_grad()" in m for m in said)


def test_a_data_assignment_to_bf16_is_flagged_at_the_next_step_with_the_parameter_named():
    def assign(step, model):
        if step == 0:
            model[3].weight.data = model[3].weight.data.bfloat16()

    with pytest.raises(PrecisionDriftError, match=r"3\.weight.*bfloat16, expected float32"):
        _fp16_loop(_model(), 3, between=assign)


def test_an_optimizer_moment_cast_to_fp16_is_flagged_and_repair_casts_it_back():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    guard = PrecisionGuard(model).watch_optimizer(optimizer)
    for step in range(3):
        x, y = _batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        if step == 2:
            state = optimizer.state[model[0].weight]
            state["exp_avg"] = state["exp_avg"].half()
            with pytest.raises(PrecisionDriftError, match=r"optimizer state.*0\.weight:exp_avg"):
                optimizer.step()
            guard.mode = "repair"
        optimizer.step()
        optimizer.zero_grad()
    assert optimizer.state[model[0].weight]["exp_avg"].dtype == torch.float32
    guard.close()


def test_an_fp32_island_removed_mid_run_is_flagged_and_repair_makes_it_an_island_again():
    model = _model()
    assert keep_norms_in_fp32(model) == ["1"]

    def remove(step, model):
        if step == 0:
            remove_fp32_island(model[1])

    with pytest.raises(
        PrecisionDriftError, match=r"1 FP32 island\(s\) 1 no longer compute in FP32"
    ):
        _fp16_loop(model, 2, between=remove)
    model = _model()
    keep_norms_in_fp32(model)
    _fp16_loop(model, 3, between=remove, guard_mode="repair")
    from amp_trainer.islands import is_fp32_island

    assert is_fp32_island(model[1])


def test_fp16_autocast_with_no_loss_scaler_is_flagged_at_the_first_step():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = PrecisionGuard(model).watch_optimizer(optimizer)  # no scaler: nothing unscales
    x, y = _batch(0)
    with torch.autocast(**FP16):
        nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(PrecisionDriftError, match="FP16 with no loss scaler"):
        optimizer.step()
    guard.close()


def test_a_loss_scaler_with_no_fp16_forward_is_flagged_at_the_first_step():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu").watch(model)
    x, y = _batch(0)
    scaler.scale(nn.functional.cross_entropy(model(x), y)).backward()  # no autocast
    with pytest.raises(PrecisionDriftError, match="not FP16 \\(autocast off\\)"):
        scaler.step(optimizer)
    scaler.precision_guard.close()


def test_a_clean_loop_sees_no_drift_and_is_bit_identical_with_the_guard_off():
    guarded, unguarded = _model(), _model()
    _fp16_loop(guarded, 4, guard_mode="raise")
    _fp16_loop(unguarded, 4, guard_mode="off")
    assert _bitwise_equal(_weights(guarded), _weights(unguarded))


def test_off_installs_nothing_and_the_last_guard_closed_puts_torchs_apply_back():
    from amp_trainer.precision_guard.tracking import TRACKER as _TRACKER

    for left_open in list(_TRACKER.guards):  # by the tests above that raised mid-loop
        left_open.close()
    torch_apply = nn.Module._apply
    assert torch_apply.__module__ == "torch.nn.modules.module"
    model = _model()
    off = PrecisionGuard(model, mode="off")
    assert nn.Module._apply is torch_apply and off.closed
    on = PrecisionGuard(model)
    assert nn.Module._apply is not torch_apply
    on.close()
    assert nn.Module._apply is torch_apply
    assert not any(model[0]._forward_pre_hooks.values())


def test_a_guarded_model_still_pickles_and_deep_copies():
    model = _model()
    guard = PrecisionGuard(model)
    clone = copy.deepcopy(model)
    unpickled = pickle.loads(pickle.dumps(model))
    for other in (clone, unpickled):
        other.train()
        other(_batch(0)[0])  # its hook does nothing: the guard watches the original only
    guard.close()


def test_a_bad_mode_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"precision_guard must be one of .*'repair'.*'bogus'"):
        PrecisionGuard(_model(), mode="bogus")
    with pytest.raises(ValueError, match="precision_guard must be one of"):
        AmpTrainingArguments(output_dir="/tmp/unused", use_cpu=True, precision_guard="bogus")


class _HalfForAQuickEval(TrainerCallback):
    """A user's callback that casts the model for a quick look and forgets to cast it back."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            model.half()


def _trainer(tmp_path, mode: str, callbacks=()):
    reset_accelerate_state()
    args = tiny_training_args(tmp_path, precision_guard=mode, seed=0)
    return AmpTrainer(
        model=make_tiny_bert(seed=0),
        args=args,
        train_dataset=ToyClassification(32),
        callbacks=list(callbacks),
    )


def test_amp_trainer_raises_at_the_step_after_a_callbacks_half_naming_the_callback(tmp_path):
    trainer = _trainer(tmp_path, "raise", [_HalfForAQuickEval()])
    with pytest.raises(PrecisionDriftError) as caught:
        trainer.train()
    assert "in on_step_end" in str(caught.value) and f"{__file__}:" in str(caught.value)
    assert trainer.state.global_step == 2  # the third update never ran


def test_amp_trainer_repairs_a_callbacks_half_and_trains_on_with_fp32_master_weights(tmp_path):
    repaired = _trainer(tmp_path / "repaired", "repair", [_HalfForAQuickEval()])
    repaired.train()
    clean = _trainer(tmp_path / "clean", "raise")
    clean.train()
    assert repaired.state.global_step == 4
    assert all(p.dtype == torch.float32 for p in repaired.model.parameters() if p.requires_grad)
    assert _bitwise_equal(_weights(clean.model), _weights(repaired.model))
    assert clean.precision_guard.drifts_seen == []


def test_a_clean_amp_trainer_run_is_bit_identical_with_the_guard_off(tmp_path):
    guarded = _trainer(tmp_path / "on", "raise")
    guarded.train()
    unguarded = _trainer(tmp_path / "off", "off")
    unguarded.train()
    assert unguarded.precision_guard is None and guarded.precision_guard.drifts_seen == []
    assert _bitwise_equal(_weights(guarded.model), _weights(unguarded.model))


def test_an_fp16_step_is_checked_once_before_unscaling_not_again_by_the_step_hook():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**8).watch(model)
    guard, checks = scaler.precision_guard, []
    original = guard.check
    guard.check = lambda opt=None: checks.append(opt) or original(opt)
    for step in range(3):
        x, y = _batch(step)
        with torch.autocast(**FP16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    assert checks == [optimizer] * 3
    optimizer.step()  # a step the scaler did not check first: the step hook checks it
    assert len(checks) == 4
    guard.close()


def test_amp_trainer_closes_its_guard_when_train_returns(tmp_path):
    from amp_trainer.precision_guard.tracking import TRACKER, ForwardWatch

    trainer = _trainer(tmp_path, "raise")
    trainer.train()
    guard = trainer.precision_guard
    assert guard.closed and guard.drifts_seen == []
    assert guard not in set(TRACKER.guards)
    hooks = [h for m in trainer.model.modules() for h in m._forward_pre_hooks.values()]
    assert not any(isinstance(h, ForwardWatch) for h in hooks)
    trainer.model.half()  # for inference: no FP32 copy kept behind the user's back
    assert guard._casts == {}

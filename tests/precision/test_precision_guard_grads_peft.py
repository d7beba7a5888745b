"""The precision guard's matrix, continued: FP16 gradients at the optimizer and PEFT adapters.

Every case is provoked for real, by a route user code takes: a post-accumulate-grad hook that
rebinds ``grad.data`` to FP16 (autograd's own dtype check never sees it), a parameter whose
``grad_dtype`` was set to FP16 (torch >= 2.10 then accumulates in it), a ``TrainerCallback``
that does the same before the optimizer step, a ``modules_to_save`` copy cast to FP16 by a
callback, a LoRA weight replaced with FP16 values read back from an FP16 save. Each is flagged
before the step it would poison, with the tensor named; the drift is raised mid-run, after clean
steps, because the guard's fast path compares against the last clean step.
"""

from __future__ import annotations

import logging

import pytest
import torch
from peft import LoraConfig, TaskType, get_peft_model
from torch import nn
from transformers import TrainerCallback

from amp_trainer import AmpTrainer, DynamicLossScaler, PrecisionDriftError
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


def _fp16_loop(model, steps: int, *, before_step=None, guard_mode: str = "raise"):
    """A plain FP16 loop through ``DynamicLossScaler.watch(model)``; ``before_step(step,
    model)`` runs between backward and ``scaler.step``. Returns the optimizer steps taken."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**8).watch(model)
    if guard_mode != "raise":
        scaler.precision_guard.close()
        scaler.precision_guard = PrecisionGuard(model, mode=guard_mode, scaler=scaler)
    taken = []
    try:
        for step in range(steps):
            x, y = _batch(step)
            with torch.autocast(**FP16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if before_step is not None:
                before_step(step, model)
            scaler.step(optimizer)
            scaler.update()
            taken.append(step)
            optimizer.zero_grad(set_to_none=True)
    finally:
        scaler.precision_guard.close()
    return taken, optimizer


def _half_grad_hook(param: torch.Tensor) -> None:
    """A user's post-accumulate hook that "saves memory" by keeping the gradient in FP16."""
    param.grad.data = param.grad.data.half()


# -- gradients reaching the optimizer in FP16 --------------------------------------------------
def test_an_fp16_gradient_from_a_users_hook_mid_run_is_flagged_before_that_step_naming_it():
    model = _model()
    taken: list[int] = []

    def hook_from_step_2(step, model):
        taken.append(step)
        if step == 2:
            assert model[3].weight.grad.dtype == torch.float32
            model[3].weight.grad.data = model[3].weight.grad.data.half()

    with pytest.raises(PrecisionDriftError) as caught:
        _fp16_loop(model, 4, before_step=hook_from_step_2)
    assert taken == [0, 1, 2]  # steps 0 and 1 were clean: the fast path is in use at step 2
    message = str(caught.value)
    assert "gradients of 1 tensor(s) 3.weight is float16, expected float32" in message
    assert caught.value.drifts[0].kind == "gradients"
    assert caught.value.drifts[0].tensors == ("3.weight",)


def test_a_post_accumulate_grad_hook_casting_to_fp16_is_flagged_in_a_plain_guarded_loop():
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = PrecisionGuard(model).watch_optimizer(optimizer)
    for step in range(3):
        if step == 2:  # attached mid-run, as a memory-saving trick would be
            model[0].bias.register_post_accumulate_grad_hook(_half_grad_hook)
        x, y = _batch(step)
        nn.functional.cross_entropy(model(x), y).backward()
        if step == 2:
            before = model[0].bias.detach().clone()
            with pytest.raises(PrecisionDriftError, match=r"gradients .* 0\.bias is float16"):
                optimizer.step()
            assert torch.equal(model[0].bias, before)  # the step never ran
        else:
            optimizer.step()
        optimizer.zero_grad()
    guard.close()


def test_repair_casts_an_fp16_gradient_back_to_fp32_and_the_step_uses_it(caplog):
    model = _model()

    def half_grad_at_step_1(step, model):
        if step == 1:
            model[3].weight.grad.data = model[3].weight.grad.data.half()

    with caplog.at_level(logging.WARNING, logger="amp_trainer.precision_guard"):
        taken, optimizer = _fp16_loop(
            model, 3, before_step=half_grad_at_step_1, guard_mode="repair"
        )
    assert taken == [0, 1, 2]
    assert all(p.dtype == torch.float32 for p in model.parameters())
    state = optimizer.state[model[3].weight]
    assert state["exp_avg"].dtype == torch.float32 and int(state["step"]) == 3
    said = [r.getMessage() for r in caplog.records]
    assert any("gradients of 1 tensor(s) 3.weight" in m for m in said)
    assert any("Repaired: master weights and gradients" in m for m in said)


def test_a_grad_dtype_set_to_fp16_is_flagged_and_repair_puts_the_parameters_grad_dtype_back(
    caplog,
):
    def fp16_grad_dtype_at_step_1(step, model):
        if step == 1:
            # torch >= 2.10: gradients accumulate in grad_dtype; the next ones are FP16 too
            grad = model[0].weight.grad
            model[0].weight.grad = None
            model[0].weight.grad_dtype = torch.float16
            model[0].weight.grad = grad.half()

    with pytest.raises(PrecisionDriftError, match=r"gradients .* 0\.weight is float16"):
        _fp16_loop(_model(), 3, before_step=fp16_grad_dtype_at_step_1)

    model = _model()
    with caplog.at_level(logging.WARNING, logger="amp_trainer.precision_guard"):
        taken, _ = _fp16_loop(model, 3, before_step=fp16_grad_dtype_at_step_1, guard_mode="repair")
    assert taken == [0, 1, 2]
    assert model[0].weight.grad_dtype == torch.float32  # the next backward is FP32 again
    assert any("grad_dtype" in r.getMessage() for r in caplog.records)


class _HalfGradientsBeforeTheStep(TrainerCallback):
    """A user's callback that casts the classifier's gradient to FP16 before the update."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if state.global_step == self.at_step:
            weight = model.classifier.weight
            weight.grad.data = weight.grad.data.half()


def test_amp_trainer_raises_at_the_step_where_a_callback_makes_a_gradient_fp16(tmp_path):
    reset_accelerate_state()
    trainer = AmpTrainer(
        model=make_tiny_bert(seed=0),
        args=tiny_training_args(tmp_path, precision_guard="raise", seed=0),
        train_dataset=ToyClassification(32),
        callbacks=[_HalfGradientsBeforeTheStep(at_step=2)],
    )
    with pytest.raises(PrecisionDriftError) as caught:
        trainer.train()
    assert "gradients of 1 tensor(s) classifier.weight is float16" in str(caught.value)
    assert trainer.state.global_step == 2  # the third update never ran


# -- PEFT: LoRA adapters and modules_to_save ---------------------------------------------------
def _lora_seq_cls(base_half: bool) -> nn.Module:
    base = make_tiny_bert(seed=0)
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["query", "value"])
    return get_peft_model(base.half() if base_half else base, config)


def _peft_trainer(tmp_path, model, callbacks=(), mode="raise") -> AmpTrainer:
    reset_accelerate_state()
    return AmpTrainer(
        model=model,
        args=tiny_training_args(tmp_path, precision_guard=mode, seed=0),
        train_dataset=ToyClassification(32),
        callbacks=list(callbacks),
    )


class _ModulesToSaveInHalf(TrainerCallback):
    """A user's callback that casts the ``modules_to_save`` copy to FP16 (to match an FP16
    base for a quick look) and leaves it there."""

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if state.global_step == 2:
            model.base_model.model.classifier.modules_to_save["default"].half()


def test_an_fp16_base_with_fp32_adapters_at_the_start_is_no_drift(tmp_path):
    model = _lora_seq_cls(base_half=True)
    trainer = _peft_trainer(tmp_path, model)
    trainer.train()
    guard = trainer.precision_guard
    assert guard.drifts_seen == [] and trainer.state.global_step == 4
    trainable = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert any("modules_to_save" in n for n in trainable) and any("lora_A" in n for n in trainable)
    assert set(trainable.values()) == {torch.float32}
    frozen = {p.dtype for n, p in model.named_parameters() if "LayerNorm" not in n}
    assert torch.float16 in frozen  # the base stays as loaded (its norms are FP32 islands)
    assert {
        p.dtype for n, p in model.named_parameters() if not p.requires_grad and "LayerNorm" not in n
    } == {torch.float16}


def test_a_modules_to_save_copy_cast_to_fp16_mid_run_is_flagged_naming_it_and_the_callback(
    tmp_path,
):
    trainer = _peft_trainer(tmp_path, _lora_seq_cls(base_half=True), [_ModulesToSaveInHalf()])
    with pytest.raises(PrecisionDriftError) as caught:
        trainer.train()
    message = str(caught.value)
    assert "classifier.modules_to_save.default.weight" in message
    assert "float16, expected float32" in message
    assert "in on_step_end" in message and f"{__file__}:" in message
    assert trainer.state.global_step == 2


def test_a_lora_weight_reloaded_from_an_fp16_save_mid_run_is_flagged_naming_it():
    """A user "restores" the adapter from an FP16 export into the live model by assigning
    ``.data`` (what a hand-rolled loader does); the optimizer keeps updating FP16 values."""
    model = _lora_seq_cls(base_half=False)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    lora_a = next(n for n in names if "lora_A" in n)
    saved_fp16 = {n: p.detach().half() for n, p in model.named_parameters() if n in names}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scaler = DynamicLossScaler("cpu", init_scale=2.0**8).watch(model)
    labels = torch.tensor([0, 1, 0, 1])
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(0))
    try:
        for step in range(3):
            if step == 2:
                model.get_parameter(lora_a).data = saved_fp16[lora_a]
            with torch.autocast(**FP16):
                loss = model(input_ids=ids, labels=labels).loss
            scaler.scale(loss).backward()
            if step == 2:
                with pytest.raises(PrecisionDriftError) as caught:
                    scaler.step(optimizer)
                break
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    finally:
        scaler.precision_guard.close()
    drift = caught.value.drifts[0]
    assert drift.kind == "master weights" and lora_a in drift.tensors
    assert (drift.seen, drift.expected) == ("float16", "float32")

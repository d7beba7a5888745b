"""The four stock ``Trainer(fp16=True)`` defects, each shown real, then fixed.

Every test runs the unmodified stock ``transformers.Trainer`` first and asserts the defect, so
the test proves the defect exists in the installed transformers/accelerate; then it runs
``AmpTrainer`` on the same setup and asserts the fix. Stock Trainer does not run fp16 on a CPU at
all (defect 3), so defects 1 and 4 put it on its CUDA code path with
:func:`tests.helpers.training.force_stock_native_fp16` (see its docstring).
"""

from __future__ import annotations

import pytest
import torch
from transformers import Trainer, TrainingArguments

from amp_trainer.trainer import AmpTrainer, AmpTrainingArguments
from tests.helpers.tiny_models import make_tiny_bert, make_tiny_gpt2
from tests.helpers.training import (
    InjectOverflow,
    RecordSkipFlags,
    ToyClassification,
    force_stock_native_fp16,
    tiny_training_args,
    train_logs,
)


def _args(cls, tmp_path, **overrides):
    """Stock and Amp arguments alike: ``fp16=True``, as a user switching to AmpTrainer has it."""
    return tiny_training_args(tmp_path, cls, fp16=True, **{"max_steps": 6, **overrides})


# ---- defect 1: fused AdamW overflow not seen as skipped; the LR scheduler advances ------------
def test_stock_fused_adamw_overflow_is_not_seen_as_skipped_and_the_scheduler_advances(tmp_path):
    model = make_tiny_bert()
    flags = RecordSkipFlags()
    trainer = Trainer(
        model=model,
        args=_args(TrainingArguments, tmp_path),
        train_dataset=ToyClassification(),
        callbacks=[InjectOverflow(model.classifier.weight, {2, 4}), flags],
    )
    force_stock_native_fp16(trainer, init_scale=2.0**10)
    trainer.train()

    assert trainer.args.optim == "adamw_torch_fused"
    assert trainer.optimizer.optimizer.defaults["fused"] is True
    assert trainer.accelerator.scaler.get_scale() == 2.0**8  # two overflows really happened
    assert flags.flags == [False] * 6  # ... yet no step was reported skipped
    assert trainer.lr_scheduler.last_epoch == 6  # ... so the LR advanced on both of them


def test_amp_trainer_reports_fused_adamw_overflow_steps_as_skipped_and_holds_the_lr(tmp_path):
    model = make_tiny_bert()
    flags = RecordSkipFlags()
    trainer = AmpTrainer(
        model=model,
        args=_args(AmpTrainingArguments, tmp_path, loss_scale_init=2.0**10),
        train_dataset=ToyClassification(),
        callbacks=[InjectOverflow(model.classifier.weight, {2, 4}), flags],
    )
    trainer.train()

    assert trainer.optimizer.optimizer.defaults["fused"] is True
    assert trainer.loss_scaler.get_scale() == 2.0**8
    assert trainer.loss_scaler.stats.skipped == 2
    # Eight attempts, two skipped: six updates, and the LR moved on those six only. The skipped
    # attempts are no steps, so on_optimizer_step hears only the applied updates.
    assert trainer.state.optimizer_step_attempts == 8
    assert trainer.state.global_step == trainer.lr_scheduler.last_epoch == 6
    assert flags.flags == [False] * 6


# ---- defect 2: gradient accumulation with a **kwargs forward that ignores num_items_in_batch --
def _first_step_log(trainer_cls, args_cls, tmp_path, accumulation, **extra):
    # No dropout, so one batch of 8 and four micro-batches of 2 compute the same mean loss.
    model = make_tiny_bert(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    args = _args(
        args_cls,
        tmp_path / f"ga{accumulation}",
        max_steps=1,
        per_device_train_batch_size=8 // accumulation,
        gradient_accumulation_steps=accumulation,
        **extra,
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=ToyClassification())
    trainer.train()
    return train_logs(trainer)[0]


def test_stock_gradient_accumulation_inflates_bert_loss_and_grad_norm_n_fold(tmp_path):
    one = _first_step_log(Trainer, TrainingArguments, tmp_path, accumulation=1)
    four = _first_step_log(Trainer, TrainingArguments, tmp_path, accumulation=4)

    assert four["loss"] == pytest.approx(4 * one["loss"], rel=1e-4)
    assert four["grad_norm"] == pytest.approx(4 * one["grad_norm"], rel=1e-4)


def test_amp_trainer_gradient_accumulation_matches_one_large_batch_for_bert(tmp_path):
    one = _first_step_log(AmpTrainer, AmpTrainingArguments, tmp_path, accumulation=1)
    four = _first_step_log(AmpTrainer, AmpTrainingArguments, tmp_path, accumulation=4)

    # fp16 autocast: the two batchings round differently, hence the tolerance (vs. 4x above).
    assert four["loss"] == pytest.approx(one["loss"], rel=1e-2)
    assert four["grad_norm"] == pytest.approx(one["grad_norm"], rel=2e-2)


def test_num_items_in_batch_is_still_passed_to_models_whose_loss_uses_it(tmp_path):
    def passes_num_items(model):
        trainer = AmpTrainer(model=model, args=_args(AmpTrainingArguments, tmp_path))
        return trainer.model_accepts_loss_kwargs

    assert passes_num_items(make_tiny_gpt2()) is True
    assert passes_num_items(make_tiny_bert()) is False


# ---- defect 3: fp16 on CPU silently trains in FP32 ------------------------------------------
def _linear_output_dtypes(trainer_cls, args_cls, tmp_path):
    model = make_tiny_bert()
    seen: set[torch.dtype] = set()
    query = model.bert.encoder.layer[0].attention.self.query
    query.register_forward_hook(lambda module, args, output: seen.add(output.dtype))
    trainer = trainer_cls(
        model=model, args=_args(args_cls, tmp_path, max_steps=2), train_dataset=ToyClassification()
    )
    trainer.train()
    return trainer, seen


def test_stock_fp16_on_cpu_trains_in_fp32_with_no_scaler(tmp_path):
    trainer, dtypes = _linear_output_dtypes(Trainer, TrainingArguments, tmp_path)

    assert trainer.args.fp16 and trainer.args.mixed_precision == "fp16"
    assert dtypes == {torch.float32}
    assert trainer.accelerator.scaler is None


def test_amp_trainer_fp16_on_cpu_runs_fp16_autocast_with_the_loss_scaler(tmp_path):
    trainer, dtypes = _linear_output_dtypes(AmpTrainer, AmpTrainingArguments, tmp_path)

    assert dtypes == {torch.float16}
    assert trainer.accelerator.scaler is trainer.loss_scaler
    assert trainer.loss_scaler.stats.steps == 2


# ---- defect 4: PEFT modules_to_save copy of an FP16-loaded model stays FP16 ------------------
def _lora_seq_cls_on_fp16_base():
    from peft import LoraConfig, TaskType, get_peft_model

    base = make_tiny_bert().half()
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["query", "value"])
    return get_peft_model(base, config)


def test_stock_lora_seq_cls_on_fp16_model_dies_unscaling_fp16_gradients(tmp_path):
    model = _lora_seq_cls_on_fp16_base()
    classifier = model.base_model.model.classifier.modules_to_save["default"]
    assert classifier.weight.requires_grad and classifier.weight.dtype == torch.float16
    trainer = Trainer(
        model=model, args=_args(TrainingArguments, tmp_path), train_dataset=ToyClassification()
    )
    force_stock_native_fp16(trainer)

    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        trainer.train()


def test_amp_trainer_trains_lora_seq_cls_on_fp16_model_with_fp32_trainable_copy(tmp_path):
    model = _lora_seq_cls_on_fp16_base()
    trainer = AmpTrainer(
        model=model,
        args=_args(AmpTrainingArguments, tmp_path, max_steps=3),
        train_dataset=ToyClassification(),
    )
    trainer.train()

    trainable = {n: p.dtype for n, p in model.named_parameters() if p.requires_grad}
    assert any("modules_to_save" in n for n in trainable)
    assert set(trainable.values()) == {torch.float32}
    assert trainer.loss_scaler.stats.steps == 3 and trainer.loss_scaler.stats.skipped == 0


# ---- observability: grad_norm inf, skipped steps invisible, no loss scale -------------------
def test_stock_logs_inf_grad_norm_and_nothing_about_the_skip_or_the_scale(tmp_path):
    model = make_tiny_bert()
    trainer = Trainer(
        model=model,
        args=_args(TrainingArguments, tmp_path, max_steps=3),
        train_dataset=ToyClassification(),
        callbacks=[InjectOverflow(model.classifier.weight, {2})],
    )
    force_stock_native_fp16(trainer)
    trainer.train()

    logs = train_logs(trainer)
    assert logs[1]["grad_norm"] == float("inf")
    assert [e["step"] for e in logs] == [1, 2, 3]  # the skipped step counts like any other
    assert not any("loss_scale" in e or "step_skipped" in e for e in logs)


def test_amp_trainer_logs_the_skip_and_the_scale_instead_of_an_inf_grad_norm(tmp_path):
    model = make_tiny_bert()
    trainer = AmpTrainer(
        model=model,
        args=_args(AmpTrainingArguments, tmp_path, max_steps=3, loss_scale_init=2.0**10),
        train_dataset=ToyClassification(),
        callbacks=[InjectOverflow(model.classifier.weight, {2})],
    )
    trainer.train()

    logs = train_logs(trainer)
    # Attempt 2 is skipped, so no log is "at" it (the logged steps are applied updates and their
    # norms finite); the log of the step after it says one update was skipped since the last.
    assert [e["step"] for e in logs] == [1, 2, 3]
    assert all(torch.isfinite(torch.tensor(e["grad_norm"])) for e in logs)
    assert [e["step_skipped"] for e in logs] == [0, 1, 0]
    assert [e["skipped_steps"] for e in logs] == [0, 1, 1]
    assert [e["loss_scale"] for e in logs] == [2.0**10, 2.0**9, 2.0**9]

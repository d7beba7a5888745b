"""AmpTrainer with PEFT LoRA models on FP16-loaded bases: BERT SEQ_CLS and GPT-2 causal LM."""

from __future__ import annotations

import math

import torch
from peft import LoraConfig, TaskType, get_peft_model
from torch import nn
from transformers import TrainerCallback

from amp_trainer import AmpTrainer
from tests.helpers.tiny_models import make_tiny_bert, make_tiny_gpt2
from tests.helpers.training import (
    InjectOverflow,
    ToyClassification,
    ToyLanguageModeling,
    tiny_training_args,
    train_logs,
)


def _args(tmp_path, **overrides):
    return tiny_training_args(tmp_path, **{"learning_rate": 1e-2, **overrides})


def _lora_gpt2_on_fp16_base():
    config = LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, target_modules=["c_attn"])
    return get_peft_model(make_tiny_gpt2().half(), config)


def _lora_bert_on_fp16_base():
    config = LoraConfig(task_type=TaskType.SEQ_CLS, r=4, target_modules=["query", "value"])
    return get_peft_model(make_tiny_bert().half(), config)


def test_lora_causal_lm_trains_the_adapters_and_leaves_the_fp16_base_untouched(tmp_path):
    model = _lora_gpt2_on_fp16_base()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = AmpTrainer(model=model, args=_args(tmp_path), train_dataset=ToyLanguageModeling())
    trainer.train()

    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert changed and changed <= trainable
    assert all(math.isfinite(e["loss"]) for e in train_logs(trainer))
    assert trainer.loss_scaler.stats.steps == 4 and trainer.loss_scaler.stats.skipped == 0
    assert model.base_model.model.transformer.h[0].attn.c_attn.base_layer.weight.dtype == (
        torch.float16
    )


def test_lora_causal_lm_keeps_normalising_the_loss_by_token_count(tmp_path):
    trainer = AmpTrainer(
        model=_lora_gpt2_on_fp16_base(), args=_args(tmp_path), train_dataset=ToyLanguageModeling()
    )

    # GPT-2's loss_function divides by num_items_in_batch, so Trainer must keep passing it.
    assert trainer.model_accepts_loss_kwargs is True


def test_lora_seq_cls_overflow_is_skipped_and_attributed_to_the_peft_parameter(tmp_path, caplog):
    model = _lora_bert_on_fp16_base()
    classifier = model.base_model.model.classifier.modules_to_save["default"]
    trainer = AmpTrainer(
        model=model,
        args=_args(tmp_path, max_steps=3, loss_scale_init=2.0**10),
        train_dataset=ToyClassification(),
        callbacks=[InjectOverflow(classifier.weight, {2})],
    )
    with caplog.at_level("INFO", logger="amp_trainer.trainer"):
        trainer.train()

    assert [e["skipped"] for e in trainer.scale_history] == [False, True, False, False]
    assert "classifier.modules_to_save.default.weight" in caplog.text


class _NormProbe(TrainerCallback):
    """Records, during training, the dtypes every LayerNorm holds and computes in."""

    def __init__(self, model: nn.Module) -> None:
        self.param_dtypes: set[torch.dtype] = set()
        self.input_dtypes: set[torch.dtype] = set()
        self.autocast_inside: set[bool] = set()
        self.norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]

    def attach(self, monkeypatch) -> None:
        # The class's forward: what AmpTrainer's FP32 island calls, with what the layer computes on.
        original = nn.LayerNorm.forward

        def forward(module, x):
            self._record(module, (x,))
            return original(module, x)

        monkeypatch.setattr(nn.LayerNorm, "forward", forward)

    def _record(self, module, args):
        self.input_dtypes.add(args[0].dtype)
        self.autocast_inside.add(torch.is_autocast_enabled("cpu"))

    def on_step_end(self, args, state, control, **kwargs):
        self.param_dtypes.update(p.dtype for norm in self.norms for p in norm.parameters())


def test_norms_stay_fp32_while_training_lora_on_an_fp16_base(tmp_path, monkeypatch):
    model = _lora_bert_on_fp16_base()
    probe = _NormProbe(model)
    assert {p.dtype for norm in probe.norms for p in norm.parameters()} == {torch.float16}
    trainer = AmpTrainer(
        model=model,
        args=_args(tmp_path, max_steps=2),
        train_dataset=ToyClassification(),
        callbacks=[probe],
    )
    probe.attach(monkeypatch)
    trainer.train()

    assert probe.param_dtypes == {torch.float32}
    assert probe.input_dtypes == {torch.float32}
    assert probe.autocast_inside == {False}


def test_keep_norms_fp32_false_leaves_the_norms_as_loaded(tmp_path):
    model = _lora_bert_on_fp16_base()
    AmpTrainer(model=model, args=_args(tmp_path, keep_norms_fp32=False))

    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    assert {p.dtype for norm in norms for p in norm.parameters()} == {torch.float16}

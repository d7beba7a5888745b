"""AmpTrainerMixin on Seq2SeqTrainer in either base order, and AmpTrainingArguments combined
with Seq2SeqTrainingArguments in either order (TRL's trainers: test_trainer_trl.py, beside it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
)

from amp_trainer import (
    AmpSeq2SeqTrainer,
    AmpSeq2SeqTrainingArguments,
    AmpTrainer,
    AmpTrainerMixin,
    AmpTrainingArguments,
    DynamicLossScaler,
)
from tests.helpers.tiny_models import tiny_t5
from tests.helpers.training import InjectOverflow, tiny_training_args


class ToyTranslation(torch.utils.data.Dataset):
    """Random source sequences; the target is the source reversed (a real seq2seq task)."""

    def __init__(self, n: int = 16, seq_len: int = 6, vocab_size: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.input_ids = torch.randint(2, vocab_size, (n, seq_len), generator=g)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.input_ids[i]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.flip(0)}


def seq2seq_args(tmp_path, cls=AmpSeq2SeqTrainingArguments, **overrides):
    settings = dict(max_steps=3, per_device_eval_batch_size=4, loss_scale_init=2.0**10)
    return tiny_training_args(tmp_path, cls, **{**settings, **overrides})


class Seq2SeqFirst(Seq2SeqTrainer, AmpTrainerMixin):
    pass


class MixinFirst(AmpTrainerMixin, Seq2SeqTrainer):
    pass


class Seq2SeqThenAmpTrainer(Seq2SeqTrainer, AmpTrainer):  # the order that refused loss_scaler=
    pass


@pytest.mark.parametrize("trainer_cls", [AmpSeq2SeqTrainer, MixinFirst, Seq2SeqFirst])
def test_mixin_on_seq2seq_trainer_skips_an_overflow_step_in_either_base_order(
    tmp_path, trainer_cls
):
    model = tiny_t5(vocab_size=64)
    trainer = trainer_cls(
        model=model,
        args=seq2seq_args(tmp_path),
        train_dataset=ToyTranslation(),
        callbacks=[InjectOverflow(model.lm_head.weight, {2})],
    )
    trainer.train()

    assert isinstance(trainer, Seq2SeqTrainer)
    # Attempt 2 is skipped and is no step: max_steps=3 takes four attempts.
    assert [entry["skipped"] for entry in trainer.scale_history] == [False, True, False, False]
    assert trainer.loss_scaler.stats.skipped == 1
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["loss_scale"] for entry in logs] == [1024.0, 512.0, 512.0]


@pytest.mark.parametrize("trainer_cls", [MixinFirst, Seq2SeqFirst, Seq2SeqThenAmpTrainer])
def test_loss_scaler_keyword_reaches_the_mixin_in_either_base_order(tmp_path, trainer_cls):
    scaler = DynamicLossScaler("cpu", init_scale=2.0**5)
    trainer = trainer_cls(
        model=tiny_t5(vocab_size=64),
        args=seq2seq_args(tmp_path, max_steps=1),
        train_dataset=ToyTranslation(),
        loss_scaler=scaler,
    )
    trainer.train()

    assert trainer.loss_scaler is scaler
    assert scaler.stats.steps == 1
    assert trainer.scale_history[0]["scale"] == 32.0


def test_a_loss_scaler_of_the_wrong_type_is_refused_through_a_subclass(tmp_path):
    with pytest.raises(TypeError, match="loss_scaler must be a DynamicLossScaler"):
        Seq2SeqFirst(
            model=tiny_t5(vocab_size=64),
            args=seq2seq_args(tmp_path),
            loss_scaler=torch.amp.GradScaler("cpu"),
        )


def test_a_subclass_of_a_subclass_still_takes_the_loss_scaler(tmp_path):
    class Deeper(Seq2SeqFirst):
        def __init__(self, *args, note: str = "", **kwargs):
            self.note = note
            super().__init__(*args, **kwargs)

    scaler = DynamicLossScaler("cpu", init_scale=8.0)
    trainer = Deeper(
        model=tiny_t5(vocab_size=64), args=seq2seq_args(tmp_path), loss_scaler=scaler, note="x"
    )

    assert trainer.loss_scaler is scaler and trainer.note == "x"


def test_amp_trainer_is_the_mixin_on_stock_trainer():
    assert AmpTrainer.__mro__[1:3] == (AmpTrainerMixin, Trainer)
    assert AmpSeq2SeqTrainer.__mro__[1:3] == (AmpTrainerMixin, Seq2SeqTrainer)


def test_seq2seq_trainer_generates_under_the_mixin(tmp_path):
    trainer = AmpSeq2SeqTrainer(
        model=tiny_t5(vocab_size=64),
        args=seq2seq_args(tmp_path, predict_with_generate=True, max_steps=1),
        train_dataset=ToyTranslation(),
        eval_dataset=ToyTranslation(n=4),
    )
    trainer.train()
    predictions = trainer.predict(ToyTranslation(n=4), max_new_tokens=3)

    assert predictions.predictions.shape[0] == 4
    assert predictions.predictions.dtype.kind == "i"  # generated token ids, not logits
    assert "test_loss" in predictions.metrics


# ---- arguments classes combined ------------------------------------------------------------
@dataclasses.dataclass
class Seq2SeqThenAmp(Seq2SeqTrainingArguments, AmpTrainingArguments):
    pass


@dataclasses.dataclass
class AmpThenSeq2Seq(AmpTrainingArguments, Seq2SeqTrainingArguments):
    pass


FLAG_CASES = [
    ({"precision": "fp16"}, ("fp16", True, False)),
    ({"fp16": True}, ("fp16", True, False)),
    ({"bf16": True}, ("bf16", False, True)),
    ({"precision": "fp32"}, ("fp32", False, False)),
]


@pytest.mark.parametrize("cls", [Seq2SeqThenAmp, AmpThenSeq2Seq, AmpSeq2SeqTrainingArguments])
@pytest.mark.parametrize("given, expected", FLAG_CASES)
def test_seq2seq_arguments_combined_in_either_order_resolve_precision_and_flags(
    tmp_path, cls, given, expected
):
    args = cls(output_dir=str(tmp_path), use_cpu=True, report_to="none", **given)

    assert (args.precision, args.fp16, args.bf16) == expected
    assert args.mixed_precision == {"fp32": "no"}.get(expected[0], expected[0])


def test_seq2seq_arguments_class_has_both_field_sets(tmp_path):
    args = seq2seq_args(tmp_path, predict_with_generate=True, loss_scale_hysteresis=2)

    assert isinstance(args, Seq2SeqTrainingArguments) and isinstance(args, AmpTrainingArguments)
    assert args.predict_with_generate and args.loss_scale_hysteresis == 2
    assert Seq2SeqThenAmp(output_dir=str(tmp_path), precision="fp16", use_cpu=True).fp16

"""TRL's SFTTrainer and DPOTrainer with AmpTrainerMixin, end to end, and AmpTrainingArguments
combined with SFTConfig/DPOConfig in either order.

Tiny GPT-2 models built from a config and a byte-level BPE tokenizer trained here (nothing is
downloaded); fp16 on the CPU with amp-trainer's scaler really in the loop: an overflow injected
into a real gradient is skipped and the loss scale appears in the logs.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from tests.helpers.tiny_models import (
    COLOURS,
    THINGS,
    colour_bpe_tokenizer,
    colour_sentences,
    tiny_gpt2_for,
)
from tests.helpers.training import InjectOverflow, tiny_training_args, train_logs

trl = pytest.importorskip("trl", reason="TRL is in the test extra: pip install -e '.[test]'")
from datasets import Dataset  # noqa: E402
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer  # noqa: E402

from amp_trainer import AmpTrainerMixin, AmpTrainingArguments  # noqa: E402


@pytest.fixture
def tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_TRAINER_CACHE", str(tmp_path / "cache"))
    return colour_bpe_tokenizer()


@dataclasses.dataclass
class AmpSFTConfig(SFTConfig, AmpTrainingArguments):
    pass


@dataclasses.dataclass
class AmpDPOConfig(AmpTrainingArguments, DPOConfig):
    pass


class AmpSFTTrainer(AmpTrainerMixin, SFTTrainer):
    pass


class SFTThenAmpTrainer(SFTTrainer, AmpTrainerMixin):
    pass


class AmpDPOTrainer(DPOTrainer, AmpTrainerMixin):
    pass


def _trl_args(cls, tmp_path):
    return tiny_training_args(
        tmp_path / "out",
        cls,
        max_steps=3,
        loss_scale_init=2.0**10,
        max_length=32,
        gradient_checkpointing=False,
    )


@pytest.mark.slow
@pytest.mark.parametrize("trainer_cls", [AmpSFTTrainer, SFTThenAmpTrainer])
def test_sft_trainer_trains_fp16_with_the_scaler_skipping_an_overflow(
    tmp_path, tokenizer, trainer_cls
):
    model = tiny_gpt2_for(tokenizer)
    trainer = trainer_cls(
        model=model,
        args=_trl_args(AmpSFTConfig, tmp_path),
        train_dataset=Dataset.from_dict({"text": colour_sentences(24)}),
        processing_class=tokenizer,
        callbacks=[InjectOverflow(model.transformer.h[0].mlp.c_fc.weight, {2})],
    )
    trainer.train()

    assert trainer.args.fp16 and not trainer.args.bf16
    # Attempt 2 is skipped and is no step: max_steps=3 takes four attempts.
    assert trainer.loss_scaler.stats.steps == 4 and trainer.loss_scaler.stats.skipped == 1
    assert [entry["skipped"] for entry in trainer.scale_history] == [False, True, False, False]
    logs = train_logs(trainer)
    assert [entry["loss_scale"] for entry in logs] == [1024.0, 512.0, 512.0]
    assert all(math.isfinite(entry["loss"]) for entry in logs)


@pytest.mark.slow
def test_dpo_trainer_trains_fp16_with_the_scaler_skipping_an_overflow(tmp_path, tokenizer):
    prompts = [f"Which {thing} is it?" for thing in THINGS] * 2
    chosen = [f" The {c} one." for c in COLOURS] * 2
    rejected = [" I do not know." for _ in prompts]
    model = tiny_gpt2_for(tokenizer)
    trainer = AmpDPOTrainer(
        model=model,
        ref_model=tiny_gpt2_for(tokenizer),
        args=_trl_args(AmpDPOConfig, tmp_path),
        train_dataset=Dataset.from_dict(
            {"prompt": prompts, "chosen": chosen, "rejected": rejected}
        ),
        processing_class=tokenizer,
        callbacks=[InjectOverflow(model.transformer.h[0].mlp.c_fc.weight, {2})],
    )
    trainer.train()

    # Attempt 2 is skipped and is no step: max_steps=3 takes four attempts.
    assert trainer.loss_scaler.stats.steps == 4 and trainer.loss_scaler.stats.skipped == 1
    assert [entry["skipped"] for entry in trainer.scale_history] == [False, True, False, False]
    logs = train_logs(trainer)
    assert [entry["loss_scale"] for entry in logs] == [1024.0, 512.0, 512.0]
    assert all("rewards/chosen" in entry for entry in logs)  # DPO's own metrics still logged


# ---- AmpTrainingArguments combined with TRL's configs ----------------------------------------
def _combined(first, second):
    return dataclasses.dataclass(type(f"{first.__name__}{second.__name__}", (first, second), {}))


COMBINED = [
    _combined(SFTConfig, AmpTrainingArguments),
    _combined(AmpTrainingArguments, SFTConfig),
    _combined(DPOConfig, AmpTrainingArguments),
    _combined(AmpTrainingArguments, DPOConfig),
]


@pytest.mark.parametrize("cls", COMBINED, ids=lambda cls: cls.__name__)
@pytest.mark.parametrize(
    "given, expected",
    [
        ({"precision": "fp16"}, ("fp16", True, False)),
        ({"fp16": True}, ("fp16", True, False)),
        ({"bf16": True}, ("bf16", False, True)),
        ({"precision": "fp32"}, ("fp32", False, False)),
    ],
)
def test_trl_config_combined_in_either_order_takes_what_the_user_set(
    tmp_path, cls, given, expected
):
    args = cls(output_dir=str(tmp_path), use_cpu=True, report_to="none", **given)

    assert (args.precision, args.fp16, args.bf16) == expected


@pytest.mark.parametrize("cls", COMBINED, ids=lambda cls: cls.__name__)
def test_trl_config_combined_still_refuses_a_real_contradiction(tmp_path, cls):
    with pytest.raises(ValueError, match="precision='fp16' contradicts bf16=True"):
        cls(output_dir=str(tmp_path), use_cpu=True, precision="fp16", bf16=True)


def test_trl_default_bf16_yields_to_precision_auto(tmp_path):
    # SFTConfig alone turns bf16=None into bf16=True; combined with ours, "auto" is our policy.
    args = AmpSFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    plain = AmpTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")

    assert SFTConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none").bf16
    assert (args.precision, args.fp16, args.bf16) == (plain.precision, plain.fp16, plain.bf16)

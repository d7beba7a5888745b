"""Forward overflow during training: told from a gradient overflow, named, fixed by an FP32 island.

Tiny models with real overflows: a T5 whose encoder FFN output (``wo``) passes 65504 in FP16 on
every token while it is finite in FP32, the case the seed calls the commonest "loss is nan".
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch
from conftest import make_tiny_bert, tiny_training_args
from transformers import T5Config, T5ForConditionalGeneration

from amp_trainer import AmpAccelerator, AmpTrainer, DynamicLossScaler
from amp_trainer.forward_overflow import ForwardOverflowGuard, NonFiniteForwardError
from amp_trainer.islands import ISLANDS_CONFIG_KEY, is_fp32_island, keep_in_fp32
from amp_trainer.scaler import LossScaleError

WO = "encoder.block.0.layer.1.DenseReluDense.wo"


def make_overflowing_t5(declared: bool = False, seed: int = 0) -> T5ForConditionalGeneration:
    """A 2-layer T5 whose block-0 encoder ``wo`` output is > 65504 on every token (finite FP32).

    ``declared=False`` drops T5's own ``_keep_in_fp32_modules = ["wo"]`` (per instance, as
    transformers 5 keeps it), i.e. a model that does not know which layer overflows.
    """
    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=128,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
    )
    model = T5ForConditionalGeneration(config)
    if not declared:
        model._keep_in_fp32_modules = set()
    with torch.no_grad():
        model.get_submodule(WO).weight.mul_(1e5)
    return model


class ToySeq2Seq(torch.utils.data.Dataset):
    def __init__(self, n: int = 32, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.inputs = torch.randint(1, 128, (n, 10), generator=g)
        self.labels = torch.randint(1, 128, (n, 6), generator=g)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.inputs[i], "labels": self.labels[i]}


def batch_of(dataset: ToySeq2Seq, n: int = 4) -> dict[str, torch.Tensor]:
    return {
        "input_ids": dataset.inputs[:n],
        "labels": dataset.labels[:n],
    }


def test_the_test_model_really_overflows_in_fp16_and_is_finite_in_fp32():
    model = make_overflowing_t5()
    batch = batch_of(ToySeq2Seq())
    seen = {}
    model.get_submodule(WO).register_forward_hook(lambda m, a, out: seen.update(out=out))
    with torch.no_grad():
        fp32_loss = model(**batch).loss
        assert seen["out"].abs().amax(-1).min() > 65504  # every token
        with torch.autocast("cpu", dtype=torch.float16):
            fp16_loss = model(**batch).loss
    assert math.isfinite(float(fp32_loss))
    assert not math.isfinite(float(fp16_loss))


def test_t5_recovers_under_the_default_policy_with_few_skips_and_the_scale_intact(tmp_path, caplog):
    trainer = AmpTrainer(
        model=make_overflowing_t5(),
        args=tiny_training_args(tmp_path, max_steps=8, learning_rate=1e-4),
        train_dataset=ToySeq2Seq(),
    )
    with caplog.at_level(logging.WARNING, logger="amp_trainer.forward_overflow"):
        trainer.train()
    skipped = [entry for entry in trainer.scale_history if entry["skipped"]]
    assert len(skipped) <= 3
    assert trainer.loss_scaler.get_scale() >= 2.0**15  # not walked down to the minimum
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    assert all(math.isfinite(loss) and loss > 0 for loss in losses[len(skipped) :])
    assert is_fp32_island(trainer.model.get_submodule(WO))
    warnings = [r.getMessage() for r in caplog.records if "Forward overflow" in r.getMessage()]
    assert len(warnings) == 1 and WO in warnings[0]  # warned once, naming the module
    assert trainer.model.config.to_dict()[ISLANDS_CONFIG_KEY] == [WO]


def test_raise_names_wo_at_the_first_overflowing_step(tmp_path):
    trainer = AmpTrainer(
        model=make_overflowing_t5(),
        args=tiny_training_args(tmp_path, max_steps=4, on_forward_overflow="raise"),
        train_dataset=ToySeq2Seq(),
    )
    with pytest.raises(LossScaleError, match=r"Step 1: forward overflow in .*DenseReluDense\.wo"):
        trainer.train()
    assert trainer.loss_scaler.get_scale() == 2.0**16  # the forward overflow did not back off


def test_skip_keeps_todays_behaviour_of_backing_the_scale_off(tmp_path):
    # Every attempt overflows and is skipped, so no step is ever made: the runaway guard ends it.
    trainer = AmpTrainer(
        model=make_overflowing_t5(),
        args=tiny_training_args(
            tmp_path, max_steps=3, on_forward_overflow="skip", max_consecutive_skipped_steps=3
        ),
        train_dataset=ToySeq2Seq(),
    )
    with pytest.raises(LossScaleError, match="3 consecutive optimizer steps were skipped"):
        trainer.train()
    assert [e["skipped"] for e in trainer.scale_history] == [True, True, True]
    assert trainer.loss_scaler.get_scale() == 2.0**13
    assert not is_fp32_island(trainer.model.get_submodule(WO))


def test_t5_declared_keep_in_fp32_modules_make_wo_compute_in_fp32_under_autocast(tmp_path):
    trainer = AmpTrainer(
        model=make_overflowing_t5(declared=True),
        args=tiny_training_args(tmp_path, max_steps=2),
        train_dataset=ToySeq2Seq(),
    )
    seen = {}
    trainer.model.get_submodule(WO).register_forward_hook(lambda m, a, out: seen.update(out=out))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        loss = trainer.model(**batch_of(ToySeq2Seq())).loss
    assert seen["out"].dtype == torch.float32
    assert math.isfinite(float(loss))
    trainer.train()
    assert not any(e["skipped"] for e in trainer.scale_history)


def test_fp32_modules_argument_makes_those_modules_islands_before_training(tmp_path):
    trainer = AmpTrainer(
        model=make_overflowing_t5(),
        args=tiny_training_args(tmp_path, max_steps=2, fp32_modules=["DenseReluDense.wo"]),
        train_dataset=ToySeq2Seq(),
    )
    wos = [n for n, m in trainer.model.named_modules() if n.endswith("DenseReluDense.wo")]
    assert len(wos) == 4 and all(is_fp32_island(trainer.model.get_submodule(n)) for n in wos)
    trainer.train()
    assert not any(e["skipped"] for e in trainer.scale_history)


def test_fp32_modules_naming_no_module_is_an_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="'no_such_layer'"):
        AmpTrainer(
            model=make_overflowing_t5(),
            args=tiny_training_args(tmp_path, fp32_modules=["no_such_layer"]),
            train_dataset=ToySeq2Seq(),
        )


def test_the_new_arguments_parse_from_the_command_line(tmp_path):
    from transformers import HfArgumentParser

    from amp_trainer import AmpTrainingArguments

    base = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--precision", "fp16"]
    (args,) = HfArgumentParser(AmpTrainingArguments).parse_args_into_dataclasses(
        [*base, "--fp32_modules", "wo", "encoder.block.*.wi", "--on_forward_overflow", "raise"]
    )
    assert args.fp32_modules == ["wo", "encoder.block.*.wi"]
    assert args.on_forward_overflow == "raise"


def test_an_unknown_policy_is_an_error_listing_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"on_forward_overflow must be one of \('fp32'"):
        tiny_training_args(tmp_path, on_forward_overflow="ignore")


def test_islands_added_in_training_are_in_checkpoints_and_come_back_on_resume(tmp_path):
    args = tiny_training_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    first = AmpTrainer(model=make_overflowing_t5(), args=args, train_dataset=ToySeq2Seq())
    first.train()
    saved = json.loads((tmp_path / "checkpoint-2" / "config.json").read_text())
    assert saved[ISLANDS_CONFIG_KEY] == [WO]

    fresh = make_overflowing_t5()
    assert not is_fp32_island(fresh.get_submodule(WO))
    resumed = AmpTrainer(
        model=fresh,
        args=tiny_training_args(tmp_path, max_steps=4, save_strategy="no"),
        train_dataset=ToySeq2Seq(),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert is_fp32_island(fresh.get_submodule(WO))
    after_resume = [e for e in resumed.scale_history if e["step"] > 2]
    assert after_resume and not any(e["skipped"] for e in after_resume)


# --------------------------------------------------------------------------------------------
# a plain loop and a plain Accelerate loop
# --------------------------------------------------------------------------------------------
def test_a_nan_in_the_batch_is_reported_as_data_not_fp16():
    model = make_tiny_bert()
    scaler = DynamicLossScaler("cpu")
    guard = ForwardOverflowGuard(model, scaler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    embeds = torch.randn(2, 8, 32)
    embeds[1, 3, 5] = float("nan")
    batch = {"inputs_embeds": embeds, "labels": torch.tensor([0, 1])}
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch).loss
    guard.observe(loss, batch)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    with pytest.raises(NonFiniteForwardError, match=r"batch itself holds inf/NaN: 'inputs_embeds'"):
        guard.after_step()


def test_a_module_that_is_nan_in_fp32_too_is_reported_as_the_model_naming_it():
    model = make_tiny_bert()
    layer_norm = model.bert.embeddings.LayerNorm
    layer_norm.eps = 0.0
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight.fill_(1.0)  # constant rows: 0/0 in the norm
        model.bert.embeddings.position_embeddings.weight.zero_()
        model.bert.embeddings.token_type_embeddings.weight.zero_()
    scaler = DynamicLossScaler("cpu")
    guard = ForwardOverflowGuard(model, scaler)
    batch = {"input_ids": torch.randint(0, 128, (2, 8)), "labels": torch.tensor([0, 1])}
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch).loss
    guard.observe(loss, batch)
    scaler.scale(loss).backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler.step(optimizer)
    scaler.update()
    with pytest.raises(NonFiniteForwardError, match=r"pure FP32 too.*bert\.embeddings\.LayerNorm"):
        guard.after_step()


def test_a_gradient_overflow_is_left_to_the_scaler():
    model = make_overflowing_t5()
    keep_in_fp32(model, WO)  # no forward overflow left
    scaler = DynamicLossScaler("cpu")
    guard = ForwardOverflowGuard(model, scaler)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    batch = batch_of(ToySeq2Seq())
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch).loss
    guard.observe(loss, batch)
    scaler.scale(loss).backward()
    next(model.parameters()).grad.fill_(float("inf"))  # a real inf gradient, finite loss
    scaler.step(optimizer)
    scaler.update()
    assert guard.after_step() is None
    assert scaler.get_scale() == 2.0**15  # backed off, as a gradient overflow should


def test_a_plain_accelerate_loop_recovers_through_check_forward_overflow(fresh_accelerate_state):
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True)
    model = make_overflowing_t5()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = accelerator.prepare(model, optimizer)
    batch = batch_of(ToySeq2Seq())
    skipped = []
    for _ in range(4):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        event = accelerator.check_forward_overflow(loss, batch)
        skipped.append(accelerator.optimizer_step_was_skipped)
        optimizer.zero_grad()
        if event is not None:
            assert event.module == WO and event.islands == (WO,)
    assert skipped == [True, False, False, False]
    assert accelerator.loss_scaler.get_scale() == 2.0**16

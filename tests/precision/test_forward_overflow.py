"""Forward overflow during training: told from a gradient overflow, named, fixed by an FP32 island.

Tiny models with real overflows: a T5 whose encoder FFN output (``wo``) passes 65504 in FP16 on
every token while it is finite in FP32, the case the seed calls the commonest "loss is nan".
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
import math

import pytest
import torch

from amp_trainer import AmpAccelerator, AmpTrainer, DynamicLossScaler
from amp_trainer.forward_overflow import ForwardOverflowGuard, NonFiniteForwardError
from amp_trainer.islands import ISLANDS_CONFIG_KEY, is_fp32_island, keep_in_fp32
from amp_trainer.scaler import LossScaleError
from tests.helpers.tiny_models import WO, make_overflowing_t5, make_tiny_bert
from tests.helpers.training import ToySeq2Seq, tiny_training_args


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
# the figures of a forward-overflow step: logged loss, backoffs, what overflowed
# --------------------------------------------------------------------------------------------
class RecordingTrainer(AmpTrainer):
    """AmpTrainer that keeps a copy of every micro-batch it trains on."""

    def training_step(self, model, inputs, *args, **kwargs):
        self.batches = [*getattr(self, "batches", []), {k: v.clone() for k, v in inputs.items()}]
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.losses = [*getattr(self, "losses", []), float(loss)]
        return loss


def test_a_forward_overflow_step_logs_the_loss_of_its_fp32_rerun_not_zero(tmp_path):
    model = make_overflowing_t5()
    before = copy.deepcopy(model)  # the weights the overflowing attempt ran with
    trainer = RecordingTrainer(
        model=model, args=tiny_training_args(tmp_path, max_steps=1), train_dataset=ToySeq2Seq()
    )
    result = trainer.train()
    assert trainer.scale_history[0]["skipped"]  # the attempt overflowed and changed no weight
    with torch.no_grad():  # that batch in pure FP32 on those weights (no autocast wrapper)
        fp32_loss = float(type(before).forward(before, **trainer.batches[0]).loss)
    (log,) = [e for e in trainer.state.log_history if "loss" in e]
    assert log["step_skipped"] == 1
    # The skipped attempt is no step: the one step applied is the second attempt (the module
    # now an FP32 island), and the log averages over both attempts.
    assert len(trainer.batches) == 2 and math.isfinite(trainer.losses[1])
    expected = (fp32_loss + trainer.losses[1]) / 2  # stock would count the overflow as 0.0
    assert log["loss"] == pytest.approx(expected, rel=1e-6)
    assert log["loss_fp32_rerun"] == pytest.approx(fp32_loss, rel=1e-6)
    assert result.training_loss == pytest.approx(expected, rel=1e-6)


class OverflowsOnlyWithGrad(torch.nn.Module):
    """A loss that passes 65504 in FP16 while gradients are recorded: the guard's re-runs (no
    gradients) are finite, so no re-run of the batch has the training step's loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.overflows_left = 1  # the first training forward only: then the run can make a step

    def forward(self, x, labels):
        out = self.linear(x)
        if torch.is_grad_enabled() and self.overflows_left:
            self.overflows_left -= 1
            out = out * 1e3 * 1e3  # FP16 under autocast: inf
        return {"loss": ((out.float().squeeze(-1) - labels) ** 2).mean()}


class Regression(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((4,), 1.0 + i), "labels": torch.tensor(float(i))}


def test_a_forward_overflow_without_a_finite_fp32_rerun_logs_nan_not_zero(tmp_path):
    trainer = AmpTrainer(
        model=OverflowsOnlyWithGrad(),
        args=tiny_training_args(tmp_path, max_steps=1),
        train_dataset=Regression(),
    )
    trainer.train()
    assert trainer.scale_history[0]["skipped"]
    (log,) = [e for e in trainer.state.log_history if "loss" in e]
    assert math.isnan(log["loss"]) and math.isnan(log["loss_fp32_rerun"])


@pytest.mark.parametrize(("policy", "backoffs"), [("fp32", 0), ("skip", 16)])
def test_backoffs_count_only_the_times_the_scale_went_down(tmp_path, policy, backoffs):
    trainer = AmpTrainer(
        model=make_overflowing_t5(),
        args=tiny_training_args(tmp_path, max_steps=3, on_forward_overflow=policy),
        train_dataset=ToySeq2Seq(),
    )
    if policy == "skip":  # every attempt overflows: no step is ever made, 65536 -> 1, then stop
        with pytest.raises(LossScaleError):
            trainer.train()
    else:
        trainer.train()
    scales = [e["scale"] for e in trainer.scale_history] + [trainer.loss_scaler.get_scale()]
    went_down = sum(after < before for before, after in itertools.pairwise(scales))
    stats = trainer.loss_scaler.stats
    assert stats.backoffs == went_down == backoffs  # a forward overflow's undone backoff is none
    # Every skipped attempt is in the history, the last (the one that raised) only in the stats.
    recorded = sum(e["skipped"] for e in trainer.scale_history)
    assert stats.skipped - (policy == "skip") == recorded >= 1


def test_a_forward_overflow_names_the_module_made_an_island_not_every_parameter(tmp_path):
    trainer = AmpTrainer(
        model=make_overflowing_t5(),
        args=tiny_training_args(tmp_path, max_steps=2),
        train_dataset=ToySeq2Seq(),
    )
    trainer.train()
    assert trainer.scale_history[0]["fp32_islands"] == [WO]
    stats = trainer.loss_scaler.stats
    assert stats.last_forward_overflow_modules == (WO,)
    assert stats.last_overflow_params == ()  # every gradient was NaN: they name nothing
    saved = trainer.loss_scaler.state_dict()
    fresh = DynamicLossScaler("cpu")
    fresh.load_state_dict(saved)
    assert fresh.stats.last_forward_overflow_modules == (WO,)


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

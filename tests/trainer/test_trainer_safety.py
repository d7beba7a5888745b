"""AmpTrainer never skips a non-finite loss silently, never overwrites another run's checkpoint,
and says what a resumed checkpoint lacks or why its scaler.pt is unusable.

Real tiny runs (a 2-layer BERT on CPU in real FP16), real checkpoints written by the Trainer and
then damaged or edited as a user's disk or hand would, and the real ``amp-trainer`` command.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from transformers import TrainingArguments

from amp_trainer import AmpTrainer, DynamicLossScaler, LossScaleError
from amp_trainer.forward_overflow import NonFiniteForwardError
from tests.helpers.repo import REPO_ROOT, subprocess_env
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import tiny_training_args

EXPORT = [sys.executable, "-m", "amp_trainer.cli", "export"]


def dataset(rows: int = 32) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 128, (rows, 16), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": [i % 2 for i in range(rows)]})


# ---- 6. a non-finite loss computed outside the model -------------------------------------
class NanLossTrainer(AmpTrainer):
    """A custom compute_loss whose loss is NaN while the model's own output is finite."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(**inputs)
        loss = outputs.loss * float("nan")
        return (loss, outputs) if return_outputs else loss


@pytest.mark.parametrize("policy", ["fp32", "raise"])
def test_a_nan_loss_from_a_custom_compute_loss_stops_at_step_1_naming_the_loss(tmp_path, policy):
    args = tiny_training_args(tmp_path, on_forward_overflow=policy)
    trainer = NanLossTrainer(model=make_tiny_bert(), args=args, train_dataset=dataset())
    with pytest.raises(NonFiniteForwardError, match=r"Step 1: the loss is non-finite in pure FP32"):
        trainer.train()
    assert trainer.state.global_step <= 1


def test_a_nan_label_smoothing_factor_stops_at_step_1_naming_the_loss(tmp_path):
    # A stock TrainingArguments takes nan (AmpTrainingArguments refuses it, below).
    args = tiny_training_args(tmp_path, cls=TrainingArguments, fp16=True)
    args.label_smoothing_factor = float("nan")  # what --label_smoothing_factor nan gives stock
    trainer = AmpTrainer(model=make_tiny_bert(), args=args, train_dataset=dataset())
    with pytest.raises(NonFiniteForwardError, match="label_smoothing_factor"):
        trainer.train()
    assert trainer.state.global_step <= 1


def test_amp_training_arguments_refuse_a_nan_label_smoothing_factor(tmp_path):
    with pytest.raises(ValueError, match=r"label_smoothing_factor must be in \[0, 1\], got nan"):
        tiny_training_args(tmp_path, label_smoothing_factor=float("nan"))


def loss_overflowing_fp16_only(model, batch):
    """A loss computed outside the model that overflows under FP16 autocast only: a ~300 x 300
    matmul (9e4 > 65504: inf; inf / inf: NaN, in the gradients too); in FP32 y / y is 1."""
    outputs = model(**batch)
    m = (outputs.logits.float().mean() + 300.0).reshape(1, 1)
    y = m @ m
    return outputs.loss + (y / y).sum() - 1.0


@pytest.mark.parametrize("policy", ["raise", "fp32"])
def test_a_loss_overflowing_fp16_outside_the_model_follows_the_forward_overflow_policy(
    policy, caplog
):
    from amp_trainer.forward_overflow import ForwardOverflowGuard

    model = make_tiny_bert()
    scaler = DynamicLossScaler("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ForwardOverflowGuard(model, scaler, policy=policy, forward=loss_overflowing_fp16_only)
    batch = {"input_ids": torch.randint(5, 128, (4, 16)), "labels": torch.tensor([0, 1, 0, 1])}
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_overflowing_fp16_only(model, batch)
    assert not torch.isfinite(loss)
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    if policy == "raise":
        with pytest.raises(LossScaleError, match="the loss overflows FP16 while every module"):
            guard.after_step(loss, batch)
    else:
        with caplog.at_level(logging.WARNING, logger="amp_trainer"):
            event = guard.after_step(loss, batch)
        assert event is not None and event.module is None
        assert any("overflow is in the loss computation" in r.message for r in caplog.records)
    assert scaler.get_scale() == 65536.0  # a forward overflow does not back the scale off


def test_a_nan_loss_the_guards_re_run_cannot_see_is_said_not_skipped_silently(caplog):
    """A plain loop whose loss is computed outside the model, with the guard's default re-run
    (the model alone): the re-run is finite, and the skipped step is still said."""
    from amp_trainer.forward_overflow import ForwardOverflowGuard

    model = make_tiny_bert()
    scaler = DynamicLossScaler("cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = ForwardOverflowGuard(model, scaler)
    batch = {"input_ids": torch.randint(5, 128, (4, 16)), "labels": torch.tensor([0, 1, 0, 1])}
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(**batch).loss * float("nan")
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        guard.after_step(loss, batch)
    assert scaler.step_was_skipped
    assert any("the guard's re-run of the batch is finite" in r.message for r in caplog.records)


# ---- 5. a checkpoint without the optimizer, scheduler, RNG or scaler state ----------------
def test_resuming_a_save_only_model_checkpoint_says_what_it_lacks_in_one_warning(tmp_path, caplog):
    args = dict(max_steps=2, save_strategy="steps", save_steps=2, save_only_model=True)
    first = AmpTrainer(
        model=make_tiny_bert(), args=tiny_training_args(tmp_path, **args), train_dataset=dataset()
    )
    first.train()
    checkpoint = tmp_path / "checkpoint-2"
    assert not (checkpoint / "optimizer.pt").exists()

    args["max_steps"] = 4
    resumed = AmpTrainer(
        model=make_tiny_bert(), args=tiny_training_args(tmp_path, **args), train_dataset=dataset()
    )
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    lines = [r.getMessage() for r in caplog.records if "which has no" in r.message]
    assert len(lines) == 1, lines
    for name in ("optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt"):
        assert name in lines[0]
    assert "warm-up" in lines[0] and "optimizer starts afresh" in lines[0]
    assert resumed._checkpoints.missing_state == [
        "optimizer.pt",
        "scheduler.pt",
        "rng_state.pth",
        "scaler.pt",
    ]
    # The scaler's own "has no scaler.pt" warning is not said a second time.
    assert not [r for r in caplog.records if "has no scaler.pt" in r.message]


# ---- 9 and the systemic case: scaler.pt that cannot be used --------------------------------
@pytest.fixture
def saved_run(tmp_path) -> Path:
    # Without a digest list, so that scaler.pt's own reader meets the damage (with one, the
    # digests name it first: tests/trainer/test_trainer_checkpoint_digests.py).
    args = tiny_training_args(
        tmp_path, max_steps=2, save_strategy="steps", save_steps=2, checkpoint_digests=False
    )
    AmpTrainer(model=make_tiny_bert(), args=args, train_dataset=dataset()).train()
    return tmp_path / "checkpoint-2"


def resume(checkpoint: Path) -> None:
    args = tiny_training_args(checkpoint.parent, max_steps=4, save_strategy="no")
    trainer = AmpTrainer(model=make_tiny_bert(), args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=str(checkpoint))


def test_a_scaler_state_with_more_skipped_than_steps_is_refused():
    scaler = DynamicLossScaler("cpu")
    state = {**scaler.state_dict(), "steps": 4, "skipped": 9}
    with pytest.raises(ValueError, match=r"'skipped' must be <= 'steps' \(4\), got 9"):
        scaler.load_state_dict(state)
    assert scaler.stats.skipped == 0  # untouched


def test_a_scaler_pt_with_more_skipped_than_steps_is_refused_naming_the_file(saved_run):
    path = saved_run / "scaler.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "skipped": state["steps"] + 5}, path)
    with pytest.raises(ValueError) as caught:
        resume(saved_run)
    message = str(caught.value)
    assert message.startswith(f"{path} is unreadable (")
    assert "'skipped' must be <= 'steps'" in message and "\n" not in message


class NotPlainNumbers:
    """What a scaler.pt holding an arbitrary pickled object unpickles to."""


@pytest.mark.parametrize("damage", ["truncated", "empty", "pickled-object", "garbage"])
def test_a_damaged_scaler_pt_is_one_line_naming_the_file_without_unsafe_advice(saved_run, damage):
    path = saved_run / "scaler.pt"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "pickled-object":
        torch.save({"scale": NotPlainNumbers(), "_growth_tracker": 0}, path)
    else:
        path.write_bytes(pickle.dumps("not a state") * 3 + os.urandom(64))
    with pytest.raises(ValueError) as caught:
        resume(saved_run)
    message = str(caught.value)
    assert message.startswith(f"{path} is unreadable (") and "\n" not in message
    assert "weights_only" not in message
    assert "Resume from another checkpoint, or delete scaler.pt" in message


# ---- 2, at the library level: another run's checkpoint of the same step --------------------
def test_a_new_run_moves_another_runs_checkpoint_of_the_same_step_aside(tmp_path, caplog):
    args = dict(max_steps=2, save_strategy="steps", save_steps=2)
    AmpTrainer(
        model=make_tiny_bert(), args=tiny_training_args(tmp_path, **args), train_dataset=dataset()
    ).train()
    old = {p.name: p.read_bytes() for p in (tmp_path / "checkpoint-2").iterdir()}
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        AmpTrainer(
            model=make_tiny_bert(seed=1),
            args=tiny_training_args(tmp_path, **args),
            train_dataset=dataset(),
        ).train()
    kept = tmp_path / "previous-run-checkpoints" / "checkpoint-2"
    assert {p.name: p.read_bytes() for p in kept.iterdir()} == old
    assert (tmp_path / "checkpoint-2" / "model.safetensors").read_bytes() != old[
        "model.safetensors"
    ]
    assert any(f"moved it to {kept}" in r.getMessage() for r in caplog.records)


def test_resuming_another_folders_checkpoint_spares_every_checkpoint_of_the_output_dir(tmp_path):
    """A checkpoint resumed from another folder makes every checkpoint of ``output_dir`` another
    run's, whatever its step: one at or below the resumed step is not this run's, so
    ``save_total_limit`` rotation leaves it alone."""
    args = dict(max_steps=2, save_strategy="steps", save_steps=2)
    for folder in ("other", "finished"):
        AmpTrainer(
            model=make_tiny_bert(),
            args=tiny_training_args(tmp_path / folder, **args),
            train_dataset=dataset(),
        ).train()
    finished = tmp_path / "finished" / "checkpoint-2"
    before = {p.name: p.read_bytes() for p in finished.iterdir()}
    resumed = AmpTrainer(
        model=make_tiny_bert(),
        args=tiny_training_args(
            tmp_path / "finished",
            max_steps=4,
            save_strategy="steps",
            save_steps=4,
            save_total_limit=1,
        ),
        train_dataset=dataset(),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "other" / "checkpoint-2"))
    assert {p.name: p.read_bytes() for p in finished.iterdir()} == before
    assert (tmp_path / "finished" / "checkpoint-4").is_dir()


# ---- 8. amp-trainer export with a truncated tokenizer.json ---------------------------------
@pytest.mark.slow
def test_cli_export_with_a_truncated_tokenizer_json_is_one_line_exit_2_nothing_written(
    tmp_path, monkeypatch
):
    from amp_trainer.recipes.tokenizers import train_wordpiece_tokenizer

    monkeypatch.setenv("AMP_TRAINER_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    texts = [f"the quick brown fox number {i} jumps over the lazy dog" for i in range(50)]
    tokenizer = train_wordpiece_tokenizer(texts, vocab_size=100)
    make_tiny_bert(vocab_size=len(tokenizer)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    file = model / "tokenizer.json"
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    result = subprocess.run(
        [*EXPORT, "--model", str(model), "--output", str(tmp_path / "out")],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert f"{file} is unreadable" in lines[0] and "Traceback" not in result.stderr
    assert "PASSED" not in result.stdout
    assert not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]  # no staging left


def test_each_checkpoint_names_its_run_and_the_run_started_last_is_the_one_resumed(tmp_path):
    """A new run in a folder holding a run with a higher step, then its resume: each
    checkpoint's amp_trainer_state.json numbers the run that wrote it, and the recipes' finder
    takes the run started last (not the previous run's higher step)."""
    from amp_trainer.checkpointing.layout import checkpoint_run
    from amp_trainer.recipes.resume import last_complete_checkpoint

    def train(max_steps: int, seed: int, resume: str | None = None) -> None:
        args = tiny_training_args(
            tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2
        )
        trainer = AmpTrainer(model=make_tiny_bert(seed=seed), args=args, train_dataset=dataset())
        trainer.train(resume_from_checkpoint=resume)

    train(4, seed=0)  # the previous run: checkpoint-2, checkpoint-4
    assert [checkpoint_run(tmp_path / f"checkpoint-{n}") for n in (2, 4)] == [1, 1]
    train(2, seed=1)  # a new run in the same folder: its checkpoint-2 (run 1's moved aside)
    assert checkpoint_run(tmp_path / "checkpoint-2") == 2
    assert checkpoint_run(tmp_path / "checkpoint-4") == 1
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-2")
    train(4, seed=1, resume=str(tmp_path / "checkpoint-2"))  # resumed: a run too, started last
    assert checkpoint_run(tmp_path / "checkpoint-4") == 3
    assert checkpoint_run(tmp_path / "previous-run-checkpoints" / "checkpoint-4") == 1
    assert last_complete_checkpoint(tmp_path) == str(tmp_path / "checkpoint-4")

"""Resume is honest: other precisions, a missing scaler.pt, overridden flags, the whole run's
summary, a finished run; checkpoints survive a full disk and other runs' rotation."""

from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from amp_trainer import AmpTrainer
from amp_trainer.checkpointing import AMP_STATE_FILE
from amp_trainer.checkpointing.completeness import INCOMPLETE_MARKER
from amp_trainer.recipes.reporting import summarize_loss_scale
from tests.helpers.disks import tiny_disk
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import (
    InjectOverflow,
    ToyClassification,
    reset_accelerate_state,
    tiny_training_args,
)

MAX_STEPS = 6
CHECKPOINT_STEP = 3
OVERFLOW_STEPS = {2, 5}  # one skip on each side of the checkpoint


def make_trainer(output_dir, *, max_steps=MAX_STEPS, save_steps=CHECKPOINT_STEP, **overrides):
    reset_accelerate_state()
    model = make_tiny_bert()
    settings = dict(
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=save_steps,
        loss_scale_init=2.0**10,
        loss_scale_growth_interval=2,
    )
    return AmpTrainer(
        model=model,
        args=tiny_training_args(output_dir, **{**settings, **overrides}),
        train_dataset=ToyClassification(),
        callbacks=[InjectOverflow(model.classifier.weight, OVERFLOW_STEPS)],
    )


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """An uninterrupted fp16 run with checkpoints at steps 3 and 6."""
    output_dir = tmp_path_factory.mktemp("full")
    trainer = make_trainer(output_dir)
    trainer.train()
    reset_accelerate_state()
    return output_dir, trainer


def copy_checkpoint(full_run, tmp_path, step=CHECKPOINT_STEP):
    source = full_run[0] / f"checkpoint-{step}"
    target = tmp_path / "from" / source.name
    shutil.copytree(source, target)
    return target


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_an_fp16_checkpoint_resumes_in_another_precision_dropping_the_scaler_with_one_line(
    full_run, tmp_path, caplog, precision
):
    checkpoint = full_run[0] / f"checkpoint-{CHECKPOINT_STEP}"
    trainer = make_trainer(tmp_path / "run", precision=precision)
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert trainer.state.global_step == MAX_STEPS
    lines = [r.getMessage() for r in caplog.records if "loss-scaler state" in r.getMessage()]
    assert len(lines) == 1 and f"in {precision}" in lines[0] and "dropped" in lines[0]


def test_a_checkpoint_without_scaler_pt_warns_that_the_fp16_scaler_starts_afresh(
    full_run, tmp_path, caplog
):
    checkpoint = copy_checkpoint(full_run, tmp_path)
    (checkpoint / "scaler.pt").unlink()
    trainer = make_trainer(tmp_path / "run")
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert "has no scaler.pt: the loss scaler starts afresh at scale 1024" in caplog.text


def test_loss_scale_flags_the_checkpoint_overrides_are_reported_and_recorded_as_used(
    full_run, tmp_path, caplog
):
    checkpoint = full_run[0] / f"checkpoint-{CHECKPOINT_STEP}"
    trainer = make_trainer(
        tmp_path / "run", loss_scale_init=2.0**5, loss_scale_growth_interval=7, loss_scale_min=0.5
    )
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    line = next(r.getMessage() for r in caplog.records if "overrides" in r.getMessage())
    for flag in ("loss_scale_init", "loss_scale_growth_interval", "loss_scale_min"):
        assert flag in line
    assert trainer.resume_overrides["loss_scale_growth_interval"] == {"given": 7, "used": 2}
    # What metrics.json records (the recipes read these fields) is what ran.
    assert trainer.args.loss_scale_growth_interval == 2
    assert trainer.args.loss_scale_init == 2.0**10 and trainer.args.loss_scale_min == 1.0


def test_the_loss_scale_summary_of_a_resumed_run_covers_the_whole_run(full_run, tmp_path):
    checkpoint = full_run[0] / f"checkpoint-{CHECKPOINT_STEP}"
    trainer = make_trainer(tmp_path / "run")
    trainer.train(resume_from_checkpoint=str(checkpoint))
    full = full_run[1]
    assert trainer.scale_history == full.scale_history
    summary = summarize_loss_scale(trainer.scale_history, trainer.loss_scaler.get_scale())
    assert (summary.scaler_updates, summary.skipped) == (
        MAX_STEPS + len(OVERFLOW_STEPS),
        len(OVERFLOW_STEPS),
    )
    assert summary.scaler_updates == trainer.loss_scaler.stats.steps


def test_resuming_the_final_checkpoint_trains_nothing_and_says_so(full_run, tmp_path, caplog):
    checkpoint = copy_checkpoint(full_run, tmp_path, step=MAX_STEPS)
    trainer = make_trainer(checkpoint.parent)
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        result = trainer.train(resume_from_checkpoint=str(checkpoint))
    assert "is the end of its run (step 6 of max_steps 6): nothing to train" in caplog.text
    assert result.global_step == MAX_STEPS and trainer.state.global_step == MAX_STEPS
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == [checkpoint.name]
    trained = full_run[1].model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in trainer.model.state_dict().items())
    assert summarize_loss_scale(
        trainer.scale_history, trainer.loss_scaler.get_scale()
    ).skipped == len(OVERFLOW_STEPS)


def test_resuming_the_final_checkpoint_restores_its_loss_scaler_not_the_initial_one(
    full_run, tmp_path
):
    checkpoint = copy_checkpoint(full_run, tmp_path, step=MAX_STEPS)
    trainer = make_trainer(checkpoint.parent, loss_scale_init=2.0**23)
    trainer.train(resume_from_checkpoint=str(checkpoint))
    saved = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert saved["steps"] == MAX_STEPS + len(OVERFLOW_STEPS)  # the run's, not a fresh scaler's
    assert trainer.loss_scaler.state_dict() == saved
    assert trainer.loss_scaler.get_scale() == full_run[1].loss_scaler.get_scale() != 2.0**23


@pytest.mark.parametrize("torn", ["marker", "no_trainer_state"])
def test_resume_true_skips_a_checkpoint_stopped_mid_save_and_names_what_it_lacks(
    full_run, tmp_path, caplog, torn
):
    # What a kill during checkpoint-6's save leaves: the in-progress marker (removed only after
    # every rank wrote its part), or a folder without trainer_state.json (killed earlier).
    earlier = copy_checkpoint(full_run, tmp_path, step=CHECKPOINT_STEP)
    last = copy_checkpoint(full_run, tmp_path, step=MAX_STEPS)
    if torn == "marker":
        (last / INCOMPLETE_MARKER).write_text("saving")
        reason = f"it holds {INCOMPLETE_MARKER}"
    else:
        (last / "trainer_state.json").unlink()
        reason = "no trainer_state.json"
    trainer = make_trainer(last.parent)
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        trainer.train(resume_from_checkpoint=True)
    skipped = [r.getMessage() for r in caplog.records if "is incomplete" in r.getMessage()]
    assert skipped == [
        f"{last} is incomplete ({reason}; interrupted while saving?): skipped; the last "
        f"complete one is {earlier}"
    ]
    assert trainer.state.global_step == MAX_STEPS
    assert trainer.scale_history == full_run[1].scale_history  # trained steps 4-6 from step 3
    trained = full_run[1].model.state_dict()
    assert all(torch.equal(v, trained[k]) for k, v in trainer.model.state_dict().items())


def test_resume_true_with_only_incomplete_checkpoints_is_one_error(full_run, tmp_path):
    last = copy_checkpoint(full_run, tmp_path, step=MAX_STEPS)
    (last / INCOMPLETE_MARKER).write_text("saving")
    trainer = make_trainer(last.parent)
    with pytest.raises(ValueError, match=r"resume_from_checkpoint=True: no checkpoint in .* is "):
        trainer.train(resume_from_checkpoint=True)


def test_a_saved_checkpoint_records_its_world_size_and_no_in_progress_marker(full_run):
    checkpoint = full_run[0] / f"checkpoint-{CHECKPOINT_STEP}"
    assert json.loads((checkpoint / AMP_STATE_FILE).read_text())["world_size"] == 1
    assert not (checkpoint / INCOMPLETE_MARKER).exists()


def test_save_total_limit_rotation_leaves_another_runs_checkpoint_alone(full_run, tmp_path):
    finished = copy_checkpoint(full_run, tmp_path, step=MAX_STEPS)
    trainer = make_trainer(finished.parent, max_steps=3, save_steps=1, save_total_limit=1)
    trainer.train()
    assert sorted(p.name for p in finished.parent.iterdir()) == ["checkpoint-3", "checkpoint-6"]


class CheckpointsAtEachSave(TrainerCallback):
    """The ``checkpoint-N`` folders in ``output_dir`` after each save (its rotation included)."""

    def __init__(self) -> None:
        self.seen: list[list[str]] = []

    def on_save(self, args, state, control, **kwargs):
        folders = Path(args.output_dir).glob("checkpoint-*")
        self.seen.append(sorted((p.name for p in folders), key=lambda n: int(n.split("-")[1])))


@pytest.mark.parametrize("limit", [1, 3])
def test_save_total_limit_keeps_the_checkpoints_stock_rotation_keeps(tmp_path, limit):
    # Rotation runs once each checkpoint is complete, as amp-trainer's own: it keeps what stock
    # Trainer keeps, the best checkpoint included (the first evaluation is the best here).
    seen = {}
    for name, trainer_cls, args_cls in (
        ("stock", Trainer, TrainingArguments),
        ("amp", AmpTrainer, None),
    ):
        reset_accelerate_state()
        evaluations = iter(range(100))
        watch = CheckpointsAtEachSave()
        trainer_cls(
            model=make_tiny_bert(),
            args=tiny_training_args(
                tmp_path / name,
                args_cls,
                max_steps=5,
                save_strategy="steps",
                save_steps=1,
                eval_strategy="steps",
                eval_steps=1,
                save_total_limit=limit,
                load_best_model_at_end=True,
                metric_for_best_model="order",
                greater_is_better=False,
            ),
            train_dataset=ToyClassification(),
            eval_dataset=ToyClassification(8),
            compute_metrics=lambda _, order=evaluations: {"order": next(order)},
            callbacks=[watch],
        ).train()
        seen[name] = watch.seen
    assert seen["amp"] == seen["stock"]
    # checkpoint-1, the best, is never rotated away; the newest always stays.
    assert [[int(name.split("-")[1]) for name in names] for names in seen["amp"]] == {
        1: [[1], [1, 2], [1, 3], [1, 4], [1, 5]],
        3: [[1], [1, 2], [1, 2, 3], [1, 3, 4], [1, 4, 5]],
    }[limit]


def test_disk_full_during_a_checkpoint_save_is_one_enospc_error_without_a_partial_checkpoint(
    tmp_path, monkeypatch
):
    real_save = torch.save

    def save_until_full(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            with open(f, "wb") as handle:
                handle.write(b"PK\x03\x04")  # the part that fitted
            raise RuntimeError(
                "[enforce fail at inline_container.cc:672] . PytorchStreamWriter failed writing "
                "file data/0: file write failed"
            ) from OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    trainer = make_trainer(tmp_path / "run", max_steps=2, save_steps=2)
    monkeypatch.setattr(torch, "save", save_until_full)
    with pytest.raises(OSError, match="no space left on device saving checkpoint-2") as info:
        trainer.train()
    assert info.value.errno == errno.ENOSPC
    assert not (tmp_path / "run" / "checkpoint-2").exists()


def test_disk_full_on_a_real_small_file_system_removes_the_partial_checkpoint(tmp_path):
    disk = tmp_path / "disk"
    unmount = tiny_disk(disk, "160k", skip_note="; the fake-ENOSPC test covers it")
    try:
        trainer = make_trainer(disk, max_steps=1, save_steps=1)
        with pytest.raises(OSError, match="no space left on device saving checkpoint-1"):
            trainer.train()
        assert list(disk.iterdir()) == []
    finally:
        unmount()

"""TensorBoard's curves land under output_dir, the loss scale and the underflow meter with them,
also when something is logged before training (an untrained evaluation, as the GPT-2 recipe
does). Event files are read back with TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from amp_trainer import AmpTrainer
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import InjectOverflow, tiny_training_args

pytest.importorskip("tensorboard")


def _scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found: dict[str, list[tuple[int, float]]] = {}
    for run in sorted({events.parent for events in folder.rglob("events.out.tfevents.*")}):
        accumulator = EventAccumulator(str(run))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return found


class _Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(5, 128, (12,), generator=g), "labels": i % 2}


def test_curves_logged_before_and_during_training_are_all_under_output_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # stock would write ./runs/ here
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    out = tmp_path / "out"
    args = tiny_training_args(out, report_to="tensorboard", eval_strategy="no")
    trainer = AmpTrainer(
        model=make_tiny_bert(), args=args, train_dataset=_Pairs(), eval_dataset=_Pairs()
    )
    trainer.evaluate()  # the untrained evaluation, before train()'s on_train_begin
    trainer.train()
    trainer.evaluate()
    assert not (tmp_path / "runs").exists()
    scalars = _scalars(out / "runs")
    logged = [h for h in trainer.state.log_history if "loss_scale" in h]
    assert [v for _, v in scalars["train/loss_scale"]] == [h["loss_scale"] for h in logged]
    assert [s for s, _ in scalars["train/grad_underflow"]] == [1]
    assert len(scalars["eval/loss"]) == 2  # before and after training, in the same place


def test_a_skip_after_the_last_logging_step_reaches_tensorboard(tmp_path, monkeypatch):
    # 16 rows in batches of 4: one epoch of 4 attempts, logged every 3 steps; the last attempt
    # is skipped, after the last logging step: the run's last log, at its end, carries it.
    monkeypatch.delenv("TENSORBOARD_LOGGING_DIR", raising=False)
    out = tmp_path / "out"
    args = tiny_training_args(
        out, report_to="tensorboard", max_steps=-1, num_train_epochs=1, logging_steps=3
    )
    model = make_tiny_bert()
    trainer = AmpTrainer(
        model=model,
        args=args,
        train_dataset=_Pairs(),
        callbacks=[InjectOverflow(model.classifier.weight, {4})],
    )
    trainer.train()

    skipped = _scalars(out / "runs")["train/skipped_steps"]
    assert trainer.loss_scaler.stats.skipped == 1
    assert [value for _, value in skipped] == [0.0, 1.0]
    assert skipped[-1][0] == trainer.state.global_step == 3

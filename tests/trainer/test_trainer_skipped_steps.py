"""A skipped update is not a training step: what AmpTrainer counts, logs, saves and resumes.

A tiny BERT trains in real fp16 on the CPU; a real overflow (an inf written into a real
gradient by a tensor hook, before the scaler's check) makes the scaler skip chosen optimizer step
attempts. The run is an AmpTrainer, so stock transformers' own loop runs underneath; these
behaviours are transformers' main-branch semantics (``TrainerState.optimizer_step_attempts``),
which :mod:`amp_trainer.step_accounting` gives the released transformers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil

import pytest
import torch
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, ProgressCallback, TrainerState

import amp_trainer.step_accounting as step_accounting
from amp_trainer import AmpTrainer
from amp_trainer.checkpointing.digests import DIGEST_FILE
from amp_trainer.recipes.reporting import describe_optimizer_steps
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import (
    InjectOverflow,
    ToyClassification,
    tiny_training_args,
    train_logs,
)


class CountEvents(TrainerCallback):
    """What a user callback hears: per attempt, per applied update, per finished step."""

    def __init__(self) -> None:
        self.pre_optimizer = 0
        self.optimizer = 0
        self.step_ends: list[int] = []
        self.saves: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.pre_optimizer += 1

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.optimizer += 1

    def on_step_end(self, args, state, control, **kwargs):
        self.step_ends.append(state.global_step)

    def on_save(self, args, state, control, **kwargs):
        self.saves.append(state.global_step)


class ToyStream(torch.utils.data.IterableDataset):
    """ToyClassification read as a stream; ``yielded`` lists the indices in the order read.

    ``one_pass``: every ``iter()`` returns the same generator, so a second pass reads nothing.
    """

    def __init__(self, n: int = 24, one_pass: bool = False) -> None:
        self.rows = ToyClassification(n=n)
        self.yielded: list[int] = []
        self._only = self._rows() if one_pass else None

    def _rows(self):
        for index in range(len(self.rows)):
            self.yielded.append(index)
            yield self.rows[index]

    def __iter__(self):
        return self._only if self._only is not None else self._rows()


def _run(tmp_path, overflow_attempts=(), dataset=None, callbacks=(), **overrides):
    model = make_tiny_bert()
    events = CountEvents()
    trainer = AmpTrainer(
        model=model,
        args=tiny_training_args(tmp_path, **{"max_steps": 6, "seed": 0, **overrides}),
        train_dataset=dataset if dataset is not None else ToyClassification(n=24),
        callbacks=[
            InjectOverflow(model.classifier.weight, set(overflow_attempts)),
            events,
            *callbacks,
        ],
    )
    return trainer, events


def _applied_updates(trainer) -> int:
    return max(int(s["step"]) for s in trainer.optimizer.optimizer.state.values())


def _weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def _assert_same_weights(a, b) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def _state_file(folder) -> dict:
    return json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))


def test_max_steps_counts_applied_updates_and_attempts_count_the_skipped_one_too(tmp_path):
    trainer, _ = _run(tmp_path, overflow_attempts={3})
    output = trainer.train()

    assert trainer.loss_scaler.stats.skipped == 1
    assert trainer.state.global_step == output.global_step == 6
    assert trainer.state.optimizer_step_attempts == 7
    assert _applied_updates(trainer) == 6  # AdamW's own count of the updates it made
    assert trainer.lr_scheduler.last_epoch == 6


def test_the_summary_row_and_every_reporting_integration_get_applied_updates_and_attempts(
    tmp_path,
):
    class OnLog(TrainerCallback):  # what report_to integrations (TensorBoard, ...) receive
        def __init__(self) -> None:
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    reporter = OnLog()
    trainer, events = _run(tmp_path, overflow_attempts={2}, callbacks=[reporter], max_steps=4)
    trainer.train()

    applied, attempts = _applied_updates(trainer), events.pre_optimizer
    assert (applied, attempts) == (4, 5)
    assert describe_optimizer_steps(trainer.state) == "applied 4 of 5 attempts"
    training = [e for e in reporter.logs if "loss" in e]
    assert [e["optimizer_step_attempts"] for e in training] == [1, 3, 4, 5]


def test_callbacks_hear_pre_optimizer_step_per_attempt_and_the_rest_per_applied_update(tmp_path):
    trainer, events = _run(tmp_path, overflow_attempts={2, 5})
    trainer.train()

    assert events.pre_optimizer == 8
    assert events.optimizer == 6
    assert events.step_ends == [1, 2, 3, 4, 5, 6]  # no step ends twice, none is skipped


def test_the_learning_rate_schedule_advances_on_applied_updates_only(tmp_path):
    overflowed, _ = _run(tmp_path / "a", overflow_attempts={3}, lr_scheduler_type="linear")
    clean, _ = _run(tmp_path / "b", lr_scheduler_type="linear")
    overflowed.train()
    clean.train()

    rates = [[e["learning_rate"] for e in train_logs(t)] for t in (overflowed, clean)]
    assert rates[0] == rates[1]
    assert len(rates[0]) == 6


def test_each_log_is_an_applied_step_whose_loss_averages_every_attempt_since_the_last(tmp_path):
    losses: list[float] = []

    class RecordLosses(AmpTrainer):
        def training_step(self, *args, **kwargs):
            loss = super().training_step(*args, **kwargs)
            losses.append(loss.item())
            return loss

    model = make_tiny_bert()
    trainer = RecordLosses(
        model=model,
        args=tiny_training_args(tmp_path, max_steps=4, seed=0),
        train_dataset=ToyClassification(n=24),
        callbacks=[InjectOverflow(model.classifier.weight, {2})],
    )
    output = trainer.train()
    logs = train_logs(trainer)

    assert [e["step"] for e in logs] == [1, 2, 3, 4]
    assert [e["step_skipped"] for e in logs] == [0, 1, 0, 0]
    assert [e["optimizer_step_attempts"] for e in logs] == [1, 3, 4, 5]
    assert logs[1]["loss"] == pytest.approx((losses[1] + losses[2]) / 2, rel=1e-4)
    assert output.training_loss == pytest.approx(sum(losses) / 5, rel=1e-4)


def test_num_train_epochs_end_when_their_data_is_read_with_one_update_fewer(tmp_path):
    trainer, events = _run(
        tmp_path,
        overflow_attempts={6},  # the epoch's last batch
        max_steps=-1,
        num_train_epochs=1,
        save_strategy="steps",
        save_steps=4,
    )
    trainer.train()

    assert trainer.state.optimizer_step_attempts == 6  # 24 rows / 4 per batch
    assert trainer.state.global_step == 5
    assert trainer.state.epoch == 1.0
    assert events.saves == [4, 5]  # the end of training saves, after the skipped last attempt
    assert _state_file(tmp_path / "checkpoint-5")["optimizer_step_attempts"] == 6


class BarAtTheEnd(TrainerCallback):
    """transformers' progress bar as training ends (its on_train_end, which closes the bar, runs
    after the callbacks passed in ``callbacks=``)."""

    def __init__(self) -> None:
        self.trainer = None
        self.seen: tuple[int, int] | None = None

    def on_train_end(self, args, state, control, **kwargs):
        (bar,) = [
            cb.training_bar
            for cb in self.trainer.callback_handler.callbacks
            if isinstance(cb, ProgressCallback)
        ]
        self.seen = (bar.n, bar.total)


@pytest.mark.parametrize(
    "length, overflow_attempts, expected",
    [
        # The epoch holds 6 attempts (24 rows, 4 a batch); two are skipped, the last one too.
        (dict(max_steps=-1, num_train_epochs=1), {2, 6}, (6, 6)),
        (dict(max_steps=4), {2, 3}, (4, 4)),  # 4 applied updates, 6 attempts
    ],
    ids=["num_train_epochs", "max_steps"],
)
def test_the_progress_bar_ends_at_its_total_on_a_run_with_skips(
    tmp_path, length, overflow_attempts, expected
):
    bar = BarAtTheEnd()
    trainer, _ = _run(tmp_path, overflow_attempts, callbacks=[bar], disable_tqdm=False, **length)
    bar.trainer = trainer
    trainer.train()

    assert trainer.loss_scaler.stats.skipped == len(overflow_attempts)
    assert bar.seen == expected


@pytest.mark.parametrize(
    "length, overflow_attempts",
    [
        # Logs at step 5 (attempt 5); attempt 6, the epoch's last, is skipped: no step follows.
        (dict(max_steps=-1, num_train_epochs=1, logging_steps=5), {6}),
        # Logs at step 4; attempt 6 is skipped, attempt 7 applies step 6, no logging step.
        (dict(max_steps=6, logging_steps=4), {6}),
    ],
    ids=["skip-last", "skip-then-step"],
)
def test_the_last_log_holds_the_runs_final_skip_count_and_loss_scale(
    tmp_path, length, overflow_attempts
):
    trainer, _ = _run(tmp_path, overflow_attempts, **length)
    trainer.train()

    last = train_logs(trainer)[-1]
    assert last["skipped_steps"] == trainer.loss_scaler.stats.skipped == 1
    assert last["step_skipped"] == 1
    assert last["loss_scale"] == trainer.loss_scaler.get_scale()
    assert last["optimizer_step_attempts"] == trainer.state.optimizer_step_attempts
    assert math.isfinite(last["loss"])


def test_trainer_state_json_holds_the_attempts_and_the_batch_position(tmp_path):
    trainer, _ = _run(tmp_path, overflow_attempts={2}, save_strategy="steps", save_steps=3)
    trainer.train()

    state = _state_file(tmp_path / "checkpoint-3")
    assert state["global_step"] == 3
    assert state["optimizer_step_attempts"] == 4
    assert (state["train_dataloader_epoch"], state["train_dataloader_batches_seen"]) == (0, 4)
    assert TrainerState.load_from_json(str(tmp_path / "checkpoint-3" / "trainer_state.json"))


def _resume_matches_the_uninterrupted_run(tmp_path, checkpoint_step, dataset=None, **settings):
    make = (lambda: dataset()) if dataset is not None else (lambda: None)
    whole, _ = _run(tmp_path / "whole", dataset=make(), **settings)
    whole.train()
    checkpoint = tmp_path / "whole" / f"checkpoint-{checkpoint_step}"
    resumed, _ = _run(tmp_path / "resumed", dataset=make(), **settings)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    _assert_same_weights(_weights(resumed), _weights(whole))
    assert resumed.state.global_step == whole.state.global_step
    assert resumed.state.optimizer_step_attempts == whole.state.optimizer_step_attempts
    assert resumed.loss_scaler.state_dict() == whole.loss_scaler.state_dict()
    assert resumed.scale_history == whole.scale_history
    return whole, resumed, _state_file(checkpoint)


def test_a_resume_after_a_skipped_update_ends_bit_identical_to_the_uninterrupted_run(tmp_path):
    _, _, saved = _resume_matches_the_uninterrupted_run(
        tmp_path, 3, overflow_attempts={2}, save_strategy="steps", save_steps=3
    )
    assert saved["optimizer_step_attempts"] == 4  # resumed at batch 4, not at batch 3


def test_a_resume_after_a_skip_with_a_short_last_accumulation_window_is_bit_identical(tmp_path):
    # 22 rows, 4 per batch: 6 batches an epoch in windows of 4 and 2. Epoch 0's short window is
    # skipped; the checkpoint is after epoch 1's first window, so the resumed run starts with a
    # short window, at the batch position the attempts (not the steps) reached.
    _, _, saved = _resume_matches_the_uninterrupted_run(
        tmp_path,
        2,
        dataset=lambda: ToyClassification(n=22),
        overflow_attempts={2},
        gradient_accumulation_steps=4,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
    )
    assert saved["optimizer_step_attempts"] == 3
    assert (saved["train_dataloader_epoch"], saved["train_dataloader_batches_seen"]) == (1, 4)


def test_a_resume_at_an_epoch_boundary_after_a_skip_is_bit_identical(tmp_path):
    _, _, saved = _resume_matches_the_uninterrupted_run(
        tmp_path, 5, overflow_attempts={3}, max_steps=8, save_strategy="epoch"
    )
    assert (saved["train_dataloader_epoch"], saved["train_dataloader_batches_seen"]) == (1, 0)
    assert saved["optimizer_step_attempts"] == 6


def test_a_checkpoint_saved_right_after_a_skipped_attempt_resumes_with_that_skip(tmp_path):
    # The epoch's last attempt is skipped; the epoch's checkpoint follows it, at step 5.
    _, resumed, saved = _resume_matches_the_uninterrupted_run(
        tmp_path, 5, overflow_attempts={6}, max_steps=8, save_strategy="epoch"
    )
    assert saved["optimizer_step_attempts"] == 6
    assert {"step": 6, "scale": 65536.0, "skipped": True} in resumed.scale_history


@pytest.mark.parametrize("rows", [48, 24])
def test_a_resume_from_an_iterable_dataset_after_skips_is_bit_identical(tmp_path, rows):
    # The skips push the run past stock's max_steps-long reading of a stream: it reads on. With
    # 24 rows the checkpoint is at the pass's last batch: the resumed run finds the pass ended
    # and starts the next, as the uninterrupted one did.
    _, _, saved = _resume_matches_the_uninterrupted_run(
        tmp_path,
        4,
        dataset=lambda: ToyStream(n=rows),
        overflow_attempts={2, 3},
        save_strategy="steps",
        save_steps=4,
    )
    assert (saved["optimizer_step_attempts"], saved["train_dataloader_batches_seen"]) == (6, 6)


def test_a_stream_reads_on_after_skipped_updates_and_starts_a_new_pass_when_it_ends(tmp_path):
    stream = ToyStream(n=28)  # 7 batches a pass
    trainer, _ = _run(tmp_path, dataset=stream, overflow_attempts={2, 3, 4}, max_steps=6)
    trainer.train()

    assert trainer.state.optimizer_step_attempts == 9
    # Stock would restart the stream after max_steps=6 attempts; it is read on to its end (row
    # 27), then a second pass starts (Accelerate's loader reads one batch ahead).
    assert stream.yielded[:32] == [*range(28), 0, 1, 2, 3]


def test_a_stream_pass_ending_inside_an_accumulation_window_applies_it_alone(tmp_path):
    stream = ToyStream(n=12)  # 3 batches a pass, windows of 2: the last window has one batch
    trainer, _ = _run(tmp_path, dataset=stream, gradient_accumulation_steps=2, max_steps=2)
    trainer.train()

    assert stream.yielded == list(range(12))  # the second update is the pass's last batch alone
    assert trainer.state.global_step == _applied_updates(trainer) == 2


class SaidOn(logging.Handler):
    """What one logger said (transformers' loggers do not propagate to the root, so pytest's
    caplog does not see them)."""

    def __init__(self, name: str) -> None:
        super().__init__(logging.WARNING)
        self.logger, self.messages = logging.getLogger(name), []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> SaidOn:
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self)


@pytest.mark.parametrize("dispatch_batches", [False, True])
@pytest.mark.parametrize("overflow_attempts", [(), (2,)], ids=["no-skip", "one-skip"])
def test_a_stream_with_nothing_left_to_read_stops_training_and_says_so(
    tmp_path, dispatch_batches, overflow_attempts
):
    # 2 batches, ever (a one-pass iterator). With a skipped update the run reads once more than
    # stock would, into the exhausted stream, where Accelerate's batch dispatcher (its default
    # for a stream) raises "Batch does not contain any data" unless the trainer stops there.
    trainer, _ = _run(
        tmp_path,
        overflow_attempts,
        dataset=ToyStream(n=8, one_pass=True),
        accelerator_config={"dispatch_batches": dispatch_batches},
    )
    with SaidOn("transformers.trainer") as said:  # where transformers' own loop says it
        trainer.train()

    applied = 2 - len(overflow_attempts)
    assert trainer.state.global_step == applied
    assert trainer.state.optimizer_step_attempts == 2
    assert any(
        m.startswith(
            f"Training data exhausted at global_step={applied} before reaching max_steps=6"
        )
        for m in said.messages
    )


def test_a_checkpoint_without_the_attempt_counter_resumes_with_attempts_equal_to_global_step(
    tmp_path, caplog
):
    whole, _ = _run(tmp_path / "whole", save_strategy="steps", save_steps=3)
    whole.train()
    state_path = tmp_path / "whole" / "checkpoint-3" / "trainer_state.json"
    state = json.loads(state_path.read_text(encoding="utf-8"))
    for name in step_accounting.STEP_FIELDS:
        del state[name]
    state_path.write_text(json.dumps(state), encoding="utf-8")
    (state_path.parent / DIGEST_FILE).unlink()  # an older amp-trainer wrote no digest list

    resumed, _ = _run(tmp_path / "resumed", save_strategy="steps", save_steps=3)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(state_path.parent))

    assert resumed.state.optimizer_step_attempts == resumed.state.global_step == 6
    _assert_same_weights(_weights(resumed), _weights(whole))
    assert _old_position_lines(caplog) == []  # no skip before it: the position is exact


def _strip_the_position(checkpoint) -> None:
    """Make ``checkpoint`` look written by an amp-trainer that saved no batch position."""
    state_path = checkpoint / "trainer_state.json"
    state = json.loads(state_path.read_text(encoding="utf-8"))
    for name in step_accounting.STEP_FIELDS:
        del state[name]
    state_path.write_text(json.dumps(state), encoding="utf-8")
    (checkpoint / DIGEST_FILE).unlink()  # nor a digest list


def _old_position_lines(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelname == "WARNING" and "has no train_dataloader_epoch" in r.getMessage()
    ]


def test_an_old_checkpoint_after_a_skip_says_once_that_the_resume_reads_other_batches(
    tmp_path, caplog
):
    whole, _ = _run(tmp_path / "whole", overflow_attempts={2}, save_strategy="steps", save_steps=3)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    intact = shutil.copytree(checkpoint, tmp_path / "intact" / "checkpoint-3")
    _strip_the_position(checkpoint)

    resumed, _ = _run(tmp_path / "resumed", save_strategy="steps", save_steps=3)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    exact, _ = _run(tmp_path / "exact", save_strategy="steps", save_steps=3)
    exact.train(resume_from_checkpoint=str(intact))

    (line,) = _old_position_lines(caplog)
    assert line.startswith(
        "checkpoint-3 has no train_dataloader_epoch / train_dataloader_batches_seen (saved by "
        "stock Trainer or an older amp-trainer): the run resumes at the data position "
        "global_step=3 gives"
    )
    assert "had skipped 1 update(s) by then, so it had read 1 batch(es) more" in line
    # What the line says is so: the same checkpoint with its position resumes as the run went
    # on; without it, at another batch, to other weights.
    _assert_same_weights(_weights(exact), _weights(whole))
    assert any(
        not torch.equal(a, b) for a, b in zip(_weights(resumed).values(), _weights(exact).values())
    )


def test_an_old_checkpoint_that_cannot_tell_its_skips_says_so(tmp_path, caplog):
    whole, _ = _run(tmp_path / "whole", overflow_attempts={2}, save_strategy="steps", save_steps=3)
    whole.train()
    checkpoint = tmp_path / "whole" / "checkpoint-3"
    _strip_the_position(checkpoint)
    (checkpoint / "amp_trainer_state.json").unlink()
    state = json.loads((checkpoint / "trainer_state.json").read_text(encoding="utf-8"))
    state["log_history"] = []
    (checkpoint / "trainer_state.json").write_text(json.dumps(state), encoding="utf-8")

    resumed, _ = _run(tmp_path / "resumed", save_strategy="steps", save_steps=3)
    with caplog.at_level(logging.WARNING):
        resumed.train(resume_from_checkpoint=str(checkpoint))

    (line,) = _old_position_lines(caplog)
    assert "it does not record whether updates were skipped before it" in line


def test_consecutive_skips_stop_the_run_with_global_step_at_the_last_applied_update(tmp_path):
    trainer, events = _run(
        tmp_path,
        overflow_attempts=set(range(3, 100)),
        on_min_loss_scale="clamp",
        max_consecutive_skipped_steps=5,
    )
    with pytest.raises(
        RuntimeError, match=r"5 consecutive optimizer steps were skipped \(attempts 3-7 at step 3"
    ):
        trainer.train()

    assert trainer.state.global_step == 2
    assert trainer.state.optimizer_step_attempts == events.pre_optimizer == 7


def test_the_scale_history_records_a_skip_transformers_kept_from_on_optimizer_step(tmp_path):
    # Where transformers itself keeps skipped updates out of on_optimizer_step, the loss-scale
    # monitor learns of the skip at the next step's start and still records and counts it.
    trainer, _ = _run(tmp_path, overflow_attempts={3})
    monitor = next(
        cb for cb in trainer.callback_handler.callbacks if hasattr(cb, "follows_every_attempt")
    )
    monitor.follows_every_attempt = False
    trainer.train()

    skipped = [e for e in trainer.scale_history if e["skipped"]]
    assert [e["step"] for e in skipped] == [3]
    assert trainer.scale_history[-1]["step"] == 6


def test_a_transformers_that_counts_attempts_itself_gets_no_second_count(tmp_path, monkeypatch):
    @dataclasses.dataclass
    class StateWithAttempts(TrainerState):
        optimizer_step_attempts: int = 0

    monkeypatch.setattr(step_accounting, "TrainerState", StateWithAttempts)
    assert step_accounting.stock_counts_skipped_steps()
    trainer, _ = _run(tmp_path)

    assert not trainer._steps.active
    assert type(trainer.callback_handler) is CallbackHandler
    values = (3, 6, 24, 24, 4, 6, 6)
    assert trainer._steps.planned(values, trainer.args, trainer.get_train_dataloader()) == values

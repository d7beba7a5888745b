"""Where stock Trainer's own tests pin resume and callback behaviour, AmpTrainer behaves the same.

Each test runs stock ``Trainer`` and ``AmpTrainer`` side by side on the same tiny model and
data, after transformers' tests/trainer/test_trainer.py and test_trainer_callback.py
(test_resume_from_interrupted_training, test_stateful_callbacks, test_stateful_mixed_callbacks,
test_stateful_duplicate_callbacks, test_missing_stateful_callback,
test_auto_batch_size_with_resume_from_checkpoint, test_init_callback, test_add_remove_callback).
"""

from __future__ import annotations

import logging

import pytest
from transformers import (
    DefaultFlowCallback,
    EarlyStoppingCallback,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.trainer_callback import ExportableState

from amp_trainer import AmpTrainer
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import ToyClassification, reset_accelerate_state, tiny_training_args

#: Which trainer, with which arguments class and precision: stock is the reference.
KINDS = {
    "stock": (Trainer, TrainingArguments, {}),
    "amp-fp16": (AmpTrainer, None, {"precision": "fp16"}),
    "amp-fp32": (AmpTrainer, None, {"precision": "fp32"}),
}


def _trainer(kind, output_dir, callbacks=None, train_len=32, **overrides):
    trainer_cls, args_cls, precision = KINDS[kind]
    reset_accelerate_state()
    args = tiny_training_args(output_dir, cls=args_cls, **{**precision, **overrides})
    return trainer_cls(
        model=make_tiny_bert(),
        args=args,
        train_dataset=ToyClassification(n=train_len),
        eval_dataset=ToyClassification(n=8, seed=1),
        callbacks=callbacks,
    )


class ExportableCallback(TrainerCallback, ExportableState):
    """A stateful callback of transformers' test (MyTestExportableCallback)."""

    def __init__(self, my_test_state: str = "test") -> None:
        self.my_test_state = my_test_state

    def state(self) -> dict:
        return {"args": {"my_test_state": self.my_test_state}}


class PlainCallback(TrainerCallback):
    """A callback without state, next to a stateful one (MyTestTrainerCallback)."""

    def __init__(self, my_test_state: str = "test") -> None:
        self.my_test_state = my_test_state


class FakeOutOfMemory(TrainerCallback):
    """transformers' MockCudaOOMCallback: "out of memory" while the batch is >= the limit."""

    def __init__(self, limit: int = 4) -> None:
        self.limit = limit

    def on_step_end(self, args, state, control, **kwargs):
        if state.train_batch_size >= self.limit:
            raise RuntimeError("CUDA out of memory.")


EVAL_AND_SAVE_AT_2 = dict(
    load_best_model_at_end=True,
    save_strategy="steps",
    eval_strategy="steps",
    save_steps=2,
    eval_steps=2,
    max_steps=2,
)


@pytest.mark.parametrize("kind", KINDS)
def test_an_unfinished_checkpoint_resumed_by_epochs_trains_to_the_end_of_the_epoch(kind, tmp_path):
    # A max_steps=2 run stores num_train_epochs=1 (2 of 8 steps rounds up): that is no reason
    # to stop a num_train_epochs=1 resume at step 2.
    first = _trainer(kind, tmp_path / "first", max_steps=2, save_strategy="steps", save_steps=2)
    first.train()
    resumed = _trainer(kind, tmp_path / "resumed", max_steps=-1, num_train_epochs=1)
    resumed.train(resume_from_checkpoint=str(tmp_path / "first" / "checkpoint-2"))
    assert resumed.state.global_step == 8  # 32 samples / batch 4
    assert resumed.state.max_steps == 8


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_a_final_checkpoint_restores_a_stateful_callback(kind, tmp_path):
    early = EarlyStoppingCallback(early_stopping_patience=5, early_stopping_threshold=0.2)
    _trainer(kind, tmp_path, callbacks=[early], **EVAL_AND_SAVE_AT_2).train()
    trainer = _trainer(
        kind,
        tmp_path,
        callbacks=[EarlyStoppingCallback()],
        restore_callback_states_from_checkpoint=True,
        **EVAL_AND_SAVE_AT_2,
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    (cb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, EarlyStoppingCallback)]
    assert (cb.early_stopping_patience, cb.early_stopping_threshold) == (5, 0.2)


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_a_final_checkpoint_restores_stateful_next_to_plain_callbacks(kind, tmp_path):
    callbacks = [PlainCallback("another value"), EarlyStoppingCallback(5, 0.2)]
    _trainer(kind, tmp_path, callbacks=callbacks, **EVAL_AND_SAVE_AT_2).train()
    trainer = _trainer(
        kind,
        tmp_path,
        callbacks=[EarlyStoppingCallback(), PlainCallback()],
        restore_callback_states_from_checkpoint=True,
        **EVAL_AND_SAVE_AT_2,
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    plain, early = [
        c
        for c in trainer.callback_handler.callbacks
        if isinstance(c, (EarlyStoppingCallback, PlainCallback))
    ]
    assert (early.early_stopping_patience, early.early_stopping_threshold) == (5, 0.2)
    assert plain.my_test_state == "test"  # not stateful: the new trainer's own


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_a_final_checkpoint_restores_duplicate_stateful_callbacks(kind, tmp_path):
    callbacks = [ExportableCallback("first"), ExportableCallback("second")]
    _trainer(kind, tmp_path, callbacks=callbacks, **EVAL_AND_SAVE_AT_2).train()
    trainer = _trainer(
        kind,
        tmp_path,
        callbacks=[ExportableCallback(), ExportableCallback()],
        restore_callback_states_from_checkpoint=True,
        **EVAL_AND_SAVE_AT_2,
    )
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    states = [
        c.my_test_state
        for c in trainer.callback_handler.callbacks
        if isinstance(c, ExportableCallback)
    ]
    assert states == ["first", "second"]


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_a_final_checkpoint_names_a_missing_stateful_callback(kind, tmp_path, caplog):
    _trainer(kind, tmp_path, callbacks=[EarlyStoppingCallback()], **EVAL_AND_SAVE_AT_2).train()
    trainer = _trainer(kind, tmp_path, restore_callback_states_from_checkpoint=True, max_steps=2)
    with caplog.at_level(logging.WARNING):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert "Checkpoint included callbacks not included in current configuration" in caplog.text
    assert "EarlyStoppingCallback" in caplog.text


@pytest.mark.parametrize("kind", KINDS)
def test_resuming_a_final_checkpoint_keeps_the_batch_size_auto_find_batch_size_found(
    kind, tmp_path
):
    run = dict(max_steps=2, save_strategy="steps", save_steps=1, auto_find_batch_size=True)
    first = _trainer(kind, tmp_path, callbacks=[FakeOutOfMemory()], **run)
    first.train()
    found = first._train_batch_size
    assert found < 4  # the batch really shrank
    trainer = _trainer(kind, tmp_path, **run)
    assert trainer._train_batch_size == 4
    trainer.train(resume_from_checkpoint=True)
    assert trainer._train_batch_size == found


def _callback_types(trainer):
    return [type(c).__name__ for c in trainer.callback_handler.callbacks]


def test_an_fp32_amp_trainer_has_stock_trainers_callbacks(tmp_path):
    stock = _trainer("stock", tmp_path, callbacks=[PlainCallback])
    amp = _trainer("amp-fp32", tmp_path, callbacks=[PlainCallback])
    assert _callback_types(amp) == _callback_types(stock)
    assert _callback_types(stock) == ["DefaultFlowCallback", "PlainCallback", "PrinterCallback"]


def test_an_fp16_amp_trainer_puts_its_monitor_after_stocks_default_callbacks(tmp_path):
    stock = _trainer("stock", tmp_path, callbacks=[PlainCallback])
    amp = _trainer("amp-fp16", tmp_path, callbacks=[PlainCallback])
    expected = _callback_types(stock)
    expected.insert(1, "LossScaleMonitor")
    assert _callback_types(amp) == expected
    # transformers' test_add_remove_callback: callbacks[0] is the flow callback, by position too.
    for trainer in (stock, amp):
        first = trainer.callback_handler.callbacks[0]
        assert isinstance(first, DefaultFlowCallback)
        assert trainer.pop_callback(first) is first
        trainer.add_callback(first)
        trainer.remove_callback(DefaultFlowCallback)
        assert not any(
            isinstance(c, DefaultFlowCallback) for c in trainer.callback_handler.callbacks
        )
    assert isinstance(amp.callback_handler.callbacks[-1], PrinterCallback)


def test_the_fp16_monitor_runs_before_user_callbacks(tmp_path):
    # A user callback reading scale_history at on_optimizer_step sees this step's entry.
    class Reader(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_optimizer_step(self, args, state, control, **kwargs):
            self.seen.append(len(amp.scale_history))

    reader = Reader()
    amp = _trainer("amp-fp16", tmp_path, callbacks=[reader], max_steps=3)
    amp.train()
    assert reader.seen == [1, 2, 3]

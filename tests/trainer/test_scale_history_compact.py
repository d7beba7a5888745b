"""scale_history keeps the run's events, not one entry per step: checkpoints stay small.

The long runs drive AmpTrainer's own loss-scale monitor and checkpoint keeper with a real
DynamicLossScaler stepping a real parameter (a Trainer step costs ~20 ms here, so thousands of
them would take a minute); the resume test runs the real Trainer end to end.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from transformers import TrainerControl

from amp_trainer import AmpTrainer
from amp_trainer.atomic_files import write_json_atomic
from amp_trainer.checkpointing import AMP_STATE_FILE
from amp_trainer.recipes.reporting import plot_training, summarize_loss_scale
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import (
    InjectOverflow,
    ToyClassification,
    reset_accelerate_state,
    tiny_training_args,
)

OVERFLOWS = {7, 8, 40, 333}  # the same events in every run length below


def _monitored_run(tmp_path, steps, *, logging_steps=None, growth_interval=10**6, save_at=()):
    """``steps`` optimizer steps through AmpTrainer's monitor; the per-step truth; file sizes.

    Returns the trainer, the full per-step record (what the history used to hold) and the size
    of ``amp_trainer_state.json`` written at each step of ``save_at``.
    """
    overrides = {"logging_strategy": "no"} if logging_steps is None else {}
    args = tiny_training_args(
        tmp_path,
        loss_scale_init=2.0**10,
        loss_scale_growth_interval=growth_interval,
        logging_steps=logging_steps or 1,
        **overrides,
    )
    trainer = AmpTrainer(model=torch.nn.Linear(2, 1), args=args)
    # The monitor sits after stock's default callbacks (DefaultFlowCallback stays first).
    monitor = next(
        cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "LossScaleMonitor"
    )
    scaler, state, control = trainer.loss_scaler, trainer.state, TrainerControl()
    state.logging_steps = logging_steps or 1  # what Trainer.train() sets from the arguments
    weight = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([weight], lr=1e-3)
    full, sizes = [], {}
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        loss = (weight * (float("inf") if step in OVERFLOWS else 1.0)).sum()
        scaler.scale(loss).backward()
        monitor.on_pre_optimizer_step(args, state, control)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        monitor.on_optimizer_step(args, state, control)
        state.global_step = step
        full.append({"step": step, "scale": scale, "skipped": step in OVERFLOWS})
        if step in save_at:
            path = tmp_path / f"checkpoint-{step}" / AMP_STATE_FILE
            write_json_atomic(path, trainer._checkpoints.saver.amp_state())
            sizes[step] = path.stat().st_size
    return trainer, full, sizes


def _scale_at(history, step):
    """The scale step ``step`` ran with, read from a compact history."""
    return [e for e in history if e["step"] <= step][-1]["scale"]


def test_checkpoint_bookkeeping_size_does_not_grow_with_run_length(tmp_path):
    trainer, full, sizes = _monitored_run(tmp_path, 4000, save_at=(1000, 4000))

    # Same events, four times the steps: the same bytes (the old per-step list: 84 KB -> 328 KB).
    assert sizes[1000] == sizes[4000] < 1100
    saved = json.loads((tmp_path / "checkpoint-4000" / AMP_STATE_FILE).read_text())
    history = saved["scale_history"]
    assert history == trainer.scale_history
    # First step, 4 skips, 4 first steps at a backed-off scale (two coincide with the skip at
    # step 8), the latest step: nothing else.
    assert [e["step"] for e in history] == [1, 7, 8, 9, 40, 41, 333, 334, 4000]
    # Nothing the per-step list held is lost.
    assert all(_scale_at(history, e["step"]) == e["scale"] for e in full)
    assert {e["step"] for e in history if e["skipped"]} == OVERFLOWS
    final = trainer.loss_scaler.get_scale()
    assert summarize_loss_scale(history, final) == summarize_loss_scale(full, final)


def test_growths_and_logging_steps_are_kept_and_bound_the_size(tmp_path):
    trainer, full, _ = _monitored_run(tmp_path, 3000, logging_steps=250, growth_interval=500)
    history = trainer.scale_history

    growths = trainer.loss_scaler.stats.growths
    assert growths >= 4  # the scale does move up as well as down in this run
    changes = [b["step"] for a, b in itertools.pairwise(full) if b["scale"] != a["scale"]]
    steps = [e["step"] for e in history]
    assert set(changes) <= set(steps)
    assert {s for s in range(250, 3001, 250)} <= set(steps)
    # events (skips and scale changes) + one per logging step + the first and latest step
    assert len(history) <= len(OVERFLOWS) + len(changes) + 3000 // 250 + 2
    assert all(_scale_at(history, e["step"]) == e["scale"] for e in full)
    final = trainer.loss_scaler.get_scale()
    assert summarize_loss_scale(history, final) == summarize_loss_scale(full, final)


def test_every_logging_step_keeps_one_entry_per_step(tmp_path):
    trainer, full, _ = _monitored_run(tmp_path, 50, logging_steps=1)

    assert trainer.scale_history == full


def test_plot_draws_the_compact_history(tmp_path):
    pytest.importorskip("matplotlib")
    trainer, _, _ = _monitored_run(tmp_path, 400)
    logs = [{"step": 100, "loss": 0.9}, {"step": 400, "loss": 0.7}]

    path = plot_training(logs, trainer.scale_history, tmp_path / "plot.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _real_run(output_dir):
    model = make_tiny_bert()
    args = tiny_training_args(
        output_dir,
        max_steps=6,
        logging_steps=4,
        save_strategy="steps",
        save_steps=3,
        loss_scale_init=2.0**10,
        loss_scale_growth_interval=3,
    )
    return AmpTrainer(
        model=model,
        args=args,
        train_dataset=ToyClassification(),
        callbacks=[InjectOverflow(model.classifier.weight, {1, 6})],
    )


def test_resume_continues_the_compact_history_into_the_uninterrupted_runs(tmp_path):
    reset_accelerate_state()
    full = _real_run(tmp_path / "full")
    full.train()
    reset_accelerate_state()
    resumed = _real_run(tmp_path / "resumed")
    # checkpoint-3 ends on a step that is neither an event nor a logging step (kept as latest)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-3"))

    # Attempts 1 and 6 overflow; a skipped attempt is no step, so the next one has its number:
    # 1 skipped, 1 first at 512, 4 logged and first at 1024 (grown after 3 clean steps),
    # 5 skipped, 5 first at 512, 6 the latest.
    assert [e["step"] for e in full.scale_history] == [1, 1, 4, 5, 5, 6]
    assert resumed.scale_history == full.scale_history
    summary = summarize_loss_scale(resumed.scale_history, resumed.loss_scaler.get_scale())
    # 6 applied updates and 2 skipped attempts: 8 updates of the scaler, as it counted them.
    assert (summary.scaler_updates, summary.skipped, summary.minimum) == (8, 2, 512.0)
    assert summary.scaler_updates == resumed.loss_scaler.stats.steps
    assert resumed.loss_scaler.state_dict() == full.loss_scaler.state_dict()

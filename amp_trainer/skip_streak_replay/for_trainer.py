"""How :class:`~amp_trainer.AmpTrainer` runs the skip-streak replay: its arguments, the loss it
trains on, the forward-overflow guard's divergence judgement and islands, where each batch sits
in the data, and the ``replay_verdict`` log entry."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from amp_trainer.skip_streak_replay import SkipStreakReplay

__all__ = ["replay_for_trainer"]


def replay_for_trainer(trainer: Any, model: nn.Module) -> SkipStreakReplay | None:
    """The replay an :class:`~amp_trainer.AmpTrainer` runs for ``model`` (``None`` when
    ``skip_streak_replay=0``, without a loss scaler, or under FSDP, whose backward outside its
    own forward would run its reduce-scatter hooks). It shares the forward-overflow guard's
    divergence judgement and islands, replays the loss the trainer trains on, logs each verdict
    as ``replay_verdict`` and appends it to ``trainer.replay_verdicts``."""
    args = trainer.args
    streak = getattr(args, "skip_streak_replay", 8)
    if not streak or trainer.loss_scaler is None or trainer.is_fsdp_enabled:
        return None
    guard = trainer._forward_overflow

    def where() -> dict[str, Any]:
        state = trainer.state  # train() makes a new one
        seen = getattr(state, "train_dataloader_batches_seen", None)
        return {
            "epoch": getattr(state, "train_dataloader_epoch", None),
            "position": None if seen is None else seen + replay.pending,
        }

    def locate(record: dict[str, Any]) -> list[int] | None:
        """Dataset indices of a batch's rows: known for a sequential sampler on one process."""
        loader = getattr(trainer.callback_handler, "train_dataloader", None)
        batches = getattr(loader, "batch_sampler", None)
        sampler = getattr(batches, "sampler", None)
        sequential = isinstance(sampler, torch.utils.data.SequentialSampler)
        size = getattr(batches, "batch_size", None)  # the loader's: auto_find_batch_size, DP
        if not sequential or not size or args.world_size > 1 or record.get("position") is None:
            return None
        start = record["position"] * size
        return list(range(start, start + size))

    replay = SkipStreakReplay(
        model,
        trainer.loss_scaler,
        streak=streak,
        quarantine=getattr(args, "skip_streak_quarantine", 0),
        forward=trainer._loss_of_batch,
        judge=guard.judge if guard is not None else None,
        on_divergence=getattr(args, "on_divergence", "raise"),
        make_islands=guard.rerun.make_islands if guard is not None else None,
        locate_batch=locate,
        on_verdict=lambda entry: trainer.log({"replay_verdict": entry["verdict"]}),
        verdicts=trainer.replay_verdicts,
        where=where,
    )
    replay.optimizer_of = lambda: trainer.optimizer
    return replay

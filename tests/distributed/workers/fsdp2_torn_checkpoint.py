"""Two-process worker: one FSDP2 rank killed mid-save, then the run resumed with ``True``.

Launched twice by tests/distributed/test_fsdp2_torn_checkpoint.py with ``torch.distributed.run``
(gloo, CPU), on Accelerate's FSDP2 path as workers/trainer_fsdp2.py forces it:

``kill``: 6 steps, a checkpoint every 2, ``save_total_limit=1``. In checkpoint-4's save, rank 1
is killed with SIGKILL at the worst moment: its sharded model and optimizer are written, its
``rng_state_1.pth`` is not, and rank 0 has already written ``trainer_state.json`` (rank 1 waits
for that file, then kills itself: without the wait the race is won only about one time in two).
Rank 1 waits another 2 s first, so that rank 0 finishes all it does before waiting for the other
ranks (stock rotation deleted checkpoint-2 there); killed sooner, torchrun's SIGTERM can end
rank 0 before it gets that far.

``resume``: the torn checkpoint resumed by path (into another folder), a fresh trainer on the
run's folder with ``train(resume_from_checkpoint=True)`` (``save_total_limit=1`` again), then
another resuming the final checkpoint-6 with the same ``max_steps`` ("nothing to train") and a
different ``loss_scale_init``. Each rank writes ``rank<N>.json``: the warnings, the steps each
run trained and the scaler states.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
from transformers import TrainerCallback

from tests.distributed.workers.trainer_fsdp2 import ForcedFSDP2Trainer, fsdp2_args
from tests.helpers.distributed import leave_without_teardown
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import ToyClassification

KILL_STEP = 4


class StepsTrained(TrainerCallback):
    """The steps this run trained (a resumed run's log history holds the checkpoint's too)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


def trainer(run_dir: Path, cls: type = ForcedFSDP2Trainer, **overrides) -> ForcedFSDP2Trainer:
    # save_total_limit=1: a torn checkpoint must not rotate the last complete one away.
    args = fsdp2_args(run_dir, **{"save_steps": 2, "save_total_limit": 1, **overrides})
    return cls(
        model=make_tiny_bert(seed=0),
        args=args,
        train_dataset=ToyClassification(64, seed=1),
        callbacks=[StepsTrained()],
    )


class KilledInSave(ForcedFSDP2Trainer):
    """Rank 1 is SIGKILLed in checkpoint-4's save, before it writes its RNG state."""

    def _save_rng_state(self, output_dir):
        if dist.get_rank() == 1 and self.state.global_step == KILL_STEP:
            state = Path(output_dir) / "trainer_state.json"
            deadline = time.monotonic() + 120
            while not state.exists() and time.monotonic() < deadline:
                time.sleep(0.02)
            time.sleep(2.0)  # rank 0 does the rest of its save alone, then waits for this rank
            os.kill(os.getpid(), signal.SIGKILL)
        return super()._save_rng_state(output_dir)


def main() -> None:
    out_dir, mode = Path(sys.argv[1]), sys.argv[2]
    run_dir = out_dir / "run"
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    if mode == "kill":
        trainer(run_dir, KilledInSave).train()
        return  # not reached on either rank: rank 1 is killed, rank 0 fails or is ended

    warnings: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("amp_trainer").addHandler(handler)

    explicit = trainer(out_dir / "explicit")
    explicit.train(resume_from_checkpoint=str(run_dir / f"checkpoint-{KILL_STEP}"))
    explicit_warnings = list(warnings)
    warnings.clear()

    resumed = trainer(run_dir)
    resumed.train(resume_from_checkpoint=True)
    trained = next(c for c in resumed.callback_handler.callbacks if isinstance(c, StepsTrained))
    result = {
        "explicit_warnings": explicit_warnings,
        "resume_warnings": list(warnings),
        "resumed_steps": trained.steps,
        "resumed_global_step": resumed.state.global_step,
        "resumed_scaler": resumed.loss_scaler.state_dict(),
    }
    warnings.clear()
    finished = trainer(out_dir / "finished", loss_scale_init=2.0**20)
    finished.train(resume_from_checkpoint=str(run_dir / "checkpoint-6"))
    result["finished_warnings"] = list(warnings)
    result["finished_scaler"] = finished.loss_scaler.state_dict()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    leave_without_teardown()


if __name__ == "__main__":
    main()

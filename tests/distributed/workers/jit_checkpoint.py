"""Two-process worker: SIGTERM that reaches one rank only still stops both at one checkpoint.

Launched by tests/distributed/test_recipe_preemption_distributed.py with ``torch.distributed.run``
(gloo, CPU), with ``enable_jit_checkpoint``. Rank 1 alone gets SIGTERM (its real handler, grace
timer set to 0 s) inside step 3; rank 0 never does. A rank that stopped alone would leave the other
waiting in the next step's gradient all-reduce. Each rank writes ``<out_dir>/rank<N>.json``: the
step it stopped at, the checkpoint it reports and its scaler state.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer_jit_checkpoint import JITCheckpointCallback

from amp_trainer import AmpTrainer, AmpTrainingArguments
from tests.helpers.distributed import leave_without_teardown
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import ToyClassification

STOP_STEP = 3


class SigtermOnRankOne(TrainerCallback):
    def __init__(self) -> None:
        self.manager = None

    def on_step_begin(self, args, state, control, **kwargs):
        if dist.get_rank() == 1 and state.global_step + 1 == STOP_STEP:
            self.manager.kill_wait = 0
            signal.raise_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while not self.manager.is_checkpoint_requested and time.monotonic() < deadline:
                time.sleep(0.01)


def main() -> None:
    out_dir = Path(sys.argv[1])
    args = AmpTrainingArguments(
        output_dir=str(out_dir / "run"),
        use_cpu=True,
        fp16=True,
        max_steps=8,
        logging_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        enable_jit_checkpoint=True,
    )
    sigterm = SigtermOnRankOne()
    trainer = AmpTrainer(
        model=make_tiny_bert(seed=0),
        args=args,
        train_dataset=ToyClassification(64, seed=1),
        callbacks=[sigterm],
    )
    (jit,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, JITCheckpointCallback)]
    sigterm.manager = jit.jit_manager
    trainer.train()
    rank = dist.get_rank()
    result = {
        "global_step": trainer.state.global_step,
        "jit_checkpoint": trainer.jit_checkpoint,
        "scaler": trainer.loss_scaler.state_dict(),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    leave_without_teardown()


if __name__ == "__main__":
    main()

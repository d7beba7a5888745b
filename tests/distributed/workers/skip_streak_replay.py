"""Two-process worker: a skip streak's replay reaches the same verdict on every rank.

Launched by tests/distributed/test_skip_streak_replay_distributed.py with
``torch.distributed.run`` (gloo, CPU, DDP). Rank 1 trains on data whose gradients overflow the
model's FP16 backward at every loss scale; rank 0 on all-zero inputs whose targets are the
model's own outputs (a zero loss), whose own replay would say ``scale_warmup``. The found-inf
flag is reduced, so both ranks skip together; the replay's findings are gathered, so both make
the same FP32 island and restore the same scale. Each rank writes ``<out_dir>/rank<N>.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from amp_trainer import AmpTrainer, AmpTrainingArguments
from amp_trainer.islands import fp32_islands
from tests.helpers.distributed import leave_without_teardown
from tests.helpers.replay_models import BackwardOverflowRegression, Regression


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(__import__("os").environ["RANK"])
    args = AmpTrainingArguments(
        output_dir=str(out_dir / "run"),
        use_cpu=True,
        fp16=True,
        max_steps=3,
        logging_steps=100,
        per_device_train_batch_size=8,
        learning_rate=1e-2,
        skip_streak_replay=4,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    model = BackwardOverflowRegression(seed=0)
    data = Regression(32, seed=rank)
    if rank == 0:  # no update is applied before the replay: the weights are still these
        data.x = torch.zeros_like(data.x)
        with torch.no_grad():
            data.y = model(x=data.x, labels=data.y)["logits"].detach().clone()
    trainer = AmpTrainer(model=model, args=args, train_dataset=data)
    trainer.train()
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    result = {
        "world_size": dist.get_world_size(),
        "wrapped": type(trainer.model_wrapped).__name__,
        "verdicts": trainer.replay_verdicts,
        "islands": fp32_islands(trainer.model),
        "scale": trainer.loss_scaler.get_scale(),
        "global_step": trainer.state.global_step,
        "param_sum": float(flat.double().sum()),
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    leave_without_teardown()


if __name__ == "__main__":
    main()

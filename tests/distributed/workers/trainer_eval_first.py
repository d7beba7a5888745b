"""Two-process worker: ``evaluate()`` before ``train()`` must still train synchronised replicas.

Launched by tests/distributed/test_trainer_eval_first_distributed.py with ``torch.distributed.run``
(gloo, CPU). Stock Trainer's evaluation prepares the bare model with ``evaluation_mode=True``, which
marks it prepared, so the ``prepare`` inside ``train()`` returned it without the DDP wrapper: each
rank then trained its own replica on its own shard of the data. Each rank writes
``<out_dir>/rank<N>.json`` (the wrapper type, the skip history) and its final parameters
``rank<N>.pt``.

A second run in the same launch (process start-up dominates the cost): the two-sided rule
(``loss_scale_grow_on_underflow``) from scale 1 on a loss 10^4 times smaller, each rank on its own
shard of the data; its scales, logged underflow readings and parameters go to
``rank<N>_underflow.json`` / ``rank<N>_underflow.pt``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from amp_trainer import AmpTrainer, AmpTrainingArguments
from tests.helpers.distributed import leave_without_teardown
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import ToyClassification


class SmallLossTrainer(AmpTrainer):
    """The loss times 1e-4: gradients far below FP16's range at small loss scales."""

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kwargs)
        return (loss * 1e-4, outputs) if return_outputs else loss * 1e-4


def underflow_run(out_dir: Path, rank: int) -> None:
    args = AmpTrainingArguments(
        output_dir=str(out_dir / "underflow"),
        use_cpu=True,
        fp16=True,
        max_steps=6,
        logging_steps=1,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        loss_scale_init=1.0,
        loss_scale_grow_on_underflow=True,
        loss_scale_underflow_check_interval=2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = SmallLossTrainer(
        model=make_tiny_bert(seed=0), args=args, train_dataset=ToyClassification(48, seed=3)
    )
    trainer.train()
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    torch.save(flat, out_dir / f"rank{rank}_underflow.pt")
    logged = [
        {key: entry[key] for key in ("step", "grad_underflow", "grad_headroom") if key in entry}
        for entry in trainer.state.log_history
        if "grad_underflow" in entry
    ]
    result = {
        "scales": [entry["scale"] for entry in trainer.scale_history],
        "logged": logged,
        "growths": trainer.loss_scaler.stats.underflow_growths,
        "final_scale": trainer.loss_scaler.get_scale(),
    }
    (out_dir / f"rank{rank}_underflow.json").write_text(json.dumps(result))


def main() -> None:
    out_dir = Path(sys.argv[1])
    args = AmpTrainingArguments(
        output_dir=str(out_dir / "run"),
        use_cpu=True,
        fp16=True,
        max_steps=4,
        logging_steps=1,  # scale_history keeps every logging step: one entry per step here
        per_device_train_batch_size=4,
        per_device_eval_batch_size=4,
        learning_rate=1e-2,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    trainer = AmpTrainer(
        model=make_tiny_bert(seed=0),
        args=args,
        train_dataset=ToyClassification(32, seed=1),
        eval_dataset=ToyClassification(8, seed=2),
    )
    metrics = trainer.evaluate()
    trainer.train()
    rank = dist.get_rank()
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    torch.save(flat, out_dir / f"rank{rank}.pt")
    result = {
        "world_size": dist.get_world_size(),
        "backend": dist.get_backend(),
        "wrapped": type(trainer.model_wrapped).__name__,
        "eval_loss_finite": bool(torch.isfinite(torch.tensor(metrics["eval_loss"]))),
        "scales": [entry["scale"] for entry in trainer.scale_history],
    }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    underflow_run(out_dir, rank)
    leave_without_teardown()


if __name__ == "__main__":
    main()

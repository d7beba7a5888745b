"""Two-process worker: the skip-streak replay's other verdicts, each provoked on one rank only.

Launched by tests/distributed/test_skip_streak_replay_distributed.py with
``torch.distributed.run`` (gloo, CPU, DDP). Four short AmpTrainer runs, one after another in the
same process group:

* ``data_stop``: rank 1's dataset holds an inf in one sample's features, rank 0's is clean; no
  quarantine allowed, so the run must stop with ``BadBatchError`` on both ranks (a rank that went
  on alone would hang the other in its next all-reduce);
* ``data_quarantine``: the same with ``skip_streak_quarantine=1``: both ranks drop the batch,
  put the scale back and finish every step with equal replicas;
* ``divergence``: a learning rate that diverges, both ranks stop with ``DivergenceError``;
* ``scale_warmup``: an initial scale of 2**30, both ranks read ``scale_warmup`` and act on
  nothing.

Each rank writes ``<out_dir>/rank<N>.json``: per run, the verdicts, the error raised (class
name), the steps, the scale and a checksum of the parameters.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from amp_trainer import AmpTrainer, AmpTrainingArguments
from amp_trainer.islands import fp32_islands
from tests.helpers.distributed import leave_without_teardown
from tests.helpers.replay_models import PlainRegression, Regression

DATA_RUN = dict(
    max_steps=6,
    per_device_train_batch_size=4,
    skip_streak_replay=1,
    loss_scale_init=2.0**8,  # no start-up skips: the one skip is the bad batch's
    on_forward_overflow="skip",
)
RUNS: dict[str, dict[str, Any]] = {
    "data_stop": dict(DATA_RUN),
    "data_quarantine": dict(DATA_RUN, skip_streak_quarantine=1),
    "divergence": dict(
        max_steps=30,
        learning_rate=5.0,
        per_device_train_batch_size=8,
        max_grad_norm=0.0,
        skip_streak_replay=2,
    ),
    "scale_warmup": dict(
        max_steps=4, per_device_train_batch_size=8, loss_scale_init=2.0**30, skip_streak_replay=3
    ),
}


class SequentialTrainer(AmpTrainer):
    """Reads the dataset in order; Accelerate hands the ranks whole batches in turn (rank 0
    samples 0-3, rank 1 samples 4-7, rank 0 8-11, rank 1 12-15, ...), so the bad sample is
    surely read, by rank 1, at the second step, and only once in the run's 6 steps."""

    def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
        return torch.utils.data.SequentialSampler(self.train_dataset)


def _data(name: str, rank: int) -> Regression:
    if name.startswith("data"):
        # Rank 1 alone holds the bad sample (its own dataset; rank 0's is clean).
        return Regression(48, seed=rank, inf_at=13 if rank == 1 else None)
    return Regression(64, seed=rank)


def _run(name: str, out_dir: Path, rank: int) -> dict[str, Any]:
    args = AmpTrainingArguments(
        output_dir=str(out_dir / name),
        use_cpu=True,
        precision="fp16",
        logging_steps=100,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        **{"learning_rate": 1e-3, **RUNS[name]},
    )
    cls = SequentialTrainer if name.startswith("data") else AmpTrainer
    trainer = cls(model=PlainRegression(seed=0), args=args, train_dataset=_data(name, rank))
    error = None
    try:
        trainer.train()
    except Exception as err:  # what each rank raised is the result
        error = type(err).__name__
    flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
    return {
        "error": error,
        "verdicts": [
            {k: v for k, v in entry.items() if k in ("verdict", "modules", "rank_verdicts")}
            | ({"quarantined": True} if entry.get("quarantined") else {})
            | (
                {"sample_indices": [b.get("sample_indices") for b in entry["batches"]]}
                if "batches" in entry
                else {}
            )
            for entry in trainer.replay_verdicts
        ],
        "global_step": trainer.state.global_step,
        "scale": trainer.loss_scaler.get_scale(),
        "islands": fp32_islands(trainer.model),
        "param_sum": float(flat.double().sum()),
    }


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = int(os.environ["RANK"])
    result: dict[str, Any] = {"world_size": dist.get_world_size()} if dist.is_initialized() else {}
    for name in RUNS:
        result[name] = _run(name, out_dir, rank)
        result.setdefault("world_size", dist.get_world_size())
        dist.barrier()  # the next run starts together on both ranks
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    leave_without_teardown()


if __name__ == "__main__":
    main()

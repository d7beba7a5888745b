"""Two-process worker: set up, train and leave a DDP run on gloo many times, as a script ends.

Each round is what ``examples/accelerate_loop.py`` does once: a fresh process group, a model
prepared by :class:`AmpAccelerator` (wrapped in DDP), fp16 steps whose scaler all-reduces
found-inf, ``end_training()``, then the model freed. Without freeing DDP's Reducer first the
process hangs in one of the first rounds (the Reducer destroys the gloo group with the GIL held
while a gloo worker thread waits for the GIL; see ``amp_trainer.ddp_teardown``). Mode ``plain``
does the same with bare torch (``DistributedDataParallel`` + ``destroy_process_group``) and
:func:`release_ddp_reducers`, as a stock loop would call it.

Each round gets its own process group through a ``FileStore`` in ``out_dir`` (torchrun's store
serves one rendezvous). Rank N writes ``rank<N>.json``: the rounds it finished and what it saw.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, GradientState

from amp_trainer import AmpAccelerator, release_ddp_reducers

ROUNDS = 12


def accelerate_round(out_dir: Path, rank: int, index: int) -> dict:
    store = dist.FileStore(str(out_dir / f"store-{index}"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = AmpAccelerator(mixed_precision="fp16", cpu=True)
    torch.manual_seed(index)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    wrapped = type(model).__name__
    for _ in range(2):
        loss = model(torch.randn(8, 16)).float().pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    steps = accelerator.loss_scaler.stats.steps
    accelerator.end_training()
    left = {name: name in model.__dict__ for name in ("reducer", "logger")}
    del model, optimizer, accelerator
    gc.collect()
    return {"wrapped": wrapped, "steps": steps, "left_after_end_training": left}


def plain_round(out_dir: Path, rank: int, index: int) -> dict:
    store = dist.FileStore(str(out_dir / f"store-{index}"), 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(16, 16))
    model(torch.randn(8, 16)).sum().backward()
    flag = torch.zeros(1)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # as the scaler's found-inf reduction
    del flag
    released = release_ddp_reducers(model, None, torch.nn.Linear(2, 2))
    dist.destroy_process_group()
    del model
    gc.collect()
    return {"released": released}


def main() -> None:
    out_dir, mode = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    one_round = accelerate_round if mode == "accelerate" else plain_round
    rounds = []
    for index in range(ROUNDS):
        rounds.append(one_round(out_dir, rank, index))
        (out_dir / f"rank{rank}.json").write_text(json.dumps(rounds))


if __name__ == "__main__":
    main()

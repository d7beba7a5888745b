"""Two real processes on gloo: the skip decision and the scale are the same on every rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from amp_trainer.scaler import DynamicLossScaler


def _worker(rank: int, world_size: int, init_file: str, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        torch.manual_seed(0)  # identical replicas; no DDP, so nothing else syncs the ranks
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scaler = DynamicLossScaler("cpu", init_scale=1024.0, growth_interval=100).watch(model)
        scales, skips = [], []
        for step in range(4):
            opt.zero_grad()
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step == 2 and rank == 1:  # overflow on ONE rank only
                model[2].weight.grad[0, 0] = math.inf
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
            skips.append(scaler.step_was_skipped)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        results[rank] = (scales, skips, flat.tolist(), scaler.stats.last_overflow_params)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_overflow_on_one_rank_skips_and_backs_off_on_every_rank(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), results), nprocs=2, join=True)
    (scales0, skips0, params0, names0), (scales1, skips1, params1, names1) = results[0], results[1]
    assert skips0 == skips1 == [False, False, True, False]
    assert scales0 == scales1 == [1024.0, 1024.0, 512.0, 512.0]
    assert params0 == params1
    # Only rank 1 saw the inf; the names are gathered on overflow steps, so both ranks name it.
    assert names1 == names0 == ("2.weight",)

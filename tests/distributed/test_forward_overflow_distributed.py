"""Two real processes on gloo: a forward overflow on one rank gives every rank the same islands
and the same loss scale."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from amp_trainer.forward_overflow import ForwardOverflowGuard
from amp_trainer.islands import is_fp32_island
from amp_trainer.scaler import DynamicLossScaler


def _worker(rank: int, world_size: int, init_file: str, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        torch.manual_seed(0)  # identical replicas; no DDP, so nothing else syncs the ranks
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = DynamicLossScaler("cpu", init_scale=1024.0)
        guard = ForwardOverflowGuard(model, scaler)
        skips, scales, events = [], [], []
        for step in range(3):
            optimizer.zero_grad()
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            if step == 1 and rank == 1:
                x = x.sign() * 1e5  # finite in FP32, past 65504 once autocast casts it
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            guard.observe(loss, x)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            event = guard.after_step()
            skips.append(scaler.step_was_skipped)
            scales.append(scaler.get_scale())
            events.append(None if event is None else list(event.islands))
        islands = [n for n, m in model.named_modules() if n and is_fp32_island(m)]
        results[rank] = (skips, scales, events, islands)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_forward_overflow_on_one_rank_makes_the_same_islands_and_scale_on_every_rank(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), results), nprocs=2, join=True)
    (skips0, scales0, events0, islands0), (skips1, scales1, events1, islands1) = (
        results[0],
        results[1],
    )
    assert skips0 == skips1 == [False, True, False]
    assert scales0 == scales1 == [1024.0, 1024.0, 1024.0]  # no backoff for a forward overflow
    assert islands0 == islands1 == ["0", "2"]
    assert events0 == events1 == [None, ["0", "2"], None]


def _diverging_worker(rank: int, world_size: int, init_file: str, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler = DynamicLossScaler("cpu", init_scale=1024.0)
        guard = ForwardOverflowGuard(model, scaler)
        outcome = None
        for step in range(3):
            optimizer.zero_grad()
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
            if step == 1:
                with torch.no_grad():  # the weights exploded on every replica alike
                    model[0].weight.mul_(100.0)
                if rank == 1:
                    x = x * 1e3  # only this rank's batch overflows FP16 with them
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            guard.observe(loss, x)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            try:
                guard.after_step()
            except FloatingPointError as err:
                outcome = (step, type(err).__name__, "diverging" in str(err))
                break
        islands = [n for n, m in model.named_modules() if n and is_fp32_island(m)]
        results[rank] = (outcome, islands)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_divergence_seen_on_one_rank_stops_every_rank_with_no_islands(tmp_path):
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_diverging_worker, args=(2, str(tmp_path / "init"), results), nprocs=2, join=True)
    assert results[0] == results[1] == ((1, "DivergenceError", True), [])

"""Two real gloo processes: the underflow meter reads the whole step, the same on every rank, so
the two-sided rule (``grow_on_underflow``) takes one decision for all and the scales never split.

Each rank's micro-batch is its own: rank 1's loss is a million times smaller, so on its own it
reads most of its gradient flushed at scale 1 while rank 0 reads none. Read alone, rank 1 would
grow its scale and rank 0 would not, and the replicas would drift apart."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from amp_trainer.scaler import DynamicLossScaler
from amp_trainer.underflow import measure_underflow

LOSS_FACTOR = {0: 1.0, 1: 1e-6}
STEPS = 6


def _figures(reading) -> dict:
    return {
        "underflow": reading.underflow,
        "headroom": reading.headroom,
        "fixing_scale": reading.fixing_scale,
        "flushed": reading.flushed,
        "nonzero": reading.nonzero,
        "by_param": dict(reading.by_param),
        "reference_scale": reading.reference_scale,
        "unreachable": reading.unreachable,
        "unreachable_elements": reading.unreachable_elements,
    }


def _worker(rank: int, init_file: str, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
        scaler = DynamicLossScaler("cpu", init_scale=1.0, grow_on_underflow=True)
        scales, local, combined = [], [], []
        for step in range(STEPS):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(10 * step + rank))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(x).float().pow(2).mean() * LOSS_FACTOR[rank]
            if step % 2 == 0:  # the same steps on every rank, as the Trainer's interval
                local.append(_figures(measure_underflow(loss, model.module, scaler.get_scale())))
                combined.append(_figures(scaler.check_underflow(loss, model.module)))
            scales.append(scaler.get_scale())
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        results[rank] = {
            "scales": scales,
            "local": local,
            "combined": combined,
            "growths": scaler.stats.underflow_growths,
            "params": flat.tolist(),
        }
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    results = mp.Manager().dict()
    init = tmp_path_factory.mktemp("underflow-ranks") / "init"
    mp.spawn(_worker, args=(str(init), results), nprocs=2, join=True)
    return results[0], results[1]


@pytest.mark.slow
def test_ranks_that_read_different_underflow_alone_read_one_combined_figure(ranks):
    rank0, rank1 = ranks
    # The provocation is real: alone, rank 0 reads nothing flushed and rank 1 most of it.
    first0, first1 = rank0["local"][0], rank1["local"][0]
    assert first0["underflow"] < 0.001 < 0.5 < first1["underflow"]
    # Every figure the meter gives (and the Trainer logs) is the same on both ranks ...
    assert rank0["combined"] == rank1["combined"]
    for both, alone0, alone1 in zip(rank0["combined"], rank0["local"], rank1["local"]):
        # ... and it is the whole step's: the counts are the two ranks' sums,
        assert both["flushed"] == alone0["flushed"] + alone1["flushed"]
        assert both["nonzero"] == alone0["nonzero"] + alone1["nonzero"]
        assert both["underflow"] == both["flushed"] / both["nonzero"]
        assert both["unreachable_elements"] == (
            alone0["unreachable_elements"] + alone1["unreachable_elements"]
        )
        # per parameter too, and the headroom is the rank nearest to overflow's.
        for name, share in both["by_param"].items():
            assert min(alone0["by_param"][name], alone1["by_param"][name]) <= share
            assert share <= max(alone0["by_param"][name], alone1["by_param"][name])
        headrooms = [h for h in (alone0["headroom"], alone1["headroom"]) if h is not None]
        assert both["headroom"] == min(headrooms)


@pytest.mark.slow
def test_the_two_sided_rule_takes_one_decision_on_every_rank_and_the_replicas_stay_equal(ranks):
    rank0, rank1 = ranks
    assert rank0["growths"] == rank1["growths"] >= 1  # the rule acted, on both at once
    assert rank0["scales"] == rank1["scales"]
    assert rank0["scales"][-1] > 1.0
    assert rank0["params"] == rank1["params"]  # DDP replicas bit-identical

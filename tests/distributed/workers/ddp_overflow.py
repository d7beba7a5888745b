"""Two-process worker: an overflow on ONE rank must make EVERY rank skip and back off.

Launched by tests/distributed/test_accelerate_distributed.py with ``torch.distributed.run`` (gloo,
CPU). Each rank writes what it saw to ``<out_dir>/rank<N>.json`` (and its final parameters to
``rank<N>.pt``) for the test process to compare.

Three checks in one launch (process start-up dominates the cost):
* ``plain``: DynamicLossScaler with bare torch.distributed (no Accelerate, no DDP): rank 1 alone
  has an inf gradient; the found-inf all-reduce must make both ranks skip.
* ``accelerate``: AmpAccelerator + DDP on tiny BERT in fp16 autocast; rank 1 writes an inf into a
  gradient after DDP's all-reduce, so only rank 1's gradients overflow.
* ``fsdp2``: DynamicLossScaler with torch's own FSDP2 (``fully_shard``, DTensor gradient shards),
  without Accelerate: Accelerate runs FSDP only on accelerators (with ``cpu=True`` it ignores the
  FSDP plugin and uses DDP), so on CPU the sharded case is exercised with torch directly. Rank 1
  overflows in its own shard; both ranks must skip.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from amp_trainer.accelerate_hooks import AmpAccelerator
from amp_trainer.scaler import DynamicLossScaler
from tests.helpers.distributed import leave_without_teardown
from tests.helpers.tiny_models import make_tiny_bert

INJECT_AT = 1
STEPS = 3


def plain_scaler_check(rank: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=256.0)
    before = model.weight.detach().clone()
    scaler.scale(model(torch.ones(3, 4)).sum()).backward()
    if rank == 1:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()
    return {
        "skipped": scaler.step_was_skipped,
        "scale": scaler.get_scale(),
        "params_unchanged": bool(torch.equal(before, model.weight.detach())),
    }


def accelerate_check(accelerator: AmpAccelerator, rank: int) -> tuple[dict, torch.Tensor]:
    model = make_tiny_bert(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    g = torch.Generator().manual_seed(100 + rank)  # different data per rank, as with a sampler
    skipped, scales = [], []
    for step in range(STEPS):
        batch = {
            "input_ids": torch.randint(0, 128, (4, 8), generator=g),
            "labels": torch.randint(0, 2, (4,), generator=g),
        }
        accelerator.backward(model(**batch).loss)
        if step == INJECT_AT and rank == 1:
            accelerator.unwrap_model(model).classifier.weight.grad[0, 0] = float("inf")
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        skipped.append(accelerator.optimizer_step_was_skipped)
        scales.append(accelerator.loss_scaler.get_scale())
    flat = torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(model).parameters()])
    return {"skipped": skipped, "scales": scales, "world_size": accelerator.num_processes}, flat


def fsdp2_check(rank: int) -> tuple[dict, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    fully_shard(model[0])
    fully_shard(model[2])
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = DynamicLossScaler("cpu", init_scale=1024.0)
    g = torch.Generator().manual_seed(200 + rank)
    skipped, scales, unchanged, grad_types = [], [], [], set()
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(torch.randn(4, 8, generator=g)).float().pow(2).mean()
        scaler.scale(loss).backward()
        grad = model[0].weight.grad
        grad_types.add(type(grad).__name__)
        if step == INJECT_AT and rank == 1:
            grad.to_local().view(-1)[0] = float("inf")  # this rank's shard only
        before = full_params(model)
        scaler.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        skipped.append(scaler.step_was_skipped)
        scales.append(scaler.get_scale())
        unchanged.append(bool(torch.equal(before, full_params(model))))
    result = {
        "skipped": skipped,
        "scales": scales,
        "params_unchanged": unchanged,
        "grad_types": sorted(grad_types),
    }
    return result, full_params(model)


def full_params(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([p.full_tensor().flatten() for p in model.parameters()])


def main() -> None:
    out_dir = Path(sys.argv[1])
    accelerator = AmpAccelerator(
        mixed_precision="fp16", cpu=True, loss_scaler={"init_scale": 1024.0}
    )
    rank = accelerator.process_index
    result = {"plain": plain_scaler_check(rank)}
    result["accelerate"], flat = accelerate_check(accelerator, rank)
    result["fsdp2"], fsdp_flat = fsdp2_check(rank)
    result["backend"] = dist.get_backend()
    torch.save(flat, out_dir / f"rank{rank}.pt")
    torch.save(fsdp_flat, out_dir / f"rank{rank}_fsdp2.pt")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    # The exit is not under test here (test_ddp_teardown.py and the example's launch test are
    # where end_training() is): a gloo rank can abort at interpreter exit ("terminate called
    # without an active exception") after writing its results, failing these tests for nothing.
    leave_without_teardown()


if __name__ == "__main__":
    main()

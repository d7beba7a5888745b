"""Two-process worker: the precision guard on FSDP2 ``MixedPrecisionPolicy`` drifts, gloo, CPU.

Launched by tests/distributed/test_precision_guard_fsdp2_distributed.py with
``torch.distributed.run``. Each rank writes what it saw to ``<out_dir>/rank<N>.json``; a check
that does not raise :class:`PrecisionDriftError` where it should is recorded as such, so the
others still report.

Checks:
* ``changed_mid_run``: a tiny BERT sharded per layer with an fp16 parameter policy, trained
  through a watched :class:`DynamicLossScaler`; after two clean steps the user's code swaps
  ``bert.encoder.layer.1``'s policy for a bf16 one (both copies FSDP2 keeps: its state's and its
  parameter group's, then re-derives the parameters' dtypes: ``fully_shard`` refuses a second
  application, so this is the only way). The next forward really all-gathers that layer's weights
  in bf16 (recorded); the step must raise on both ranks before the optimizer's third update.
* ``run_precision``: a model the user sharded with a bf16 policy, in an fp16 run (a watched
  scaler): raised at the first step.
* ``asked_by_plugin`` (last: it changes Accelerate's process-wide state): Accelerate's own FSDP2
  path (forced on CPU as in fsdp2_scaleout.py) with a plugin asking for an fp16 policy, on a model
  the user already sharded with an FP32 one (Accelerate's ``prepare`` leaves an FSDP module as it
  is, silently): raised at the first step, naming the plugin.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from amp_trainer import AmpAccelerator, DynamicLossScaler, PrecisionDriftError, keep_norms_in_fp32
from tests.helpers.distributed import leave_without_teardown
from tests.helpers.tiny_models import make_tiny_bert

FP16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def sharded_bert(policy: MixedPrecisionPolicy) -> torch.nn.Module:
    """Sharded per layer under ``policy``, its norms FP32 islands (as an AMP run has them)."""
    model = make_tiny_bert(seed=0)
    keep_norms_in_fp32(model)
    for layer in model.bert.encoder.layer:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return {
        "input_ids": torch.randint(0, 128, (4, 8), generator=g),
        "labels": torch.randint(0, 2, (4,), generator=g),
    }


def swap_policy(module: torch.nn.Module, policy: MixedPrecisionPolicy) -> None:
    """What user code must do to change a sharded module's policy (no public call does)."""
    state = module._get_fsdp_state()
    state._mp_policy = policy
    group = state._fsdp_param_group
    group.mp_policy = policy
    group._init_mp_dtypes()
    for param in group.fsdp_params:  # unsharded buffers are re-made in the new param_dtype
        param.all_gather_outputs = []
        del param._unsharded_param


def drift_info(err: PrecisionDriftError) -> dict[str, Any]:
    return {
        "message": str(err),
        "kinds": [d.kind for d in err.drifts],
        "tensors": [list(d.tensors) for d in err.drifts],
        "seen": [d.seen for d in err.drifts],
        "expected": [d.expected for d in err.drifts],
    }


def scaled_steps(model, steps: int, rank: int, *, swap_at: int | None = None) -> dict[str, Any]:
    """A plain fp16 loop through a watched scaler; the policy swap happens before ``swap_at``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = DynamicLossScaler("cpu", init_scale=1024.0).watch(model)
    layer = model.bert.encoder.layer[1]
    compute: list[str] = []
    layer.attention.self.query.register_forward_pre_hook(  # the all-gathered weight it uses
        lambda mod, args: compute.append(str(mod.weight.dtype).replace("torch.", ""))
    )
    info: dict[str, Any] = {"updates": 0, "raised_at": None}
    try:
        for step in range(steps):
            if step == swap_at:
                swap_policy(layer, BF16)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(**batch(step, rank)).loss
            scaler.scale(loss).backward()
            info["raised_at"] = step
            scaler.step(optimizer)
            info["raised_at"] = None
            scaler.update()
            optimizer.zero_grad()
            info["updates"] += 1
    except PrecisionDriftError as err:
        info.update(drift_info(err))
    finally:
        if scaler.precision_guard is not None:
            scaler.precision_guard.close()
    states = [s for s in optimizer.state.values() if "step" in s]
    info["optimizer_steps"] = sorted({int(s["step"]) for s in states})
    info["query_weight_dtypes"] = compute
    return info


def forced_fsdp2_accelerator(policy: MixedPrecisionPolicy) -> AmpAccelerator:
    """Accelerate's FSDP2 path on CPU (see fsdp2_scaleout.py), its plugin asking for ``policy``."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        mixed_precision_policy=policy,
        state_dict_type="SHARDED_STATE_DICT",
        cpu_ram_efficient_loading=False,
    )
    accelerator = AmpAccelerator(
        mixed_precision="fp16", cpu=True, fsdp_plugin=plugin, loss_scaler={"init_scale": 1024.0}
    )
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    return accelerator


def asked_by_plugin_check(rank: int) -> dict[str, Any]:
    accelerator = forced_fsdp2_accelerator(FP16)
    model = sharded_bert(MixedPrecisionPolicy())  # the user's FP32 policy, sharded before
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    info: dict[str, Any] = {"updates": 0}
    try:
        with accelerator.autocast():
            loss = model(**batch(0, rank)).loss
        accelerator.backward(loss)
        optimizer.step()
        info["updates"] += 1
    except PrecisionDriftError as err:
        info.update(drift_info(err))
    states = [s for s in optimizer.optimizer.state.values() if "step" in s]
    info["optimizer_steps"] = sorted({int(s["step"]) for s in states})
    return info


def run(name: str, check, results: dict[str, Any]) -> None:
    try:
        results[name] = check()
    except Exception as err:  # recorded so that the other checks still report
        results[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}


def main() -> None:
    out_dir = Path(sys.argv[1])
    AmpAccelerator(mixed_precision="fp16", cpu=True)  # the gloo process group, as a run sets up
    rank = dist.get_rank()
    results: dict[str, Any] = {"world_size": dist.get_world_size()}
    run("changed_mid_run", lambda: scaled_steps(sharded_bert(FP16), 4, rank, swap_at=2), results)
    run("run_precision", lambda: scaled_steps(sharded_bert(BF16), 2, rank), results)
    run("asked_by_plugin", lambda: asked_by_plugin_check(rank), results)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    leave_without_teardown()


if __name__ == "__main__":
    main()

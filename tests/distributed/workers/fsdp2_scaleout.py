"""Two-process worker: FP16 under torch's FSDP2 (``fully_shard``), gloo, CPU.

Launched by tests/distributed/test_fsdp2_scaleout.py with ``torch.distributed.run``. Each rank
writes what it saw to ``<out_dir>/rank<N>.json`` and its full (unsharded) parameters to
``rank<N>_<check>.pt``. One launch runs every check (process start-up dominates the cost); a check
that raises is recorded as ``{"error": ...}`` so the others still report.

Checks:
* ``watch_ours`` / ``watch_torch``: the same loop on a tiny BERT sharded per layer, once with a
  watched :class:`DynamicLossScaler`, once with ``torch.amp.GradScaler``. Rank 1 alone writes an
  inf into its own gradient shard at step 2; at step 4 rank 0 and rank 1 each overflow in a
  different parameter. The test compares the two loops bit for bit and checks the names.
* ``islands``: FP32 norm islands under ``MixedPrecisionPolicy(param_dtype=float16)`` (what
  Accelerate's FSDP2 plugin uses for fp16): forward, backward, one scaled step; records the
  dtypes ``layer_norm`` ran with and the storage dtypes of the parameters.
* ``accelerator``: ``AmpAccelerator.prepare`` on a model the user already ``fully_shard``-ed:
  no DDP wrap, overflow on one rank skipped on both, the parameter named.
* ``accelerate_fsdp2`` (last: it changes Accelerate's process-wide state): Accelerate's own FSDP2
  code path (``prepare`` shards with its plugin and its fp16 ``MixedPrecisionPolicy``), forced on
  CPU: Accelerate 1.15 enables FSDP only on accelerators, so the test sets the state's
  ``distributed_type`` to FSDP after building the accelerator, as a GPU launch would have. FP32
  norms, an overflow on one rank, ``save_state`` at step 4, two more steps; then a fresh
  accelerator, model and optimizer ``load_state`` it (DCP's dummy optimizer step runs through
  our scaler, unless Accelerate unwraps the optimizer for it, as 1.16 does) and run the same two
  steps: parameters and scaler state must equal the uninterrupted run's.
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

from amp_trainer import AmpAccelerator, DynamicLossScaler, keep_norms_in_fp32
from tests.helpers.distributed import leave_without_teardown
from tests.helpers.tiny_models import make_tiny_bert

STEPS = 6
# (step, rank) -> parameter whose local gradient shard gets an inf
INJECT = {
    (2, 1): "classifier.weight",
    (4, 0): "bert.pooler.dense.weight",
    (4, 1): "classifier.weight",
}


def sharded_bert(seed: int = 0, mp_policy: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    model = make_tiny_bert(seed=seed)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for layer in model.bert.encoder.layer:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def batch(step: int, rank: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # different data per rank
    return {
        "input_ids": torch.randint(0, 128, (4, 8), generator=g),
        "labels": torch.randint(0, 2, (4,), generator=g),
    }


def inject(model: torch.nn.Module, step: int, rank: int) -> str | None:
    name = INJECT.get((step, rank))
    if name is None:
        return None
    local = model.get_parameter(name).grad.to_local()
    assert local.numel() > 0, f"rank {rank} holds no shard of {name}"
    local.view(-1)[0] = float("inf")  # this rank's shard only
    return name


def full_params(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([p.full_tensor().flatten() for p in model.parameters()])


def scaled_loop(kind: str, rank: int) -> tuple[dict[str, Any], torch.Tensor]:
    """The same loop with our scaler (``"ours"``) or torch's (``"torch"``)."""
    model = sharded_bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if kind == "ours":
        scaler: Any = DynamicLossScaler("cpu", init_scale=1024.0, growth_interval=2).watch(model)
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    skipped, scales, names, grad_types = [], [], [], set()
    for step in range(STEPS):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(**batch(step, rank)).loss
        scaler.scale(loss).backward()
        grad_types.add(type(model.classifier.weight.grad).__name__)
        inject(model, step, rank)
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        if kind == "ours":
            skipped.append(scaler.found_inf(optimizer))
        else:
            skipped.append(
                bool(sum(v.item() for v in scaler._found_inf_per_device(optimizer).values()))
            )
        scaler.update()
        optimizer.zero_grad()
        scales.append(scaler.get_scale())
        if kind == "ours":
            names.append(list(scaler.stats.last_overflow_params) if skipped[-1] else [])
    result = {"skipped": skipped, "scales": scales, "grad_types": sorted(grad_types)}
    if kind == "ours":
        result["names"] = names
    return result, full_params(model)


def islands_check(rank: int) -> tuple[dict[str, Any], torch.Tensor]:
    """FP32 norms under FSDP2's fp16 parameter policy (Accelerate's fp16 FSDP2 settings)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    model = make_tiny_bert(seed=0)
    norms = keep_norms_in_fp32(model)
    kwargs = {"mp_policy": policy}
    for layer in model.bert.encoder.layer:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = DynamicLossScaler("cpu", init_scale=1024.0).watch(model)

    seen: list[list[str]] = []
    original = torch.nn.functional.layer_norm

    def recording_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        seen.append([str(input.dtype), str(weight.dtype), str(bias.dtype)])
        return original(input, normalized_shape, weight, bias, eps)

    torch.nn.functional.layer_norm = recording_layer_norm
    try:
        out = model(**batch(0, rank))
        scaler.scale(out.loss).backward()
    finally:
        torch.nn.functional.layer_norm = original
    grad_dtypes = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    scaler.step(optimizer)
    scaler.update()
    result = {
        "norms": len(norms),
        "layer_norm_dtypes": seen,
        "logits_dtype": str(out.logits.dtype),
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "param_types": sorted({type(p.data).__name__ for p in model.parameters()}),
        "grad_dtypes": grad_dtypes,
        "skipped": scaler.step_was_skipped,
        "loss_finite": bool(torch.isfinite(out.loss).item()),
    }
    return result, full_params(model)


def accelerator_check(
    accelerator: AmpAccelerator, rank: int
) -> tuple[dict[str, Any], torch.Tensor]:
    """AmpAccelerator.prepare on a model the user sharded: no DDP; skips agree across ranks."""
    model = sharded_bert()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    result = {
        "wrapper": type(prepared).__name__,
        "same_object": prepared is model,
        **accelerate_steps(accelerator, prepared, optimizer, range(4), rank),
    }
    return result, full_params(prepared)


def forced_fsdp2_accelerator() -> tuple[AmpAccelerator, torch.nn.Module, Any]:
    """Accelerate's FSDP2 path on CPU: what ``accelerate launch --use_fsdp`` sets up on GPUs."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["BertLayer"],
        state_dict_type="SHARDED_STATE_DICT",
        cpu_ram_efficient_loading=False,
    )
    accelerator = AmpAccelerator(
        mixed_precision="fp16",
        cpu=True,
        fsdp_plugin=plugin,
        loss_scaler={"init_scale": 1024.0, "growth_interval": 2},
    )
    # What AcceleratorState.__init__ does on accelerators (it keeps PartialState in step too).
    accelerator.state.distributed_type = DistributedType.FSDP
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    plugin.set_mixed_precision("fp16")
    accelerator.state.fsdp_plugin = plugin
    assert accelerator.is_fsdp2
    model = make_tiny_bert(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


def accelerate_steps(accelerator, model, optimizer, steps, rank: int) -> dict[str, list]:
    """Train ``steps`` (an inf in rank 1's gradient shard at step 2, clipped at 1.0): each step's
    skip, loss scale and overflowing parameter names."""
    scaler = accelerator.loss_scaler
    out: dict[str, list] = {"skipped": [], "scales": [], "names": []}
    for step in steps:
        loss = model(**batch(step, rank)).loss
        accelerator.backward(loss)
        if step == 2 and rank == 1:
            model.get_parameter("classifier.weight").grad.to_local().view(-1)[0] = float("inf")
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        out["skipped"].append(accelerator.optimizer_step_was_skipped)
        out["scales"].append(scaler.get_scale())
        out["names"].append(list(scaler.stats.last_overflow_params) if out["skipped"][-1] else [])
    return out


def accelerate_fsdp2_check(rank: int, out_dir: Path) -> tuple[dict[str, Any], torch.Tensor]:
    accelerator, model, optimizer = forced_fsdp2_accelerator()
    seen: list[str] = []
    original = torch.nn.functional.layer_norm

    def recording_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        seen.append(str(input.dtype))
        return original(input, normalized_shape, weight, bias, eps)

    torch.nn.functional.layer_norm = recording_layer_norm
    try:
        first = accelerate_steps(accelerator, model, optimizer, range(4), rank)
    finally:
        torch.nn.functional.layer_norm = original
    checkpoint = out_dir / "accelerate_fsdp2_ckpt"
    accelerator.save_state(str(checkpoint))
    saved_scaler = accelerator.loss_scaler.state_dict()
    rest = accelerate_steps(accelerator, model, optimizer, range(4, 6), rank)
    uninterrupted = full_params(model)

    resumed, model2, optimizer2 = forced_fsdp2_accelerator()
    # Count the scaler steps load_state makes: DCP's dummy optimizer step reaches the scaler
    # through Accelerate's optimizer wrapper unless Accelerate unwraps it first (1.16).
    steps_during_load = []
    scaler_step = resumed.loss_scaler.step
    resumed.loss_scaler.step = lambda *a, **k: steps_during_load.append(1) or scaler_step(*a, **k)
    resumed.load_state(str(checkpoint))
    del resumed.loss_scaler.step
    loaded_scaler = resumed.loss_scaler.state_dict()
    again = accelerate_steps(resumed, model2, optimizer2, range(4, 6), rank)
    result = {
        "wrapper": type(model).__name__,
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "layer_norm_dtypes": sorted(set(seen)),
        "layer_norm_calls": len(seen),
        "first": first,
        "rest": rest,
        "resumed": again,
        "scaler_after_load_equals_saved": loaded_scaler == saved_scaler,
        "scaler_steps_during_load": len(steps_during_load),
        "scaler_final_equal": resumed.loss_scaler.state_dict()
        == accelerator.loss_scaler.state_dict(),
        "params_equal_after_resume": bool(torch.equal(full_params(model2), uninterrupted)),
    }
    return result, uninterrupted


def run(name: str, check, out_dir: Path, rank: int, results: dict[str, Any]) -> None:
    try:
        info, params = check()
    except Exception as err:  # recorded so that the other checks still report
        results[name] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()}
        return
    results[name] = info
    torch.save(params, out_dir / f"rank{rank}_{name}.pt")


def main() -> None:
    out_dir = Path(sys.argv[1])
    accelerator = AmpAccelerator(
        mixed_precision="fp16", cpu=True, loss_scaler={"init_scale": 1024.0}
    )
    rank = accelerator.process_index
    results: dict[str, Any] = {"backend": dist.get_backend(), "world_size": dist.get_world_size()}
    run("watch_ours", lambda: scaled_loop("ours", rank), out_dir, rank, results)
    run("watch_torch", lambda: scaled_loop("torch", rank), out_dir, rank, results)
    run("islands", lambda: islands_check(rank), out_dir, rank, results)
    run("accelerator", lambda: accelerator_check(accelerator, rank), out_dir, rank, results)
    run("accelerate_fsdp2", lambda: accelerate_fsdp2_check(rank, out_dir), out_dir, rank, results)
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results, indent=1))
    # Its results are written: skip interpreter teardown, where gloo's and DCP's C++ threads
    # sometimes abort a rank (seen here with accelerate 1.10 and 1.16 under pytest -n 2).
    leave_without_teardown()


if __name__ == "__main__":
    main()

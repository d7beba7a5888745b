"""Two-process worker: AmpTrainer on Accelerate's FSDP2 code path (forced on CPU), with resume.

Launched by tests/distributed/test_trainer_fsdp2_distributed.py with ``torch.distributed.run``
(gloo, CPU). Accelerate 1.15 turns FSDP on only on accelerators; the trainer subclass below sets the
state as ``AcceleratorState`` does on a GPU launch (``distributed_type`` FSDP, the plugin's fp16
policy) right after Accelerate builds it. Everything else is stock Trainer + Accelerate FSDP2 code:
``fsdp="full_shard"`` with ``fsdp_config={"version": 2}``, ``prepare`` shards, checkpoints go
through ``torch.distributed.checkpoint``.

Runs: ``full`` (6 steps, checkpoint at step 3, an inf in rank 1's gradient shard at step 2),
``resumed`` (a fresh trainer from that checkpoint) and ``rule`` (1 step with
``loss_scale_grow_on_underflow=True``); the library's log lines of ``full`` and ``rule`` are
kept. Each rank writes ``rank<N>.json`` and its full parameters ``rank<N>_<run>.pt``.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate.state import AcceleratorState, PartialState
from accelerate.utils import DistributedType

from amp_trainer import AmpTrainer, AmpTrainingArguments
from tests.helpers.distributed import leave_without_teardown
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import ToyClassification


class ForcedFSDP2Trainer(AmpTrainer):
    """AmpTrainer whose accelerator state is FSDP, as a GPU launch with this config would be."""

    def create_accelerator_and_postprocess(self) -> None:
        original = AcceleratorState.__init__

        def forced(state, *args, **kwargs):
            original(state, *args, **kwargs)
            plugin = kwargs.get("fsdp_plugin")
            if plugin is not None and state.distributed_type == DistributedType.MULTI_CPU:
                state.distributed_type = DistributedType.FSDP
                PartialState._shared_state["distributed_type"] = DistributedType.FSDP
                plugin.set_mixed_precision(state._mixed_precision)
                state.fsdp_plugin = plugin

        AcceleratorState.__init__ = forced
        try:
            super().create_accelerator_and_postprocess()
        finally:
            AcceleratorState.__init__ = original

    inject = False

    def training_step(self, model, inputs, *args, **kwargs):
        """After backward (FSDP2 has reduce-scattered the shards), before the scaler's inf check:
        an inf in rank 1's local shard of ``classifier.weight``'s gradient at optimizer step
        attempt 2 (attempts: a skipped update is no step, so "step 2" would overflow again)."""
        loss = super().training_step(model, inputs, *args, **kwargs)
        attempt = getattr(self.state, "optimizer_step_attempts", self.state.global_step) + 1
        if self.inject and attempt == 2 and dist.get_rank() == 1:
            grad = model.get_parameter("classifier.weight").grad
            grad.to_local().view(-1)[0] = float("inf")
        return loss


def fsdp2_args(out_dir: Path, **overrides: Any) -> AmpTrainingArguments:
    """The FSDP2 workers' run: 6 fp16 steps of batch 4, a sharded (DCP) checkpoint every 3
    steps; ``overrides`` win."""
    settings: dict[str, Any] = dict(
        output_dir=str(out_dir),
        use_cpu=True,
        fp16=True,
        max_steps=6,
        logging_steps=1,  # scale_history keeps every logging step: one entry per step here
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        loss_scale_init=1024.0,
        save_strategy="steps",
        save_steps=3,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        fsdp="full_shard",
        fsdp_config={
            "version": 2,
            "transformer_layer_cls_to_wrap": ["BertLayer"],
            "reshard_after_forward": True,
            "cpu_ram_efficient_loading": False,
            "state_dict_type": "SHARDED_STATE_DICT",
        },
    )
    return AmpTrainingArguments(**{**settings, **overrides})


def trainer(out_dir: Path, inject: bool = False, **overrides: Any) -> ForcedFSDP2Trainer:
    args = fsdp2_args(out_dir, **overrides)
    run = ForcedFSDP2Trainer(
        model=make_tiny_bert(seed=0), args=args, train_dataset=ToyClassification(64, seed=1)
    )
    run.inject = inject
    return run


def full_params(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([p.full_tensor().flatten() for p in model.parameters()])


def record(run: ForcedFSDP2Trainer) -> dict:
    return {
        "fsdp": bool(run.is_fsdp_enabled),
        "model": type(run.model).__name__,
        "param_types": sorted({type(p).__name__ for p in run.model.parameters()}),
        "history": run.scale_history,
        "names": list(run.loss_scaler.stats.last_overflow_params),
        "scaler": run.loss_scaler.state_dict(),
    }


class Said(logging.Handler):
    """The library's log lines (``amp_trainer.trainer``) of one run, as ``(level, message)``."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def main() -> None:
    out_dir = Path(sys.argv[1])
    said = Said()
    library = logging.getLogger("amp_trainer.trainer")
    library.addHandler(said)
    library.setLevel(logging.INFO)
    rank = dist.get_rank() if dist.is_initialized() else int(__import__("os").environ["RANK"])
    full = trainer(out_dir / "full", inject=True)
    seen: set[str] = set()
    original = torch.nn.functional.layer_norm

    def recording_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
        seen.update({str(input.dtype), str(weight.dtype)})
        return original(input, normalized_shape, weight, bias, eps)

    torch.nn.functional.layer_norm = recording_layer_norm
    try:
        full.train()
    finally:
        torch.nn.functional.layer_norm = original
    result = {
        "full": record(full),
        "layer_norm_dtypes": sorted(seen),
        "said_full": list(said.lines),
    }
    torch.save(full_params(full.model), out_dir / f"rank{rank}_full.pt")

    said.lines.clear()
    resumed = trainer(out_dir / "resumed")
    resumed.train(resume_from_checkpoint=str(out_dir / "full" / "checkpoint-3"))
    result["resumed"] = record(resumed)
    torch.save(full_params(resumed.model), out_dir / f"rank{rank}_resumed.pt")
    # The two-sided rule asked for under FSDP (where the meter does not run): one short run.
    said.lines.clear()
    trainer(
        out_dir / "rule", loss_scale_grow_on_underflow=True, max_steps=1, save_strategy="no"
    ).train()
    result["said_rule"] = list(said.lines)
    result["world_size"] = dist.get_world_size()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    leave_without_teardown()


if __name__ == "__main__":
    main()

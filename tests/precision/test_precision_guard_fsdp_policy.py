"""FSDP2 ``MixedPrecisionPolicy`` against what was asked: the comparison, in one process.

The policies compared here are torch's own ``MixedPrecisionPolicy`` objects and Accelerate's
own FSDP2 plugin; the modules that apply them need a process group, so the guard on real
``fully_shard`` modules (a policy changed mid-run, a model sharded with another policy than
Accelerate's plugin asked for, a bf16 policy in an fp16 run) is tested on two gloo ranks in
``tests/distributed/test_precision_guard_fsdp2_distributed.py``.
"""

from __future__ import annotations

import torch
from accelerate.utils import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import MixedPrecisionPolicy

from amp_trainer.precision_guard.fsdp_policy import (
    PolicyAsk,
    guard_kwargs_for_accelerate,
    policy_drift,
)

FP16 = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
FP32 = MixedPrecisionPolicy()


def test_a_policy_other_than_the_one_asked_is_a_drift_naming_the_module_the_dtypes_and_who_asked():
    drift = policy_drift("bert.encoder.layer.0", (BF16, BF16), BF16, PolicyAsk(FP16, "the plugin"))
    assert drift is not None
    assert drift.describe() == (
        "the FSDP2 MixedPrecisionPolicy of bert.encoder.layer.0 is param_dtype=bfloat16, "
        "expected param_dtype=float16 (asked for by the plugin)"
    )


def test_the_asked_policy_wins_over_the_policy_at_the_start_and_over_the_runs_precision():
    # a bf16 policy asked for on purpose in an fp16 run is what was asked
    assert policy_drift("", (BF16,), BF16, PolicyAsk(BF16, "the plugin", "fp16")) is None
    # the state's copy and the parameter group's copy are both checked
    drift = policy_drift("", (FP16, BF16), FP16, PolicyAsk(FP16, "the plugin"))
    assert (
        drift is not None
        and drift.tensors == ("<model>",)
        and drift.seen == ("param_dtype=bfloat16")
    )


def test_with_nothing_asked_a_change_since_the_start_is_a_drift():
    changed = MixedPrecisionPolicy(torch.float16, torch.float16, output_dtype=torch.float16)
    drift = policy_drift("layer", (changed,), FP16, PolicyAsk())
    assert drift is not None
    assert drift.seen == "reduce_dtype=float16, output_dtype=float16"
    assert drift.expected == "reduce_dtype=float32, output_dtype=None"
    assert policy_drift("layer", (FP16,), FP16, PolicyAsk()) is None


def test_a_bf16_policy_in_an_fp16_run_is_a_drift_and_fp32_in_either_is_not():
    drift = policy_drift("layer", (BF16,), BF16, PolicyAsk(precision="fp16"))
    assert drift is not None and "the run's precision is fp16" in drift.describe()
    assert drift.seen == "param_dtype=bfloat16"
    fp16_in_bf16 = policy_drift("layer", (FP16,), FP16, PolicyAsk(precision="bf16"))
    assert fp16_in_bf16 is not None and fp16_in_bf16.seen == "param_dtype=float16"
    for precision in ("fp16", "bf16", None):
        assert policy_drift("layer", (FP32,), FP32, PolicyAsk(precision=precision)) is None
    assert policy_drift("layer", (FP16,), FP16, PolicyAsk(precision="fp16")) is None


def test_accelerates_fsdp2_plugin_policy_is_what_the_guard_is_asked_to_check():
    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2,
        mixed_precision_policy=FP16,  # accelerate 1.10 takes a dict only with all three keys
    )
    state = type("State", (), {"fsdp_plugin": plugin})()
    kwargs = guard_kwargs_for_accelerate(state, "fp16", fsdp2=True)
    assert kwargs["fsdp_policy"] == FP16 and kwargs["precision"] == "fp16"
    assert "Accelerate's FSDP plugin" in kwargs["fsdp_policy_source"]
    # a plugin holding no policy: Accelerate gives fully_shard MixedPrecisionPolicy() (FP32)
    plugin.mixed_precision_policy = None
    assert guard_kwargs_for_accelerate(state, "fp16", fsdp2=True)["fsdp_policy"] == FP32
    assert guard_kwargs_for_accelerate(state, "bf16", fsdp2=False) == {"precision": "bf16"}

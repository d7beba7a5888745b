"""The precision guard on FSDP2 ``MixedPrecisionPolicy`` drifts, on two real gloo ranks (CPU).

One launch of workers/precision_guard_fsdp2.py feeds every test here: a policy changed mid-run
by user code, a bf16 policy in an fp16 run, and a model sharded with another policy than
Accelerate's FSDP2 plugin asked for. Each must raise ``PrecisionDriftError`` on both ranks,
before the optimizer step, naming the module and the dtypes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.distributed import WORKERS, run_two_gloo_ranks

pytestmark = pytest.mark.slow

WORKER = WORKERS / "precision_guard_fsdp2.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out_dir: Path = tmp_path_factory.mktemp("precision_guard_fsdp2")
    run_two_gloo_ranks(WORKER, out_dir, timeout=300)
    infos = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    assert [i["world_size"] for i in infos] == [2, 2]
    return infos


def check(ranks: list[dict], name: str) -> list[dict]:
    """Each rank's result of one check; a check that failed otherwise shows its traceback."""
    infos = [info[name] for info in ranks]
    for rank, info in enumerate(infos):
        assert "error" not in info, f"rank {rank}: {info.get('trace', info.get('error'))}"
    return infos


def test_a_policy_changed_mid_run_raises_on_both_ranks_before_the_step_naming_module_and_dtypes(
    ranks,
):
    for info in check(ranks, "changed_mid_run"):
        assert info["raised_at"] == 2 and info["updates"] == 2
        assert info["optimizer_steps"] == [2]  # the third update never ran
        # the swap was real: layer 1's weights were all-gathered in bf16 from step 2 on
        assert info["query_weight_dtypes"] == ["float16", "float16", "bfloat16"]
        assert info["kinds"] == ["FSDP2 MixedPrecisionPolicy"]
        assert info["tensors"] == [["bert.encoder.layer.1"]]
        assert info["seen"] == ["param_dtype=bfloat16"]
        assert info["expected"] == ["param_dtype=float16"]
        assert "bert.encoder.layer.1 is param_dtype=bfloat16" in info["message"]


def test_a_bf16_policy_in_an_fp16_run_raises_at_the_first_step_on_both_ranks(ranks):
    for info in check(ranks, "run_precision"):
        assert info["raised_at"] == 0 and info["updates"] == 0 and info["optimizer_steps"] == []
        assert "the run's precision is fp16" in info["message"]
        assert all(seen == "param_dtype=bfloat16" for seen in info["seen"])
        assert "bert.encoder.layer.0" in {t for ts in info["tensors"] for t in ts}


def test_a_model_sharded_against_accelerates_fsdp2_plugin_policy_raises_at_the_first_step(ranks):
    for info in check(ranks, "asked_by_plugin"):
        assert info["updates"] == 0 and info["optimizer_steps"] == []
        assert "asked for by Accelerate's FSDP plugin" in info["message"]
        assert set(info["seen"]) == {"param_dtype=None, reduce_dtype=None"}
        assert set(info["expected"]) == {"param_dtype=float16, reduce_dtype=float32"}
        named = {t for ts in info["tensors"] for t in ts}
        assert {"<model>", "bert.encoder.layer.0", "bert.encoder.layer.1"} <= named

"""AmpTrainer on Accelerate's FSDP2 code path, two gloo ranks on CPU, with a checkpoint resume.

One launch of workers/trainer_fsdp2.py. Accelerate enables FSDP only on accelerators, so the
worker forces its state as a GPU launch would set it (see the worker); the rest is stock Trainer
and Accelerate FSDP2 code. an overflow in one rank's gradient shard is a skip on both
ranks with the same scale, the scaler names the parameter, FP32 norms work under the fp16
parameter policy, and a resume from step 3 ends where the uninterrupted run ends (resuming runs
``torch.distributed.checkpoint``'s dummy optimizer step through our scaler).
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.distributed import WORKERS, XFAIL_FSDP2_OPTIMIZER_NOT_RESUMED, run_two_gloo_ranks

pytestmark = pytest.mark.slow

WORKER = WORKERS / "trainer_fsdp2.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[tuple[dict, dict[str, torch.Tensor]]]:
    out_dir = tmp_path_factory.mktemp("trainer_fsdp2")
    run_two_gloo_ranks(WORKER, out_dir, timeout=300)
    return [
        (
            json.loads((out_dir / f"rank{r}.json").read_text()),
            {
                run: torch.load(out_dir / f"rank{r}_{run}.pt", weights_only=True)
                for run in ("full", "resumed")
            },
        )
        for r in range(2)
    ]


def test_amp_trainer_runs_on_accelerates_fsdp2_path(ranks):
    for info, _ in ranks:
        assert info["world_size"] == 2
        assert info["full"]["fsdp"] is True
        assert info["full"]["model"].startswith("FSDP")
        assert info["full"]["param_types"] == ["DTensor"]


def test_amp_trainer_fsdp2_overflow_on_one_rank_is_skipped_on_both_with_the_same_scale(ranks):
    for info, _ in ranks:
        history = info["full"]["history"]
        # Six steps take seven attempts: attempt 2 is skipped and is no step.
        assert [e["skipped"] for e in history] == [False, True] + [False] * 5
        assert [e["scale"] for e in history] == [1024.0, 1024.0] + [512.0] * 5
        assert info["full"]["names"] == ["classifier.weight"]


def test_amp_trainer_fsdp2_norms_compute_in_fp32_under_the_fp16_param_policy(ranks):
    for info, _ in ranks:
        assert info["layer_norm_dtypes"] == ["torch.float32"]


def test_amp_trainer_fsdp2_resume_keeps_the_scale_history_and_the_scaler_state(ranks):
    for info, params in ranks:
        assert info["resumed"]["history"] == info["full"]["history"]
        assert info["resumed"]["scaler"] == info["full"]["scaler"]
        assert torch.isfinite(params["full"]).all()
    assert torch.equal(ranks[0][1]["full"], ranks[1][1]["full"])


@XFAIL_FSDP2_OPTIMIZER_NOT_RESUMED
def test_amp_trainer_fsdp2_resume_ends_where_the_uninterrupted_run_ends(ranks):
    for _, params in ranks:
        assert torch.equal(params["resumed"], params["full"])


def test_amp_trainer_fsdp2_says_once_that_the_underflow_meter_and_the_two_sided_rule_do_not_run(
    ranks,
):
    for info, _ in ranks:
        meter_off = [m for _, m in info["said_full"] if "underflow meter" in m]
        assert meter_off == [
            "The underflow meter (loss_scale_underflow_check_interval=500) does not run under "
            "FSDP: no grad_underflow / grad_headroom in the logs."
        ]
        assert [lvl for lvl, m in info["said_full"] if "underflow meter" in m] == ["INFO"]
        rule_off = [(lvl, m) for lvl, m in info["said_rule"] if "underflow" in m]
        assert len(rule_off) == 1 and rule_off[0][0] == "WARNING"
        assert rule_off[0][1].startswith(
            "loss_scale_grow_on_underflow=True does nothing under FSDP: the underflow meter"
        )
        # and nothing was measured: no reading reached the logs
        for entry in info["full"]["history"]:
            assert "underflow" not in entry

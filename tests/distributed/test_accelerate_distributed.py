"""Two real processes on gloo: an overflow on one rank is a skip on every rank.

One launch of workers/ddp_overflow.py (start-up dominates the cost) feeds several tests.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import WORKERS, run_two_gloo_ranks

pytestmark = pytest.mark.slow

WORKER = WORKERS / "ddp_overflow.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[tuple[dict, torch.Tensor, torch.Tensor]]:
    out_dir: Path = tmp_path_factory.mktemp("ddp_overflow")
    run_two_gloo_ranks(WORKER, out_dir, timeout=240)
    return [
        (
            json.loads((out_dir / f"rank{r}.json").read_text()),
            torch.load(out_dir / f"rank{r}.pt", weights_only=True),
            torch.load(out_dir / f"rank{r}_fsdp2.pt", weights_only=True),
        )
        for r in range(2)
    ]


def test_workers_ran_as_two_gloo_ranks(ranks):
    assert [info["backend"] for info, *_ in ranks] == ["gloo", "gloo"]
    assert [info["accelerate"]["world_size"] for info, *_ in ranks] == [2, 2]


def test_plain_scaler_reduces_found_inf_so_both_ranks_skip_and_back_off(ranks):
    for info, *_ in ranks:
        assert info["plain"] == {"skipped": True, "scale": 128.0, "params_unchanged": True}


def test_accelerate_ddp_overflow_on_one_rank_skips_the_same_step_on_both(ranks):
    for info, *_ in ranks:
        assert info["accelerate"]["skipped"] == [False, True, False]


def test_accelerate_ddp_both_ranks_back_off_to_the_same_scale(ranks):
    for info, *_ in ranks:
        assert info["accelerate"]["scales"] == [1024.0, 512.0, 512.0]


def test_accelerate_ddp_params_stay_identical_across_ranks(ranks):
    (_, params0, _), (_, params1, _) = ranks
    assert torch.isfinite(params0).all()
    assert torch.equal(params0, params1)


def test_fsdp2_sharded_grads_overflow_on_one_rank_skips_and_backs_off_on_both(ranks):
    for info, *_ in ranks:
        assert info["fsdp2"]["grad_types"] == ["DTensor"]
        assert info["fsdp2"]["skipped"] == [False, True, False]
        assert info["fsdp2"]["scales"] == [1024.0, 512.0, 512.0]


def test_fsdp2_skipped_step_leaves_the_full_params_untouched_and_others_update_them(ranks):
    for info, _, full in ranks:
        assert info["fsdp2"]["params_unchanged"] == [False, True, False]
        assert torch.isfinite(full).all()

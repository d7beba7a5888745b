"""Two real gloo processes: a skip streak's replay gives every rank the same verdict, the same
FP32 island and the same loss scale, though only one rank's batch proves it."""

from __future__ import annotations

import json

import pytest

from tests.helpers.distributed import WORKERS, run_two_gloo_ranks

pytestmark = pytest.mark.slow


def test_the_replay_verdict_islands_and_scale_are_identical_on_both_ranks(tmp_path):
    run_two_gloo_ranks(WORKERS / "skip_streak_replay.py", tmp_path, timeout=300)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0["world_size"] == 2 and rank0["wrapped"] == "DistributedDataParallel"
    assert rank0["verdicts"] == rank1["verdicts"]
    (verdict,) = rank0["verdicts"]
    assert verdict["verdict"] == "fp16_backward_range" and verdict["modules"] == ["amp"]
    # Rank 0's batch alone fits FP16 at scale 1: the gathered findings decided for both.
    assert verdict["rank_verdicts"] == ["scale_warmup", "fp16_backward_range"]
    assert "amp" in rank0["islands"] and rank0["islands"] == rank1["islands"]
    assert rank0["scale"] == rank1["scale"] == verdict["scale"]
    assert rank0["global_step"] == rank1["global_step"] == 3
    assert rank0["param_sum"] == rank1["param_sum"]  # DDP replicas still identical

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


def test_each_other_verdict_provoked_on_one_rank_is_acted_on_by_both(tmp_path):
    """A bad sample, a diverging learning rate and start-up skips (workers/
    skip_streak_replay_faults.py): the gathered findings give both ranks the same verdict and the
    same action, so neither goes on alone (which would leave the other waiting in an all-reduce)."""
    run_two_gloo_ranks(WORKERS / "skip_streak_replay_faults.py", tmp_path, timeout=300)
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert rank0["world_size"] == 2
    for name in ("data_stop", "data_quarantine", "divergence", "scale_warmup"):
        assert rank0[name]["verdicts"] == rank1[name]["verdicts"], name
        assert rank0[name]["error"] == rank1[name]["error"], name
        assert rank0[name]["param_sum"] == rank1[name]["param_sum"], name  # replicas equal
        assert rank0[name]["scale"] == rank1[name]["scale"], name
    # Only rank 1 read the inf: its batch proved "data" for both, which stop together...
    stop = rank0["data_stop"]
    assert stop["error"] == "BadBatchError"
    assert [v["verdict"] for v in stop["verdicts"]] == ["data"]
    assert stop["verdicts"][0]["rank_verdicts"][1] == "data"
    assert stop["verdicts"][0]["rank_verdicts"][0] != "data"
    # ...or, with a quarantine of 1, drop it and finish every step at the scale they had.
    kept = rank0["data_quarantine"]
    assert kept["error"] is None and kept["global_step"] == 6
    assert [(v["verdict"], v.get("quarantined")) for v in kept["verdicts"]] == [("data", True)]
    assert kept["scale"] == 2.0**8
    assert rank0["divergence"]["error"] == "DivergenceError"
    assert rank0["divergence"]["verdicts"][-1]["verdict"] == "divergence"
    assert rank0["divergence"]["islands"] == []
    warmup = rank0["scale_warmup"]
    assert warmup["error"] is None and warmup["global_step"] == 4
    assert [v["verdict"] for v in warmup["verdicts"]] == ["scale_warmup"]
    assert warmup["islands"] == []

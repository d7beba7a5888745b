"""A DDP run on two gloo ranks leaves its process group without hanging, round after round
(``amp_trainer.ddp_teardown``). Without the Reducer freed first, the worker's loop hangs within
its first rounds (measured: at rounds 2, 2 and 8 of 12 in three runs), so each test fails by
running past its timeout."""

from __future__ import annotations

import json

import pytest

from tests.distributed.workers.ddp_teardown import ROUNDS
from tests.helpers.distributed import WORKERS, run_two_gloo_ranks

pytestmark = pytest.mark.slow

WORKER = WORKERS / "ddp_teardown.py"


def rounds_of(out_dir, rank: int) -> list[dict]:
    return json.loads((out_dir / f"rank{rank}.json").read_text())


def test_amp_accelerator_end_training_leaves_a_ddp_run_without_hanging_every_round(tmp_path):
    run_two_gloo_ranks(WORKER, tmp_path, "accelerate", timeout=180)
    for rank in (0, 1):
        rounds = rounds_of(tmp_path, rank)
        assert len(rounds) == ROUNDS
        for seen in rounds:
            assert seen["wrapped"] == "DistributedDataParallel"  # the path that deadlocked
            assert seen["steps"] == 2  # the scaler all-reduced found-inf on each step
            assert seen["left_after_end_training"] == {"reducer": False, "logger": False}


def test_release_ddp_reducers_before_destroy_process_group_leaves_a_plain_ddp_loop(tmp_path):
    run_two_gloo_ranks(WORKER, tmp_path, "plain", timeout=180)
    for rank in (0, 1):
        rounds = rounds_of(tmp_path, rank)
        # one DDP wrapper released per round; None and a plain module are left alone
        assert [seen["released"] for seen in rounds] == [1] * ROUNDS

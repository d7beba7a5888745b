"""Preemption on two gloo ranks: a SIGTERM that reaches one rank only stops both at one step.

One launch of tests/distributed/workers/jit_checkpoint.py (``--enable_jit_checkpoint``, rank 1
alone terminated inside step 3); the single-process preemption tests are
tests/recipes/test_recipe_preemption.py.
"""

from __future__ import annotations

import json

import pytest
import torch

from amp_trainer.checkpointing import AMP_STATE_FILE
from amp_trainer.checkpointing.digests import DIGEST_FILE
from tests.distributed.workers.jit_checkpoint import STOP_STEP
from tests.helpers.distributed import WORKERS, run_two_gloo_ranks


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_both_at_the_same_step_with_one_checkpoint(tmp_path):
    # Rank 1 alone is terminated, inside step 3: both ranks save checkpoint-3 and stop there
    # (each deciding alone, rank 0 trained on and waited in step 4's all-reduce: a hang).
    run_two_gloo_ranks(WORKERS / "jit_checkpoint.py", tmp_path, timeout=240)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    checkpoint = tmp_path / "run" / f"checkpoint-{STOP_STEP}"
    for rank in ranks:
        assert rank["global_step"] == STOP_STEP
        assert rank["jit_checkpoint"] == str(checkpoint)
    assert ranks[0]["scaler"] == ranks[1]["scaler"]
    assert [p.name for p in (tmp_path / "run").iterdir()] == [checkpoint.name]
    saved = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert saved == ranks[0]["scaler"]
    files = {p.name for p in checkpoint.iterdir()}
    assert {"rng_state_0.pth", "rng_state_1.pth", AMP_STATE_FILE, "trainer_state.json"} <= files
    # Under DDP too the digest list, written once both ranks saved, covers every rank's files.
    listed = json.loads((checkpoint / DIGEST_FILE).read_text(encoding="utf-8"))["files"]
    assert sorted(listed) == sorted(files - {DIGEST_FILE})

"""Two real gloo processes: AmpTrainer's evaluate() before train() still trains under DDP.

the GPT-2 recipe evaluates before training; stock Trainer's evaluation marks the
bare model prepared, so train() never wrapped it in DDP and the two ranks ended with different
weights (457.5 vs 442.3 parameter sums) while their loss-scale histories agreed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.distributed import WORKERS, run_two_gloo_ranks

pytestmark = pytest.mark.slow

WORKER = WORKERS / "trainer_eval_first.py"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[tuple[dict, torch.Tensor, Path]]:
    out_dir = tmp_path_factory.mktemp("eval_first")
    run_two_gloo_ranks(WORKER, out_dir, timeout=300)
    return [
        (
            json.loads((out_dir / f"rank{r}.json").read_text()),
            torch.load(out_dir / f"rank{r}.pt", weights_only=True),
            out_dir,
        )
        for r in range(2)
    ]


def test_evaluate_before_train_still_wraps_the_model_in_ddp(ranks):
    for info, _, _ in ranks:
        assert (info["backend"], info["world_size"]) == ("gloo", 2)
        assert info["eval_loss_finite"]
        assert info["wrapped"] == "DistributedDataParallel"


def test_evaluate_before_train_replicas_end_identical(ranks):
    (info0, params0, _), (info1, params1, _) = ranks
    assert info0["scales"] == info1["scales"] and len(info0["scales"]) == 4
    assert torch.isfinite(params0).all()
    assert params0.sum().item() == params1.sum().item()
    assert torch.equal(params0, params1)


def test_the_two_sided_rule_under_ddp_keeps_every_ranks_scale_and_replica_the_same(ranks):
    """Each rank measures its own shard of the data; the readings are combined before the rule
    reads them, so the ranks log the same figures and grow at the same steps (read alone, each
    rank's shard gives its own figures and its own growths)."""
    out_dir = ranks[0][2]
    runs = [json.loads((out_dir / f"rank{r}_underflow.json").read_text()) for r in range(2)]
    params = [torch.load(out_dir / f"rank{r}_underflow.pt", weights_only=True) for r in range(2)]
    assert runs[0]["growths"] >= 1  # the rule acted
    assert runs[0]["final_scale"] > 1.0
    assert runs[0]["logged"] and all("grad_underflow" in e for e in runs[0]["logged"])
    assert runs[0] == runs[1]  # scales, logged readings, growths: one decision for both
    assert torch.equal(params[0], params[1])

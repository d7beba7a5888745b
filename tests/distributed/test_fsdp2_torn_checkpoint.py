"""An FSDP2 rank killed mid-save: the checkpoint says it is incomplete, and a resume skips it.

Two launches of workers/fsdp2_torn_checkpoint.py (two gloo ranks on Accelerate's FSDP2 path,
``save_total_limit=1``): rank 1 SIGKILLed in checkpoint-4's save after rank 0 wrote
``trainer_state.json``, then that
checkpoint resumed by path, the run resumed with ``resume_from_checkpoint=True``, and its final
checkpoint resumed once more with the same ``max_steps``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from amp_trainer.checkpointing.completeness import INCOMPLETE_MARKER, why_incomplete
from tests.helpers.distributed import WORKERS, run_two_gloo_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

WORKER = WORKERS / "fsdp2_torn_checkpoint.py"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """The ``kill`` launch, and what each ``checkpoint-N`` of the run folder lacked after it."""
    out = tmp_path_factory.mktemp("fsdp2_torn")
    proc = run_two_gloo_ranks(WORKER, out, "kill", timeout=300, check=False)
    after_kill = {path.name: why_incomplete(path) for path in (out / "run").glob("checkpoint-*")}
    return out, proc, after_kill


@pytest.fixture(scope="module")
def torn(killed):
    out, proc, _ = killed
    checkpoint = out / "run" / "checkpoint-4"
    files = sorted(str(p.relative_to(checkpoint)) for p in checkpoint.rglob("*") if p.is_file())
    kept = out / "torn-copy" / checkpoint.name
    shutil.copytree(checkpoint, kept)  # the resumed run saves its own checkpoint-4 there
    run_two_gloo_ranks(WORKER, out, "resume", timeout=300)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return out, proc, files, kept, ranks


def test_a_rank_killed_mid_save_leaves_a_checkpoint_marked_incomplete(torn):
    _, killed, files, kept, _ = torn
    assert killed.returncode != 0
    # The fault as it happens: rank 0's files are all there, rank 1's RNG state is not.
    assert {"trainer_state.json", "rng_state_0.pth"} <= set(files)
    assert "rng_state_1.pth" not in files
    assert INCOMPLETE_MARKER in files  # removed only after every rank wrote its part
    assert why_incomplete(kept) == f"it holds {INCOMPLETE_MARKER}; no rng_state_1.pth"


def test_save_total_limit_1_keeps_the_last_complete_checkpoint_when_a_rank_dies_mid_save(killed):
    # Rotation waits until every rank wrote its part: the kill left the torn checkpoint-4 beside
    # the complete checkpoint-2 it would have replaced, which the resume below starts from
    # (test_resume_true_skips_the_torn_checkpoint_on_every_rank_and_names_what_it_lacks).
    _, _, after_kill = killed
    assert after_kill == {
        "checkpoint-2": None,
        "checkpoint-4": f"it holds {INCOMPLETE_MARKER}; no rng_state_1.pth",
    }


def test_save_total_limit_1_still_rotates_once_each_checkpoint_is_complete(torn):
    # The resumed run (save_total_limit=1 too) keeps only its newest checkpoint; the torn one it
    # found at step 4 was moved aside, whole, before its own checkpoint-4 was written.
    out, _, _, _, _ = torn
    assert sorted(p.name for p in (out / "run").glob("checkpoint-*")) == ["checkpoint-6"]
    aside = out / "run" / "previous-run-checkpoints" / "checkpoint-4"
    assert why_incomplete(aside) == f"it holds {INCOMPLETE_MARKER}; no rng_state_1.pth"


def test_a_torn_checkpoint_without_the_marker_is_incomplete_naming_the_ranks_file(torn):
    # As one saved by a version without the marker is: the rank's missing file is named.
    _, _, _, kept, _ = torn
    (kept / INCOMPLETE_MARKER).unlink(missing_ok=True)
    assert why_incomplete(kept) == "no rng_state_1.pth"


def test_resume_true_skips_the_torn_checkpoint_on_every_rank_and_names_what_it_lacks(torn):
    out, _, _, _, ranks = torn
    for rank in ranks:
        skipped = [w for w in rank["resume_warnings"] if "is incomplete" in w]
        assert skipped == [
            f"{out / 'run' / 'checkpoint-4'} is incomplete (it holds {INCOMPLETE_MARKER}; "
            "no rng_state_1.pth; interrupted while saving?): skipped; the last complete one is "
            f"{out / 'run' / 'checkpoint-2'}"
        ]
        assert rank["resumed_steps"] == [3, 4, 5, 6]  # from checkpoint-2, not the torn one
        assert rank["resumed_global_step"] == 6


def test_the_torn_checkpoint_resumed_by_path_is_one_warning_naming_the_missing_file(torn):
    out, _, _, _, ranks = torn
    for rank in ranks:
        said = [w for w in rank["explicit_warnings"] if "which is incomplete" in w]
        assert said == [
            f"Resuming {out / 'run' / 'checkpoint-4'}, which is incomplete (it holds "
            f"{INCOMPLETE_MARKER}; no rng_state_1.pth; interrupted while saving?): the resumed "
            "run differs from the interrupted one (the ranks without their files start with "
            f"other state). The last complete checkpoint is {out / 'run' / 'checkpoint-2'}."
        ]


def test_fsdp2_resuming_the_final_checkpoint_restores_its_loss_scaler(torn):
    out, _, _, _, ranks = torn
    saved = torch.load(out / "run" / "checkpoint-6" / "scaler.pt", weights_only=True)
    assert saved["steps"] >= 4  # the trained run's scaler (steps 3-6 at least)
    for rank in ranks:
        assert any("nothing to train" in w for w in rank["finished_warnings"])
        assert rank["finished_scaler"] == saved == rank["resumed_scaler"]

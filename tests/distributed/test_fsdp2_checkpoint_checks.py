"""Real FSDP2 checkpoints with damaged bytes, and one naming a malicious best model, resumed on
two gloo ranks: each is refused on both ranks with one line naming the file, before DCP reads it.

One launch of workers/fsdp2_checkpoint_checks.py (Accelerate's FSDP2 path on CPU; see its
docstring for the cases). Damage: a truncated shard, 64 flipped bytes in a shard, a truncated
``.metadata``, each with and without the checkpoint's digest list; ``resume_from_checkpoint=True``
passing the damaged checkpoint over. Malice: ``best_model_checkpoint`` naming a folder whose
``.metadata`` pickle would write a marker file, with ``load_best_model_at_end=True``, met when
the checkpoint naming it is resumed and in the end-of-training load itself.
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.distributed import WORKERS, run_two_gloo_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[object, list[dict]]:
    out_dir = tmp_path_factory.mktemp("fsdp2_checks")
    run_two_gloo_ranks(WORKERS / "fsdp2_checkpoint_checks.py", out_dir, timeout=500)
    return out_dir, [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def refused(result: dict, case: str) -> str:
    """The one-line ValueError a case raised before anything was trained."""
    error = result[case]["error"]
    assert error is not None and error.startswith("ValueError: "), error
    assert "\n" not in error
    assert result[case]["step"] == 0
    return error.removeprefix("ValueError: ")


def test_every_fsdp2_checkpoint_lists_its_files_digests(ranks):
    _, results = ranks
    assert [result["listed"] for result in results] == [True, True]


def test_a_truncated_fsdp2_shard_is_named_with_its_sizes_on_every_rank(ranks):
    out_dir, results = ranks
    checkpoint = out_dir / "shard_truncated" / "checkpoint-4"
    shard = checkpoint / "pytorch_model_fsdp_0" / "__1_0.distcp"
    for result in results:
        message = refused(result, "shard_truncated")
        assert message.startswith(f"{shard}: expected ")
        assert " bytes, found " in message and "(truncated)" in message
        assert f"The checkpoint {checkpoint} is damaged" in message
        older = out_dir / "shard_truncated" / "checkpoint-2"
        assert f"resume from {older}, the last intact checkpoint before it" in message


def test_flipped_bytes_in_an_fsdp2_shard_are_named_on_every_rank(ranks):
    out_dir, results = ranks
    shard = out_dir / "shard_flipped" / "checkpoint-4" / "optimizer_0" / "__0_0.distcp"
    for result in results:
        message = refused(result, "shard_flipped")
        assert message.startswith(f"{shard}: expected sha256 ")
        assert "its bytes changed" in message and "is damaged" in message


def test_a_truncated_fsdp2_metadata_is_named_as_damaged_not_as_code(ranks):
    out_dir, results = ranks
    meta = out_dir / "metadata_truncated" / "checkpoint-4" / "pytorch_model_fsdp_0" / ".metadata"
    for result in results:
        message = refused(result, "metadata_truncated")
        assert message.startswith(f"{meta}: expected ") and "(truncated)" in message
        assert "could run code" not in message


def test_without_a_digest_list_a_truncated_shard_or_metadata_is_still_named_as_truncated(ranks):
    out_dir, results = ranks
    shard = out_dir / "shard_truncated_unlisted" / "checkpoint-4" / "pytorch_model_fsdp_0"
    meta = out_dir / "metadata_truncated_unlisted" / "checkpoint-4" / "pytorch_model_fsdp_0"
    for result in results:
        message = refused(result, "shard_truncated_unlisted")
        assert message.startswith(f"{shard / '__1_0.distcp'} is truncated: its .metadata places ")
        message = refused(result, "metadata_truncated_unlisted")
        assert message.startswith(f"{meta / '.metadata'} is unreadable (truncated or damaged")
        assert "could run code" not in message


def test_resume_true_passes_a_damaged_fsdp2_checkpoint_over_on_every_rank(ranks):
    out_dir, results = ranks
    run = out_dir / "shard_flipped"
    for result in results:
        warnings = [m for level, m in result["resume_true"]["said"] if level == "WARNING"]
        assert len(warnings) == 1
        assert warnings[0].startswith(f"{run / 'checkpoint-4'} is damaged (")
        assert warnings[0].endswith(f"skipped; the last intact one is {run / 'checkpoint-2'}")
        assert result["resume_true"]["step"] == 6


def test_a_resumed_fsdp2_checkpoint_naming_a_malicious_best_model_is_refused_on_both_ranks(ranks):
    out_dir, results = ranks
    meta = out_dir / "best_poisoned" / "checkpoint-1" / "pytorch_model_fsdp_0" / ".metadata"
    for result in results:
        message = refused(result, "best_poisoned")
        assert message.startswith(f"{meta} is unreadable (")
        assert "names builtins.exec" in message and "could run code" in message
        assert result["best_poisoned"]["payload_ran"] is False
    assert not (out_dir / "best_poisoned-payload-ran").exists()


def test_the_end_of_training_fsdp2_best_model_load_refuses_a_malicious_metadata(ranks):
    out_dir, results = ranks
    for result in results:
        error = result["end"]["error"]
        assert error is not None and error.startswith("ValueError: "), error
        assert "pytorch_model_fsdp_0/.metadata is unreadable (" in error
        assert "names builtins.exec" in error and "\n" not in error
        assert result["end"]["payload_ran"] is False
    assert not (out_dir / "end-payload-ran").exists()

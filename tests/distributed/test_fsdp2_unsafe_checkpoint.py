"""Resuming an FSDP2 checkpoint runs no code from it: a pickle payload in its sharded folders
is refused on every rank with one line naming the file, and a legit checkpoint still resumes.

One launch of workers/fsdp2_unsafe_checkpoint.py (two gloo ranks, Accelerate's FSDP2 path on CPU):
a real checkpoint written by ``torch.distributed.checkpoint``, with a payload that writes a marker
file if unpickled, in ``pytorch_model_fsdp_0/.metadata`` (read by plain ``pickle.load``) or in a
non-tensor entry of ``optimizer_0`` (read by ``torch.load(weights_only=False)``).
"""

from __future__ import annotations

import json

import pytest

from tests.helpers.distributed import WORKERS, run_two_gloo_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> tuple[object, list[dict]]:
    out_dir = tmp_path_factory.mktemp("fsdp2_unsafe")
    run_two_gloo_ranks(WORKERS / "fsdp2_unsafe_checkpoint.py", out_dir, timeout=400)
    return out_dir, [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def test_a_pickle_in_an_fsdp2_metadata_file_is_refused_unread_on_every_rank(ranks):
    out_dir, results = ranks
    meta = out_dir / "metadata" / "checkpoint-3" / "pytorch_model_fsdp_0" / ".metadata"
    for result in results:
        error = result["metadata"]["error"]
        assert error is not None and error.startswith(f"ValueError: {meta} is unreadable (")
        assert "names builtins.exec" in error and "could run code" in error
        assert "\n" not in error
        assert result["metadata"]["payload_ran"] is False
    assert not (out_dir / "metadata-payload-ran").exists()


def test_a_pickle_in_an_fsdp2_non_tensor_entry_is_refused_unread_on_every_rank(ranks):
    out_dir, results = ranks
    for result in results:
        error = result["entry"]["error"]
        assert error is not None and error.startswith("ValueError: ")
        assert str(out_dir / "entry" / "checkpoint-3" / "optimizer_0") in error
        assert "could run code" in error and "\n" not in error
        assert result["entry"]["payload_ran"] is False
    assert not (out_dir / "entry-payload-ran").exists()


def test_an_untouched_fsdp2_checkpoint_still_resumes_to_the_end(ranks):
    _, results = ranks
    assert [result["legit_step"] for result in results] == [6, 6]

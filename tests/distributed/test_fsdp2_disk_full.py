"""Disk full during an FSDP2 checkpoint save: one ENOSPC error on each rank, nothing left behind.

One launch of workers/fsdp2_disk_full.py (two gloo ranks on Accelerate's FSDP2 path) whose
``output_dir`` is a real 32 KiB tmpfs: ``torch.distributed.checkpoint`` fails writing the model
shards. The single-process case is tests/trainer/test_trainer_resume_honesty.py.
"""

from __future__ import annotations

import errno
import json
import shutil

import pytest

from tests.helpers.disks import tiny_disk
from tests.helpers.distributed import WORKERS, run_two_gloo_ranks

pytestmark = pytest.mark.slow


def test_fsdp2_disk_full_is_one_enospc_error_per_rank_and_the_partial_checkpoint_is_removed(
    tmp_path,
):
    disk = tmp_path / "disk"
    unmount = tiny_disk(disk, "32k")
    try:
        run_two_gloo_ranks(WORKERS / "fsdp2_disk_full.py", tmp_path, timeout=300)
        remaining = sorted(p.name for p in disk.iterdir())
        used = shutil.disk_usage(disk).used
    finally:
        unmount()
    for rank in range(2):
        raised = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # Not torch's CheckpointException (a BaseException, past `except Exception`).
        assert raised["raised"] == "OSError"
        assert raised["errno"] == errno.ENOSPC
        assert raised["message"].startswith(
            f"[Errno 28] no space left on device saving checkpoint-1 in {disk}; the partial "
            "checkpoint was removed."
        )
    assert remaining == []
    assert used < 16 * 1024  # the disk is free again

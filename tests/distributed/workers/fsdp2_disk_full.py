"""Two-process worker: an FSDP2 checkpoint saved onto a full disk.

Launched by tests/distributed/test_fsdp2_disk_full.py with ``torch.distributed.run`` (gloo, CPU),
on Accelerate's FSDP2 path as workers/trainer_fsdp2.py forces it. ``output_dir`` is
``OUT/disk``, a tmpfs the test mounted, too small for the sharded model that
``torch.distributed.checkpoint`` writes at step 1. Each rank writes ``rank<N>.json`` (outside the
full disk): the type, errno and message of what ``train()`` raised.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from tests.distributed.workers.fsdp2_torn_checkpoint import trainer
from tests.helpers.distributed import leave_without_teardown


def main() -> None:
    out_dir = Path(sys.argv[1])
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    run = trainer(out_dir / "disk", max_steps=1, save_steps=1)
    try:
        run.train()
        result: dict = {"raised": None}
    except BaseException as err:  # what reaches the user's script, whatever it is
        result = {
            "raised": type(err).__name__,
            "errno": getattr(err, "errno", None),
            "message": str(err),
        }
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    leave_without_teardown()


if __name__ == "__main__":
    main()

"""Two-process worker: resuming a real FSDP2 checkpoint that carries a pickle payload.

Launched by tests/distributed/test_fsdp2_unsafe_checkpoint.py with ``torch.distributed.run``
(gloo, CPU), on Accelerate's FSDP2 path as workers/trainer_fsdp2.py forces it. A 3-step run saves
checkpoint-3 (sharded: ``pytorch_model_fsdp_0/`` and ``optimizer_0/``, written by
``torch.distributed.checkpoint``). Rank 0 then makes two copies carrying a payload that, unpickled,
writes a marker file:

* ``metadata``: ``pytorch_model_fsdp_0/.metadata`` replaced by the payload (DCP reads it with plain
  ``pickle.load``);
* ``entry``: one non-tensor entry of ``optimizer_0`` (a param group's ``lr``) pointed at a
  ``torch.save``'d payload appended to its ``.distcp`` file (DCP reads such entries with
  ``torch.load(weights_only=False)``).

Each rank resumes each copy, then the untouched checkpoint, and writes ``rank<N>.json``: the
error each poisoned resume raised, whether the marker exists after it, and the step the legit
resume ended at.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from amp_trainer.checkpointing.digests import DIGEST_FILE
from tests.distributed.workers.trainer_fsdp2 import trainer
from tests.helpers.distributed import leave_without_teardown


class WritesMarker:
    """Unpickles by running code that writes a marker file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def poison_metadata(checkpoint: Path, marker: Path) -> None:
    (checkpoint / "pytorch_model_fsdp_0" / ".metadata").write_bytes(
        pickle.dumps(WritesMarker(marker))
    )


def poison_entry(checkpoint: Path, marker: Path) -> None:
    """Point optimizer_0's first non-tensor entry at a payload appended to its storage file,
    with the metadata rewritten to match (what a crafted checkpoint would hold)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = checkpoint / "optimizer_0"
    meta_file = folder / ".metadata"
    metadata = pickle.loads(meta_file.read_bytes())  # our own, just written: trusted here
    fqn = next(
        k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    )
    index = next(i for i in metadata.storage_data if i.fqn == fqn)
    info = metadata.storage_data[index]
    target = folder / info.relative_path
    payload = __import__("io").BytesIO()
    torch.save(WritesMarker(marker), payload)
    offset = target.stat().st_size
    with open(target, "ab") as handle:
        handle.write(payload.getvalue())
    metadata.storage_data[index] = dataclasses.replace(
        info, offset=offset, length=len(payload.getvalue())
    )
    meta_file.write_bytes(pickle.dumps(metadata))


def main() -> None:
    out_dir = Path(sys.argv[1])
    full = trainer(out_dir / "full")  # initializes the process group
    rank = dist.get_rank()
    full.args.max_steps = 3
    full.train()
    saved = out_dir / "full" / "checkpoint-3"
    copies = {"metadata": poison_metadata, "entry": poison_entry}
    if rank == 0:
        for name, poison in copies.items():
            copy = Path(shutil.copytree(saved, out_dir / name / "checkpoint-3"))
            poison(copy, out_dir / f"{name}-payload-ran")
            # A crafted checkpoint carries no digest list of ours (or one rewritten to match):
            # what meets the payload is then the unpickler check.
            (copy / DIGEST_FILE).unlink()
    dist.barrier()
    result: dict = {}
    for name in copies:
        run = trainer(out_dir / f"{name}-resumed")
        try:
            run.train(resume_from_checkpoint=str(out_dir / name / "checkpoint-3"))
            result[name] = {"error": None}
        except Exception as err:  # what the test checks
            result[name] = {"error": f"{type(err).__name__}: {err}"}
        dist.barrier()
        result[name]["payload_ran"] = (out_dir / f"{name}-payload-ran").exists()
    legit = trainer(out_dir / "legit-resumed")
    legit.train(resume_from_checkpoint=str(saved))
    result["legit_step"] = legit.state.global_step
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    leave_without_teardown()


if __name__ == "__main__":
    main()

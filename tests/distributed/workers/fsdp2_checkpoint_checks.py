"""Two-process worker: real FSDP2 checkpoints with damaged bytes or a malicious best model, resumed.

Launched by tests/distributed/test_fsdp2_checkpoint_checks.py with ``torch.distributed.run``
(gloo, CPU), on Accelerate's FSDP2 path as workers/trainer_fsdp2.py forces it. A 4-step run
saves checkpoint-2 and checkpoint-4 (sharded: ``pytorch_model_fsdp_0/`` and ``optimizer_0/``,
written by ``torch.distributed.checkpoint``, with ``checkpoint-digests.json``). Rank 0 copies
the run folder once per case and damages that copy's checkpoint-4:

* ``shard_truncated``: rank 1's model shard ``__1_0.distcp`` cut to half its size;
* ``shard_flipped``: 64 bytes inverted in the middle of rank 0's optimizer shard;
* ``metadata_truncated``: the model folder's ``.metadata`` cut to half its size;
* ``*_unlisted``: the same damage, the digest list deleted (as an older checkpoint has none);
* ``best_poisoned``: checkpoint-4 whose ``trainer_state.json`` names as best_model_checkpoint a
  folder whose ``pytorch_model_fsdp_0/.metadata`` is a pickle that writes a marker file (its
  digest list deleted, as a hand-made checkpoint has none), resumed with
  ``load_best_model_at_end=True``.

Each rank resumes each copy by path, then the ``shard_flipped`` run folder with
``resume_from_checkpoint=True`` (to step 6), then trains a fresh ``load_best_model_at_end`` run
whose best checkpoint gets the payload right after the last save (before the end-of-training
load). Each rank writes ``rank<N>.json``: each error, the step each run reached, the library's
warnings and whether the marker files exist.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from transformers import TrainerCallback

from amp_trainer.checkpointing.digests import DIGEST_FILE
from tests.distributed.workers.fsdp2_unsafe_checkpoint import WritesMarker
from tests.distributed.workers.trainer_fsdp2 import ForcedFSDP2Trainer, Said, fsdp2_args
from tests.helpers.distributed import leave_without_teardown
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import ToyClassification


def trainer(out: Path, **overrides) -> ForcedFSDP2Trainer:
    args = fsdp2_args(out, **{"max_steps": 4, "save_steps": 2, **overrides})
    best = overrides.get("load_best_model_at_end", False)
    return ForcedFSDP2Trainer(
        model=make_tiny_bert(seed=0),
        args=args,
        train_dataset=ToyClassification(64, seed=1),
        eval_dataset=ToyClassification(16, seed=2) if best else None,
    )


BEST = dict(
    load_best_model_at_end=True,
    eval_strategy="steps",
    eval_steps=2,
    metric_for_best_model="loss",
)


def half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for index in range(middle, middle + count):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))


def poisoned_folder(folder: Path, marker: Path) -> Path:
    shards = folder / "pytorch_model_fsdp_0"
    shards.mkdir(parents=True, exist_ok=True)
    (shards / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    (folder / DIGEST_FILE).unlink(missing_ok=True)
    return folder


def point_best_at(checkpoint: Path, best: Path) -> None:
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text(encoding="utf-8"))
    state["best_model_checkpoint"] = str(best)
    state_file.write_text(json.dumps(state), encoding="utf-8")
    (checkpoint / DIGEST_FILE).unlink(missing_ok=True)


def damage(case: Path, out_dir: Path) -> None:
    checkpoint = case / "checkpoint-4"
    name = case.name.removesuffix("_unlisted")
    if name == "shard_truncated":
        half(checkpoint / "pytorch_model_fsdp_0" / "__1_0.distcp")
    elif name == "shard_flipped":
        flip(checkpoint / "optimizer_0" / "__0_0.distcp")
    elif name == "metadata_truncated":
        half(checkpoint / "pytorch_model_fsdp_0" / ".metadata")
    elif name == "best_poisoned":
        best = poisoned_folder(case / "checkpoint-1", out_dir / "best_poisoned-payload-ran")
        point_best_at(checkpoint, best)
    if case.name.endswith("_unlisted"):
        (checkpoint / DIGEST_FILE).unlink(missing_ok=True)


CASES = [
    "shard_truncated",
    "shard_flipped",
    "metadata_truncated",
    "shard_truncated_unlisted",
    "metadata_truncated_unlisted",
    "best_poisoned",
]


class PoisonBestAfterLastSave(TrainerCallback):
    """After the last save, rank 0 puts the payload in the best checkpoint's ``.metadata``
    (removing its digest list, so that the unpickler check is what meets it); every rank
    waits, so the end-of-training load reads the poisoned folder."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == args.max_steps:
            if dist.get_rank() == 0:
                best = Path(state.best_model_checkpoint)
                (best / "pytorch_model_fsdp_0" / ".metadata").write_bytes(
                    pickle.dumps(WritesMarker(self.marker))
                )
                (best / DIGEST_FILE).unlink(missing_ok=True)
            dist.barrier()


def main() -> None:
    out_dir = Path(sys.argv[1])
    said = Said()
    for name in ("amp_trainer.checkpointing.completeness", "amp_trainer.checkpointing.file_checks"):
        logging.getLogger(name).addHandler(said)
        logging.getLogger(name).setLevel(logging.INFO)
    run = trainer(out_dir / "run")  # initializes the process group
    rank = dist.get_rank()
    run.train()
    if rank == 0:
        for name in CASES:
            damage(Path(shutil.copytree(out_dir / "run", out_dir / name)), out_dir)
    dist.barrier()
    result: dict = {"listed": (out_dir / "run" / "checkpoint-4" / DIGEST_FILE).is_file()}
    for name in CASES:
        said.lines.clear()
        # The best-model case resumes into its own folder: the folder it names lies inside
        # output_dir, so the check that meets it is the .metadata one (not "outside").
        best = "best" in name
        resumed = trainer(
            out_dir / (name if best else f"{name}-resumed"), max_steps=6, **(BEST if best else {})
        )
        try:
            resumed.train(resume_from_checkpoint=str(out_dir / name / "checkpoint-4"))
            error = None
        except Exception as err:  # what the test checks
            error = f"{type(err).__name__}: {err}"
        dist.barrier()
        result[name] = {"error": error, "step": resumed.state.global_step, "said": said.lines[:]}
    result["best_poisoned"]["payload_ran"] = (out_dir / "best_poisoned-payload-ran").exists()

    said.lines.clear()
    passed_over = trainer(out_dir / "shard_flipped", max_steps=6)
    passed_over.train(resume_from_checkpoint=True)
    result["resume_true"] = {"step": passed_over.state.global_step, "said": said.lines[:]}

    marker = out_dir / "end-payload-ran"
    end = trainer(out_dir / "end", **BEST)
    end.add_callback(PoisonBestAfterLastSave(marker))
    try:
        end.train()
        error = None
    except Exception as err:  # what the test checks
        error = f"{type(err).__name__}: {err}"
    dist.barrier()
    result["end"] = {"error": error, "payload_ran": marker.exists()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    leave_without_teardown()


if __name__ == "__main__":
    main()

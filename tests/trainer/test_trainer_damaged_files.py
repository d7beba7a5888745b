"""A resumed checkpoint's damaged files are one line naming the file and what is wrong, never
torch's advice to load them with ``weights_only=False``, and a pickle in one never runs.

A real 2-step run's checkpoint (tiny BERT, CPU FP16) is damaged as a disk, a copy or a hand
would damage it, then resumed through the real ``AmpTrainer.train``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from amp_trainer import AmpTrainer
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import tiny_training_args


def dataset(rows: int = 32) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 128, (rows, 16), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": [i % 2 for i in range(rows)]})


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A 2-step run with checkpoint-2 (read-only: copy it)."""
    out = tmp_path_factory.mktemp("saved")
    # Without a digest list (as older versions saved it): the checks below are the ones such a
    # checkpoint gets; with one, the digests name the damage first
    # (tests/trainer/test_trainer_checkpoint_digests.py).
    args = tiny_training_args(
        out, max_steps=2, save_strategy="steps", save_steps=2, checkpoint_digests=False
    )
    AmpTrainer(model=make_tiny_bert(), args=args, train_dataset=dataset()).train()
    return out


class WritesMarker:
    """Unpickles by running code that writes a marker file: what a malicious file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])


def garbage(path: Path) -> None:
    path.write_bytes(os.urandom(200))


NOT_TORCH = "not a torch.save file: truncated, overwritten or another format"
# file -> damage -> (how, what the line says is wrong)
DAMAGE = {
    "trainer_state.json": {
        "truncated": (truncate, "not JSON: "),
        "garbage": (garbage, "not text"),
        "not-a-state": (
            lambda p: p.write_text(json.dumps({"steps": 2})),
            "no integer global_step: not a trainer state",
        ),
    },
    "amp_trainer_state.json": {
        "truncated": (truncate, "not JSON: "),
        "entry-without-step": (
            lambda p: p.write_text(
                json.dumps({"precision": "fp16", "scale_history": [{"scale": 1.0}]})
            ),
            "scale_history[0] is not an entry with an integer step",
        ),
    },
    "optimizer.pt": {"truncated": (truncate, NOT_TORCH), "garbage": (garbage, NOT_TORCH)},
    "scheduler.pt": {"truncated": (truncate, NOT_TORCH), "garbage": (garbage, NOT_TORCH)},
    "rng_state.pth": {"truncated": (truncate, NOT_TORCH), "garbage": (garbage, NOT_TORCH)},
}
CASES = [(name, kind) for name, kinds in DAMAGE.items() for kind in kinds]


def resume(checkpoint: Path) -> None:
    args = tiny_training_args(checkpoint.parent, max_steps=4, save_strategy="no")
    trainer = AmpTrainer(model=make_tiny_bert(), args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=str(checkpoint))


def assert_one_line_naming(err: BaseException, path: Path) -> str:
    message = str(err)
    assert message.startswith(f"{path} is unreadable ("), message
    assert "\n" not in message and "weights_only" not in message
    assert "arbitrary code" not in message
    return message


@pytest.mark.parametrize(("name", "kind"), CASES, ids=[f"{n}-{k}" for n, k in CASES])
def test_a_damaged_checkpoint_file_is_one_line_naming_it(saved_run, tmp_path, name, kind):
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    path = run / "checkpoint-2" / name
    damage, said = DAMAGE[name][kind]
    damage(path)
    with pytest.raises(ValueError) as caught:
        resume(run / "checkpoint-2")
    assert said in assert_one_line_naming(caught.value, path)


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng_state.pth"])
def test_a_pickle_in_a_checkpoint_file_is_refused_unread(saved_run, tmp_path, name):
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    marker = tmp_path / "payload-ran"
    path = run / "checkpoint-2" / name
    torch.save({"state": WritesMarker(marker)}, path)
    with pytest.raises(ValueError) as caught:
        resume(run / "checkpoint-2")
    message = assert_one_line_naming(caught.value, path)
    assert "refused unread: loading it could run code" in message
    assert not marker.exists()
    torch.load(path, weights_only=False)  # the payload is real: an unrestricted load runs it
    assert marker.read_text() == "ran"


def test_an_undamaged_checkpoint_still_resumes(saved_run, tmp_path):
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    args = tiny_training_args(run, max_steps=4, save_strategy="no")
    trainer = AmpTrainer(model=make_tiny_bert(), args=args, train_dataset=dataset())
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-2"))
    assert trainer.state.global_step == 4

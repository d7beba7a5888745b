"""The folder ``trainer_state.json`` names as ``best_model_checkpoint`` gets the resumed folder's
checks before ``load_best_model_at_end`` reads it, and one outside ``output_dir`` is refused.

transformers' ``_load_best_model`` reads that folder at the end of training; under FSDP it goes
through ``torch.distributed.checkpoint``, whose ``.metadata`` is a plain ``pickle.load``. A resumed
checkpoint from elsewhere can name any folder there. The payload here is a ``.metadata`` pickle
that writes a marker file when unpickled: each test checks the marker was never written. These
runs are one process (the check runs before any loader, FSDP or not); the FSDP2 load itself is
not run here.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from amp_trainer import AmpTrainer
from amp_trainer.checkpointing.digests import DIGEST_FILE
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import tiny_training_args
from tests.trainer.test_trainer_damaged_files import WritesMarker


def dataset(rows: int = 32) -> Dataset:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 128, (rows, 16), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": [i % 2 for i in range(rows)]})


def trainer_for(out: Path, **overrides) -> AmpTrainer:
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2, eval_strategy="steps")
    settings |= dict(eval_steps=2, load_best_model_at_end=True, metric_for_best_model="loss")
    args = tiny_training_args(out, **{**settings, **overrides})
    return AmpTrainer(
        model=make_tiny_bert(), args=args, train_dataset=dataset(), eval_dataset=dataset(8)
    )


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A 4-step run with load_best_model_at_end (read-only: copy it)."""
    out = tmp_path_factory.mktemp("saved")
    trainer = trainer_for(out)
    trainer.train()  # loads its best model at the end: the check passes on a clean run
    assert trainer.state.best_model_checkpoint is not None
    return out


def poisoned_folder(folder: Path, marker: Path) -> Path:
    """A sharded-model folder whose DCP ``.metadata`` runs code when unpickled."""
    shards = folder / "pytorch_model_fsdp_0"
    shards.mkdir(parents=True)
    (shards / ".metadata").write_bytes(pickle.dumps(WritesMarker(marker)))
    return folder


def resumable_copy(saved_run: Path, out: Path, best: Path) -> Path:
    """checkpoint-2 of ``saved_run`` in ``out``, its trainer_state.json naming ``best``."""
    checkpoint = Path(shutil.copytree(saved_run / "checkpoint-2", out / "checkpoint-2"))
    state_file = checkpoint / "trainer_state.json"
    state = json.loads(state_file.read_text(encoding="utf-8"))
    state["best_model_checkpoint"] = str(best)
    state_file.write_text(json.dumps(state), encoding="utf-8")
    # Edited by hand: its digest list removed, as a digest mismatch's error advises.
    (checkpoint / DIGEST_FILE).unlink()
    return checkpoint


def test_a_poisoned_best_model_checkpoint_inside_output_dir_is_refused_before_training(
    saved_run, tmp_path
):
    marker = tmp_path / "payload-ran"
    out = tmp_path / "run"
    best = poisoned_folder(out / "checkpoint-1", marker)
    checkpoint = resumable_copy(saved_run, out, best)

    trainer = trainer_for(out)
    with pytest.raises(ValueError, match=r"pytorch_model_fsdp_0/\.metadata.*refused unread"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert not marker.exists()
    assert trainer.state.global_step == 0  # nothing trained


def test_a_best_model_checkpoint_outside_output_dir_is_refused_unread(saved_run, tmp_path):
    marker = tmp_path / "payload-ran"
    best = poisoned_folder(tmp_path / "elsewhere" / "checkpoint-9", marker)
    out = tmp_path / "run"
    checkpoint = resumable_copy(saved_run, out, best)

    with pytest.raises(ValueError) as raised:
        trainer_for(out).train(resume_from_checkpoint=str(checkpoint))
    message = str(raised.value)
    assert message.startswith(f"{checkpoint / 'trainer_state.json'} names best_model_checkpoint=")
    assert "lies outside output_dir" in message and "refused unread" in message
    assert not marker.exists()


def test_load_best_model_at_end_checks_the_folder_the_state_names_then(saved_run, tmp_path):
    # A best_model_checkpoint that turns bad (or is set) during the run: the end-of-training
    # load checks it too, before transformers reads it.
    marker = tmp_path / "payload-ran"
    out = tmp_path / "run"
    trainer = trainer_for(out)
    trainer.state.best_model_checkpoint = str(poisoned_folder(out / "checkpoint-3", marker))
    with pytest.raises(ValueError, match=r"\.metadata.*refused unread"):
        trainer._load_best_model()
    assert not marker.exists()


def test_a_clean_best_model_checkpoint_resumes_and_is_loaded_at_the_end(saved_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(saved_run, out, dirs_exist_ok=True)
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text(encoding="utf-8"))
    # The saved run names its best folder inside its own output_dir: rename it into ours.
    best = Path(state["best_model_checkpoint"]).name
    resumable_copy(saved_run, tmp_path / "scratch", out / best)  # same content, path rewritten
    shutil.copy(
        tmp_path / "scratch" / "checkpoint-2" / "trainer_state.json",
        out / "checkpoint-2" / "trainer_state.json",
    )
    (out / "checkpoint-2" / DIGEST_FILE).unlink()  # its trainer_state.json edited
    trainer = trainer_for(out)
    trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert trainer.state.global_step == 4
    assert Path(trainer.state.best_model_checkpoint).parent.resolve() == out.resolve()

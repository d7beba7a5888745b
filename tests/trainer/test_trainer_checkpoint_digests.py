"""Every checkpoint lists the size and SHA-256 of each of its files, and a resume compares them
before anything reads one: damaged bytes are one error naming the file, never a silent load.

A real 4-step run (tiny BERT, CPU FP16) saves checkpoint-2 and checkpoint-4; copies of them are
damaged as a disk or a copy would damage them (a flipped byte, a cut-off file) and resumed
through the real ``AmpTrainer.train``. The two-rank FSDP2 cases (shards, ``.metadata``) are in
tests/distributed/test_fsdp2_checkpoint_checks.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import pytest

from amp_trainer import AmpTrainer
from amp_trainer.checkpointing.digests import DIGEST_FILE
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import tiny_training_args
from tests.trainer.test_trainer_best_model_checkpoint import trainer_for
from tests.trainer.test_trainer_damaged_files import dataset


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory) -> Path:
    """A 4-step run with checkpoint-2 and checkpoint-4 (read-only: copy it)."""
    out = tmp_path_factory.mktemp("saved")
    args = tiny_training_args(out, max_steps=4, save_strategy="steps", save_steps=2)
    AmpTrainer(model=make_tiny_bert(), args=args, train_dataset=dataset()).train()
    return out


def trainer(out: Path, **overrides) -> AmpTrainer:
    settings = dict(max_steps=4, save_strategy="steps", save_steps=2) | overrides
    args = tiny_training_args(out, **settings)
    return AmpTrainer(model=make_tiny_bert(), args=args, train_dataset=dataset())


def flip(path: Path, count: int = 1) -> None:
    """Invert ``count`` bytes in the middle of ``path`` (its size unchanged)."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    for index in range(middle, middle + count):
        data[index] ^= 0xFF
    path.write_bytes(bytes(data))


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


@pytest.fixture
def said():
    handler = Lines()
    library = logging.getLogger("amp_trainer")
    level = library.level
    library.addHandler(handler)
    library.setLevel(logging.DEBUG)
    yield handler.lines
    library.removeHandler(handler)
    library.setLevel(level)


def test_every_checkpoint_lists_each_of_its_files_with_its_size_and_sha256(saved_run):
    for checkpoint in (saved_run / "checkpoint-2", saved_run / "checkpoint-4"):
        listed = json.loads((checkpoint / DIGEST_FILE).read_text(encoding="utf-8"))
        files = sorted(
            p.relative_to(checkpoint).as_posix()
            for p in checkpoint.rglob("*")
            if p.is_file() and p.name != DIGEST_FILE
        )
        assert listed["algorithm"] == "sha256"
        assert sorted(listed["files"]) == files
        assert {"model.safetensors", "optimizer.pt", "scaler.pt", "trainer_state.json"} <= set(
            files
        )
        for name, entry in listed["files"].items():
            data = (checkpoint / name).read_bytes()
            assert entry == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.pt"])
def test_a_flipped_byte_is_one_error_naming_the_file_and_the_intact_checkpoint_before_it(
    saved_run, tmp_path, name
):
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    damaged = run / "checkpoint-4" / name
    flip(damaged)

    resumed = trainer(run, max_steps=6)
    with pytest.raises(ValueError) as raised:
        resumed.train(resume_from_checkpoint=str(run / "checkpoint-4"))
    message = str(raised.value)
    assert message.startswith(f"{damaged}: expected sha256 ")
    assert "found " in message and "its bytes changed" in message
    assert f"The checkpoint {run / 'checkpoint-4'} is damaged" in message
    assert f"resume from {run / 'checkpoint-2'}, the last intact checkpoint before it" in message
    assert "\n" not in message
    assert resumed.state.global_step == 0  # refused before anything was loaded or trained


def test_a_truncated_file_is_named_with_the_size_saved_and_the_size_found(saved_run, tmp_path):
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    damaged = run / "checkpoint-2" / "model.safetensors"
    size = damaged.stat().st_size
    damaged.write_bytes(damaged.read_bytes()[: size // 2])

    with pytest.raises(ValueError) as raised:
        trainer(run).train(resume_from_checkpoint=str(run / "checkpoint-2"))
    message = str(raised.value)
    assert message.startswith(f"{damaged}: expected {size} bytes, found {size // 2} (truncated)")
    assert "is damaged" in message and "no intact one is before it" in message


def test_resume_true_passes_a_damaged_checkpoint_over_with_a_warning_naming_it(
    saved_run, tmp_path, said
):
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    damaged = run / "checkpoint-4" / "model.safetensors"
    flip(damaged, count=64)

    resumed = trainer(run, max_steps=6)
    resumed.train(resume_from_checkpoint=True)

    warnings = [text for level, text in said if level == "WARNING" and "damaged" in text]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"{run / 'checkpoint-4'} is damaged ({damaged}: expected sha256")
    assert warnings[0].endswith(f"skipped; the last intact one is {run / 'checkpoint-2'}")
    assert resumed.state.global_step == 6
    # Resumed from checkpoint-2: its step-4 checkpoint replaced the damaged one, set aside.
    assert (run / "previous-run-checkpoints" / "checkpoint-4" / "model.safetensors").is_file()


def test_a_damaged_digest_list_is_named(saved_run, tmp_path):
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    listed = run / "checkpoint-4" / DIGEST_FILE
    listed.write_bytes(listed.read_bytes()[:100])

    with pytest.raises(ValueError, match=r"checkpoint-digests\.json is not JSON \(truncated\?\)"):
        trainer(run, max_steps=6).train(resume_from_checkpoint=str(run / "checkpoint-4"))


def test_an_old_checkpoint_without_digests_resumes_with_one_info_line(saved_run, tmp_path, said):
    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    (run / "checkpoint-4" / DIGEST_FILE).unlink()

    resumed = trainer(run, max_steps=6)
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-4"))

    assert resumed.state.global_step == 6
    infos = [text for level, text in said if DIGEST_FILE in text]
    assert infos == [
        f"{run / 'checkpoint-4'} has no {DIGEST_FILE} (saved by an older version, or with "
        "checkpoint_digests=False): its files are not compared with digests"
    ]
    assert [level for level, text in said if DIGEST_FILE in text] == ["INFO"]


def test_checkpoint_digests_false_writes_no_list_and_compares_nothing(saved_run, tmp_path):
    out = tmp_path / "off"
    trainer(out, max_steps=2, checkpoint_digests=False).train()
    assert (out / "checkpoint-2" / "model.safetensors").is_file()
    assert not (out / "checkpoint-2" / DIGEST_FILE).exists()

    run = Path(shutil.copytree(saved_run, tmp_path / "run"))
    flip(run / "checkpoint-4" / "model.safetensors")  # listed, but not compared when off
    resumed = trainer(run, max_steps=6, checkpoint_digests=False)
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-4"))
    assert resumed.state.global_step == 6


def test_the_best_model_load_at_the_end_compares_digests_first(tmp_path):
    out = tmp_path / "run"
    run = trainer_for(out)
    run.train()
    best = Path(run.state.best_model_checkpoint)
    flip(best / "model.safetensors")
    with pytest.raises(ValueError) as raised:
        run._load_best_model()
    assert str(raised.value).startswith(f"{best / 'model.safetensors'}: expected sha256 ")
    assert f"The checkpoint {best} is damaged" in str(raised.value)

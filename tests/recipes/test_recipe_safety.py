"""A recipe never loses or silently changes a user's run, driven as a user drives it:
``python recipes/finetune_bert.py ...`` in a subprocess, on a real run's folder.

* a resume trains on the checkpoint's own tokenizer, never a retrained one;
* ``--reuse_output_dir`` keeps the previous run's checkpoints byte for byte;
* resuming another folder's checkpoint into a folder holding a run is refused, the run untouched;
* ``--output_dir`` equal to the model folder being fine-tuned is refused, the model untouched;
* the other recipe's from-scratch model name, ``--label_smoothing_factor nan`` and a damaged
  ``scaler.pt`` are one line naming the value or the file, exit 2.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from amp_trainer.checkpointing.digests import DIGEST_FILE
from tests.helpers.recipes import BERT
from tests.helpers.repo import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow

RUN = ["--max_steps", "4", "--max_train_samples", "32", "--max_eval_samples", "8"]
RUN += ["--save_strategy", "steps", "--save_steps", "2", "--save_total_limit", "5"]


def bert(args, cache) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, BERT, *RUN, *args],
        cwd=REPO_ROOT,
        env=subprocess_env(AMP_TRAINER_CACHE=str(cache)),
        capture_output=True,
        text=True,
        timeout=300,
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    """The single ``finetune_bert: error:`` line (exit 2), without a traceback."""
    lines = [line for line in result.stderr.splitlines() if "finetune_bert: error:" in line]
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-4000:]
    assert "Traceback" not in result.stderr
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 4-step BERT run with checkpoint-2 and checkpoint-4 (read-only: copy it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    result = bert(["--output_dir", str(out)], tmp_path_factory.mktemp("cache"))
    assert result.returncode == 0, result.stderr[-4000:]
    assert (out / "checkpoint-2" / "tokenizer.json").is_file()
    return out


def copy_run(finished: Path, tmp_path: Path, name: str = "run") -> Path:
    return Path(shutil.copytree(finished, tmp_path / name))


# ---- 1. a resume uses the checkpoint's tokenizer ------------------------------------------
def swap_two_tokens(tokenizer_json: Path) -> tuple[str, str]:
    """Give the checkpoint's vocabulary an order no retraining reproduces: two word ids swapped
    (what a retrained, non-deterministic WordPiece does to hundreds of ids)."""
    data = json.loads(tokenizer_json.read_text())
    vocab = data["model"]["vocab"]
    words = [w for w in vocab if w.isalpha() and len(w) > 3][:2]
    vocab[words[0]], vocab[words[1]] = vocab[words[1]], vocab[words[0]]
    tokenizer_json.write_text(json.dumps(data))
    return words[0], words[1]


def test_a_resume_without_the_tokenizer_cache_trains_on_the_checkpoints_tokenizer(
    finished, tmp_path
):
    run = copy_run(finished, tmp_path)
    first, second = swap_two_tokens(run / "checkpoint-2" / "tokenizer.json")
    (run / "checkpoint-2" / DIGEST_FILE).unlink()  # edited on purpose: its digests dropped
    saved = json.loads((run / "checkpoint-2" / "tokenizer.json").read_text())["model"]["vocab"]
    # A new node, a container, a cleared ~/.cache: an empty tokenizer cache.
    result = bert(
        ["--output_dir", str(run), "--resume_from_checkpoint", str(run / "checkpoint-2")],
        tmp_path / "empty-cache",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "the tokenizer is the checkpoint's" in result.stderr
    assert not (tmp_path / "empty-cache").exists()  # nothing was trained
    for folder in (run, run / "checkpoint-4"):
        vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
        assert vocab == saved, folder
        assert (vocab[first], vocab[second]) == (saved[first], saved[second])


def test_resuming_a_from_scratch_checkpoint_without_its_tokenizer_is_refused(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (run / "checkpoint-2" / name).unlink()
    before = snapshot(run)
    line = error_line(
        bert(
            ["--output_dir", str(run), "--resume_from_checkpoint", str(run / "checkpoint-2")],
            tmp_path / "cache",
        )
    )
    assert "checkpoint-2" in line and "holds no tokenizer.json" in line
    assert snapshot(run) == before


# ---- 2. --reuse_output_dir keeps the previous run's checkpoints ---------------------------
def test_reuse_output_dir_keeps_the_previous_runs_checkpoints_byte_for_byte(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    previous = {name: snapshot(run / name) for name in ("checkpoint-2", "checkpoint-4")}
    result = bert(
        ["--output_dir", str(run), "--reuse_output_dir", "true", "--seed", "7"],
        tmp_path / "cache",
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for name, files in previous.items():
        kept = run / "previous-run-checkpoints" / name
        assert snapshot(kept) == files, name  # moved whole, not rewritten
        assert f"moved it to {kept}" in result.stderr
        # The new run's checkpoint of that step is there too, and is not the old one.
        assert snapshot(run / name)["model.safetensors"] != files["model.safetensors"]


# ---- 3. resuming another folder's checkpoint into a folder holding a run -------------------
def test_resuming_another_runs_checkpoint_into_a_finished_run_is_refused_untouched(
    finished, tmp_path
):
    other = copy_run(finished, tmp_path, "other")  # the run being resumed
    target = copy_run(finished, tmp_path, "finished")  # a finished run someone else cares about
    before = snapshot(target)
    line = error_line(
        bert(
            ["--output_dir", str(target), "--resume_from_checkpoint", str(other / "checkpoint-2")],
            tmp_path / "cache",
        )
    )
    assert "holds another run" in line and str(other / "checkpoint-2") in line
    assert snapshot(target) == before


# ---- 4. --output_dir is the model folder being fine-tuned ----------------------------------
def test_an_output_dir_that_is_the_source_model_folder_is_refused_untouched(finished, tmp_path):
    model = tmp_path / "model"  # a saved model folder (no run in it): config, weights, tokenizer
    model.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(finished / name, model / name)
    before = snapshot(model)
    line = error_line(
        bert(
            ["--model_name_or_path", str(model), "--output_dir", str(model)],
            tmp_path / "cache",
        )
    )
    assert "is the model folder being fine-tuned" in line and str(model) in line
    assert snapshot(model) == before


# ---- 6, 7, systemic: one line naming the value or the file --------------------------------
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            ["--model_name_or_path", "tiny-gpt2"],
            ["'tiny-gpt2' is the from-scratch model of the causal-lm recipe", "finetune_gpt2.py"],
        ),
        (["--label_smoothing_factor", "nan"], ["label_smoothing_factor must be in [0, 1]", "nan"]),
    ],
    ids=["other-recipes-tiny-model", "label-smoothing-nan"],
)
def test_a_value_that_would_train_something_else_is_one_line_exit_2(tmp_path, args, expected):
    line = error_line(bert(["--output_dir", str(tmp_path / "run"), *args], tmp_path / "cache"))
    for text in expected:
        assert text in line
    assert not (tmp_path / "run").exists()


def test_a_truncated_scaler_pt_is_one_line_naming_the_file(finished, tmp_path):
    run = copy_run(finished, tmp_path)
    scaler = run / "checkpoint-2" / "scaler.pt"
    size = scaler.stat().st_size
    scaler.write_bytes(scaler.read_bytes()[: size // 2])
    line = error_line(
        bert(
            ["--output_dir", str(run), "--resume_from_checkpoint", str(run / "checkpoint-2")],
            tmp_path / "cache",
        )
    )
    # The checkpoint's digests name it first: the size saved and the size found.
    assert f"{scaler}: expected {size} bytes, found {size // 2} (truncated)" in line
    assert "is damaged" in line and "weights_only" not in line


@pytest.mark.parametrize(
    ("name", "task", "other"),
    [("tiny-gpt2", "classification", "finetune_gpt2.py"), ("tiny-bert", "causal-lm", "bert.py")],
)
def test_each_recipe_refuses_the_other_recipes_from_scratch_model(name, task, other):
    from amp_trainer.recipes.data import DataError
    from amp_trainer.recipes.models import check_model_path

    with pytest.raises(DataError, match=rf"{name!r} is the from-scratch model of .*{other}"):
        check_model_path(name, task)
    check_model_path(name)  # without a task (the doctor detects it from the config): no check


def test_the_gpt2_recipes_tokenizer_on_resume_is_the_checkpoints_and_a_damaged_one_is_named(
    tmp_path, monkeypatch
):
    from amp_trainer.recipes.data import DataError
    from amp_trainer.recipes.models import causal_lm_tokenizer
    from amp_trainer.recipes.tokenizers import train_byte_level_bpe_tokenizer

    monkeypatch.setenv("AMP_TRAINER_CACHE", str(tmp_path / "cache"))
    texts = [f"the quick brown fox number {i} jumps over the lazy dog" for i in range(50)]
    checkpoint = tmp_path / "checkpoint-2"
    train_byte_level_bpe_tokenizer(texts, vocab_size=300).save_pretrained(checkpoint)
    shutil.rmtree(tmp_path / "cache")
    # No texts to train on: a retrain would fail; the checkpoint's tokenizer needs none.
    resumed = causal_lm_tokenizer("tiny-gpt2", [], 300, checkpoint=checkpoint)
    saved = json.loads((checkpoint / "tokenizer.json").read_text())["model"]["vocab"]
    assert resumed.get_vocab() == saved and resumed.pad_token == "<|endoftext|>"
    assert not (tmp_path / "cache").exists()

    file = checkpoint / "tokenizer.json"
    file.write_bytes(file.read_bytes()[:200])
    with pytest.raises(DataError, match=rf"^{file} is unreadable \("):
        causal_lm_tokenizer("tiny-gpt2", texts, 300, checkpoint=checkpoint)


@pytest.mark.parametrize("name", ["optimizer.pt", "trainer_state.json", "rng_state.pth"])
def test_a_damaged_checkpoint_file_is_one_line_naming_it(finished, tmp_path, name):
    run = copy_run(finished, tmp_path)
    damaged = run / "checkpoint-2" / name
    damaged.write_bytes(damaged.read_bytes()[: damaged.stat().st_size // 2])
    # Without the digest list (an older checkpoint's): the file's own check names it.
    (run / "checkpoint-2" / DIGEST_FILE).unlink()
    line = error_line(
        bert(
            ["--output_dir", str(run), "--resume_from_checkpoint", str(run / "checkpoint-2")],
            tmp_path / "cache",
        )
    )
    assert f"{damaged} is unreadable (" in line
    assert "weights_only" not in line and "arbitrary code" not in line


# ---- a new run in a reused folder, then resumed: this run's checkpoints, not the previous ---
def test_resume_true_after_reuse_output_dir_resumes_the_new_run_not_the_previous(
    finished, tmp_path
):
    from safetensors.torch import load_file

    run = copy_run(finished, tmp_path)  # the previous run: checkpoint-2, checkpoint-4
    new = ["--output_dir", str(run), "--max_steps", "2", "--seed", "7"]
    result = bert([*new, "--reuse_output_dir", "true"], tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-4000:]
    model = load_file(run / "model.safetensors")  # the new run's (2 steps, seed 7)
    assert (run / "checkpoint-4").is_dir()  # the previous run's, a higher step than the new one's

    result = bert([*new, "--resume_from_checkpoint", "true"], tmp_path / "cache")
    assert result.returncode == 0, result.stderr[-4000:]
    assert f"Resumed from {run / 'checkpoint-2'} at step 2" in result.stderr
    assert "checkpoint-4 is the end of its run" not in result.stderr
    kept = load_file(run / "model.safetensors")
    assert kept.keys() == model.keys()
    assert all(torch.equal(kept[k], model[k]) for k in model)

"""Every user mistake in a recipe is ONE line on stderr, exit 2 (usage) or 1 (runtime failure).

The recipes' ``main`` runs in-process through the same :func:`run_entry_point` their
``__main__`` uses (one subprocess test checks that path for real); each mistake is made for real:
a real YAML file, a real non-UTF-8 CSV, a real truncated tokenizer cache, a real read-only folder.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.util
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from amp_trainer.entry_point import EXIT_USAGE, describe_error, run_entry_point
from amp_trainer.recipes.config import check_output_dir
from amp_trainer.scaler import DynamicLossScaler, LossScaleError
from tests.helpers.repo import REPO_ROOT, subprocess_env

FAST = ["--max_steps", "1", "--max_train_samples", "16", "--max_eval_samples", "8"]
FAST += ["--save_strategy", "no"]


def load_recipe(name: str, monkeypatch):
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # @dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def recipe(monkeypatch, tmp_path):
    """``recipe(args, name=...)`` -> (exit code, the single stderr line)."""
    monkeypatch.setenv("AMP_TRAINER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("AMP_TRAINER_DEBUG", raising=False)

    def call(args, capsys, name="finetune_bert"):
        module = load_recipe(name, monkeypatch)
        code = run_entry_point(lambda: module.main(list(args)), name)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if f"{name}: error:" in line]
        assert len(lines) == 1 and "Traceback" not in err, err
        return code, lines[0]

    return call


def out_dir(tmp_path):
    return ["--output_dir", str(tmp_path / "run")]


# ---- flags and config files -----------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--no_such_flag", "1"], "unknown flag(s) ['--no_such_flag'] (see --help)"),
        (["--learnin_rate", "0.1"], "['--learnin_rate'] (did you mean --learning_rate?)"),
        (
            ["--report_to", "tensorbord"],
            "--report_to tensorbord: no such integration (did you mean tensorboard?)",
        ),
        (["--max_steps", "5", "6"], "unexpected argument(s) ['6']"),
        (["--max_steps", "abc"], "max_steps"),
        (["--loss_scale_backoff_factor", "2"], "loss_scale_backoff_factor"),
        (["--precision", "fp32", "--bf16", "true"], "contradicts"),
        (["--config", "/no/such/config.yaml"], "does not exist"),
        (
            [
                "--loss_scale_grow_on_underflow",
                "true",
                "--loss_scale_underflow_check_interval",
                "0",
            ],
            "loss_scale_grow_on_underflow=True needs the underflow meter, but "
            "loss_scale_underflow_check_interval=0 turns it off",
        ),
    ],
    ids=[
        "unknown-flag",
        "flag-typo",
        "report-to-typo",
        "stray-value",
        "bad-int",
        "bad-scaler-value",
        "contradictory-precision",
        "no-config",
        "grow-on-underflow-without-the-meter",
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(recipe, tmp_path, capsys, args, message):
    code, line = recipe([*args, *out_dir(tmp_path)], capsys)
    assert code == 2 and message in line


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("max_steps: [1,\n", "not valid YAML"),
        ("- max_steps\n- 2\n", "must hold a mapping"),
        ("learnig_rate: 0.1\n", "unknown key(s) ['learnig_rate']"),
        ("learnig_rate: 0.1\n", "(did you mean learning_rate?)"),
        ("max_steps: 2.7\n", "max_steps: 2.7"),
        ("precision: fp8\n", "precision: 'fp8'"),
    ],
    ids=["yaml-syntax", "a-list", "a-typo", "a-typo-suggestion", "float-for-int", "bad-choice"],
)
def test_a_bad_config_file_is_one_line_and_exit_2(recipe, tmp_path, capsys, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    code, line = recipe(["--config", str(config), *out_dir(tmp_path)], capsys)
    assert code == 2 and message in line and str(config) in line


@pytest.mark.parametrize("name", ["finetune_bert", "finetune_gpt2"])
def test_a_model_path_that_is_not_a_model_is_one_line_and_exit_2(recipe, tmp_path, capsys, name):
    folder = tmp_path / "not-a-model"
    folder.mkdir()
    (folder / "notes.txt").write_text("hello")
    args = ["--model_name_or_path", str(folder), *out_dir(tmp_path)]
    code, line = recipe(args, capsys, name=name)
    assert code == 2 and "has no config.json: not a saved model folder" in line


def test_an_output_dir_that_is_a_file_is_one_line_and_exit_2(recipe, tmp_path, capsys):
    (tmp_path / "run").write_text("a file")
    code, line = recipe(out_dir(tmp_path), capsys)
    assert code == 2 and "is not a folder" in line


# ---- inputs validated before expensive work ---------------------------------------------------
@pytest.mark.parametrize(
    ("length", "message"), [("0", "must be an integer >= 1"), ("512", "has positions (128)")]
)
def test_max_seq_length_outside_the_models_positions_is_refused(
    recipe, tmp_path, capsys, length, message
):
    code, line = recipe(["--max_seq_length", length, *out_dir(tmp_path)], capsys)
    assert code == 2 and message in line
    assert not (tmp_path / "cache").exists()  # refused before the tokenizer was trained


def test_gpt2_block_size_zero_is_refused(recipe, tmp_path, capsys):
    code, line = recipe(["--block_size", "0", *out_dir(tmp_path)], capsys, name="finetune_gpt2")
    assert code == 2 and "--block_size must be an integer >= 1" in line


def write_csv(path, rows, encoding="utf-8"):
    path.write_bytes(("text,label\n" + "\n".join(rows) + "\n").encode(encoding))
    return str(path)


@pytest.mark.parametrize(
    "labels", [["0.5", "1.5"], ["0.0", "2.5", "5.0", "3.5"]], ids=["halves", "sts-b-like"]
)
def test_fractional_labels_are_refused_for_classification(recipe, tmp_path, capsys, labels):
    rows = [f"sentence number {i},{labels[i % len(labels)]}" for i in range(20)]
    train = write_csv(tmp_path / "train.csv", rows)
    code, line = recipe(["--train_file", train, *out_dir(tmp_path)], capsys)
    assert code == 2 and "fractional labels" in line


def test_a_non_utf8_csv_is_one_line_naming_the_file(recipe, tmp_path, capsys):
    rows = [f"caf\u00e9 number {i},{i % 2}" for i in range(20)]
    train = write_csv(tmp_path / "train.csv", rows, encoding="latin-1")
    code, line = recipe(["--train_file", train, *out_dir(tmp_path)], capsys)
    assert code == 2 and "not UTF-8" in line and "train.csv" in line


def test_a_malformed_jsonl_is_one_line_naming_the_file(recipe, tmp_path, capsys):
    train = tmp_path / "train.jsonl"
    good = [json.dumps({"text": f"line {i}", "label": i % 2}) for i in range(10)]
    train.write_text("\n".join([*good, '{"text": "broken", "label": ', *good]) + "\n")
    code, line = recipe(["--train_file", str(train), *out_dir(tmp_path)], capsys)
    assert code == 2 and "cannot read the data file" in line and "train.jsonl" in line


def test_an_output_dir_holding_a_finished_run_is_refused_unless_reused(recipe, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "checkpoint-24").mkdir(parents=True)
    (run / "metrics.json").write_text("{}")
    code, line = recipe(out_dir(tmp_path), capsys)
    assert code == 2 and "holds a previous run" in line and "--reuse_output_dir" in line
    check_output_dir(run, reuse=True, resuming=False)  # the flag says: start a new run there
    check_output_dir(run, reuse=False, resuming=True)  # resuming it needs no flag


# ---- runtime failures: exit 1, one line, traceback kept -----------------------------------
def overflow_at_the_minimum_scale() -> None:
    """A real LossScaleError: inf gradients at min_scale with on_min_scale='raise'."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = DynamicLossScaler("cpu", init_scale=1.0, min_scale=1.0)
    for _ in range(2):
        scaler.scale((param * float("inf")).sum()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def test_a_run_ending_in_loss_scale_error_is_one_line_exit_1_with_the_traceback_in_a_file(
    capsys, monkeypatch
):
    monkeypatch.delenv("AMP_TRAINER_DEBUG", raising=False)
    with pytest.raises(LossScaleError):
        overflow_at_the_minimum_scale()
    assert run_entry_point(overflow_at_the_minimum_scale, "finetune_bert") == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("finetune_bert: error:") and "(traceback: " in line
    log = line.rsplit("(traceback: ", 1)[1].rstrip(")")
    with open(log) as handle:
        assert "LossScaleError" in handle.read()


def test_debug_prints_the_traceback_too(capsys, monkeypatch):
    monkeypatch.setenv("AMP_TRAINER_DEBUG", "1")
    assert run_entry_point(overflow_at_the_minimum_scale, "finetune_bert") == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "finetune_bert: error:" in err


def test_disk_full_anywhere_in_a_recipe_is_one_line_exit_1(capsys, tmp_path):
    def write_to_a_full_disk():
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "metrics.json"))

    assert run_entry_point(write_to_a_full_disk, "finetune_gpt2") == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "No space left on device" in line


@pytest.mark.slow  # a subprocess: start-up dominates
def test_the_recipe_script_itself_prints_one_line_and_exits_2(tmp_path):
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "recipes" / "finetune_gpt2.py"), "--no_such_flag", "1"],
        env=subprocess_env(AMP_TRAINER_CACHE=str(tmp_path)),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("finetune_gpt2: error:")
    assert "Traceback" not in result.stderr and "no_such_flag" in result.stderr


# ---- the tokenizer cache ----------------------------------------------------------------------
TEXTS = [f"the quick brown fox number {i} jumps over the lazy dog" for i in range(50)]


def test_a_corrupted_tokenizer_cache_entry_is_trained_again(tmp_path, monkeypatch, caplog):
    from amp_trainer.recipes.tokenizers import train_wordpiece_tokenizer

    monkeypatch.setenv("AMP_TRAINER_CACHE", str(tmp_path))
    first = train_wordpiece_tokenizer(TEXTS, vocab_size=100)
    (entry,) = (tmp_path / "tokenizers").iterdir()
    entry.write_text(entry.read_text()[:200])  # a torn write from an older version, or a bad disk
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        again = train_wordpiece_tokenizer(TEXTS, vocab_size=100)
    assert "unreadable" in caplog.text
    assert len(again("the quick brown fox")["input_ids"]) > 2 and len(first) == len(again)
    assert json.loads(entry.read_text())["model"]["type"] == "WordPiece"  # rebuilt in place


def read_only_folder(path):
    """A folder nobody can write, root included (a read-only tmpfs); chmod for other users."""
    path.mkdir()
    if os.geteuid() == 0:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], check=True
        )
        return lambda: subprocess.run(["umount", "-l", str(path)], check=False)
    path.chmod(0o555)
    return lambda: path.chmod(0o755)


def test_a_read_only_cache_falls_back_to_a_temp_folder_with_a_warning(
    tmp_path, monkeypatch, caplog
):
    from amp_trainer.recipes.tokenizers import train_wordpiece_tokenizer

    restore = read_only_folder(tmp_path / "ro")
    monkeypatch.setenv("AMP_TRAINER_CACHE", str(tmp_path / "ro"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", None)  # re-read TMPDIR
    try:
        with caplog.at_level(logging.WARNING, logger="amp_trainer"):
            tokenizer = train_wordpiece_tokenizer(TEXTS, vocab_size=100)
        assert (
            "Cannot write the tokenizer cache" in caplog.text and "AMP_TRAINER_CACHE" in caplog.text
        )
        assert len(list((tmp_path / "tmp" / "amp-trainer-cache" / "tokenizers").iterdir())) == 1
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="amp_trainer"):
            again = train_wordpiece_tokenizer(TEXTS, vocab_size=100)  # found in the fallback
        assert "Loading cached" in caplog.text and again.get_vocab() == tokenizer.get_vocab()
    finally:
        restore()


def test_a_truncated_safetensors_file_is_a_usage_error(tmp_path):
    from safetensors.torch import load_file, save_file

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(64)}, str(path))
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(Exception) as info:
        load_file(str(path))
    code, message = describe_error(info.value)
    assert code == EXIT_USAGE and message.startswith("unreadable safetensors file:")


@dataclasses.dataclass
class _Transformers50Args:
    group_by_length: bool = False


@dataclasses.dataclass
class _Transformers5xArgs:
    train_sampling_strategy: str = dataclasses.field(
        default="random", metadata={"choices": ["random", "group_by_length"]}
    )


@pytest.mark.parametrize(
    ("args_class", "key", "yaml_value", "field", "expected"),
    [
        (
            _Transformers50Args,
            "train_sampling_strategy",
            "group_by_length",
            "group_by_length",
            True,
        ),
        (
            _Transformers5xArgs,
            "group_by_length",
            "true",
            "train_sampling_strategy",
            "group_by_length",
        ),
        (
            _Transformers5xArgs,
            "train_sampling_strategy",
            "group_by_length",
            "train_sampling_strategy",
            "group_by_length",
        ),
    ],
)
def test_a_config_runs_with_either_spelling_of_length_grouping(
    tmp_path, args_class, key, yaml_value, field, expected
):
    # transformers 5.0 (our lower bound) says group_by_length, later 5.x train_sampling_strategy.
    from transformers import HfArgumentParser

    from amp_trainer.recipes.config import parse_args_with_config

    config = tmp_path / "c.yaml"
    config.write_text(f"{key}: {yaml_value}\n")
    (parsed,) = parse_args_with_config(HfArgumentParser(args_class), [], config)
    assert getattr(parsed, field) == expected


@pytest.mark.parametrize(
    ("name", "hint"),
    [("tiny-bertt", "; did you mean 'tiny-bert'? "), ("bert-base-uncsed", "; check the name. ")],
    ids=["close-to-a-local-name", "nothing-close"],
)
def test_an_offline_hub_id_not_in_the_cache_is_one_line_with_the_names_that_load(
    recipe, tmp_path, capsys, monkeypatch, name, hint
):
    # The suite runs with HF_HUB_OFFLINE=1, as a laptop without network does. Before, the run
    # loaded its data and then said transformers' "Check your internet connection".
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    code, line = recipe(["--model_name_or_path", name, *out_dir(tmp_path)], capsys)
    assert code == 2
    assert (
        f"--model_name_or_path {name!r}: no such local folder, and not in the Hugging Face " in line
    )
    assert hint in line
    assert line.endswith(
        "Names that load offline: tiny-bert, tiny-gpt2, offline:all-MiniLM-L6-v2, a local model "
        "folder"
    )
    assert "internet connection" not in line

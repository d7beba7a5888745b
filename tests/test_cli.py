"""The amp-trainer CLI: subcommands, exit codes, one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT, make_tiny_bert, subprocess_env
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amp_trainer.cli import main

VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "great", "dull", "film", "plot"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A saved tiny BERT classifier with a real (10-word) WordPiece tokenizer."""
    from transformers import BertTokenizerFast

    folder = tmp_path_factory.mktemp("model")
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    make_tiny_bert().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def overflowing_model_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("overflowing")
    model = make_tiny_bert()
    with torch.no_grad():
        model.bert.encoder.layer[0].intermediate.dense.weight.mul_(5e5)
    model.save_pretrained(folder)
    return folder


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def test_module_help_lists_the_subcommands_with_examples():
    result = subprocess.run(
        [sys.executable, "-m", "amp_trainer.cli", "--help"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        cwd=REPO_ROOT,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "export" in result.stdout and "doctor" in result.stdout
    assert "examples:" in result.stdout and "amp-trainer export --model" in result.stdout


@pytest.mark.parametrize("command", ["export", "doctor"])
def test_each_subcommand_has_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert "--model" in capsys.readouterr().out


def test_no_subcommand_is_a_one_line_usage_error(capsys):
    assert main([]) == 2
    assert "required" in one_line_error(capsys)


def test_missing_model_folder_is_one_line_not_a_traceback(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert main(["export", "--model", str(missing), "--output", str(tmp_path / "o")]) == 2
    line = one_line_error(capsys)
    assert str(missing) in line and "no such directory" in line


def test_folder_without_config_is_refused(tmp_path, capsys):
    assert main(["doctor", "--model", str(tmp_path)]) == 2
    assert "no config.json" in one_line_error(capsys)


@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.one_of(
        st.floats(max_value=-1e-9, allow_nan=False),
        st.floats(min_value=1.000001, allow_nan=False),
        st.just(float("nan")),
    )
)
def test_threshold_outside_zero_one_is_a_one_line_error(tmp_path, capsys, value):
    argv = ["export", "--model", "m", "--output", "o", f"--min-top1-agreement={value!r}"]
    assert main(argv) == 2
    line = one_line_error(capsys)
    assert "--min-top1-agreement" in line and "[0, 1]" in line


def test_export_writes_folder_and_report_and_exits_zero(model_dir, tmp_path, capsys):
    out, report = tmp_path / "fp16", tmp_path / "report.json"
    argv = ["export", "--model", str(model_dir), "--output", str(out), "--report", str(report)]
    assert main([*argv, "--texts", "a great film", "a dull plot"]) == 0
    assert "FP16 export: PASSED" in capsys.readouterr().out
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    assert json.loads(report.read_text())["parity"]["pytorch"]["positions"] == 2


def test_export_refuses_an_existing_output_in_one_line(model_dir, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("x")
    assert main(["export", "--model", str(model_dir), "--output", str(tmp_path / "out")]) == 2
    assert "--overwrite" in one_line_error(capsys)


def test_failed_parity_exits_one_and_writes_nothing_unless_forced(
    overflowing_model_dir, tmp_path, capsys
):
    argv = ["export", "--model", str(overflowing_model_dir), "--no-overflow-guard"]
    assert main([*argv, "--output", str(tmp_path / "out")]) == 1
    captured = capsys.readouterr()
    assert "non-finite" in captured.out and "nothing was written" in captured.err
    assert not (tmp_path / "out").exists()

    assert main([*argv, "--output", str(tmp_path / "forced"), "--force"]) == 1
    assert "written anyway" in capsys.readouterr().err
    assert json.loads((tmp_path / "forced" / "report.json").read_text())["passed"] is False


def test_doctor_on_a_healthy_model_exits_zero_and_writes_json(model_dir, tmp_path, capsys):
    data = tmp_path / "batch.jsonl"
    data.write_text('{"text": "a great film", "label": 1}\n{"text": "a dull plot", "label": 0}\n')
    diagnosis = tmp_path / "diagnosis.json"
    argv = ["doctor", "--model", str(model_dir), "--data", str(data), "--steps", "2"]
    assert main([*argv, "--json", str(diagnosis)]) == 0
    assert "verdict: healthy" in capsys.readouterr().out
    assert json.loads(diagnosis.read_text())["verdict"] == "healthy"


def test_doctor_names_the_overflowing_layer_and_exits_one(overflowing_model_dir, capsys):
    assert main(["doctor", "--model", str(overflowing_model_dir), "--steps", "1"]) == 1
    out = capsys.readouterr().out
    assert "verdict: fp16_unfriendly_layer" in out
    assert "culprit: bert.encoder.layer.0.intermediate.dense" in out


def test_doctor_texts_without_a_saved_tokenizer_is_a_one_line_error(overflowing_model_dir, capsys):
    assert main(["doctor", "--model", str(overflowing_model_dir), "--texts", "hello"]) == 2
    assert "no tokenizer" in one_line_error(capsys)


def test_doctor_missing_data_file_is_a_one_line_error(model_dir, tmp_path, capsys):
    missing = tmp_path / "missing.txt"
    assert main(["doctor", "--model", str(model_dir), "--data", str(missing)]) == 2
    assert f"--data {missing}: no such file" in one_line_error(capsys)

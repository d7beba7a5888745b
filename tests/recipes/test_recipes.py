"""The recipes, run end to end as a user runs them (subprocesses), at tiny size.

Each full run is a module-scoped fixture that several tests read, because start-up (imports,
tokenizer, export) dominates the cost. Also here: the config loader and the reporting helpers
the recipes are built from.
"""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from transformers import HfArgumentParser

from amp_trainer.atomic_files import write_json_atomic
from amp_trainer.recipes.config import parse_args_with_config
from amp_trainer.recipes.reporting import (
    format_table,
    plot_training,
    summarize_loss_scale,
)
from tests.helpers.recipes import BERT, GPT2, TINY, expect_success, run
from tests.helpers.repo import REPO_ROOT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("amp-trainer-cache"))


# ---- end-to-end runs ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory, cache):
    """The offline default from a custom YAML, with flags overriding two of its values."""
    out = tmp_path_factory.mktemp("bert")
    config = out / "custom.yaml"
    base = (REPO_ROOT / "configs" / "bert_offline.yaml").read_text()
    config.write_text(base + "\nmax_steps: 50\nlearning_rate: 5.0e-4\n")
    args = [sys.executable, BERT, "--config", str(config), *TINY, "--output_dir", str(out / "r")]
    result = expect_success(run(args, cache))
    return out / "r", result


@pytest.fixture(scope="module")
def gpt2_lora_run(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("gpt2") / "r"
    args = [sys.executable, GPT2, *TINY, "--lora", "true", "--output_dir", str(out)]
    return out, expect_success(run(args, cache))


def test_bert_recipe_writes_model_metrics_plot_and_fp16_export(bert_run):
    out, _ = bert_run
    for name in ("model.safetensors", "tokenizer.json", "metrics.json", "training.png"):
        assert (out / name).is_file(), name
    assert (out / "fp16_export" / "report.json").is_file()
    assert json.loads((out / "fp16_export_report.json").read_text())["passed"] is True


def test_bert_recipe_trains_in_fp16_with_the_loss_scaler(bert_run):
    metrics = json.loads((bert_run[0] / "metrics.json").read_text())
    assert metrics["precision"] == "fp16"
    assert metrics["loss_scale"]["final"] > 0
    assert 0.0 <= metrics["eval"]["eval_accuracy"] <= 1.0 and "eval_f1" in metrics["eval"]


def test_command_line_flags_override_the_yaml_file(bert_run):
    training = json.loads((bert_run[0] / "metrics.json").read_text())["config"]["training"]
    assert training["max_steps"] == 3  # flag beat the file's 50
    assert training["learning_rate"] == 5.0e-4  # from the file


def test_bert_recipe_prints_a_summary_table(bert_run):
    stdout = bert_run[1].stdout
    for row in ("eval accuracy", "loss scale final", "skipped steps", "tokens/s", "peak RSS"):
        assert row in stdout
    metrics = json.loads((bert_run[0] / "metrics.json").read_text())
    updates = metrics["optimizer_updates"]
    assert updates["applied"] == 3  # max_steps counts applied updates
    assert updates["attempts"] == updates["applied"] + updates["skipped"]
    assert f"applied {updates['applied']} of {updates['attempts']} attempts" in stdout


def test_metrics_json_names_say_what_each_count_counts(bert_run):
    metrics = json.loads((bert_run[0] / "metrics.json").read_text())
    updates, scale = metrics["optimizer_updates"], metrics["loss_scale"]
    # One update of the scaler per attempt, applied or skipped; no count is called "steps".
    assert scale["scaler_updates"] == updates["attempts"] >= updates["applied"] == 3
    assert scale["skipped"] == updates["skipped"]
    assert "optimizer_steps" not in metrics and "steps" not in scale


def test_neither_recipe_replays_a_skip_streak_on_a_clean_run(bert_run, gpt2_lora_run):
    for out, result in (bert_run, gpt2_lora_run):
        assert json.loads((out / "metrics.json").read_text())["replay_verdicts"] == []
        assert re.search(r"skip-streak replays \(verdicts\)\s*\|?\s*0\b", result.stdout)


def test_gpt2_recipe_with_lora_saves_an_adapter_and_a_merged_fp16_export(gpt2_lora_run):
    out, _ = gpt2_lora_run
    assert (out / "adapter_model.safetensors").is_file()
    assert (out / "fp16_export" / "model.safetensors").is_file()
    assert (out / "training.png").is_file()


def test_gpt2_recipe_reports_trained_and_untrained_perplexity(gpt2_lora_run):
    out, result = gpt2_lora_run
    metrics = json.loads((out / "metrics.json").read_text())
    for key in ("eval", "untrained"):
        assert math.isfinite(metrics[key]["perplexity"]) and metrics[key]["perplexity"] > 1
    # logged as eval_untrained_*: TensorBoard and W&B file it under eval/, not train/
    assert "eval_untrained_loss" in metrics["untrained"]
    assert metrics["sample_before"].startswith("The with statement")
    assert "untrained eval perplexity" in result.stdout and "after training:" in result.stdout


# ---- bad input fails before training --------------------------------------------------------


def bad_csv(tmp_path: Path, header: str, rows: list[str]) -> str:
    path = tmp_path / "train.csv"
    path.write_text("\n".join([header, *rows]) + ("\n" if rows or header else ""))
    return str(path)


@pytest.mark.parametrize(
    ("header", "rows", "extra", "message"),
    [
        ("text,target", ["a film,1", "a book,0"], [], "column 'label' (--label_column) not found"),
        ("", [], [], "is empty"),
        ("text,label", ["a film,1", "a book,0"], ["--num_labels", "3"], "num_labels=3"),
    ],
    ids=["missing-column", "empty-file", "label-mismatch"],
)
def test_bad_input_exits_nonzero_with_the_reason_before_training(
    tmp_path, cache, header, rows, extra, message
):
    train = bad_csv(tmp_path, header, rows)
    out = tmp_path / "r"
    args = [sys.executable, BERT, "--train_file", train, "--validation_file", train, *extra]
    result = run([*args, "--output_dir", str(out)], cache, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr and "finetune_bert: error:" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()  # nothing was trained, saved or exported


# ---- the pieces: config loading and reporting ----------------------------------------------


@dataclass
class _Args:
    alpha: int = 1
    beta: str = "b"
    gamma: bool = False


def test_yaml_values_become_defaults_that_flags_override(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("alpha: 5\nbeta: from-file\n")
    (args,) = parse_args_with_config(
        HfArgumentParser(_Args), ["--config", str(config), "--alpha", "7"]
    )
    assert (args.alpha, args.beta, args.gamma) == (7, "from-file", False)


def test_default_config_applies_without_config_flag_and_none_disables_it(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("alpha: 5\n")
    (with_default,) = parse_args_with_config(HfArgumentParser(_Args), [], config)
    (bare,) = parse_args_with_config(HfArgumentParser(_Args), ["--config", "none"], config)
    assert (with_default.alpha, bare.alpha) == (5, 1)


def test_unknown_yaml_key_is_an_error_naming_it(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("alpha: 5\ndelta: 1\n")
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['delta'\]"):
        parse_args_with_config(HfArgumentParser(_Args), ["--config", str(config)])


def test_metrics_json_is_strict_json_with_non_finite_values_as_null(tmp_path):
    path = write_json_atomic(tmp_path / "m.json", {"loss": float("nan"), "ok": [1.0, math.inf]})
    assert json.loads(path.read_text()) == {"loss": None, "ok": [1.0, None]}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_loss_scale_summary_counts_skips_and_the_minimum():
    history = [
        {"step": 1, "scale": 65536.0, "skipped": True},
        {"step": 2, "scale": 32768.0, "skipped": False},
        {"step": 3, "scale": 32768.0, "skipped": False},
    ]
    summary = summarize_loss_scale(history, final_scale=32768.0)
    assert (summary.final, summary.minimum, summary.skipped) == (32768, 32768, 1)
    assert summary.scaler_updates == 4  # steps 1-3 applied, the first attempt skipped
    assert summarize_loss_scale([], None) is None
    # "final" is the scale after the last update: a growth there shows, the history's last
    # entry (the scale that step ran with) stays available under its own name.
    grown = summarize_loss_scale(history, final_scale=65536.0)
    assert (grown.final, grown.last_step_ran_with, grown.maximum) == (65536, 32768, 65536)
    with pytest.raises(ValueError, match="final_scale is needed"):
        summarize_loss_scale(history, None)


def test_plot_is_written_as_png_with_skipped_steps(tmp_path):
    pytest.importorskip("matplotlib")
    logs = [{"step": 1, "loss": 0.9}, {"step": 2, "loss": 0.7}, {"step": 2, "eval_loss": 0.8}]
    history = [
        {"step": 1, "scale": 4.0, "skipped": True},
        {"step": 2, "scale": 2.0, "skipped": False},
    ]
    path = plot_training(logs, history, tmp_path / "plot.png", title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_summary_table_formats_floats_and_missing_values():
    table = format_table([("accuracy", 0.876543), ("memory", None), ("steps", 3)])
    assert "0.8765" in table and "n/a" in table and "| steps" in table

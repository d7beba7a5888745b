"""``--help`` of a recipe: ``--config`` and the recipe's own flags first, short; ``--help-all``:
every flag. Stock HfArgumentParser help was 758 lines with the recipe flags among ~600 lines of
TrainingArguments and no ``--config`` at all."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers.repo import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow


def recipe_help(name, *args):
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "recipes" / f"{name}.py"), *args],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


@pytest.mark.parametrize("name", ["finetune_bert", "finetune_gpt2"])
def test_help_lists_config_and_the_recipe_flags_first_and_stays_short(name):
    text = recipe_help(name, "--help")
    lines = text.splitlines()
    assert len(lines) < 300, len(lines)
    options = [line.split()[0] for line in lines if line.startswith("  --")]
    assert options[0] == "--config"
    assert options[1] == "--model_name_or_path"  # the recipe's own flags next
    assert options.index("--lora") < options.index("--precision") < options.index("--max_steps")
    assert "--adam_beta1" not in options  # TrainingArguments' long tail: --help-all
    assert "--help-all lists every flag" in " ".join(text.split())
    # The defaults shown are the offline config's, and it says so.
    assert "_offline.yaml's" in text
    assert "Consecutive clean optimizer steps before S grows. (default: 20)" in " ".join(
        text.split()
    )


def test_help_all_lists_every_training_argument():
    text = recipe_help("finetune_bert", "--help-all")
    assert "--adam_beta1" in text and "--lora_r" in text


@pytest.mark.parametrize("columns", [40, 63, 69, 80, 97, 120, 200])
def test_help_never_breaks_a_flag_or_a_path_across_lines(columns, monkeypatch):
    """argparse wraps at the terminal's width, and ``textwrap``'s defaults break at hyphens: CI,
    whose checkout path made the config name longer, got ``--help-`` / ``all``. Every width, and
    a long config path, keeps ``--help-all`` and the path whole on one line."""
    from transformers import HfArgumentParser

    from amp_trainer import AmpTrainingArguments
    from amp_trainer.recipes.config import RunArguments, _short_help

    monkeypatch.setenv("COLUMNS", str(columns))
    config = "/a/rather-long/checkout-path/for/ci-machines/configs/bert_offline.yaml"
    text = _short_help(HfArgumentParser((RunArguments, AmpTrainingArguments)), config)
    assert "--help-all lists every flag" in " ".join(text.split())
    assert f"{config}'s" in text.split()
    assert not [line for line in text.splitlines() if line.rstrip().endswith("-")], text

"""``--help`` of a recipe: ``--config`` and the recipe's own flags first, short, answered without
importing torch or transformers; ``--help-all``: every flag. Stock HfArgumentParser help was 758
lines with the recipe flags among ~600 lines of TrainingArguments and no ``--config`` at all."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from tests.helpers.repo import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow


def recipe_help(name, *args, cwd=REPO_ROOT, full=False, env=None):
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "recipes" / f"{name}.py"), *args],
        cwd=cwd,
        env={**subprocess_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return result if full else result.stdout


def flag_help(text, option):
    """The help text of ``option`` in a ``--help`` page, on one line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [option])
    block = [lines[start]]
    for line in lines[start + 1 :]:
        if line.startswith("  -") or not line.startswith("    "):
            break
        block.append(line)
    return " ".join(" ".join(block).split())


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
    # The training knobs a first fine-tune reaches for are on the short page.
    for knob in ("--warmup_steps", "--weight_decay", "--max_grad_norm", "--torch_compile"):
        assert knob in options, knob


@pytest.mark.parametrize("name", ["finetune_bert", "finetune_gpt2"])
def test_help_imports_neither_torch_nor_transformers(name):
    """What made --help take 20-60 s on a busy laptop: the parser was transformers', built
    after torch and transformers loaded. Python's import-time log lists what was imported."""
    done = recipe_help(name, "--help", full=True, env={"PYTHONPROFILEIMPORTTIME": "1"})
    assert "--model_name_or_path" in done.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line}
    assert {"amp_trainer.entry_point", "yaml"} <= imported  # the listing is real
    heavy = sorted(m for m in imported if m.split(".")[0] in ("torch", "transformers"))
    assert heavy == []


def test_the_negated_flag_says_what_it_does_in_both_helps():
    short = recipe_help("finetune_bert", "--help")
    assert flag_help(short, "--keep_norms_fp32").endswith("(default: true)")
    negated = flag_help(short, "--no_keep_norms_fp32")
    assert "--keep_norms_fp32 false" in negated and "Keep normalisation" not in negated
    full = recipe_help("finetune_bert", "--help-all")
    negated = flag_help(full, "--no_keep_norms_fp32,")
    assert "--keep_norms_fp32 false" in negated and "Keep normalisation" not in negated
    assert "(default: False)" not in negated


@pytest.mark.parametrize("where", ["repo", "elsewhere"])
def test_help_names_the_config_without_this_machines_path(where, tmp_path):
    cwd = REPO_ROOT if where == "repo" else tmp_path
    text = recipe_help("finetune_bert", "--help", cwd=cwd)
    assert str(REPO_ROOT) not in text
    assert "configs/bert_offline.yaml's" in " ".join(text.split())


def test_help_shows_a_given_config_as_typed_with_its_values(tmp_path):
    (tmp_path / "mine.yaml").write_text("learning_rate: 0.0042\nlora: true\n")
    text = recipe_help("finetune_bert", "--config", "mine.yaml", "--help", cwd=tmp_path)
    assert "mine.yaml's" in " ".join(text.split())
    assert flag_help(text, "--learning_rate").endswith("(default: 0.0042)")
    assert flag_help(text, "--lora").endswith("(default: true)")


def test_the_help_tables_match_the_installed_training_arguments():
    """The short help's amp-trainer flags are AmpTrainingArguments' own fields (help, default,
    choices), every one of them; its training flags are TrainingArguments fields with the
    defaults this transformers has."""
    from typing import Literal, get_args, get_origin, get_type_hints

    from transformers import TrainingArguments

    from amp_trainer import AmpTrainingArguments
    from amp_trainer.recipes.help import AMP_TRAINER_FLAGS, TRAINING_FLAGS

    def default(f):
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return f.default

    stock = {f.name: f for f in dataclasses.fields(TrainingArguments)}
    own = {f.name: f for f in dataclasses.fields(AmpTrainingArguments) if f.name not in stock}
    assert [flag.name for flag in AMP_TRAINER_FLAGS] == list(own)
    hints = get_type_hints(AmpTrainingArguments)
    for flag in AMP_TRAINER_FLAGS:
        f = own[flag.name]
        assert flag.help == f.metadata["help"], flag.name
        assert flag.default == default(f), flag.name
        hint = hints[flag.name]
        assert flag.choices == (get_args(hint) if get_origin(hint) is Literal else ()), flag.name
    for flag in TRAINING_FLAGS:
        assert flag.name in stock, flag.name
        assert flag.default == default(stock[flag.name]), flag.name


def test_help_all_lists_every_training_argument():
    text = recipe_help("finetune_bert", "--help-all")
    assert "--adam_beta1" in text and "--lora_r" in text


@pytest.mark.parametrize("columns", [40, 63, 69, 80, 97, 120, 200])
def test_help_never_breaks_a_flag_or_a_path_across_lines(columns, monkeypatch):
    """argparse wraps at the terminal's width, and ``textwrap``'s defaults break at hyphens: CI,
    whose checkout path made the config name longer, got ``--help-`` / ``all``. Every width, and
    a long config path, keeps ``--help-all`` and the path whole on one line."""
    from amp_trainer.recipes import SharedDataArguments
    from amp_trainer.recipes.help import short_help

    monkeypatch.setenv("COLUMNS", str(columns))
    config = "/a/rather-long/checkout-path/for/ci-machines/configs/bert_offline.yaml"
    text = short_help("finetune_bert.py", [SharedDataArguments], config)
    assert "--help-all lists every flag" in " ".join(text.split())
    assert f"{config}'s" in text.split()
    assert not [line for line in text.splitlines() if line.rstrip().endswith("-")], text

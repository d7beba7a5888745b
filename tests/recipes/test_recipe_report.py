"""The recipes' end of run as a user reads it: the plot, the summary and its hints.

* bf16/fp32 runs have no loss scaler: the plot is one loss panel whose title says so (it was an
  empty scale panel with its label overprinted and clipped);
* forward overflows (the guard's FP32 islands) are their own kind of event in
  ``scale_history``, the plot and the summary, not gradient-overflow skips;
* the GPT-2 sample prompt comes from ``--prompt``, the config file (for the config's own data),
  or else the user's data, and the summary says which;
* a tiny validation set, LoRA on a from-scratch base and an accuracy not above the
  majority-class rate each get one line saying so.

Unit tests build the matplotlib figure and read its axes, titles and legends (no image
comparison); two real recipe runs (subprocesses, a couple of steps) check the summary lines.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import subprocess
import sys

import pytest

from amp_trainer import AmpTrainer
from amp_trainer.recipes.config import given_on_command_line
from amp_trainer.recipes.data import offline_lm_dataset
from amp_trainer.recipes.reporting import (
    FORWARD_OVERFLOW_LABEL,
    SKIPPED_STEP_LABEL,
    accuracy_against_majority,
    lora_base_hint,
    plot_training,
    summarize_loss_scale,
    training_figure,
    training_length_hint,
    validation_size_hint,
)
from amp_trainer.recipes.run import RecipeRun
from tests.helpers.recipes import BERT, GPT2, expect_success, run
from tests.helpers.repo import REPO_ROOT
from tests.helpers.tiny_models import WO, make_overflowing_t5
from tests.helpers.training import ToySeq2Seq, tiny_training_args

LOGS = [{"step": s, "loss": 2.0 / s} for s in range(1, 9)] + [{"step": 8, "eval_loss": 0.4}]


def legend_labels(axes) -> list[str]:
    legend = axes.get_legend()
    return [] if legend is None else [text.get_text() for text in legend.get_texts()]


def points_labelled(axes, label: str) -> list[tuple[float, float]]:
    """The (step, scale) points of the scatter drawn under ``label``."""
    found = [c for c in axes.collections if c.get_label() == label]
    assert len(found) == 1, f"no single scatter labelled {label!r}"
    return [tuple(map(float, point)) for point in found[0].get_offsets()]


# ---- (a) no loss scaler: one panel that says why ---------------------------------------------


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_a_run_without_a_loss_scaler_plots_one_loss_panel_saying_there_is_no_loss_scale(
    precision,
):
    pytest.importorskip("matplotlib")
    figure = training_figure(LOGS, [], title=f"tiny-bert ({precision})", precision=precision)
    (axes,) = figure.axes  # no empty loss-scale panel
    assert axes.get_ylabel() == "loss" and axes.get_xlabel() == "optimizer step"
    assert axes.get_title() == (
        f"tiny-bert ({precision})\n{precision} trains without a loss scaler: no loss-scale panel"
    )
    assert legend_labels(axes) == ["train loss", "eval loss"]
    assert not axes.texts  # the old panel's centred text, drawn over its own label


def test_every_label_of_the_scalerless_plot_lies_inside_the_figure():
    pytest.importorskip("matplotlib")
    figure = training_figure(LOGS, [], title="offline:all-MiniLM-L6-v2 (bf16)", precision="bf16")
    figure.canvas.draw()
    renderer = figure.canvas.get_renderer()
    (axes,) = figure.axes
    page = figure.bbox
    for text in (axes.title, axes.xaxis.label, axes.yaxis.label):
        box = text.get_window_extent(renderer)
        assert page.x0 <= box.x0 and box.x1 <= page.x1, text.get_text()
        assert page.y0 <= box.y0 and box.y1 <= page.y1, text.get_text()
    assert not axes.title.get_window_extent(renderer).overlaps(axes.get_window_extent(renderer))


def test_plot_is_skipped_with_a_warning_without_matplotlib(monkeypatch, tmp_path, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an absent package looks like
    with caplog.at_level(logging.WARNING, logger="amp_trainer.recipes.reporting"):
        assert plot_training(LOGS, [], tmp_path / "training.png", precision="bf16") is None
    assert "amp-trainer[recipes]" in caplog.text
    assert not list(tmp_path.iterdir())


def test_matplotlib_and_tensorboard_are_the_recipes_extra_that_dev_installs():
    import tomllib

    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert extras["recipes"] == ["matplotlib>=3.7", "tensorboard>=2.14"]
    assert "amp-trainer[recipes]" in extras["dev"]


# ---- (b) forward overflows apart from gradient skips -----------------------------------------

HISTORY = [
    {"step": 1, "scale": 65536.0, "skipped": True, "fp32_islands": [WO]},
    {"step": 2, "scale": 65536.0, "skipped": False},
    {"step": 4, "scale": 65536.0, "skipped": True},
    {"step": 5, "scale": 32768.0, "skipped": False},
    {"step": 8, "scale": 32768.0, "skipped": False},
]


def test_forward_overflows_and_gradient_skips_have_their_own_markers_and_legend_entries():
    pytest.importorskip("matplotlib")
    loss_axes, scale_axes = training_figure(LOGS, HISTORY, precision="fp16").axes
    assert legend_labels(loss_axes) == ["train loss", "eval loss"]
    assert scale_axes.get_ylabel() == "loss scale"
    assert legend_labels(scale_axes) == ["loss scale", SKIPPED_STEP_LABEL, FORWARD_OVERFLOW_LABEL]
    assert points_labelled(scale_axes, SKIPPED_STEP_LABEL) == [(4.0, 65536.0)]
    assert points_labelled(scale_axes, FORWARD_OVERFLOW_LABEL) == [(1.0, 65536.0)]


def test_summary_counts_forward_overflows_among_the_skips_and_names_the_islands():
    summary = summarize_loss_scale(HISTORY, final_scale=32768.0)
    assert (summary.skipped, summary.forward_overflows, summary.fp32_islands) == (2, 1, (WO,))


def test_a_real_forward_overflow_is_recorded_and_drawn_as_an_fp32_island(tmp_path):
    pytest.importorskip("matplotlib")
    trainer = AmpTrainer(
        model=make_overflowing_t5(),
        args=tiny_training_args(tmp_path, max_steps=2, learning_rate=1e-4),
        train_dataset=ToySeq2Seq(),
    )
    trainer.train()
    forward = [e for e in trainer.scale_history if "fp32_islands" in e]
    assert [e["fp32_islands"] for e in forward] == [[WO]] and forward[0]["skipped"]
    summary = summarize_loss_scale(trainer.scale_history, trainer.loss_scaler.get_scale())
    assert summary.forward_overflows == 1 and summary.fp32_islands == (WO,)
    scale_axes = training_figure(trainer.state.log_history, trainer.scale_history).axes[1]
    drawn = points_labelled(scale_axes, FORWARD_OVERFLOW_LABEL)
    assert [step for step, _ in drawn] == [e["step"] for e in forward]
    gradient_skips = [e for e in trainer.scale_history if e["skipped"] and e not in forward]
    assert (SKIPPED_STEP_LABEL in legend_labels(scale_axes)) == bool(gradient_skips)


# ---- (d), (e) the hints ---------------------------------------------------------------------


def test_a_one_block_validation_set_gets_a_hint_and_a_big_one_none():
    hint = validation_size_hint(1, block_size=128)
    assert hint.startswith("hint: validation has 1 block of 128 tokens: eval loss")
    assert validation_size_hint(16, block_size=128) is None  # 2048 tokens
    assert "validation has 8 examples: accuracy moves in steps of 12.5 points" in (
        validation_size_hint(8)
    )
    assert validation_size_hint(100) is None


def test_a_from_scratch_model_under_100_updates_gets_a_hint_with_the_length_that_reaches_100():
    hint = training_length_hint(16, True, "tiny-gpt2", updates_per_epoch=8, max_steps=-1)
    assert hint.startswith("hint: 16 optimizer updates are far too few to train tiny-gpt2 from ")
    assert "(--num_train_epochs 13: this data gives 8 updates an epoch)" in hint  # 13 * 8 >= 100
    by_steps = training_length_hint(3, True, "tiny-bert", updates_per_epoch=40, max_steps=3)
    assert "train for at least 100 updates (--max_steps 100)" in by_steps
    assert training_length_hint(100, True, "tiny-gpt2", updates_per_epoch=8, max_steps=-1) is None
    assert training_length_hint(16, False, "gpt2", updates_per_epoch=8, max_steps=-1) is None


def test_lora_on_a_from_scratch_base_gets_a_hint_and_on_a_pretrained_one_none():
    hint = lora_base_hint(True, True, "tiny-gpt2")
    assert hint == (
        "hint: LoRA trains adapters on a randomly initialised base (tiny-gpt2 is built from "
        "scratch): the base never learns; use a pretrained --model_name_or_path or --lora false"
    )
    assert lora_base_hint(True, False, "gpt2") is None and lora_base_hint(False, True, "x") is None


def test_accuracy_is_shown_beside_the_majority_rate_and_commented_when_not_above_it():
    cell, note = accuracy_against_majority(0.48, 0.52, "neg")
    assert cell == "0.48 (majority class: 0.52)"
    assert note.startswith("note: eval accuracy 0.48 is not above the majority-class baseline 0.52")
    assert "always answering 'neg'" in note
    assert accuracy_against_majority(0.52, 0.52, "neg")[1] is not None  # equal is not above
    assert accuracy_against_majority(0.9, 0.52, "neg") == ("0.9 (majority class: 0.52)", None)
    assert "one label only ('pos')" in accuracy_against_majority(1.0, 1.0, "pos")[1]
    assert accuracy_against_majority(None, 0.5, "neg") == (None, None)


# ---- (c) the GPT-2 prompt -------------------------------------------------------------------


def test_flags_are_told_from_config_values_in_every_spelling():
    argv = ["--config", "c.yaml", "--train-file", "t.txt", "--prompt=Hi", "--max_steps", "3"]
    names = ("prompt", "train_file", "validation_file")
    assert given_on_command_line(argv, names) == {"prompt", "train_file"}
    assert given_on_command_line(["--max_steps", "3"], names) == set()


@pytest.fixture
def gpt2_recipe(monkeypatch):
    spec = importlib.util.spec_from_file_location("finetune_gpt2", GPT2)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "finetune_gpt2", module)  # @dataclass looks it up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    ("flags", "prompt", "source"),
    [
        ([], "The with statement", "from the config file"),
        (["--train_file", "own.txt"], "Rivers carry sediment downstream", "the first 4 words"),
        (["--train_file", "own.txt", "--prompt", "Once"], "Once", "from --prompt"),
        (["--validation_file=own.txt"], "Rivers carry sediment downstream", "the first 4 words"),
        (["--config", "none", "--model_name_or_path", "tiny-gpt2"], "Rivers carry", "the first"),
        (["--dataset_name", "wikitext"], "The with statement", "from the config file"),
    ],
    ids=["config-data", "own-data", "flag", "own-validation", "no-config", "hub-dataset"],
)
def test_the_prompt_is_the_flag_the_configs_for_its_data_or_the_datas(
    gpt2_recipe, tmp_path, flags, prompt, source
):
    m = gpt2_recipe
    argv = [*flags, "--output_dir", str(tmp_path / "run")]
    run = RecipeRun.parse(
        "finetune_gpt2", argv, m.ModelArguments, m.DataArguments, m.DEFAULT_CONFIG
    )
    rows = ["", "  ", "Rivers carry sediment downstream every spring.", "Second row."]
    chosen, said = m.choose_prompt(run, iter(rows))
    assert chosen.startswith(prompt) and said.startswith(source)


# ---- real runs, summary lines ----------------------------------------------------------------


def run_recipe(script: str, args: list[str], cache) -> subprocess.CompletedProcess:
    extra = ["--save_strategy", "no", "--disable_tqdm", "true"]
    return expect_success(run([sys.executable, script, *args, *extra], str(cache), timeout=300))


@pytest.mark.slow
def test_bf16_bert_with_lora_from_scratch_says_no_loss_scale_and_prints_its_hints(tmp_path):
    out = tmp_path / "run"
    args = ["--precision", "bf16", "--lora", "true", "--max_steps", "2"]
    args += ["--max_train_samples", "16", "--max_eval_samples", "8", "--output_dir", str(out)]
    stdout = run_recipe(BERT, args, tmp_path / "cache").stdout
    metrics = json.loads((out / "metrics.json").read_text())
    accuracy, majority = metrics["eval"]["eval_accuracy"], metrics["majority_class_accuracy"]
    cell = f"{accuracy:.4g} (majority class: {majority:.4g})"
    assert re.search(rf"^\| eval accuracy +\| +{re.escape(cell)} \|$", stdout, re.MULTILINE)
    assert ("is not above the majority-class baseline" in stdout) == (accuracy <= majority)
    assert "hint: validation has 8 examples: accuracy moves in steps of 12.5 points" in stdout
    assert "hint: LoRA trains adapters on a randomly initialised base (tiny-bert" in stdout
    assert metrics["loss_scale"] is None and (out / "training.png").is_file()


@pytest.mark.slow
def test_gpt2_on_the_users_text_prompts_with_it_and_hints_at_one_block_and_lora(tmp_path):
    corpus = offline_lm_dataset()
    (tmp_path / "train.txt").write_text("\n".join(corpus["train"]["text"][:300]) + "\n")
    own = ["", "Rivers carry sediment downstream every spring.", *corpus["validation"]["text"]]
    (tmp_path / "valid.txt").write_text("\n".join(own[:60]) + "\n")
    out = tmp_path / "run"
    args = ["--train_file", str(tmp_path / "train.txt")]
    args += ["--validation_file", str(tmp_path / "valid.txt"), "--lora", "true"]
    args += ["--max_steps", "1", "--max_eval_samples", "1", "--output_dir", str(out)]
    stdout = run_recipe(GPT2, args, tmp_path / "cache").stdout
    assert (
        "prompt: 'Rivers carry sediment downstream' (the first 4 words of the first validation "
        "example; --prompt sets another)"
    ) in stdout
    assert "hint: validation has 1 block of 64 tokens: eval loss and perplexity are noise" in stdout
    assert "hint: LoRA trains adapters on a randomly initialised base (tiny-gpt2" in stdout
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["prompt"] == "Rivers carry sediment downstream"
    assert metrics["sample_before"].startswith("Rivers carry sediment downstream")


@pytest.mark.slow
def test_gpt2_from_scratch_on_a_small_file_for_two_epochs_hints_the_run_is_far_too_short(tmp_path):
    """A user's small text file and the offline config's 2 epochs: a handful of updates, after
    which the greedy sample is no continuation at all. The hint names the count the summary
    shows and the epochs that reach 100 updates on this data."""
    corpus = offline_lm_dataset()
    (tmp_path / "train.txt").write_text("\n".join(corpus["train"]["text"][:60]) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(corpus["validation"]["text"][:20]) + "\n")
    out = tmp_path / "run"
    args = ["--train_file", str(tmp_path / "train.txt")]
    args += ["--validation_file", str(tmp_path / "valid.txt"), "--output_dir", str(out)]
    stdout = run_recipe(GPT2, args, tmp_path / "cache").stdout
    applied = int(re.search(r"^\| optimizer steps +\| +applied (\d+) of", stdout, re.M).group(1))
    per_epoch = applied // 2  # the config's num_train_epochs: 2
    assert 0 < applied < 100 and applied == 2 * per_epoch
    epochs = -(-100 // per_epoch)
    assert (
        f"hint: {applied} optimizer updates are far too few to train tiny-gpt2 from scratch: it "
        "still predicts little more than the commonest tokens"
    ) in stdout
    assert (
        f"train for at least 100 updates (--num_train_epochs {epochs}: this data gives "
        f"{per_epoch} updates an epoch), on more text if there is more, or fine-tune a "
        "pretrained --model_name_or_path"
    ) in stdout

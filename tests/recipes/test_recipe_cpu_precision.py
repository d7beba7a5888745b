"""Every --precision runs on a CPU under `accelerate launch --cpu`, and "auto" says what it picked.

`accelerate launch --cpu` exports ACCELERATE_USE_CPU=True; TrainingArguments (transformers 5.24)
reads it for the device but not for its bf16 check, so `--precision bf16` died with "Your setup
doesn't support bf16/gpu" unless `--use_cpu true` was passed as well.
"""

from __future__ import annotations

import logging
import sys

import pytest
import torch
from transformers.utils import is_torch_bf16_gpu_available

from amp_trainer import AmpTrainingArguments
from amp_trainer.precision import resolve_precision
from tests.helpers.recipes import ACCELERATE, BERT, expect_success, run

ONE_STEP = ["--max_steps", "1", "--max_train_samples", "16", "--max_eval_samples", "8"]
ONE_STEP += ["--save_strategy", "no", "--eval_strategy", "no", "--disable_tqdm", "true"]


def test_bf16_is_accepted_when_the_launcher_says_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("ACCELERATE_USE_CPU", "True")  # what `accelerate launch --cpu` exports
    args = AmpTrainingArguments(output_dir=str(tmp_path), precision="bf16")
    assert args.precision == "bf16" and args.bf16 and args.use_cpu
    assert args.device.type == "cpu"


@pytest.mark.skipif(
    torch.cuda.is_available() or is_torch_bf16_gpu_available(),
    reason="the machine has an accelerator: bf16 there is its business, not the CPU's",
)
def test_explicit_bf16_without_a_bf16_accelerator_trains_on_the_cpu(tmp_path):
    args = AmpTrainingArguments(output_dir=str(tmp_path), precision="bf16")
    assert args.precision == "bf16" and args.use_cpu and args.device.type == "cpu"


def test_auto_logs_what_it_picked_and_why(caplog):
    with caplog.at_level(logging.INFO, logger="amp_trainer.precision"):
        picked = resolve_precision("auto", "cpu")
    message = next(r.getMessage() for r in caplog.records if "precision='auto'" in r.getMessage())
    assert f"picked {picked} on cpu" in message
    assert "hardware" in message  # the reason: native BF16 or not


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["bf16", "auto"])
def test_recipe_runs_under_accelerate_launch_cpu_without_extra_flags(precision, tmp_path):
    args = [ACCELERATE, "launch", "--cpu", "--num_processes", "1", BERT, "--precision", precision]
    args += [*ONE_STEP, "--output_dir", str(tmp_path / "run")]
    expect_success(run(args, str(tmp_path / "cache")))
    assert (tmp_path / "run" / "metrics.json").is_file()


@pytest.mark.slow
def test_a_recipe_shows_what_auto_picked_once_after_its_logging_is_set_up(tmp_path):
    # The arguments say what "auto" picked while they are parsed, before the recipe sets up its
    # logging: the line used to go nowhere.
    args = [sys.executable, BERT, "--precision", "auto", *ONE_STEP]
    result = expect_success(
        run([*args, "--output_dir", str(tmp_path / "run")], str(tmp_path / "cache"))
    )
    lines = result.stderr.splitlines()
    picked = [i for i, line in enumerate(lines) if "precision='auto' picked" in line]
    on_cpu = [i for i in picked if " on cpu: " in lines[i]]
    assert len(on_cpu) == 1, result.stderr[-3000:]
    assert " INFO amp_trainer.precision: precision='auto' picked " in lines[on_cpu[0]]
    said = [lines[i].split(" ", 1)[1] for i in picked]  # without the time
    assert len(said) == len(set(said)), said  # no line twice
    # In the run's log, before the recipe's own precision line.
    assert max(picked) < next(
        i for i, line in enumerate(lines) if "finetune_bert: precision=" in line
    )

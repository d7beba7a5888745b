"""Every --precision runs on a CPU under `accelerate launch --cpu`, and "auto" says what it picked.

`accelerate launch --cpu` exports ACCELERATE_USE_CPU=True; TrainingArguments (transformers 5.24)
reads it for the device but not for its bf16 check, so `--precision bf16` died with "Your setup
doesn't support bf16/gpu" unless `--use_cpu true` was passed as well.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers.utils import is_torch_bf16_gpu_available

from amp_trainer import AmpTrainingArguments
from amp_trainer.precision import resolve_precision
from tests.conftest import REPO_ROOT, subprocess_env

ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
BERT = str(REPO_ROOT / "recipes" / "finetune_bert.py")
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
    result = subprocess.run(
        args,
        cwd=REPO_ROOT,
        env=subprocess_env(AMP_TRAINER_CACHE=str(tmp_path / "cache")),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.json").is_file()

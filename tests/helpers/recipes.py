"""The recipes and the ``accelerate`` command, run in a subprocess as a user runs them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers.repo import REPO_ROOT, subprocess_env

BERT = str(REPO_ROOT / "recipes" / "finetune_bert.py")
GPT2 = str(REPO_ROOT / "recipes" / "finetune_gpt2.py")
# The `accelerate` command of the interpreter running the tests (a venv's, not whatever is first
# on PATH).
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
# A handful of optimizer steps on a slice of the offline data: exercises every stage quickly.
TINY = ["--max_steps", "3", "--max_train_samples", "64", "--max_eval_samples", "32"]
TINY += ["--logging_steps", "1", "--save_strategy", "no"]
# Every value the launcher would otherwise fill in with a six-line "were not passed" warning.
QUIET_LAUNCHER = ["--num_processes", "1", "--num_machines", "1", "--dynamo_backend", "no"]
#: The BERT recipe's one line for ``--precision fp64``.
FP64_USAGE_ERROR = (
    "finetune_bert: error: argument --precision: invalid choice: 'fp64' (choose from 'auto', "
    "'fp16', 'bf16', 'fp32')"
)


def run(
    args: list[str], cache: str, timeout: int = 240, cwd: Path = REPO_ROOT
) -> subprocess.CompletedProcess:
    """``args`` from ``cwd`` (the checkout's root), its tokenizers trained into ``cache``."""
    return subprocess.run(
        args,
        cwd=cwd,
        env=subprocess_env(AMP_TRAINER_CACHE=cache),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def expect_success(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    return result


def launch(
    launcher_args: list[str], recipe_args: list[str], tmp_path: Path, cache: str
) -> subprocess.CompletedProcess:
    """``accelerate launch LAUNCHER_ARGS recipes/finetune_bert.py RECIPE_ARGS``, with no
    ``accelerate config`` default file (HF_HOME is empty) unless ``--config_file`` names one."""
    return subprocess.run(
        [ACCELERATE, "launch", *launcher_args, BERT, *recipe_args],
        cwd=REPO_ROOT,
        env=subprocess_env(AMP_TRAINER_CACHE=cache, HF_HOME=str(tmp_path / "hf_home")),
        capture_output=True,
        text=True,
        timeout=240,
    )

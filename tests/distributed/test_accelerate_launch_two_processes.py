"""``accelerate launch`` on two CPU processes (``configs/accelerate/cpu_2proc.yaml``), as a user
without a GPU runs the Accelerate example and the recipes: the skip is every rank's, rank 0 alone
reports, and a usage error is torchrun's summary naming the recipe's one line."""

from __future__ import annotations

import socket
import subprocess

import pytest

from tests.helpers.recipes import (
    ACCELERATE,
    BERT,
    FP64_USAGE_ERROR,
    TINY,
    expect_success,
    launch,
    run,
)
from tests.helpers.repo import REPO_ROOT, subprocess_env

pytestmark = pytest.mark.slow

CPU_2PROC = str(REPO_ROOT / "configs" / "accelerate" / "cpu_2proc.yaml")


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("amp-trainer-cache"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_the_accelerate_loop_example_runs_on_two_cpu_processes_with_the_cpu_launcher_config():
    result = subprocess.run(
        [
            ACCELERATE,
            "launch",
            "--config_file",
            CPU_2PROC,
            str(REPO_ROOT / "examples" / "accelerate_loop.py"),
            "--steps",
            "4",
            "--cpu",
        ],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=240,
        cwd=REPO_ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "processes: 2" in result.stdout
    assert "1 skipped, 1 backoffs" in result.stdout


def test_bert_recipe_with_lora_under_accelerate_launch_on_two_cpu_processes(tmp_path, cache):
    out = tmp_path / "r"
    args = [ACCELERATE, "launch", "--config_file", CPU_2PROC]
    args += ["--main_process_port", "29531", BERT, *TINY, "--lora", "true", "--use_cpu", "true"]
    result = expect_success(run([*args, "--output_dir", str(out)], cache, timeout=300))
    assert "world_size=2" in result.stderr
    assert (out / "adapter_model.safetensors").is_file() and (out / "metrics.json").is_file()
    assert result.stdout.count("finetune_bert: tiny-bert") == 1  # rank 0 alone reports


def test_a_usage_error_in_two_processes_is_torchruns_summary_naming_the_recipes_line(
    tmp_path, cache
):
    launcher = ["--config_file", CPU_2PROC, "--main_process_port", str(free_port())]
    result = launch(launcher, ["--use_cpu", "true", "--precision", "fp64"], tmp_path, cache)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert lines.count(FP64_USAGE_ERROR) == 2  # each rank's
    root_cause = result.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert f"  traceback : {FP64_USAGE_ERROR}" in root_cause.splitlines()
    assert "To enable traceback see" not in result.stderr  # what it said without the error file

"""A recipe resumed from its own checkpoint reports the whole run and what actually ran."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.helpers.recipes import BERT, run

# The module fixture trains and resumes three runs: 43 s alone, 89 s in the suite on 2 loaded cores
# (the first test pays for it); 600 s leaves room for a busier machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = ["--max_steps", "4", "--max_train_samples", "64", "--max_eval_samples", "16"]
RUN += ["--logging_steps", "1", "--save_strategy", "steps", "--save_steps", "2"]
RUN += ["--save_total_limit", "5", "--loss_scale_init", "16777216"]  # 2**24: overflows to count


def bert(args, cache) -> subprocess.CompletedProcess:
    result = run([sys.executable, BERT, *RUN, *args], cache, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("cache"))
    out = tmp_path_factory.mktemp("bert") / "run"
    bert(["--output_dir", str(out)], cache)
    full = json.loads((out / "metrics.json").read_text())
    resumed_result = bert(
        [
            "--output_dir",
            str(out),
            "--resume_from_checkpoint",
            str(out / "checkpoint-2"),
            "--loss_scale_growth_interval",
            "7",
        ],
        cache,
    )
    resumed = json.loads((out / "metrics.json").read_text())
    finished_result = bert(
        ["--output_dir", str(out), "--resume_from_checkpoint", str(out / "checkpoint-4")], cache
    )
    return out, full, resumed, resumed_result, finished_result


def test_the_resumed_recipes_loss_scale_summary_covers_the_whole_run(runs):
    _, full, resumed, _, _ = runs
    assert full["loss_scale"]["skipped"] > 0  # the test means something
    assert resumed["loss_scale"] == full["loss_scale"]
    assert resumed["optimizer_updates"]["applied"] == 4
    assert resumed["loss_scale"]["scaler_updates"] == resumed["optimizer_updates"]["attempts"]


def test_a_flag_the_checkpoint_overrides_is_reported_and_metrics_json_records_what_ran(runs):
    _, full, resumed, result, _ = runs
    assert "overrides loss_scale_growth_interval=7 (given) with 20" in result.stderr
    assert resumed["config"]["training"]["loss_scale_growth_interval"] == 20
    assert resumed["config"]["training"] == full["config"]["training"]


def test_resuming_the_recipes_final_checkpoint_trains_nothing_and_says_so(runs):
    out, _, _, _, result = runs
    assert "nothing to train" in result.stderr
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def test_the_resumed_final_checkpoints_summary_reports_the_checkpoints_loss_scale(runs):
    # metrics.json and the summary of the "nothing to train" run are the finished run's: the
    # scaler is restored from checkpoint-4/scaler.pt, not left at --loss_scale_init.
    out, full, _, _, result = runs
    finished = json.loads((out / "metrics.json").read_text())  # the last of the three runs
    assert full["loss_scale"]["final"] != 16777216  # the run's overflows lowered it
    assert finished["loss_scale"] == full["loss_scale"]
    row = next(line for line in result.stdout.splitlines() if "loss scale final" in line)
    cells = [cell.strip() for cell in row.split("|") if cell.strip()]
    assert cells[-1] == f"{full['loss_scale']['final']:.10g}"

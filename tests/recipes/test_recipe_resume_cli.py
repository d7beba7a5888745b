"""Resume and Ctrl-C as people drive the recipes: the real CLI, in a subprocess.

``--resume_from_checkpoint true|RUN_DIR|CHECKPOINT`` all work (the last checkpoint found as
transformers' ``get_last_checkpoint`` finds it), a bad value is one line before any loading, the
run says where it picked up, and Ctrl-C ends with one line holding the command that resumes.
A new run next to a previous run's default folder gets a folder of its own, and a run on files
records the files, not the offline dataset name, in metrics.json.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers.recipes import BERT, run
from tests.helpers.repo import REPO_ROOT, subprocess_env

# The module fixture trains and resumes four runs: 65 s alone, 80 s in the suite on 2 loaded cores
# (the first test pays for it); 600 s leaves room for a busier machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RUN = ["--max_train_samples", "64", "--max_eval_samples", "16", "--logging_steps", "1"]
RUN += ["--save_strategy", "steps", "--save_steps", "1", "--save_total_limit", "5"]


def bert(args, cache, cwd=REPO_ROOT, expect=0) -> subprocess.CompletedProcess:
    result = run([sys.executable, BERT, *RUN, *args], cache, timeout=300, cwd=cwd)
    assert result.returncode == expect, result.stderr[-4000:]
    return result


def error_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if "finetune_bert: error:" in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-4000:]
    return lines[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One 2-step run, then a resume in each of the three spellings."""
    cache = str(tmp_path_factory.mktemp("cache"))
    out = tmp_path_factory.mktemp("bert") / "run"
    bert(["--max_steps", "2", "--output_dir", str(out)], cache)
    true = bert(
        ["--max_steps", "3", "--output_dir", str(out), "--resume_from_checkpoint", "true"], cache
    )
    steps_true = json.loads((out / "metrics.json").read_text())["train"]
    # A run folder, no --output_dir: the run continues in that folder.
    run_dir = bert(["--max_steps", "4", "--resume_from_checkpoint", str(out)], cache)
    steps_run_dir = json.loads((out / "metrics.json").read_text())["train"]
    other = out.parent / "from-checkpoint-1"
    checkpoint = bert(
        [
            "--max_steps",
            "2",
            "--output_dir",
            str(other),
            "--resume_from_checkpoint",
            str(out / "checkpoint-1"),
        ],
        cache,
    )
    return out, other, cache, (true, steps_true), (run_dir, steps_run_dir), checkpoint


def test_resume_true_continues_the_last_checkpoint_in_output_dir(runs):
    out, _, _, (result, _), _, _ = runs
    assert f"Resumed from {out / 'checkpoint-2'} at step 2 (loss scale 65536)" in result.stderr
    assert (out / "checkpoint-3").is_dir()


def test_resume_from_a_run_folder_picks_its_last_checkpoint_and_writes_there(runs):
    out, _, _, _, (result, _), _ = runs
    assert f"Resumed from {out / 'checkpoint-3'} at step 3 (loss scale" in result.stderr
    assert (out / "checkpoint-4").is_dir()  # the run's own folder, not the config's default
    assert not (REPO_ROOT / "runs" / "bert_offline" / "checkpoint-4").exists()


def test_resume_from_a_checkpoint_folder(runs):
    out, other, _, _, _, result = runs
    assert f"Resumed from {out / 'checkpoint-1'} at step 1 (loss scale 65536)" in result.stderr
    assert (other / "checkpoint-2").is_dir()


def test_an_incomplete_checkpoint_is_named_with_the_last_complete_one(runs, tmp_path):
    # Ctrl-C while saving leaves checkpoint-N without trainer_state.json.
    _, _, cache, _, _, _ = runs
    for step, files in ((1, ["trainer_state.json", "config.json"]), (2, ["config.json"])):
        (tmp_path / f"checkpoint-{step}").mkdir()
        for name in files:
            (tmp_path / f"checkpoint-{step}" / name).write_text("{}")
    result = bert(["--resume_from_checkpoint", str(tmp_path / "checkpoint-2")], cache, expect=2)
    assert error_line(result).endswith(
        f"is an incomplete checkpoint (no trainer_state.json: interrupted while saving?); the "
        f"last complete one is {tmp_path / 'checkpoint-1'}"
    )


@pytest.mark.parametrize("kind", ["empty-run-folder", "missing", "true-without-checkpoints"])
def test_a_resume_value_without_a_checkpoint_is_one_line_before_loading(runs, tmp_path, kind):
    _, _, cache, _, _, _ = runs
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "notes.txt").write_text("x")
    args = {
        "empty-run-folder": ["--resume_from_checkpoint", str(folder)],
        "missing": ["--resume_from_checkpoint", str(tmp_path / "nope")],
        "true-without-checkpoints": [
            "--output_dir",
            str(folder),
            "--resume_from_checkpoint",
            "true",
        ],
    }[kind]
    result = bert(["--max_steps", "1", *args], cache, expect=2)
    line = error_line(result)
    if kind == "missing":
        assert f"--resume_from_checkpoint '{tmp_path / 'nope'}' does not exist" in line
    else:
        assert f"'{folder}' holds no checkpoint-N folder (it holds notes.txt)" in line
    assert "train / " not in result.stderr  # stopped before the data was loaded


def test_ctrl_c_ends_with_one_line_and_the_command_that_resumes(runs, tmp_path):
    _, _, cache, _, _, _ = runs
    out = tmp_path / "interrupted"
    args = [*RUN, "--max_steps", "500", "--output_dir", str(out)]
    proc = subprocess.Popen(
        [sys.executable, BERT, *args],
        cwd=REPO_ROOT,
        env=subprocess_env(AMP_TRAINER_CACHE=cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 240
    while not (out / "checkpoint-2").is_dir() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-4000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-4000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-4000:]
    last = stderr.rstrip().split("\n")[-1]  # a whole line: nothing after it, not even a bar
    assert last.startswith("finetune_bert: interrupted; checkpoint-"), last
    command = shlex.split(last.split("Resume with: ", 1)[1])
    assert command[:2] == ["python", BERT]
    checkpoint = command[command.index("--resume_from_checkpoint") + 1]
    assert checkpoint.startswith(str(out / "checkpoint-"))
    step = int(checkpoint.rsplit("-", 1)[1])
    # The command as printed (one more step) resumes where the run stopped.
    resumed = subprocess.run(
        [sys.executable, *command[1:], "--max_steps", str(step + 1)],
        cwd=REPO_ROOT,
        env=subprocess_env(AMP_TRAINER_CACHE=cache),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"Resumed from {checkpoint} at step {step} (loss scale" in resumed.stderr


def test_a_new_run_next_to_the_default_folder_gets_its_own_and_records_its_files(runs, tmp_path):
    # The README's next example after the main job (same default output_dir) is not refused;
    # this second run trains on a CSV, and metrics.json says so (not the offline dataset).
    _, _, cache, _, _, _ = runs
    config = tmp_path / "bert.yaml"
    text = (REPO_ROOT / "configs" / "bert_offline.yaml").read_text()
    config.write_text(text.replace("output_dir: runs/bert_offline", "output_dir: runs/bert"))
    rows = [f"{'a good film' if i % 2 else 'a dull plot'} {i},{i % 2}" for i in range(40)]
    csv = tmp_path / "train.csv"
    csv.write_text("sentence,label\n" + "\n".join(rows) + "\n")
    bert(["--config", str(config), "--max_steps", "1"], cache, cwd=tmp_path)
    result = bert(
        ["--config", str(config), "--max_steps", "1", "--train_file", str(csv)], cache, cwd=tmp_path
    )
    assert "runs/bert holds a previous run: this run writes to runs/bert-2" in result.stderr
    first = json.loads((tmp_path / "runs" / "bert" / "metrics.json").read_text())
    second = json.loads((tmp_path / "runs" / "bert-2" / "metrics.json").read_text())
    assert first["config"]["data"]["dataset_name"] == "offline:pydoc-topics"
    assert second["config"]["data"]["dataset_name"] is None
    assert second["config"]["data"]["train_file"] == str(csv)
    # --resume_from_checkpoint true without --output_dir continues the latest of those runs.
    resumed = bert(
        [
            "--config",
            str(config),
            "--max_steps",
            "2",
            "--train_file",
            str(csv),
            "--resume_from_checkpoint",
            "true",
        ],
        cache,
        cwd=tmp_path,
    )
    assert "Resumed from runs/bert-2/checkpoint-1 at step 1" in resumed.stderr

"""The recipes under `accelerate launch`, as a user runs them: whose precision wins, and what an
error looks like once the launcher has added its part.

Precision (docs/guides/recipes.md, "Precision and the launcher"): ``--precision`` on the command
line beats the launcher's ``--mixed_precision`` (or its ``accelerate config`` file), which beats
the recipe config file's ``precision``; each override is one line. Before, the offline YAML's
``precision: fp16`` won without a word over ``accelerate launch --mixed_precision bf16``.

Errors: the recipe's one line is always there; ``accelerate launch`` then adds its own
``CalledProcessError`` traceback (1.16: with the recipe's line repeated as its cause) and turns
exit 2 into 1, and ``accelerate launch -q`` leaves the one line alone (still exit 1).
The subprocess tests run the real recipe through the real ``accelerate`` command; the
in-process ones set ``ACCELERATE_MIXED_PRECISION`` as the launcher does, for the cases this
machine's launcher cannot start (fp8) or that need no training run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from amp_trainer.recipes.config import EXIT_USAGE, UsageError, run_entry_point
from amp_trainer.recipes.run import RecipeRun
from tests.helpers.recipes import ACCELERATE, BERT, FP64_USAGE_ERROR, QUIET_LAUNCHER, launch
from tests.helpers.repo import REPO_ROOT, subprocess_env

OFFLINE_YAML = REPO_ROOT / "configs" / "bert_offline.yaml"  # precision: fp16
ONE_STEP = ["--max_steps", "1", "--max_train_samples", "16", "--max_eval_samples", "8"]
ONE_STEP += ["--save_strategy", "no", "--eval_strategy", "no", "--disable_tqdm", "true"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("amp-trainer-cache"))


def trained_precision(result: subprocess.CompletedProcess, run_dir: Path) -> str:
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((run_dir / "metrics.json").read_text())["precision"]


def override_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if "overrides" in line]


# --------------------------------------------------------------------------------------------
# Precision: the command line, then the launcher, then the recipe's config file
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_accelerate_launch_mixed_precision_bf16_beats_the_config_files_fp16(tmp_path, cache):
    run_dir = tmp_path / "run"
    result = launch(
        ["--mixed_precision", "bf16", *QUIET_LAUNCHER],
        [*ONE_STEP, "--output_dir", str(run_dir)],
        tmp_path,
        cache,
    )
    assert trained_precision(result, run_dir) == "bf16"
    (line,) = override_lines(result)
    assert "WARNING finetune_bert: training in bf16, accelerate launch's mixed_precision" in line
    assert f"overrides precision fp16 of the config file {str(OFFLINE_YAML)!r}" in line
    assert line.endswith("(--precision fp16 trains in fp16)")


@pytest.mark.slow
def test_an_accelerate_config_files_bf16_beats_the_recipe_config_files_fp16(tmp_path, cache):
    launcher_config = tmp_path / "accelerate_bf16.yaml"  # what `accelerate config` writes, cut
    launcher_config.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmixed_precision: bf16\n"
        "num_processes: 1\nnum_machines: 1\nuse_cpu: true\n"
    )
    run_dir = tmp_path / "run"
    result = launch(
        ["--config_file", str(launcher_config)],
        [*ONE_STEP, "--output_dir", str(run_dir)],
        tmp_path,
        cache,
    )
    assert trained_precision(result, run_dir) == "bf16"
    assert len(override_lines(result)) == 1


@pytest.mark.slow
def test_precision_on_the_command_line_beats_accelerate_launch_with_one_line(tmp_path, cache):
    run_dir = tmp_path / "run"
    result = launch(
        ["--mixed_precision", "bf16", *QUIET_LAUNCHER],
        [*ONE_STEP, "--output_dir", str(run_dir), "--precision", "fp16"],
        tmp_path,
        cache,
    )
    assert trained_precision(result, run_dir) == "fp16"
    (line,) = override_lines(result)
    assert line.endswith(
        "WARNING finetune_bert: training in fp16, --precision on the command line: it overrides "
        "accelerate launch's mixed_precision=bf16"
    )


def load_bert_recipe(monkeypatch):
    spec = importlib.util.spec_from_file_location("finetune_bert", BERT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "finetune_bert", module)  # @dataclass looks its module up
    spec.loader.exec_module(module)
    return module


def parse_bert(monkeypatch, tmp_path, launcher: str | None, *argv: str) -> RecipeRun:
    """The BERT recipe's arguments as `accelerate launch --mixed_precision LAUNCHER` hands them
    over (``None``: no launcher), parsed by the recipe's own code; nothing is trained."""
    if launcher is not None:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher)
    recipe = load_bert_recipe(monkeypatch)
    argv = (*argv, "--output_dir", str(tmp_path / "run"), "--use_cpu", "true")
    return RecipeRun.parse(
        "finetune_bert",
        argv,
        recipe.ModelArguments,
        recipe.DataArguments,
        recipe.DEFAULT_CONFIG,
    )


def test_a_config_file_that_says_fp16_true_yields_to_the_launchers_bf16(monkeypatch, tmp_path):
    config = tmp_path / "stock_flags.yaml"  # TrainingArguments' own flag instead of precision
    config.write_text("model_name_or_path: tiny-bert\nfp16: true\n")
    run = parse_bert(monkeypatch, tmp_path, "bf16", "--config", str(config))
    args = run.training_args
    assert (args.precision, args.bf16, args.fp16, args.mixed_precision) == (
        "bf16",
        True,
        False,
        "bf16",
    )
    assert run.precision_note.startswith("training in bf16, accelerate launch's mixed_precision")


@pytest.mark.parametrize(
    "flags",
    [["--precision=fp16"], ["--precision", "fp16"], ["--fp16", "true"], ["--fp16"]],
    ids=["equals", "spaced", "fp16-true", "bare-fp16"],
)
def test_every_spelling_of_a_precision_flag_beats_the_launcher(monkeypatch, tmp_path, flags):
    run = parse_bert(monkeypatch, tmp_path, "bf16", *flags)
    assert run.training_args.precision == "fp16"
    flag = "--precision" if flags[0].startswith("--prec") else "--fp16"
    assert run.precision_note == (
        f"training in fp16, {flag} on the command line: it overrides accelerate launch's "
        "mixed_precision=bf16"
    )


def test_an_abbreviation_that_fits_two_flags_is_refused_naming_both(monkeypatch, tmp_path):
    # --prec fits --precision and --precision_guard: argparse's refusal, not a guess.
    with pytest.raises(
        UsageError,
        match=r"ambiguous option: --prec could match --precision, "
        r"--precision_guard",
    ):
        parse_bert(monkeypatch, tmp_path, "bf16", "--prec", "fp16")


@pytest.mark.parametrize("flags", [["--precision", "auto"], ["--bf16", "false"]])
def test_a_flag_that_chooses_no_precision_lets_the_launcher_win(monkeypatch, tmp_path, flags):
    run = parse_bert(monkeypatch, tmp_path, "bf16", *flags)
    assert run.training_args.precision == "bf16"


@pytest.mark.parametrize("launcher", [None, "no", "fp16"])
def test_a_launcher_that_chose_nothing_else_leaves_the_config_files_fp16(
    monkeypatch, tmp_path, launcher
):
    # `accelerate launch` exports "no" also when nothing was chosen: it cannot override.
    run = parse_bert(monkeypatch, tmp_path, launcher)
    assert run.training_args.precision == "fp16"
    assert run.precision_note is None


def test_the_launchers_fp8_is_one_line_exit_2_unless_precision_is_given(
    monkeypatch, tmp_path, capsys
):
    code = run_entry_point(lambda: parse_bert(monkeypatch, tmp_path, "fp8"), "finetune_bert")
    assert code == EXIT_USAGE
    assert capsys.readouterr().err == (
        "finetune_bert: error: accelerate launch's mixed_precision=fp8 "
        "(ACCELERATE_MIXED_PRECISION) is not a precision the recipes train in: launch with "
        "--mixed_precision fp16, bf16 or no, or pass --precision fp16|bf16|fp32\n"
    )
    run = parse_bert(monkeypatch, tmp_path, "fp8", "--precision", "fp32")
    assert run.training_args.precision == "fp32"
    assert run.precision_note.endswith("overrides accelerate launch's mixed_precision=fp8")


def test_help_under_the_launcher_shows_the_precision_that_would_run(monkeypatch, tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_bert(monkeypatch, tmp_path, "bf16", "--help")
    help_text = " ".join(capsys.readouterr().out.split())
    shown = re.search(r"--precision \{auto,fp16,bf16,fp32\} .*?\(default: (\w+)\)", help_text)
    assert shown.group(1) == "bf16"


# --------------------------------------------------------------------------------------------
# Errors: what accelerate launch adds to the recipe's one line
# --------------------------------------------------------------------------------------------


def launcher_chains_the_childs_stderr() -> bool:
    """Whether the installed one-process launcher keeps the tail of the child's stderr and
    raises it as the cause of its ``CalledProcessError`` (accelerate 1.16 does; 1.10 to 1.15
    pass stderr through untouched). A feature check, so a backport or a later change of the
    shape is caught by the test below rather than read off a version number."""
    from accelerate.commands import launch as accelerate_launch

    return hasattr(accelerate_launch, "CHILD_STDERR_TAIL_CHUNKS")


@pytest.mark.slow
def test_a_usage_error_under_accelerate_launch_is_the_one_line_then_the_launchers_traceback(
    tmp_path, cache
):
    result = launch(
        ["--mixed_precision", "no", *QUIET_LAUNCHER], ["--precision", "fp64"], tmp_path, cache
    )
    lines = result.stderr.splitlines()
    assert result.returncode == 1  # the launcher's; the recipe exited 2
    assert lines[0] == FP64_USAGE_ERROR
    # Both shapes end in the launcher's interpreter, the recipe's command line, its exit status.
    assert lines[-1].startswith("subprocess.CalledProcessError: Command '['")
    assert lines[-1].endswith(f"{BERT!r}, '--precision', 'fp64']' returned non-zero exit status 2.")
    assert result.stdout == ""
    if launcher_chains_the_childs_stderr():
        # accelerate 1.16: the recipe's line again, as the RuntimeError that caused the
        # launcher's CalledProcessError, then the chained traceback.
        assert lines[1] == f"RuntimeError: {FP64_USAGE_ERROR}"
        assert lines[2:7] == [
            "",
            "",
            "The above exception was the direct cause of the following exception:",
            "",
            "Traceback (most recent call last):",
        ]
        assert all(line.startswith("  ") for line in lines[7:-1])  # the launcher's frames
        assert len(lines) == 19
    else:
        # accelerate 1.10 to 1.15: the one line, then the launcher's 11.
        assert lines[1] == "Traceback (most recent call last):"
        assert all(line.startswith("  ") for line in lines[2:-1])
        assert "RuntimeError" not in result.stderr
        assert len(lines) == 12


@pytest.mark.slow
def test_accelerate_launch_quiet_leaves_the_one_line_alone_with_exit_1(tmp_path, cache):
    result = launch(
        ["-q", "--mixed_precision", "no", *QUIET_LAUNCHER],
        ["--no_such_flag", "1"],
        tmp_path,
        cache,
    )
    assert result.returncode == 1
    assert result.stderr.splitlines()[-1] == (
        "finetune_bert: error: unknown flag(s) ['--no_such_flag'] (see --help)"
    )
    assert "Traceback" not in result.stderr and "CalledProcessError" not in result.stderr


def test_a_failing_worker_leaves_its_one_line_where_torchrun_reads_the_root_cause(
    monkeypatch, tmp_path
):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    def main() -> None:
        raise UsageError("max_steps must be an int, got 'ten'")

    error_file = tmp_path / "error.json"  # torchrun names one per worker in this variable
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    assert run_entry_point(main, "finetune_bert") == EXIT_USAGE
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    assert failure.message == "finetune_bert: error: max_steps must be an int, got 'ten'"


@pytest.mark.parametrize(
    ("argv", "asked"),
    [
        (["/v/bin/python", "/v/bin/accelerate", "launch", "--num_processes", "2", "x.py"], 2),
        (["/v/bin/accelerate", "launch", "--num_processes=4", "--cpu", "x.py"], 4),
        (["/v/bin/accelerate", "launch", "x.py"], None),
        (["python", "x.py", "--num_processes", "2"], None),
    ],
)
def test_the_processes_a_launcher_command_line_asked_for_are_read(argv, asked):
    from amp_trainer.recipes.launcher import processes_asked

    assert processes_asked(argv) == asked


def test_two_processes_asked_with_cpu_say_that_one_runs_and_how_to_run_two(tmp_path, cache):
    run_dir = tmp_path / "run"
    result = launch(
        ["--num_processes", "2", "--cpu", "--num_machines", "1", "--dynamo_backend", "no"],
        [*ONE_STEP, "--output_dir", str(run_dir)],
        tmp_path,
        cache,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if "--num_processes 2" in line]
    assert len(said) == 1, result.stderr[-3000:]
    assert said[0].endswith(
        "accelerate launch asked for --num_processes 2 but started 1 process (on a CPU, --cpu "
        "runs one process); for several CPU processes use the config that does: accelerate "
        "launch --config_file configs/accelerate/cpu_2proc.yaml recipes/finetune_bert.py"
    )


def launcher_terminates_its_child() -> bool:
    """Whether the installed one-process launcher passes SIGTERM on to the script it started
    (accelerate 1.16: terminate, then kill 5 s later); 1.10 to 1.15 exit alone. A feature
    check, as above."""
    from accelerate.commands import launch as accelerate_launch

    return hasattr(accelerate_launch, "_terminate_process_tree")


@pytest.mark.slow
def test_sigterm_to_a_one_process_launcher_reaches_the_recipe_only_where_the_launcher_passes_it_on(
    tmp_path, cache
):
    """docs/guides/recipes.md, "Preemption": what SIGTERM to ``accelerate launch`` does to the
    recipe it runs, on the installed accelerate."""
    args = [ACCELERATE, "launch", "--mixed_precision", "no", *QUIET_LAUNCHER, BERT]
    args += ["--max_steps", "100000", "--max_train_samples", "64", "--max_eval_samples", "8"]
    args += ["--save_strategy", "no", "--eval_strategy", "no", "--disable_tqdm", "true"]
    args += ["--output_dir", str(tmp_path / "run")]
    env = subprocess_env(AMP_TRAINER_CACHE=cache, HF_HOME=str(tmp_path / "hf_home"))
    with (tmp_path / "stderr.txt").open("wb") as stderr:
        launcher = subprocess.Popen(
            args, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr
        )
        try:
            deadline = time.monotonic() + 120
            recipe = None
            while recipe is None and time.monotonic() < deadline:
                children = psutil.Process(launcher.pid).children()
                recipe = children[0] if children else None
                time.sleep(0.2)
            assert recipe is not None, "the launcher started no recipe process"
            time.sleep(3)  # into the recipe's start-up; SIGTERM there ends it as usual
            launcher.send_signal(signal.SIGTERM)
            launcher_status = launcher.wait(timeout=60)
            try:
                recipe_alive = recipe.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                recipe_alive = False
        finally:
            for process in [launcher, *([recipe] if recipe is not None else [])]:
                with contextlib.suppress(psutil.Error, OSError):
                    process.kill()
    seen = f"launcher exit {launcher_status}, recipe alive: {recipe_alive}\n"
    seen += (tmp_path / "stderr.txt").read_text(errors="replace")[-3000:]
    if launcher_terminates_its_child():
        # Terminated (and waited for) before the launcher exits.
        assert not recipe_alive and launcher_status == 128 + signal.SIGTERM, seen
    else:
        # Orphaned: it would train on.
        assert recipe_alive and launcher_status == -signal.SIGTERM, seen

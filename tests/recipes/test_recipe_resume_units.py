"""Which checkpoint a recipe resumes and the command it prints to resume, in-process.

The subprocess tests in test_recipe_resume_cli.py and test_recipe_preemption.py drive the real
CLI; these cover what a subprocess cannot cheaply set up: transformers' own "incomplete" marker
in a checkpoint folder, and the launcher a run was started with (``accelerate launch``,
``torchrun``), read from the variables each exports.
"""

from __future__ import annotations

import logging
import shlex
import sys

import pytest

from amp_trainer.recipes.config import UsageError
from amp_trainer.recipes.resume import (
    interrupted,
    last_complete_checkpoint,
    launcher_prefix,
    resolve_checkpoint,
    resume_command,
)

MARKER = "checkpoint-is-incomplete.txt"  # transformers' trainer_jit_checkpoint.py writes it


def checkpoints(run, marked_step=None, steps=(1, 2)):
    """``checkpoint-N`` folders with trainer_state.json; ``marked_step`` also holds the marker
    that transformers writes before a SIGTERM save and removes after it."""
    for step in steps:
        folder = run / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        (folder / "trainer_state.json").write_text(f'{{"global_step": {step}}}')
        if step == marked_step:
            (folder / MARKER).write_text(f"Checkpoint started at step {step} and in progress...")
    return run


def test_a_checkpoint_holding_the_incomplete_marker_is_skipped_and_named(tmp_path, caplog):
    run = checkpoints(tmp_path / "run", marked_step=2)
    with caplog.at_level(logging.WARNING, logger="amp_trainer.recipes.resume"):
        assert last_complete_checkpoint(run) == str(run / "checkpoint-1")
        assert resolve_checkpoint("true", str(run)) == str(run / "checkpoint-1")
        assert resolve_checkpoint(str(run), str(tmp_path)) == str(run / "checkpoint-1")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == 3 * [
        f"{run / 'checkpoint-2'} is incomplete (it holds {MARKER}; interrupted while saving?): "
        f"skipped; the last complete one is {run / 'checkpoint-1'}"
    ]


def test_a_marked_checkpoint_named_directly_is_refused_with_the_last_complete_one(tmp_path):
    run = checkpoints(tmp_path / "run", marked_step=2)
    with pytest.raises(UsageError) as error:
        resolve_checkpoint(str(run / "checkpoint-2"), str(tmp_path))
    assert str(error.value) == (
        f"--resume_from_checkpoint '{run / 'checkpoint-2'}' is an incomplete checkpoint (it "
        f"holds {MARKER}: interrupted while saving?); the last complete one is "
        f"{run / 'checkpoint-1'}"
    )


def test_a_run_whose_only_checkpoint_is_marked_has_nothing_to_resume(tmp_path):
    run = checkpoints(tmp_path / "run", marked_step=1, steps=(1,))
    assert last_complete_checkpoint(run) is None
    with pytest.raises(UsageError, match=r"no checkpoint in .* is complete"):
        resolve_checkpoint("true", str(run))
    assert "nothing to resume" in str(interrupted([], str(run)))


def test_a_complete_checkpoint_without_the_marker_is_still_taken(tmp_path):
    run = checkpoints(tmp_path / "run")
    assert last_complete_checkpoint(run) == str(run / "checkpoint-2")
    assert resolve_checkpoint(str(run / "checkpoint-2"), str(tmp_path)) == str(run / "checkpoint-2")


def test_a_checkpoint_missing_one_ranks_rng_state_is_skipped_and_refused_naming_it(
    tmp_path, caplog
):
    # What a two-process save leaves when rank 1 is killed before its rng_state_1.pth (the
    # FSDP2 case with a real kill: tests/distributed/test_fsdp2_torn_checkpoint.py).
    run = checkpoints(tmp_path / "run")
    for step, ranks in ((1, (0, 1)), (2, (0,))):
        folder = run / f"checkpoint-{step}"
        (folder / "amp_trainer_state.json").write_text('{"world_size": 2}')
        for rank in ranks:
            (folder / f"rng_state_{rank}.pth").write_bytes(b"")
    with caplog.at_level(logging.WARNING):
        assert resolve_checkpoint("true", str(run)) == str(run / "checkpoint-1")
    assert f"{run / 'checkpoint-2'} is incomplete (no rng_state_1.pth; " in caplog.text
    with pytest.raises(UsageError) as error:
        resolve_checkpoint(str(run / "checkpoint-2"), str(tmp_path))
    assert "is an incomplete checkpoint (no rng_state_1.pth: interrupted while saving?)" in str(
        error.value
    )


# -- the launcher in the resume command ----------------------------------------------------------

LAUNCHER_VARIABLES = (
    "ACCELERATE_MIXED_PRECISION",
    "ACCELERATE_DYNAMO_BACKEND",
    "TORCHELASTIC_RUN_ID",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
)


@pytest.fixture
def launched(monkeypatch, tmp_path):
    """Set the variables a launcher exports (none of the shell's leak in); returns the run
    folder with one complete checkpoint, and the recipe as ``sys.argv[0]``."""
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "argv", ["recipes/finetune_bert.py"])
    run = checkpoints(tmp_path / "run", steps=(3,))

    def launch(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        return run

    return launch


ARGV = ["--max_steps", "9", "--output_dir", "old", "--resume_from_checkpoint", "true"]


def test_a_plain_python_run_resumes_with_python(launched):
    run = launched()
    line = str(interrupted(ARGV, str(run)))
    assert line.endswith(
        "Resume with: "
        + shlex.join(
            [
                *("python", "recipes/finetune_bert.py", "--max_steps", "9"),
                *("--output_dir", str(run), "--resume_from_checkpoint", str(run / "checkpoint-3")),
            ]
        )
    )


@pytest.mark.parametrize(
    "env, prefix, note",
    [
        # accelerate launch, one process (its simple launcher: no torchrun variables)
        (
            {"ACCELERATE_MIXED_PRECISION": "fp16", "ACCELERATE_DYNAMO_BACKEND": "NO"},
            ["accelerate", "launch"],
            "add your accelerate launch flags",
        ),
        # accelerate launch --num_processes 2: accelerate's variables and torchrun's
        (
            {
                "ACCELERATE_MIXED_PRECISION": "no",
                "TORCHELASTIC_RUN_ID": "none",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
            },
            ["accelerate", "launch", "--num_processes", "2"],
            "add your accelerate launch flags",
        ),
        # accelerate launch with DeepSpeed exports only the precision of the two
        (
            {"ACCELERATE_MIXED_PRECISION": "bf16", "LOCAL_RANK": "0", "WORLD_SIZE": "1"},
            ["accelerate", "launch"],
            "add your accelerate launch flags",
        ),
        # torchrun --standalone --nproc_per_node 4: everything the command needs is known
        (
            {
                "TORCHELASTIC_RUN_ID": "abc",
                "LOCAL_RANK": "1",
                "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "4",
            },
            ["torchrun", "--nproc_per_node", "4"],
            None,
        ),
        # torchrun on 2 nodes of 8: the rendezvous flags are not exported
        (
            {
                "TORCHELASTIC_RUN_ID": "job",
                "LOCAL_RANK": "0",
                "WORLD_SIZE": "16",
                "LOCAL_WORLD_SIZE": "8",
            },
            ["torchrun", "--nproc_per_node", "8", "--nnodes", "2"],
            "add your torchrun rendezvous flags",
        ),
        # LOCAL_RANK without torchrun's variables: some other launcher (DeepSpeed's)
        (
            {"LOCAL_RANK": "0", "WORLD_SIZE": "2"},
            ["torchrun", "--nproc_per_node", "2"],
            "or the launcher you started it with, and its flags",
        ),
    ],
    ids=[
        "accelerate-1",
        "accelerate-2",
        "accelerate-deepspeed",
        "torchrun-1-node",
        "torchrun-2",
        "other-launcher",
    ],
)
def test_a_launched_run_resumes_with_its_launcher(launched, env, prefix, note):
    run = launched(**env)
    assert launcher_prefix() == (prefix, note)
    command = resume_command(ARGV, str(run))
    assert shlex.split(command) == [
        *prefix,
        "recipes/finetune_bert.py",
        "--max_steps",
        "9",
        "--output_dir",
        str(run),
        "--resume_from_checkpoint",
        str(run / "checkpoint-3"),
    ]
    said = f"Resume with ({note}): " if note else "Resume with: "
    assert str(interrupted(ARGV, str(run))).endswith(said + command)

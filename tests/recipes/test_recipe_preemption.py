"""Preemption: ``--enable_jit_checkpoint`` (transformers' checkpoint on SIGTERM) with AmpTrainer.

A SIGTERM (SLURM's ``--signal=TERM@N``, Kubernetes' pod termination) makes the run save a
checkpoint and stop. AmpTrainer saves it between two optimizer steps, with that step's scaler
state and scale history, so resuming it is the uninterrupted run; the recipes then end with one
line, exit 143 (128 + SIGTERM) and the command that resumes. The in-process tests send the real
signal to the real handler Trainer installs (its grace period set to 0 s); the last test runs the
BERT recipe in a subprocess and terminates it as an orchestrator would.
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback
from transformers.trainer_jit_checkpoint import JITCheckpointCallback

from amp_trainer import AmpTrainer
from amp_trainer.checkpointing import AMP_STATE_FILE
from amp_trainer.checkpointing.completeness import why_incomplete
from amp_trainer.recipes import RecipeRun
from amp_trainer.recipes.resume import RunPreempted
from tests.helpers.recipes import BERT
from tests.helpers.repo import REPO_ROOT, subprocess_env
from tests.helpers.tiny_models import make_tiny_bert
from tests.helpers.training import (
    InjectOverflow,
    ToyClassification,
    reset_accelerate_state,
    tiny_training_args,
    train_logs,
)

MAX_STEPS = 8
STOP_STEP = 3
# Overflows on both sides of the stop and growth every 2 clean steps: the scale moves throughout,
# so a resume from anything but the exact scaler state logs other loss scales after it.
OVERFLOW_STEPS = {2, 6}


class SendSigterm(TrainerCallback):
    """SIGTERM to this process at step ``step``: ``inside`` the step (before its forward), or
    ``between`` it and the next (after its end). The handler is the one Trainer installed; its
    grace timer is set to 0 s and awaited, so the request lands exactly there."""

    def __init__(self, step: int, when: str) -> None:
        self.step, self.when = step, when
        self.manager = None
        self.scaler_state_at_stop: dict | None = None

    def _terminate(self) -> None:
        self.manager.kill_wait = 0
        signal.raise_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not self.manager.is_checkpoint_requested and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.manager.is_checkpoint_requested

    def on_step_begin(self, args, state, control, **kwargs):
        if self.when == "inside" and state.global_step + 1 == self.step:
            self._terminate()

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if self.when == "between" and state.global_step == self.step:
            self._terminate()


def _trainer(output_dir, *callbacks, eval_dataset=None, **overrides) -> AmpTrainer:
    model = make_tiny_bert()  # dropout 0.1: a resume with another RNG state trains differently
    args = tiny_training_args(
        output_dir,
        max_steps=MAX_STEPS,
        loss_scale_init=2.0**10,
        loss_scale_growth_interval=2,
        **overrides,
    )
    return AmpTrainer(
        model=model,
        args=args,
        train_dataset=ToyClassification(),
        eval_dataset=eval_dataset,
        callbacks=[InjectOverflow(model.classifier.weight, OVERFLOW_STEPS), *callbacks],
    )


def _terminated_run(output_dir, when: str, **overrides) -> tuple[AmpTrainer, SendSigterm]:
    sigterm = SendSigterm(STOP_STEP, when)
    trainer = _trainer(output_dir, sigterm, enable_jit_checkpoint=True, **overrides)
    callbacks = trainer.callback_handler.callbacks
    (jit,) = [cb for cb in callbacks if isinstance(cb, JITCheckpointCallback)]
    sigterm.manager = jit.jit_manager
    handler_before = signal.getsignal(signal.SIGTERM)
    trainer.train()
    # The handler Trainer installed is gone again: a later SIGTERM ends the process as usual.
    assert signal.getsignal(signal.SIGTERM) is not handler_before
    return trainer, sigterm


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    reset_accelerate_state()
    trainer = _trainer(tmp_path_factory.mktemp("uninterrupted"))
    trainer.train()
    reset_accelerate_state()
    return trainer


def test_sigterm_inside_a_step_saves_at_its_end_with_the_live_scaler_state(tmp_path):
    # An evaluation every step: the one due at the stop is left out (the grace period is short).
    evals = dict(eval_dataset=ToyClassification(8, seed=1), eval_strategy="steps", eval_steps=1)
    trainer, _ = _terminated_run(tmp_path, "inside", **evals)

    checkpoint = tmp_path / f"checkpoint-{STOP_STEP}"
    # The step under way is finished and saved (stock saves checkpoint-2 inside step 3, then
    # trains step 3 anyway), and the run stops there.
    assert trainer.state.global_step == STOP_STEP
    assert trainer.jit_checkpoint == str(checkpoint)
    assert sorted(p.name for p in tmp_path.iterdir()) == [checkpoint.name]
    assert not (checkpoint / "checkpoint-is-incomplete.txt").exists()
    saved = torch.load(checkpoint / "scaler.pt", weights_only=True)
    assert saved == trainer.loss_scaler.state_dict()
    # Attempt 2's overflow included: three steps took four attempts.
    assert saved["skipped"] == 1 and saved["steps"] == STOP_STEP + 1
    amp_state = json.loads((checkpoint / AMP_STATE_FILE).read_text())
    assert amp_state["scale_history"] == trainer.scale_history
    assert [e["step"] for e in amp_state["scale_history"]] == [1, 2, 2, 3]
    evaluated = [e["step"] for e in trainer.state.log_history if "eval_loss" in e]
    assert evaluated == [1, 2]


def test_sigterm_between_steps_saves_the_step_before_and_nothing_after(tmp_path):
    trainer, _ = _terminated_run(tmp_path, "between", save_strategy="steps", save_steps=1)

    checkpoint = tmp_path / f"checkpoint-{STOP_STEP}"
    assert trainer.jit_checkpoint == str(checkpoint)
    # Seen at the next step's begin: saved at once, then that step runs (Trainer cannot skip
    # it) and is not saved (save_steps=1; stock saves it, as a later checkpoint than SIGTERM's).
    assert trainer.state.global_step == STOP_STEP + 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"checkpoint-{n}" for n in (1, 2, 3)]
    history = json.loads((checkpoint / AMP_STATE_FILE).read_text())["scale_history"]
    assert history == [e for e in trainer.scale_history if e["step"] <= STOP_STEP]


@pytest.mark.parametrize("when", ["inside", "between"])
def test_resuming_the_sigterm_checkpoint_is_the_uninterrupted_run(uninterrupted, tmp_path, when):
    reset_accelerate_state()
    stopped, _ = _terminated_run(tmp_path / "stopped", when)
    reset_accelerate_state()
    resumed = _trainer(tmp_path / "resumed")
    resumed.train(resume_from_checkpoint=stopped.jit_checkpoint)

    def comparable(trainer):
        return [{k: v for k, v in e.items() if k != "epoch"} for e in train_logs(trainer)]

    got, expected = comparable(resumed), comparable(uninterrupted)
    assert [e["step"] for e in got] == list(range(1, MAX_STEPS + 1))
    # Same losses (same dropout masks: the RNG state is the step's), same loss scales.
    assert got[STOP_STEP:] == expected[STOP_STEP:]
    assert resumed.loss_scaler.state_dict() == uninterrupted.loss_scaler.state_dict()
    assert resumed.scale_history == uninterrupted.scale_history


# Growth on every clean step: the scale at the stop is not the initial one, so a resume that
# restarted the scaler would show.
RUN = ["--max_train_samples", "64", "--max_eval_samples", "16", "--logging_steps", "1"]
RUN += ["--loss_scale_growth_interval", "1", "--enable_jit_checkpoint", "true"]


def _read_lines(stream, lines: list[str]) -> threading.Thread:
    thread = threading.Thread(target=lambda: lines.extend(stream), daemon=True)
    thread.start()
    return thread


class SigtermWhileEvaluating(TrainerCallback):
    """SIGTERM to this process in the first evaluation step: after training, in the recipe's
    evaluate phase (transformers' own handler is gone by then)."""

    def __init__(self) -> None:
        self.sent = False

    def on_prediction_step(self, args, state, control, **kwargs):
        if not self.sent:
            self.sent = True
            signal.raise_signal(signal.SIGTERM)


class Ended(BaseException):
    """What the process's own SIGTERM action (it ends) is replaced with, so the test can see it."""


def _ended(signum, frame):
    raise Ended


def test_sigterm_after_training_saves_the_trained_model_and_ends_as_a_preempted_run(tmp_path):
    reset_accelerate_state()
    out = tmp_path / "run"
    # Trainer puts back the handler it found (at __init__) when training ends: this one.
    before = signal.signal(signal.SIGTERM, _ended)
    try:
        trainer = _trainer(
            out,
            SigtermWhileEvaluating(),
            eval_dataset=ToyClassification(8, seed=1),
            enable_jit_checkpoint=True,
            save_strategy="no",  # nothing else saves a trained step
        )
        run = RecipeRun(
            name="finetune_bert",
            model_args=None,
            data_args=None,
            training_args=trainer.args,
            started=time.perf_counter(),
            argv=("--enable_jit_checkpoint", "true", "--save_strategy", "no"),
        )
        with pytest.raises(RunPreempted) as info:
            run.train_evaluate_save(trainer)
        assert signal.getsignal(signal.SIGTERM) is _ended  # put back afterwards
    finally:
        signal.signal(signal.SIGTERM, before)
    checkpoint = out / f"checkpoint-{MAX_STEPS}"
    scale = trainer.loss_scaler.get_scale()
    assert str(info.value).startswith(
        f"stopped by SIGTERM (--enable_jit_checkpoint); {checkpoint.name} saved at step "
        f"{MAX_STEPS} (loss scale {scale:g}). Resume with: "
    )
    assert info.value.exit_code == 143
    assert why_incomplete(checkpoint) is None
    assert torch.load(checkpoint / "scaler.pt", weights_only=True) == (
        trainer.loss_scaler.state_dict()
    )
    saved = load_file(checkpoint / "model.safetensors")
    trained = trainer.model.state_dict()
    assert saved and all(torch.equal(v, trained[k]) for k, v in saved.items())


@pytest.mark.slow
def test_sigterm_saves_the_scaler_and_ends_with_one_line_and_the_command_that_resumes(tmp_path):
    cache, out = str(tmp_path / "cache"), tmp_path / "run"
    # No save strategy: the one checkpoint is the SIGTERM's.
    args = [*RUN, "--save_strategy", "no", "--max_steps", "500", "--output_dir", str(out)]
    env = subprocess_env(AMP_TRAINER_CACHE=cache)
    proc = subprocess.Popen(
        [sys.executable, BERT, *args],
        cwd=REPO_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    stdout: list[str] = []
    stderr: list[str] = []
    readers = [_read_lines(proc.stdout, stdout), _read_lines(proc.stderr, stderr)]
    deadline = time.monotonic() + 240
    while sum("'loss_scale'" in line for line in stdout) < 3 and time.monotonic() < deadline:
        assert proc.poll() is None, "".join(stderr)[-4000:]  # still training when terminated
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 143, "".join(stderr)[-4000:]
    for reader in readers:
        reader.join(timeout=10)
    err = "".join(stderr)
    assert "Traceback" not in err, err[-4000:]
    last = err.rstrip().split("\n")[-1]  # a whole line: nothing after it, not even a bar
    checkpoint = next(out.glob("checkpoint-*"))
    step = int(checkpoint.name.rsplit("-", 1)[1])
    scale = torch.load(checkpoint / "scaler.pt", weights_only=True)["scale"]
    assert scale != 2.0**16  # grown since the start (or backed off): the test can tell
    assert last.startswith(
        f"finetune_bert: stopped by SIGTERM (--enable_jit_checkpoint); {checkpoint.name} saved "
        f"at step {step} (loss scale {scale:g}). Resume with: python {BERT} "
    ), last
    # The run stopped at the checkpoint: no evaluation, final model or metrics after it.
    assert sorted(p.name for p in out.iterdir()) == [checkpoint.name]
    assert {AMP_STATE_FILE, "scaler.pt", "trainer_state.json"} <= {
        p.name for p in checkpoint.iterdir()
    }
    history = json.loads((checkpoint / AMP_STATE_FILE).read_text())["scale_history"]
    # Its last entry is step N's, or a skipped attempt at step N+1 when SIGTERM came after one
    # (saved between two attempts: a skipped update is no step).
    assert history[-1]["step"] == step or (
        history[-1]["skipped"] and history[-1]["step"] == step + 1
    )

    # The printed command resumes there (two more steps; one saved at the end to look into).
    command = shlex.split(last.split("Resume with: ", 1)[1])
    assert command[command.index("--resume_from_checkpoint") + 1] == str(checkpoint)
    more = ["--max_steps", str(step + 2), "--save_strategy", "steps", "--save_steps", str(step + 2)]
    resumed = subprocess.run(
        [sys.executable, *command[1:], *more],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"Resumed from {checkpoint} at step {step} (loss scale {scale:g})" in resumed.stderr
    final = out / f"checkpoint-{step + 2}"
    resumed_history = json.loads((final / AMP_STATE_FILE).read_text())["scale_history"]
    # The whole run's history, continued: the first attempt after it ran at the scale saved.
    assert resumed_history[: len(history)] == history
    assert resumed_history[len(history)]["scale"] == scale

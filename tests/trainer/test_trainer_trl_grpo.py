"""TRL's GRPOTrainer with AmpTrainerMixin: FP16 for RL fine-tuning, on a CPU, end to end.

The FP16-RL use (FP16 removes the training/inference mismatch of RL fine-tuning): a tiny GPT-2
from a config and a byte-level BPE tokenizer trained here, a rule-based reward, transformers' own
``generate`` (no vLLM), fp16 with amp-trainer's scaler in the loop. An overflow injected into a
real gradient is skipped (the learning rate held), the loss scale is logged with GRPO's own
metrics, and a checkpoint taken mid-run resumes to the uninterrupted run's parameters and scale.
"""

from __future__ import annotations

import logging
import math
import shutil

import pytest
import torch
from transformers import TrainerCallback

from tests.helpers.tiny_models import THINGS, colour_bpe_tokenizer, tiny_gpt2_for
from tests.helpers.training import InjectOverflow, tiny_training_args, train_logs

trl = pytest.importorskip("trl", reason="TRL is in the test extra: pip install -e '.[test]'")
from datasets import Dataset  # noqa: E402

from tests.helpers.grpo import AmpGRPOConfig, AmpGRPOTrainer, says_a_colour  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture
def tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_TRAINER_CACHE", str(tmp_path / "cache"))
    return colour_bpe_tokenizer()


def _trainer(tokenizer, output_dir, max_steps: int, callbacks=()):
    model = tiny_gpt2_for(tokenizer, seed=0)
    args = tiny_training_args(
        output_dir,
        AmpGRPOConfig,
        max_steps=max_steps,
        loss_scale_init=2.0**10,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        gradient_checkpointing=False,
        save_strategy="steps",
        save_steps=2,
        logging_steps=1,
        seed=0,
    )
    prompts = [f"Which {thing} is it?" for thing in THINGS] * 2
    return AmpGRPOTrainer(
        model=model,
        reward_funcs=says_a_colour,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
        callbacks=[cb(model) for cb in callbacks],
    )


def _inject_at_step_2(model):
    return InjectOverflow(model.transformer.h[0].mlp.c_fc.weight, {2})


def _params(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


def test_grpo_trains_fp16_skips_an_overflow_and_logs_the_loss_scale(tmp_path, tokenizer):
    trainer = _trainer(tokenizer, tmp_path / "run", 3, callbacks=[_inject_at_step_2])
    dtypes = set()
    trainer.model.transformer.h[0].mlp.c_fc.register_forward_hook(
        lambda module, args, output: dtypes.add(output.dtype)
    )
    trainer.train()

    assert trainer.args.fp16 and trainer.precision == "fp16"
    assert torch.float16 in dtypes  # the policy's forward ran under fp16 autocast, on the CPU
    # Attempt 2 is skipped and is no step: three steps take four attempts.
    assert trainer.loss_scaler.stats.steps == 4 and trainer.loss_scaler.stats.skipped == 1
    assert trainer.loss_scaler.stats.last_overflow_params == ("transformer.h.0.mlp.c_fc.weight",)
    assert [entry["skipped"] for entry in trainer.scale_history] == [False, True, False, False]
    logs = train_logs(trainer)
    assert [entry["loss_scale"] for entry in logs] == [1024.0, 512.0, 512.0]
    assert [entry["step_skipped"] for entry in logs] == [0, 1, 0]
    assert trainer.lr_scheduler.last_epoch == 3  # the LR held on the skipped attempt
    assert all("reward" in entry and math.isfinite(entry["reward"]) for entry in logs)
    assert torch.isfinite(_params(trainer)).all()


def test_grpo_checkpoint_resumes_to_the_uninterrupted_run(tmp_path, tokenizer):
    full = _trainer(tokenizer, tmp_path / "full", 3, callbacks=[_inject_at_step_2])
    full.train()
    checkpoint = tmp_path / "full" / "checkpoint-2"  # the step right after the skipped attempt
    assert checkpoint.is_dir()

    resumed = _trainer(tokenizer, tmp_path / "resumed", 3)
    resumed.train(resume_from_checkpoint=str(checkpoint))

    assert resumed.loss_scaler.get_scale() == full.loss_scaler.get_scale() == 512.0
    assert resumed.loss_scaler.state_dict() == full.loss_scaler.state_dict()
    assert [e["skipped"] for e in resumed.scale_history] == [False, True, False, False]
    assert torch.equal(_params(resumed), _params(full))


def test_grpo_resume_true_skips_a_checkpoint_stopped_mid_save(tmp_path, tokenizer, caplog):
    # The mixin picks the checkpoint as AmpTrainer and the recipes do: a checkpoint-3 whose save
    # was killed before trainer_state.json is skipped, with one warning (stock picks it and
    # dies with FileNotFoundError).
    run = tmp_path / "run"
    _trainer(tokenizer, run, 2).train()
    torn = run / "checkpoint-3"
    shutil.copytree(run / "checkpoint-2", torn)
    (torn / "trainer_state.json").unlink()

    steps: list[int] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            steps.append(state.global_step)

    resumed = _trainer(tokenizer, run, 3, callbacks=[lambda model: Steps()])
    with caplog.at_level(logging.WARNING, logger="amp_trainer"):
        resumed.train(resume_from_checkpoint=True)
    skipped = [r.getMessage() for r in caplog.records if "is incomplete" in r.getMessage()]
    assert skipped == [
        f"{torn} is incomplete (no trainer_state.json; interrupted while saving?): skipped; "
        f"the last complete one is {run / 'checkpoint-2'}"
    ]
    assert steps == [3] and resumed.state.global_step == 3

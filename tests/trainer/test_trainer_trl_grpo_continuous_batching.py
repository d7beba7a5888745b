"""TRL GRPO with ``use_transformers_continuous_batching=True`` keeps FP32 master weights.

TRL casts the policy in place to the training dtype (``unwrapped_model.to(torch.float16)``)
before each generation and never back: with stock TRL fp16 dies later on FP16 gradients and bf16
goes on as pure-BF16 training. Under ``AmpTrainerMixin`` the precision guard keeps the FP32
tensors that cast replaced (it was made under ``torch.no_grad()``) and puts them back before the
training forward, so at every optimizer step the weights are FP32 and bit-identical to what they
were when the step began: the update is the one the run without the cast would make.
"""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import TrainerCallback

from tests.helpers.tiny_models import THINGS, colour_bpe_tokenizer, tiny_gpt2_for
from tests.helpers.training import tiny_training_args

trl = pytest.importorskip("trl", reason="TRL is in the test extra: pip install -e '.[test]'")
from datasets import Dataset  # noqa: E402

from tests.helpers.grpo import AmpGRPOConfig, AmpGRPOTrainer, says_a_colour  # noqa: E402

pytestmark = pytest.mark.slow


class MasterWeightsAtEachStep(TrainerCallback):
    """At each optimizer step: the weights' dtypes, and whether they are bit for bit what they
    were when the step began (before its generation)."""

    def __init__(self) -> None:
        self.seen: list[tuple[set[torch.dtype], bool]] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.before = [p.detach().clone() for p in model.parameters()]

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        now = list(model.parameters())
        same = all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(self.before, now))
        self.seen.append(({p.dtype for p in now}, same))


@pytest.fixture
def tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_TRAINER_CACHE", str(tmp_path / "cache"))
    return colour_bpe_tokenizer()


def _run(tokenizer, output_dir, precision: str, guard: str):
    watch = MasterWeightsAtEachStep()
    args = tiny_training_args(
        output_dir,
        AmpGRPOConfig,
        precision=precision,
        precision_guard=guard,
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=4,
        use_transformers_continuous_batching=True,
        seed=0,
    )
    trainer = AmpGRPOTrainer(
        model=tiny_gpt2_for(tokenizer, seed=0),
        reward_funcs=says_a_colour,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"Which {t} is it?" for t in THINGS]}),
        processing_class=tokenizer,
        callbacks=[watch],
    )
    trainer.train()
    return trainer, watch.seen


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_continuous_batching_keeps_fp32_master_weights_across_every_generation(
    tmp_path, tokenizer, precision, caplog
):
    with caplog.at_level(logging.WARNING, logger="amp_trainer.precision_guard"):
        trainer, seen = _run(tokenizer, tmp_path / "run", precision, "raise")
    assert trainer.state.global_step == 2
    assert seen == [({torch.float32}, True)] * 2
    said = [r.getMessage() for r in caplog.records]
    assert any("grpo_trainer.py" in m and "bit for bit" in m for m in said), said


def test_without_the_guard_continuous_batching_turns_bf16_into_pure_bf16_training(
    tmp_path, tokenizer
):
    trainer, seen = _run(tokenizer, tmp_path / "run", "bf16", "off")
    # TRL's cast, never undone (the FP32 islands, the norms, re-cast themselves at their forward)
    assert [(torch.bfloat16 in dtypes, same) for dtypes, same in seen] == [(True, False)] * 2
    assert trainer.model.transformer.h[0].mlp.c_fc.weight.dtype == torch.bfloat16

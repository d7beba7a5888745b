"""TRL GRPO: the rollout side's precision is checked against the trainer's before the first step.

TRL 1.16 builds its colocated vLLM engine as ``LLM(model=model.name_or_path, ...)`` with no
``dtype``, so vLLM's ``"auto"`` decides from the checkpoint's config: a float32 checkpoint runs in
bf16 on Ampere+ GPUs and on CPUs, a bf16 one in bf16, under an fp16 trainer too. vLLM is not
installed here (and TRL refuses ``use_vllm=True`` without it only when it starts the engine, after
``Trainer.__init__``, where the mixin's check runs): the refusals are real ``AmpGRPOTrainer``
constructions; the run that trains with an allowed mismatch uses a CPU stand-in for the colocated
engine that does what vLLM's ``"auto"`` does (the checkpoint loaded in bf16, the policy's weights
synced into it) and samples with transformers' ``generate``.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers.tiny_models import THINGS, colour_bpe_tokenizer, tiny_gpt2_for
from tests.helpers.training import tiny_training_args, train_logs

trl = pytest.importorskip("trl", reason="TRL is in the test extra: pip install -e '.[test]'")
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl import GRPOConfig  # noqa: E402

from amp_trainer import AmpTrainingArguments  # noqa: E402
from amp_trainer.mismatch import PrecisionMismatchCallback  # noqa: E402
from amp_trainer.precision_guard import (  # noqa: E402
    RolloutPrecisionError,
    rollout_precision,
    vllm_auto_precision,
)
from tests.helpers.grpo import AmpGRPOConfig, AmpGRPOTrainer, says_a_colour  # noqa: E402

pytestmark = pytest.mark.slow

GUARD_LOGGER = "amp_trainer.precision_guard"


@pytest.fixture
def tokenizer(tmp_path, monkeypatch):
    monkeypatch.setenv("AMP_TRAINER_CACHE", str(tmp_path / "cache"))
    return colour_bpe_tokenizer()


def _checkpoint(tokenizer, folder, dtype: torch.dtype) -> AutoModelForCausalLM:
    """The tiny GPT-2 saved with ``dtype`` weights (its config.json says so) and loaded back in
    FP32 for training, as a user loads a policy: vLLM reads ``name_or_path``'s config."""
    model = tiny_gpt2_for(tokenizer, seed=0).to(dtype)
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _args(output_dir, **overrides):
    settings = dict(max_steps=2, logging_steps=1, seed=0)
    return tiny_training_args(
        output_dir,
        AmpGRPOConfig,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=6,
        gradient_checkpointing=False,
        **{**settings, **overrides},
    )


def _trainer(tokenizer, model, args, callbacks=()):
    return AmpGRPOTrainer(
        model=model,
        reward_funcs=says_a_colour,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"Which {t} is it?" for t in THINGS]}),
        processing_class=tokenizer,
        callbacks=list(callbacks),
    )


# -- the rollout side's precision, found from what the trainer is given -------------------------


@pytest.mark.parametrize(
    ("config_dtype", "capability", "expected"),
    [
        ("float32", (9, 0), "bf16"),  # H100: the float32 checkpoint is "downcast" to bf16
        ("float32", (8, 0), "bf16"),  # A100
        ("float32", (7, 5), "fp16"),  # T4: no bf16 before Ampere
        ("float32", None, "bf16"),  # a CPU
        (None, (9, 0), "bf16"),  # no dtype in the config: float32, as vLLM reads it
        ("bfloat16", (9, 0), "bf16"),
        ("bfloat16", (7, 5), "fp16"),  # bf16 unsupported: the device's preferred dtype
        ("float16", (9, 0), "fp16"),
    ],
)
def test_vllm_auto_picks_what_vllm_picks_for_the_checkpoint_and_device(
    config_dtype, capability, expected
):
    assert vllm_auto_precision(config_dtype, "gpt2", capability) == expected


def test_vllm_auto_never_picks_fp16_for_models_vllm_runs_only_in_bf16_or_fp32():
    assert vllm_auto_precision("float32", "gemma2", (9, 0)) == "bf16"
    assert vllm_auto_precision("float16", "gemma3", (9, 0)) == "bf16"


def test_the_colocated_vllm_precision_comes_from_the_checkpoint_trl_hands_to_vllm(
    tmp_path, tokenizer
):
    # GRPOConfig(use_vllm=True) itself does not need vLLM: the engine is TRL's trainer's.
    fp32_model = _checkpoint(tokenizer, tmp_path / "fp32", torch.float32)
    bf16_model = _checkpoint(tokenizer, tmp_path / "bf16", torch.bfloat16)
    args = GRPOConfig(str(tmp_path / "out"), use_vllm=True, vllm_mode="colocate", bf16=False)

    on_h100 = rollout_precision(args, fp32_model, "fp16", device_capability=(9, 0))
    on_t4 = rollout_precision(args, fp32_model, "fp16", device_capability=(7, 5))
    bf16_on_h100 = rollout_precision(args, bf16_model, "fp16", device_capability=(9, 0))

    assert (on_h100.precision, on_t4.precision, bf16_on_h100.precision) == ("bf16", "fp16", "bf16")
    assert str(tmp_path / "fp32" / "config.json") in on_h100.source
    # the policy in memory is FP32 either way: vLLM reads the checkpoint, not the model
    assert {p.dtype for p in bf16_model.parameters()} == {torch.float32}
    assert "bfloat16" in bf16_on_h100.source


def test_without_vllm_the_rollouts_are_the_training_forward_and_a_server_is_known_once_asked(
    tmp_path, tokenizer
):
    model = tiny_gpt2_for(tokenizer)
    plain = GRPOConfig(str(tmp_path / "a"), bf16=False)
    server = GRPOConfig(str(tmp_path / "b"), use_vllm=True, vllm_mode="server", bf16=False)
    assert rollout_precision(plain, model, "fp16").precision == "fp16"
    assert rollout_precision(server, model, "fp16") is None  # not connected yet
    assert rollout_precision(AmpTrainingArguments(str(tmp_path / "c")), model, "fp16") is None


# -- the check in AmpTrainerMixin -----------------------------------------------------------------


def test_a_clean_fp16_run_generating_in_fp16_trains_without_error_or_warning(
    tmp_path, tokenizer, caplog
):
    trainer = _trainer(tokenizer, tiny_gpt2_for(tokenizer), _args(tmp_path / "run"))
    with caplog.at_level(logging.WARNING, logger=GUARD_LOGGER):
        trainer.train()
    assert trainer.state.global_step == 2
    assert trainer.rollout_precision.precision == trainer.precision == "fp16"
    assert not [r for r in caplog.records if "ollout" in r.getMessage()]


def test_vllm_with_a_float32_checkpoint_is_refused_under_fp16_before_vllm_starts(
    tmp_path, tokenizer
):
    # Here (a CPU) vLLM's "auto" runs the float32 checkpoint in bf16, as on any Ampere+ GPU.
    model = _checkpoint(tokenizer, tmp_path / "policy", torch.float32)
    args = _args(tmp_path / "run", use_vllm=True, vllm_mode="colocate")
    with pytest.raises(RolloutPrecisionError) as raised:
        _trainer(tokenizer, model, args)  # without the check: TRL's "vLLM is not available"
    message = str(raised.value)
    assert message.startswith("The rollouts are sampled in bf16 (TRL builds its colocated vLLM")
    assert "float32" in message and str(tmp_path / "policy" / "config.json") in message
    assert "but the trainer trains in fp16" in message
    assert "config.json says float16" in message
    assert "rollout_precision_mismatch='allow'" in message


def test_a_policy_whose_checkpoint_is_bf16_is_refused_naming_both_precisions(tmp_path, tokenizer):
    model = _checkpoint(tokenizer, tmp_path / "policy", torch.bfloat16)
    args = _args(tmp_path / "run", use_vllm=True)
    with pytest.raises(RolloutPrecisionError, match=r"sampled in bf16 .*bfloat16.* trains in fp16"):
        _trainer(tokenizer, model, args)


def test_a_bad_rollout_precision_mismatch_value_names_the_value_and_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"\('raise', 'allow'\), got 'sometimes'"):
        AmpTrainingArguments(str(tmp_path), rollout_precision_mismatch="sometimes")


class _Bf16Rollouts:
    """A CPU stand-in for TRL's colocated ``VLLMGeneration`` (vLLM is not installed here): the
    engine vLLM's ``"auto"`` would build, i.e. the checkpoint at ``name_or_path`` in bf16, the
    policy's weights synced into it before each generation, sampled with transformers' own
    ``generate``; it returns what ``VLLMGeneration.generate`` returns."""

    def __init__(self, model, processing_class, max_completion_length, **kwargs):
        self.model = model
        self.engine = AutoModelForCausalLM.from_pretrained(model.name_or_path).to(torch.bfloat16)
        self.dtypes: set[torch.dtype] = set()
        self.engine.transformer.h[0].mlp.c_fc.register_forward_hook(
            lambda module, args, output: self.dtypes.add(output.dtype)
        )
        self.max_new = max_completion_length
        self.sampling = {k: kwargs[k] for k in ("temperature", "top_p", "top_k")}
        self.eos = processing_class.eos_token_id

    def sync_weights(self):
        self.engine.load_state_dict(self.model.state_dict())  # copied into the bf16 tensors

    @torch.no_grad()
    def generate(self, prompts, images, num_generations, profiler=None):
        completions, logprobs = [], []
        for ids in prompts:
            out = self.engine.generate(
                torch.tensor([ids]),
                do_sample=True,
                **self.sampling,
                max_new_tokens=self.max_new,
                pad_token_id=self.eos,
                output_scores=True,
                return_dict_in_generate=True,
            )
            new = out.sequences[0, len(ids) :].tolist()
            scores = self.engine.compute_transition_scores(
                out.sequences, out.scores, normalize_logits=True
            )[0]
            completions.append(new)
            logprobs.append([[float(lp)] for lp in scores[: len(new)]])
        return prompts, completions, logprobs, None


def test_an_allowed_mismatch_warns_once_trains_and_the_meter_logs_the_rollout_precision(
    tmp_path, tokenizer, caplog, monkeypatch
):
    engines = []

    def stand_in(**kwargs):
        engines.append(_Bf16Rollouts(**kwargs))
        return engines[-1]

    monkeypatch.setattr("trl.trainer.grpo_trainer.VLLMGeneration", stand_in)
    model = _checkpoint(tokenizer, tmp_path / "policy", torch.float32)
    args = _args(tmp_path / "run", use_vllm=True, rollout_precision_mismatch="allow", max_steps=1)
    # The user measures fp16 only: the rollouts' bf16 is added because it is the rollouts'.
    meter = PrecisionMismatchCallback(every_n_steps=1, precisions=("fp16",))
    with caplog.at_level(logging.WARNING, logger=GUARD_LOGGER):
        trainer = _trainer(tokenizer, model, args, callbacks=[meter])
        trainer.train()

    said = [r.getMessage() for r in caplog.records if "ollout" in r.getMessage()]
    assert len(said) == 1, said
    assert said[0].startswith("Rollouts in bf16 (TRL builds its colocated vLLM engine")
    assert "while the trainer trains in fp16: allowed" in said[0] and "mismatch/bf16/" in said[0]
    assert engines[0].dtypes == {torch.bfloat16}  # the rollouts really were bf16
    assert trainer.state.global_step == 1 and trainer.loss_scaler is not None
    logged = train_logs(trainer)[-1]
    assert {k.split("/")[1] for k in logged if k.startswith("mismatch/")} == {"fp16", "bf16"}
    assert (
        logged["mismatch/bf16/mean_abs_logprob_diff"]
        > logged["mismatch/fp16/mean_abs_logprob_diff"]
    )

"""The precision-mismatch meter: FP16 and BF16 token log-probs against FP32, alone and in training.

A seeded tiny GPT-2 (4 layers, 128 wide) is measured for real under CPU autocast: BF16's 7
mantissa bits put its log-probs several times further from FP32 than FP16's 10 do, FP32 against
itself is exactly 0, and the figures are those a direct computation gives. A module made to
overflow FP16 is reported and named, not averaged away. In a tiny TRL GRPO run (and a plain
Trainer) the callback logs the function's figures for the step's completions, and the run ends
with the parameters of the run without it, bit for bit.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from amp_trainer import (
    AmpTrainer,
    NonFiniteForwardError,
    PrecisionMismatchCallback,
    measure_precision_mismatch,
)
from amp_trainer.mismatch import FIGURES
from amp_trainer.precision import without_autocast_wrapper
from tests.helpers.tiny_models import (
    COLOURS,
    THINGS,
    colour_bpe_tokenizer,
    make_tiny_bert,
    make_tiny_gpt2,
)
from tests.helpers.training import tiny_training_args

VOCAB = 512


def _gpt2(seed: int = 0, **overrides) -> GPT2LMHeadModel:
    """The issue's model: a seeded GPT-2 of 4 layers, 128 wide."""
    torch.manual_seed(seed)
    config = dict(vocab_size=VOCAB, n_embd=128, n_layer=4, n_head=4, n_positions=64)
    config.update(bos_token_id=0, eos_token_id=0, **overrides)
    return GPT2LMHeadModel(GPT2Config(**config))


def _tokens(rows: int = 8, length: int = 32, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def gpt2():
    return _gpt2()


@pytest.fixture(scope="module")
def measured(gpt2):
    return measure_precision_mismatch(gpt2, _tokens(), precisions=("fp32", "fp16", "bf16"))


# --------------------------------------------------------------------------------------------
# the function
# --------------------------------------------------------------------------------------------
def test_fp16_log_probs_are_several_times_closer_to_fp32_than_bf16s(measured):
    fp16, bf16 = measured["fp16"], measured["bf16"]
    assert fp16.mean_abs_logprob_diff > 0 and fp16.kl > 0  # real rounding, measured
    assert bf16.mean_abs_logprob_diff >= 3 * fp16.mean_abs_logprob_diff
    assert bf16.max_abs_logprob_diff >= 3 * fp16.max_abs_logprob_diff
    assert bf16.kl >= 3 * fp16.kl  # second order in the difference: ~60x here
    assert fp16.tokens == bf16.tokens == 8 * 31


def test_fp32_against_itself_reads_exactly_zero(measured):
    fp32 = measured["fp32"]
    assert (fp32.mean_abs_logprob_diff, fp32.max_abs_logprob_diff, fp32.kl, fp32.clip_rate) == (
        0.0,
        0.0,
        0.0,
        0.0,
    )
    assert not fp32.nonfinite and fp32.tokens == 8 * 31


def test_figures_are_those_a_direct_autocast_computation_gives(gpt2):
    ids = _tokens()
    model = gpt2.eval()
    targets = ids[:, 1:].unsqueeze(-1)
    with torch.no_grad():
        ref = model(ids).logits[:, :-1].double().log_softmax(-1)
        logps = {}
        for precision, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
            with torch.autocast("cpu", dtype=dtype):
                logits = model(ids).logits
            assert logits.dtype == dtype
            logps[precision] = logits[:, :-1].double().log_softmax(-1)
    # An epsilon FP16's rounding crosses on about half the tokens, whatever the CPU's FP16
    # arithmetic (emulated, or AVX512-FP16 units: their rounding differs by a factor of a few).
    fp16_delta = (logps["fp16"].gather(-1, targets) - ref.gather(-1, targets)).abs()
    epsilon = float(fp16_delta.median())
    stats = measure_precision_mismatch(gpt2, ids, clip_epsilon=epsilon)
    with torch.no_grad():
        for precision in ("fp16", "bf16"):
            logp = logps[precision]
            delta = (logp.gather(-1, targets) - ref.gather(-1, targets)).flatten()
            kl = (ref.exp() * (ref - logp)).sum(-1)
            ratio = delta.exp()
            clipped = ((ratio < 1 - epsilon) | (ratio > 1 + epsilon)).double().mean()
            got = stats[precision]
            assert got.mean_abs_logprob_diff == pytest.approx(float(delta.abs().mean()), rel=1e-9)
            assert got.max_abs_logprob_diff == pytest.approx(float(delta.abs().max()), rel=1e-9)
            assert got.kl == pytest.approx(float(kl.mean()), rel=1e-6)
            assert got.clip_rate == pytest.approx(float(clipped), abs=1 / delta.numel())
    assert 0 < stats["fp16"].clip_rate < stats["bf16"].clip_rate <= 1


def _draws_from_the_rng(module, args, output) -> None:
    torch.rand(1)


def test_the_model_is_left_as_it_was_modes_parameters_and_rng():
    model = _gpt2(resid_pdrop=0.1)  # dropout: measured in train mode, figures would be random
    model.train()
    model.transformer.h[0].eval()  # a submodule a user froze in eval mode stays so
    modes = {name: m.training for name, m in model.named_modules()}
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    # A forward that draws from the RNG even in eval mode: the meter must fork the stream.
    model.transformer.h[1].register_forward_hook(_draws_from_the_rng)
    same_weights_in_eval_mode = _gpt2(resid_pdrop=0.1).eval()
    torch.manual_seed(123)
    rng = torch.get_rng_state()

    measured = measure_precision_mismatch(model, _tokens(4, 16))

    assert torch.equal(torch.get_rng_state(), rng)
    # Eval mode: no dropout noise in the figure, that of the same weights in eval mode.
    assert measured == measure_precision_mismatch(same_weights_in_eval_mode, _tokens(4, 16))
    assert {name: m.training for name, m in model.named_modules()} == modes
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_padded_tokens_are_not_scored_and_do_not_change_the_figures(gpt2):
    lengths = [16, 10, 5, 2]
    mask = torch.tensor([[1] * n + [0] * (16 - n) for n in lengths])
    ids = _tokens(4, 16)
    garbage = torch.where(mask.bool(), ids, _tokens(4, 16, seed=7))

    padded = measure_precision_mismatch(gpt2, ids, mask)
    other_padding = measure_precision_mismatch(gpt2, garbage, mask)

    assert padded["fp16"].tokens == sum(n - 1 for n in lengths)
    assert padded == other_padding
    # Left padding: the first real token of a row follows padding, nothing predicts it.
    left = torch.tensor([[0] * (16 - n) + [1] * n for n in lengths])
    assert measure_precision_mismatch(gpt2, ids, left)["bf16"].tokens == sum(n - 1 for n in lengths)


def test_labels_limit_the_scored_tokens_to_the_completion(gpt2):
    ids = _tokens(4, 16)
    labels = ids.clone()
    labels[:, :10] = -100  # a 10-token prompt
    stats = measure_precision_mismatch(gpt2, ids, labels=labels)
    assert stats["fp16"].tokens == 4 * 6
    assert stats != measure_precision_mismatch(gpt2, ids)


def test_a_module_overflowing_fp16_is_reported_non_finite_and_named():
    model = _gpt2()
    with torch.no_grad():
        # Its FP16 output exceeds 65504 (inf); in FP32 and BF16 (FP32's range) it is finite.
        model.transformer.h[1].mlp.c_fc.weight.mul_(1e6)

    stats = measure_precision_mismatch(model, _tokens(4, 16))

    fp16, bf16 = stats["fp16"], stats["bf16"]
    assert fp16.nonfinite and fp16.nonfinite_modules == ("transformer.h.1.mlp.c_fc",)
    assert all(math.isnan(getattr(fp16, name)) for name in FIGURES[:4])
    assert fp16.tokens == 4 * 15
    assert not bf16.nonfinite and math.isfinite(bf16.mean_abs_logprob_diff)
    table = str(stats)  # the printed table
    assert "fp16: non-finite logits" in table and "'transformer.h.1.mlp.c_fc'" in table


def test_a_non_finite_fp32_reference_is_an_error_naming_the_module():
    model = _gpt2()
    with torch.no_grad():
        model.transformer.h[2].mlp.c_fc.bias[0] = float("nan")
    with pytest.raises(
        NonFiniteForwardError, match=r"FP32 reference.*'transformer\.h\.2\.mlp\.c_fc"
    ):
        measure_precision_mismatch(model, _tokens(2, 8))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(precisions=("fp16", "fp8")), r"Unknown precision 'fp8'; valid: fp16, bf16, fp32"),
        (dict(precisions=()), r"precisions is empty; give one or more of"),
        (dict(input_ids=torch.arange(8)), r"input_ids must be a 2-D integer tensor.*\(8,\)"),
        (dict(input_ids=torch.zeros(2, 8)), r"2-D integer tensor.*of float32"),
        (dict(input_ids=torch.zeros(2, 1, dtype=torch.long)), r"no next token to score"),
        (
            dict(attention_mask=torch.ones(2, 5, dtype=torch.long)),
            r"attention_mask has shape \(2, 5\); it must match input_ids' \(2, 8\)",
        ),
        (dict(attention_mask=torch.full((2, 8), 2)), r"only 0 \(padding\) and 1"),
        (dict(labels=torch.full((2, 8), -100)), r"no token to score.*label is not -100"),
        (dict(labels=torch.full((2, 8), VOCAB)), r"token id 512 is outside.*\[0, 511\]"),
        (dict(clip_epsilon=1.5), r"clip_epsilon=1\.5 is outside \(0, 1\)"),
        (dict(temperature=0), r"temperature=0 is outside \(0, inf\)"),
        (dict(batch_size=0), r"batch_size must be None or an integer >= 1, got 0"),
    ],
    ids=[
        "unknown-precision",
        "no-precision",
        "1-d-ids",
        "float-ids",
        "one-position",
        "mask-shape",
        "mask-values",
        "nothing-labelled",
        "label-out-of-vocabulary",
        "clip-epsilon",
        "temperature",
        "batch-size",
    ],
)
def test_bad_arguments_name_the_value_and_what_is_valid(gpt2, change, message):
    kwargs = {"input_ids": _tokens(2, 8), **change}
    with pytest.raises(ValueError, match=message):
        measure_precision_mismatch(gpt2, **kwargs)


def test_a_model_that_is_not_a_causal_lm_is_refused_by_name():
    with pytest.raises(ValueError, match=r"BertForSequenceClassification is not a causal lang"):
        measure_precision_mismatch(make_tiny_bert(), torch.ones(2, 8, dtype=torch.long))


def test_a_model_with_half_precision_weights_is_refused_naming_a_parameter():
    with pytest.raises(ValueError, match=r"'transformer\.wte\.weight' is float16.*dtype=torch"):
        measure_precision_mismatch(_gpt2().half(), _tokens(2, 8))


# --------------------------------------------------------------------------------------------
# the callback in a plain Trainer
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(every_n_steps=0), r"every_n_steps must be an integer >= 1, got 0"),
        (dict(precisions=["fp16", "int8"]), r"Unknown precision 'int8'; valid: fp16, bf16, fp32"),
        (dict(clip_epsilon=0.0), r"clip_epsilon=0\.0 is outside \(0, 1\)"),
    ],
    ids=["every-n-steps", "precision", "clip-epsilon"],
)
def test_the_callbacks_arguments_are_checked_when_it_is_made(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrecisionMismatchCallback(**kwargs)


class _Prompted(torch.utils.data.Dataset):
    """Causal-LM examples whose first 6 tokens are a prompt (label -100), as SFT masks them."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (12,), generator=torch.Generator().manual_seed(i))
        labels = ids.clone()
        labels[:6] = -100
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


class _Reporter(TrainerCallback):
    """Stands where the reporting integrations (TensorBoard, W&B) stand: before user callbacks."""

    def __init__(self) -> None:
        self.seen: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.seen.append(dict(logs))


def test_a_plain_trainer_logs_the_figures_on_sampled_steps_where_integrations_see_them(tmp_path):
    reporter = _Reporter()
    args = tiny_training_args(tmp_path, cls=TrainingArguments)
    trainer = Trainer(model=make_tiny_gpt2(), args=args, train_dataset=_Prompted())
    trainer.callback_handler.callbacks.insert(1, reporter)
    meter = PrecisionMismatchCallback(every_n_steps=2).attach(trainer)
    trainer.train()

    seen = [log for log in reporter.seen if "loss" in log]
    keys = {f"mismatch/{p}/{name}" for p in ("fp16", "bf16") for name in FIGURES}
    assert [keys <= set(log) for log in seen] == [False, True, False, True]
    logged = [e for e in trainer.state.log_history if "loss" in e]
    assert [keys <= set(e) for e in logged] == [False, True, False, True]
    assert [entry["step"] for entry in meter.history] == [2, 4]
    assert all(entry["fp16"].tokens == 4 * 6 for entry in meter.history)  # the 6 labelled tokens
    assert logged[3]["mismatch/bf16/kl"] == meter.history[1]["bf16"].kl


def test_a_callback_no_trainer_was_attached_to_stops_at_the_start_saying_how(tmp_path):
    args = tiny_training_args(tmp_path, cls=TrainingArguments)
    trainer = Trainer(
        model=make_tiny_gpt2(),
        args=args,
        train_dataset=_Prompted(),
        callbacks=[PrecisionMismatchCallback()],
    )
    with pytest.raises(RuntimeError, match=r"not attached.*\.attach\(trainer\)"):
        trainer.train()


def test_amp_trainer_attaches_the_callbacks_it_is_given_and_measures_its_own_precision(tmp_path):
    trainer = AmpTrainer(
        model=make_tiny_gpt2(),
        args=tiny_training_args(tmp_path, precision="bf16", max_steps=1),
        train_dataset=_Prompted(),
        callbacks=[PrecisionMismatchCallback(every_n_steps=1)],
    )
    meter = trainer.callback_handler.callbacks[0]
    assert isinstance(meter, PrecisionMismatchCallback)
    trainer.train()
    assert list(meter.history[0]) == ["step", "bf16", "fp16"]  # the run's, then the other
    assert set(meter.summary) == {"bf16", "fp16"}
    assert "bf16/fp16:" in meter.format_summary()


# --------------------------------------------------------------------------------------------
# the callback in TRL's GRPOTrainer
# --------------------------------------------------------------------------------------------


GRPO_EPSILON, GRPO_EPSILON_HIGH = 1.5e-5, 3e-5


def _says_a_colour(completions: list[str], **kwargs) -> list[float]:
    return [sum(c in text for c in COLOURS) - 0.01 * len(text) for text in completions]


class _TrainingForwards:
    """Records the tokens of every training forward (grad enabled, train mode), as GRPO sends
    them: prompt + completion ids, the attention mask, labels marking the completion."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.advantages: list[torch.Tensor] = []  # GRPO's, per loss computation
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if module.training and torch.is_grad_enabled():
            self.batches.append((kwargs["input_ids"], kwargs["attention_mask"], kwargs["labels"]))


def _grpo_run(tokenizer, output_dir, meter):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from amp_trainer import AmpTrainerMixin, AmpTrainingArguments

    @dataclasses.dataclass
    class AmpGRPOConfig(AmpTrainingArguments, GRPOConfig):
        pass

    class AmpGRPOTrainer(AmpTrainerMixin, GRPOTrainer):
        def _compute_loss(self, model, inputs):
            forwards.advantages.append(inputs["advantages"].detach().clone())
            return super()._compute_loss(model, inputs)

    model = make_tiny_gpt2(vocab_size=len(tokenizer), seed=0)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, name, tokenizer.eos_token_id)
        setattr(model.generation_config, name, tokenizer.eos_token_id)
    forwards = _TrainingForwards(model)
    args = tiny_training_args(
        output_dir,
        AmpGRPOConfig,
        max_steps=3,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        gradient_checkpointing=False,
        logging_steps=1,
        seed=0,
        # Bounds FP16 rounding crosses, clip-higher's two apart. One iteration per generation:
        # GRPO's own ratio is exactly 1, so they change nothing in training.
        epsilon=GRPO_EPSILON,
        epsilon_high=GRPO_EPSILON_HIGH,
    )
    trainer = AmpGRPOTrainer(
        model=model,
        reward_funcs=_says_a_colour,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": [f"Which {t} is it?" for t in THINGS] * 2}),
        processing_class=tokenizer,
        callbacks=[meter] if meter is not None else None,
    )
    trainer.train()
    return trainer, forwards


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory):
    """The same 3-step fp16 GRPO run twice: with the meter on every step, and without it."""
    pytest.importorskip("trl", reason="TRL is in the test extra: pip install -e '.[test]'")
    root = tmp_path_factory.mktemp("grpo")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("AMP_TRAINER_CACHE", str(root / "cache"))
        tokenizer = colour_bpe_tokenizer()
    meter = PrecisionMismatchCallback(every_n_steps=1)
    with_meter = _grpo_run(tokenizer, root / "with", meter)
    without = _grpo_run(tokenizer, root / "without", None)
    return with_meter, without, meter


def _params(trainer) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in trainer.model.parameters()])


@pytest.mark.slow
def test_grpo_with_the_meter_ends_bit_identical_to_grpo_without_it(grpo_runs):
    (measured, _), (plain, _), _ = grpo_runs
    assert torch.equal(_params(measured), _params(plain))
    assert measured.loss_scaler.state_dict() == plain.loss_scaler.state_dict()

    def same(log):  # everything but the meter's own keys and the clocks
        return {k: v for k, v in log.items() if not k.startswith("mismatch/") and "time" not in k}

    def clockless(history):
        return [same(e) for e in history if "loss" in e]

    assert clockless(measured.state.log_history) == clockless(plain.state.log_history)


@pytest.mark.slow
def test_grpo_logs_the_functions_figures_for_the_steps_completions(grpo_runs):
    (trainer, forwards), _, meter = grpo_runs
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert [entry["step"] for entry in meter.history] == [1, 2, 3]
    for entry in logs:
        assert {f"mismatch/{p}/{name}" for p in ("fp16", "bf16") for name in FIGURES} <= set(entry)

    # The last step's training forward, measured again on the final model (the meter measures
    # at the step's end, after the update): the same figures, exactly.
    input_ids, attention_mask, labels = forwards.batches[-1]
    again = measure_precision_mismatch(
        trainer.model,
        input_ids,
        attention_mask,
        labels=labels,
        clip_epsilon=GRPO_EPSILON,
        clip_epsilon_high=GRPO_EPSILON_HIGH,
        advantages=forwards.advantages[-1],
    )
    assert meter.history[-1]["fp16"] == again["fp16"] and meter.history[-1]["bf16"] == again["bf16"]
    assert logs[-1]["mismatch/fp16/mean_abs_logprob_diff"] == again["fp16"].mean_abs_logprob_diff
    # Only the completions are scored: the tokens GRPO's labels mark, never the prompt.
    completion = int((labels[:, 1:] != -100).sum())
    assert again["fp16"].tokens == completion < int(attention_mask.sum())
    assert (
        logs[-1]["mismatch/bf16/mean_abs_logprob_diff"]
        > logs[-1]["mismatch/fp16/mean_abs_logprob_diff"]
    )


@pytest.mark.slow
def test_the_cost_benchmark_prints_the_machine_and_one_ratio_row_per_mode(capsys):
    # The benchmark times GRPO runs, so it needs TRL (the lowest-versions CI leaves TRL out).
    pytest.importorskip("trl", reason="TRL is in the test extra: pip install -e '.[test]'")
    from benchmarks.mismatch import bench

    assert bench.main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "Machine: CPU " in out and "commit " in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "x [" in line]
    assert [row.split(" | ")[0] for row in rows] == [
        "| none",
        "| none, again (A/A)",
        "| every 1 step(s)",
    ]
    assert rows[0].split(" | ")[2] == "1.000x [1.000-1.000]"


@pytest.mark.slow
def test_grpo_logs_the_share_its_clipped_objective_clips_from_the_steps_own_tensors(grpo_runs):
    (trainer, forwards), _, meter = grpo_runs
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(forwards.batches) == len(forwards.advantages) == 3  # one forward a step
    # The last step's tokens and GRPO's advantages for them, recorded apart from the meter,
    # on the final model (the meter measures at the step's end, after the update).
    input_ids, attention_mask, labels = forwards.batches[-1]
    advantages = forwards.advantages[-1]
    model = trainer.model.eval()
    valid = (labels[:, 1:] != -100) & attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    targets = labels[:, 1:].clamp(min=0).unsqueeze(-1)
    # Accelerate's prepare left an FP16 autocast wrapper on the model's forward: off here.
    with torch.no_grad(), without_autocast_wrapper(model):
        ref = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        with torch.autocast("cpu", dtype=torch.float16):
            fp16 = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]

    def logp(logits):
        return logits.double().log_softmax(-1).gather(-1, targets).squeeze(-1)

    ratio = (logp(fp16) - logp(ref)).exp()[valid]
    sign = advantages.unsqueeze(1).expand_as(valid)[valid]
    clipped = ((ratio > 1 + GRPO_EPSILON_HIGH) & (sign > 0)) | (
        (ratio < 1 - GRPO_EPSILON) & (sign < 0)
    )
    share = float(clipped.double().mean())
    assert (advantages > 0).any() and (advantages < 0).any()
    assert (
        0 < share < float(((ratio > 1 + GRPO_EPSILON) | (ratio < 1 - GRPO_EPSILON)).double().mean())
    )
    assert logs[-1]["mismatch/fp16/objective_clip_rate"] == share
    assert meter.history[-1]["fp16"].objective_tokens == int(valid.sum())
    assert (
        "mismatch/fp16/objective_clip_rate" in logs[0]
        and "mismatch/bf16/objective_clip_rate" in logs[0]
    )

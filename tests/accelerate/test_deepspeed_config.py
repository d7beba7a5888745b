"""deepspeed_fp16_config against DeepSpeed's own config parser and loss scaler (CPU, no engine)."""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

# .ci/run installs DeepSpeed (DS_BUILD_OPS=0); an environment without it (a lowest-versions venv)
# skips this file rather than failing to collect it.
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (.ci/run installs it)")
import deepspeed.runtime.fp16.loss_scaler as deepspeed_loss_scaler
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler as DeepSpeedLossScaler

from amp_trainer.deepspeed import deepspeed_fp16_config
from amp_trainer.scaler import DynamicLossScaler, LossScaleError
from amp_trainer.training_args import AmpTrainingArguments


def _parsed(section: dict) -> dict:
    """The dynamic loss-scale arguments DeepSpeed's engine would build its scaler from."""
    config = DeepSpeedConfig({"train_batch_size": 1, "fp16": section})
    assert config.float16_config.enabled and config.float16_config.loss_scale == 0
    return config.float16_config.dynamic_loss_scale_args()


def test_default_section_parses_to_the_scalers_defaults():
    ours = inspect.signature(DynamicLossScaler).parameters
    assert _parsed(deepspeed_fp16_config()) == {
        "init_scale": ours["init_scale"].default,
        "scale_window": ours["growth_interval"].default,
        "delayed_shift": ours["hysteresis"].default,  # 1, torch's behaviour (DeepSpeed's is 2)
        "consecutive_hysteresis": ours["consecutive_hysteresis"].default,
        "min_scale": 1,
    }


def test_every_knob_survives_deepspeeds_parser():
    section = deepspeed_fp16_config(
        init_scale=2.0**12, growth_interval=500, hysteresis=3, consecutive_hysteresis=True,
        min_scale=4.0, auto_cast=True,
    )  # fmt: skip
    assert _parsed(section) == {
        "init_scale": 4096,
        "scale_window": 500,
        "delayed_shift": 3,
        "consecutive_hysteresis": True,
        "min_scale": 4,
    }
    assert DeepSpeedConfig({"train_batch_size": 1, "fp16": section}).float16_config.auto_cast


def test_deepspeeds_parser_rejects_a_fractional_min_scale_so_we_refuse_it_first():
    raw = {**deepspeed_fp16_config(), "min_loss_scale": 0.5}
    with pytest.raises(Exception, match="min_loss_scale"):
        DeepSpeedConfig({"train_batch_size": 1, "fp16": raw})
    with pytest.raises(ValueError, match=r"min_scale must be a whole number.*got 0\.5.*1"):
        deepspeed_fp16_config(min_scale=0.5)


def test_section_from_training_args_parses_to_the_same_knobs(tmp_path):
    args = AmpTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, loss_scale_init=2.0**10,
        loss_scale_growth_interval=50, loss_scale_hysteresis=2, loss_scale_min=2.0,
    )  # fmt: skip
    assert _parsed(deepspeed_fp16_config.from_training_args(args)) == {
        "init_scale": 1024,
        "scale_window": 50,
        "delayed_shift": 2,
        "consecutive_hysteresis": False,
        "min_scale": 2,
    }


def test_training_args_deepspeed_cannot_express_are_named_by_their_field(tmp_path):
    args = AmpTrainingArguments(output_dir=str(tmp_path), use_cpu=True, loss_scale_max=2.0**20)
    with pytest.raises(ValueError, match="loss_scale_max must be None"):
        deepspeed_fp16_config.from_training_args(args)


def test_deepspeed_grows_one_clean_step_later_the_first_time_as_documented():
    """The one timing difference the docstring states, measured on DeepSpeed's own scaler."""
    section = _parsed(deepspeed_fp16_config(init_scale=16.0, growth_interval=3))
    theirs = DeepSpeedLossScaler(**section)
    ours = DynamicLossScaler("cpu", init_scale=16.0, growth_interval=3)
    param = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.0)
    ds_scales, our_scales = [], []
    for _ in range(10):
        theirs.update_scale(False)
        ds_scales.append(float(theirs.cur_scale))
        ours.scale(param.sum()).backward()
        ours.step(optimizer)
        ours.update()
        our_scales.append(ours.get_scale())
    assert our_scales == [16.0, 16.0, 32.0, 32.0, 32.0, 64.0, 64.0, 64.0, 128.0, 128.0]
    assert ds_scales == [16.0, 16.0, 16.0, 32.0, 32.0, 32.0, 64.0, 64.0, 64.0, 128.0]


@settings(max_examples=40, deadline=None)
@given(
    pattern=st.text(alphabet=".x", min_size=1, max_size=40),
    hysteresis=st.integers(1, 3),
    consecutive=st.booleans(),
)
def test_the_same_knobs_back_off_the_same_under_deepspeeds_own_scaler(
    pattern, hysteresis, consecutive
):
    """Hysteresis, consecutive hysteresis, backoff and the error at the minimum, step by step.

    (Growth is compared above; here the window is long enough that the scale never grows.)
    """
    knobs = dict(
        init_scale=2.0**6, growth_interval=1000, hysteresis=hysteresis,
        consecutive_hysteresis=consecutive, min_scale=4.0,
    )  # fmt: skip
    ours = DynamicLossScaler("cpu", **knobs)
    param = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.SGD([param], lr=0.0)
    with pytest.MonkeyPatch.context() as patch:
        # DeepSpeed's scaler asks its comm layer for the rank only to decide who logs.
        patch.setattr(deepspeed_loss_scaler.dist, "get_rank", lambda: 0)
        theirs = DeepSpeedLossScaler(**_parsed(deepspeed_fp16_config(**knobs)))
        for step, mark in enumerate(pattern):
            overflow = mark == "x"
            try:
                theirs.update_scale(overflow)
                deepspeed_raised = False
            except Exception as err:  # DeepSpeed raises a bare Exception at its minimum
                assert "minimum" in str(err)
                deepspeed_raised = True
            optimizer.zero_grad()
            ours.scale(param.sum()).backward()
            if overflow:
                param.grad[0] = float("inf")
            ours.step(optimizer)
            if deepspeed_raised:
                with pytest.raises(LossScaleError):
                    ours.update()
                return
            ours.update()
            assert ours.get_scale() == theirs.cur_scale, f"step {step}"
